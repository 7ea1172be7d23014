"""Run configuration: dataclasses, TOML files, ``--set section.key=value`` overrides, validation.

Every field carries its help text in ``metadata["help"]`` so that ``scalenlp train --help-config``
can print the whole surface, and so that a wrong key or type names the field and what it expects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from scalenlp.errors import ConfigError  # noqa: F401 (re-exported: callers import it from here)
from scalenlp.layout import DATA_PARALLEL, SCHEDULES, choice_problems


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    flavor: str = opt("debug", "named model size from scalenlp.models.flavors (`scalenlp train --list-flavors`); "
                               "the shape keys below replace its values. Empty: the shape alone (model.hidden, "
                               "model.layers and model.heads needed)")
    family: str = opt("", "llama | gpt2: norms, activation, positions, tied embeddings and biases as in that family; "
                          "empty keeps the flavor's (llama without a flavor)")
    hidden: int = opt(0, "model width; 0 keeps the flavor's")
    layers: int = opt(0, "transformer blocks; 0 keeps the flavor's")
    heads: int = opt(0, "attention heads (must divide model.hidden); 0 keeps the flavor's")
    kv_heads: int = opt(0, "key/value heads (must divide model.heads; fewer is grouped-query attention); 0 keeps "
                           "the flavor's (as many as heads without a flavor)")
    ffn: int = opt(0, "MLP width; 0 keeps the flavor's (without a flavor, 4 x hidden for gpt2, 8/3 x hidden rounded up "
                      "to 256 for llama)")
    vocab_size: int = opt(0, "vocabulary size; 0 takes it from the tokenizer")
    max_seq_len: int = opt(0, "longest sequence the model accepts; 0 keeps the flavor's value (training.seq_len "
                              "without a flavor)")
    dropout: float = opt(0.0, "dropout probability on attention and residual paths")
    init: str = opt("", "start from this checkpoint (run folder, export folder, Hugging Face model folder or "
                        ".gguf file): its architecture and tokenizer replace model.flavor and the tokenizer.* keys; "
                        "empty starts from random weights")


@dataclass
class DataConfig:
    path: str = opt("", "file, folder or glob of .txt/.jsonl/.parquet/.tsv, or of .npy token ids (already "
                        "tokenized by tokenizer.path's tokenizer, EOS between documents); empty uses the built-in "
                        "corpus (docstrings of the Python standard library)")
    text_field: str = opt("text", "field holding the text in .jsonl and .parquet records (for classification, "
                                  "also .tsv/.csv columns; failing it, sentence/content/text are tried)")
    label_field: str = opt("label", "classification: field or column holding the label")
    text_pair_field: str = opt("", "classification: field or column holding a second text (sentence pairs); "
                                   "empty for single texts")
    eval_path: str = opt("", "classification: labelled .tsv/.csv/.jsonl/.parquet file scored every "
                             "training.eval_every steps and at the end (accuracy, macro-F1); qa: SQuAD .json or "
                             ".jsonl questions (exact match, F1)")
    val_fraction: float = opt(0.05, "fraction of the token stream held out for evaluation")
    shuffle: bool = opt(True, "a new random order of training windows (classification: rows) each epoch; false "
                              "reads them in file order, e.g. data shuffled beforehand or batches replayed from "
                              "another trainer")
    bucket_batches: int = opt(4, "classification, qa, token_classification: global batches whose rows are sorted "
                                 "by length together, so that each batch pads less (1: batches drawn at random). "
                                 "More is faster (less padding) but makes each batch's lengths alike, which can cost "
                                 "accuracy: on WNUT-17, 64 ran 1.3x as fast as 1 and scored 1.2 entity-F1 points "
                                 "lower; 4 keeps most of the speed (benchmarks/RESULTS.md)")
    cache_dir: str = opt("", "where tokenized token files are cached; empty: <run_dir>/../.token_cache")
    reset_positions: bool = opt(False, "training.task=lm: positions restart at 0 at each document of a packed "
                                       "window (at a BOS, or after an EOS), where inference puts a prompt "
                                       "(Megatron's --reset-position-ids; torchtitan's loader); attention "
                                       "still spans the window")
    doc_stride: int = opt(128, "qa: tokens two windows of a long context share (the context is cut into windows of "
                               "training.seq_len tokens, question included)")
    max_answer_len: int = opt(30, "qa: longest answer, in tokens, that evaluation and inference predict")
    n_best: int = opt(20, "qa: highest start and end logits of each window paired up when choosing an answer")


@dataclass
class TokenizerConfig:
    path: str = opt("", "tokenizer.json file or Hugging Face tokenizer folder; empty trains a byte-level BPE")
    vocab_size: int = opt(4096, "vocabulary size of the byte-level BPE trained when no path is given")


@dataclass
class TrainingConfig:
    steps: int = opt(200, "optimizer steps to run")
    global_batch_size: int = opt(16, "sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = opt(0, "sequences per forward/backward on one rank; 0 = global / dp (no accumulation)")
    seq_len: int = opt(128, "tokens per training sequence")
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = opt(20, "linear warm-up steps")
    lr_decay: str = opt("cosine", "cosine | linear: the shape of the decay to min_lr_ratio")
    decay_ratio: float = opt(1.0, "fraction of training.steps, at the end, over which the LR decays; before it the "
                                  "LR holds at the peak (warmup-stable-decay, as torchtitan's decay_ratio); 1: the "
                                  "decay starts when warm-up ends")
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to matrices only (not norms, biases)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables")
    seed: int = opt(1234, "seed for weights, data order and dropout")
    mixed_precision: str = opt("fp32", "fp32 | bf16 (bf16 autocast; master weights stay fp32) | fp16 (fp16 autocast "
                                       "with dynamic loss scaling, for GPUs without bf16 such as V100 and T4: a "
                                       "step whose gradient overflows is skipped and the scale backs off)")
    loss_scale_init: float = opt(65536.0, "fp16: the first loss scale (torch.amp.GradScaler's init_scale)")
    loss_scale_growth: float = opt(2.0, "fp16: the factor the scale grows by after loss_scale_interval steps "
                                        "without an overflow")
    loss_scale_interval: int = opt(2000, "fp16: overflow-free steps before the scale grows")
    loss_scale_backoff: float = opt(0.5, "fp16: the factor the scale shrinks by at a step whose gradient overflows "
                                         "(that step is skipped)")
    param_dtype: str = opt("float32", "float32 | bfloat16: FSDP keeps fp32 master weights and gathers them in bf16, "
                                      "so every op computes in bf16 (torchtitan's bf16); FSDP then wraps one process "
                                      "too. The alternative to mixed_precision=bf16 (autocast)")
    device: str = opt("auto", "auto | cpu | cuda")
    log_every: int = opt(10, "steps between metric lines")
    eval_every: int = opt(100, "steps between evaluations on the held-out split; 0 disables")
    eval_batches: int = opt(4, "batches per evaluation")
    activation_checkpointing: str = opt("none", "none | full | selective")
    compile: bool = opt(False, "torch.compile each transformer block and the chunked loss")
    stack_projections: bool = opt(True, "run q/k/v and SwiGLU's gate/up as one matmul each (the weights stay "
                                        "separate; not under tensor parallelism, whose column shards run apart); "
                                        "LoRA-adapted ones as one autograd node sharing their low-rank products")
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one process that MFU divides by; 0: the device table's on a known "
                                  "GPU, else measured once per machine and cached (~/.cache/scalenlp)")
    timeout_s: int = opt(300, "process-group timeout: a rank that waits longer fails instead of hanging")
    hang_timeout: float = opt(0.0, "seconds one training step may last before the watchdog names the rank the "
                                   "others wait for, dumps every rank's stacks to <run_dir>/hang and ends the "
                                   "attempt for torchrun to restart (under torchrun only); 0 = 10 x the slowest of "
                                   "the last 20 steps, at least 60 s, at most half of training.timeout_s; set: below "
                                   "training.timeout_s")
    task: str = opt("lm", "lm: next-token loss on packed text | sft: supervised fine-tuning on chat JSONL "
                          "(a `messages` list per line, rendered with model.init's chat template; loss on "
                          "assistant tokens only) | classification: an encoder (model.init) with a sequence "
                          "classification head on labelled rows (data.path, data.eval_path); training.seq_len is "
                          "the longest row, in tokens | token_classification: an encoder tagging BIO words (CoNLL or "
                          "JSONL data.path, data.eval_path; entity F1); training.seq_len is the window")
    on_nonfinite: str = opt("stop", "a step whose loss or gradient is not finite: stop (error naming step and "
                                    "rank; nothing saved from it) | skip (drop its update) | rollback (reload the "
                                    "newest checkpoint, read on with the next data)")


@dataclass
class CheckpointConfig:
    every: int = opt(100, "steps between checkpoints; 0 saves only at the end")
    keep: int = opt(2, "number of newest checkpoints kept")
    resume: bool = opt(False, "continue from the newest complete checkpoint in <run_dir>/checkpoints")
    async_save: bool = opt(False, "write checkpoints from a background thread while training goes on (DCP's "
                                  "async_save; costs one host-memory copy of model and optimizer state); "
                                  "the final checkpoint and one before a stop are still awaited")
    export: bool = opt(True, "write final weights as safetensors + config to <run_dir>/export")
    keep_best: str = opt("", "also export the model at its best evaluation to <run_dir>/best, judged by "
                             "(classification) accuracy or macro_f1, (qa) f1 or exact_match, (token_classification) "
                             "f1, precision or recall; empty keeps no best")


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(1, "data-parallel replicas (HSDP outer dim when dp_shard > 1)")
    dp_shard: int = opt(-1, "data-parallel shard degree; -1 = whatever is left of the world size")
    tp: int = opt(1, "tensor-parallel degree")
    pp: int = opt(1, "pipeline-parallel degree")
    data_parallel: str = opt("ddp", " | ".join(DATA_PARALLEL))
    pp_schedule: str = opt("1f1b", " | ".join(SCHEDULES))
    pp_microbatches: int = opt(0, "microbatches per step for pipelining; 0 = pp degree")
    pp_stages_per_rank: int = opt(1, "pipeline stages per rank (interleaved schedules use > 1)")
    sequence_parallel: bool = opt(False, "shard norms/dropout activations along the sequence in TP regions")
    loss_parallel: bool = opt(True, "with tp > 1, keep the logits sharded on the vocabulary and compute the "
                                    "cross-entropy across tp ranks (no rank holds full-vocabulary logits); "
                                    "false gathers them first. No effect when tp = 1")
    offload: bool = opt(False, "offload parameters and optimizer state to CPU (GPU only)")
    ddp_bucket_mb: int = opt(25, "DDP gradient bucket size in MiB")


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank: > 0 fine-tunes low-rank adapters on the frozen model.init instead of every "
                       "weight (only adapters, and a classification head, train and are checkpointed); 0: off")
    alpha: float = opt(16.0, "LoRA alpha: the update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)")
    dropout: float = opt(0.0, "dropout on the adapters' input")
    targets: str = opt("all-linear", "linear layers to adapt: all-linear (every linear of the transformer blocks) or "
                                     "a regular expression over module names or their dotted tails, e.g. "
                                     "\"attention.w[qkvo]|feed_forward.w[123]\"")
    use_rslora: bool = opt(False, "rank-stabilised scaling alpha / sqrt(rank) (rsLoRA)")
    dora: bool = opt(False, "DoRA: a trained magnitude per output row on top of the low-rank direction update")
    init: str = opt("", "start from this adapter: a PEFT adapter folder (adapter_config.json + "
                        "adapter_model.safetensors) or a run's export/adapter; its rank, alpha and layers are used")
    quantize_base: str = opt("", "\"\" | nf4: hold the frozen base weights in 4-bit NF4 with double-quantized "
                                 "scales, computed in bf16 on a GPU (QLoRA; needs the qlora extra, torchao), in "
                                 "float32 on the CPU, where that ran faster; runs under every layout: ZeRO-2/3 "
                                 "shard the NF4 base, tensor parallelism quantizes each rank's shard of it")
    pack_frozen: str = opt("auto", "auto | onednn | transposed | mkl | cast | off: on the CPU, hold each frozen "
                                   "base linear as two oneDNN-packed copies (W for the product, W^T for its input's "
                                   "gradient; in float32 in place of its weight) (onednn), with a row-major copy of "
                                   "W^T beside it for the product (transposed), with a copy of W packed by MKL for "
                                   "the product's rows beside it (mkl, float32 only), or, under "
                                   "training.mixed_precision, with a copy of W cast to its dtype once rather than "
                                   "by autocast every step (cast; the other layouts then hold W cast too): one more "
                                   "copy of the base's block linears, for products that run faster on some CPUs "
                                   "and slower on others; auto times them once per machine and dtype and takes the "
                                   "faster layout where it is at least 1.05x as fast as the plain base, while the "
                                   "copies fit in half the memory available (train/frozen_packing.py); skipped, "
                                   "with the reason logged, for an NF4 base and a sharded one (tensor parallelism, "
                                   "ZeRO-2/3); training.compile takes transposed, mkl and cast")


@dataclass
class MonitorConfig:
    metrics_port: int = opt(0, "serve every rank's CPU, memory, GPU and training figures in Prometheus' format on "
                               "this port of each machine while training (local rank 0 serves its machine's "
                               "ranks, labelled rank=N); 0 serves nothing. --metrics-port sets it")
    metrics_host: str = opt("127.0.0.1", "address the metrics port listens on: this machine only by default; 0.0.0.0 "
                                         "(every interface) for a Prometheus on another machine, preferably with "
                                         "monitor.metrics_token_file. --metrics-host sets it")
    metrics_token_file: str = opt("", "file whose first line is a key the metrics port then requires as "
                                      "`Authorization: Bearer KEY` (else the SCALENLP_METRICS_TOKEN environment "
                                      "variable's; neither: no key). --metrics-token-file sets it")
    interval_s: float = opt(5.0, "seconds between the resource samples served on monitor.metrics_port")


@dataclass
class ProfileConfig:
    steps: str = opt("", "training steps to trace with the PyTorch profiler, FIRST-LAST (e.g. 3-5; step 1 is the "
                         "first): one Chrome trace per rank in <run_dir>/traces/rank<N>.json, for Perfetto or "
                         "chrome://tracing; empty traces nothing")


@dataclass
class TrackingConfig:
    mlflow_uri: str = opt("", "MLflow tracking URI (http(s)://HOST:PORT of a tracking server, file:///PATH, or a "
                              "database URI such as sqlite:///PATH): rank 0 logs the resolved config as params, "
                              "every metrics.jsonl record as metrics and <run_dir>/export as an artifact; the run id "
                              "is kept in <run_dir>/tracking.json, so a resumed run continues the same MLflow run. "
                              "Empty logs nothing (needs the tracking extra)")
    mlflow_experiment: str = opt("scalenlp", "MLflow experiment the run is logged under (created if missing)")
    wandb_project: str = opt("", "Weights & Biases project rank 0 logs the same config, records and export to; "
                                 "empty logs nothing (needs the tracking extra)")
    wandb_mode: str = opt("online", "online | offline: offline writes the W&B run under WANDB_DIR (else <run_dir>) "
                                    "with no network, for `wandb sync` later")
    timeout_s: int = opt(10, "seconds one call to a tracker may take; a tracker that fails or does not answer "
                             "within it is dropped for the rest of the run with one warning (metrics.jsonl keeps "
                             "every record), and nothing is retried")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value: Any, typ: type, where: str) -> Any:
    """Turn a TOML value or a --set string into the field's type, or say what was expected."""
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        if typ is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        try:
            return typ(text)
        except ValueError:
            raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}: {value} is too large for a float") from None
    if typ is str and not isinstance(value, str):  # a TOML value left unquoted (an option once a boolean, say)
        raise ConfigError(f"{where}: expected a string, got {json.dumps(value)}; put the value in quotes")
    if typ is bool and not isinstance(value, bool) or typ is not bool and isinstance(value, bool):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}")
    if not isinstance(value, typ):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section_name, _, key = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if section_name not in sections or not key:
        raise ConfigError(f"unknown config key {dotted!r}: keys look like section.key with section one of "
                          f"{', '.join(sorted(sections))}")
    section = getattr(cfg, section_name)
    hints = get_type_hints(type(section))
    if key not in hints:
        raise ConfigError(f"unknown config key {dotted!r}: {section_name} has "
                          f"{', '.join(f.name for f in dataclasses.fields(section))}")
    setattr(section, key, _coerce(value, hints[key], dotted))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then each ``section.key=value`` override, then validation."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass a TOML file such as configs/debug.toml")
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {str(p)!r}: top-level key {section!r} must be a [section] table")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
    for item in overrides or []:
        dotted, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected section.key=value, for example training.steps=100")
        _set(cfg, dotted.strip(), value)
    validate(cfg)
    return cfg


def check_choice(value: str, allowed: tuple[str, ...], where: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}={value!r} is not one of {' | '.join(allowed)}")


INT_MAX = 2**63 - 1  # torch takes 64-bit integers (seeds, sizes): a larger one overflows inside it


@dataclass(frozen=True)
class Range:
    low: float
    high: float = INT_MAX
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high in (INT_MAX, math.inf) and not self.low_open:
            return f"at least {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


FRACTION = Range(0, 1, high_open=True)
COUNT, POSITIVE = Range(0), Range(1)

# The range of every numeric key, in one place (a test checks that none is missing).
RANGES = {
    "model.vocab_size": COUNT, "model.max_seq_len": COUNT, "model.dropout": FRACTION, "model.hidden": COUNT,
    "model.layers": COUNT, "model.heads": COUNT, "model.kv_heads": COUNT, "model.ffn": COUNT,
    "data.val_fraction": Range(0, 0.5, high_open=True),
    "data.doc_stride": COUNT, "data.max_answer_len": POSITIVE, "data.bucket_batches": POSITIVE, "data.n_best": POSITIVE,
    "tokenizer.vocab_size": POSITIVE,
    "training.steps": POSITIVE, "training.global_batch_size": POSITIVE, "training.micro_batch_size": COUNT,
    "training.seq_len": POSITIVE, "training.lr": Range(0, 1, low_open=True, high_open=True),
    "training.min_lr_ratio": Range(0, 1), "training.warmup_steps": COUNT,
    "training.decay_ratio": Range(0, 1, low_open=True), "training.weight_decay": Range(0, math.inf),
    "training.beta1": FRACTION, "training.beta2": FRACTION, "training.grad_clip": Range(0, math.inf),
    # seed + 1 + rank seeds torch, which takes up to 2**64 - 1.
    "training.seed": COUNT, "training.log_every": POSITIVE, "training.eval_every": COUNT,
    "training.eval_batches": POSITIVE, "training.peak_tflops": Range(0, math.inf),
    # The process group holds the timeout in milliseconds as a 64-bit integer; 2**31 s is 68 years.
    "training.timeout_s": Range(1, 2**31 - 1),
    "training.hang_timeout": Range(0, math.inf),
    "training.loss_scale_init": Range(0, math.inf, low_open=True),
    "training.loss_scale_growth": Range(1, math.inf, low_open=True),
    "training.loss_scale_interval": POSITIVE, "training.loss_scale_backoff": Range(0, 1, low_open=True, high_open=True),
    "checkpoint.every": COUNT, "checkpoint.keep": POSITIVE,
    "parallel.dp_replicate": POSITIVE, "parallel.dp_shard": Range(-1), "parallel.tp": POSITIVE,
    "parallel.pp": POSITIVE, "parallel.pp_microbatches": COUNT, "parallel.pp_stages_per_rank": POSITIVE,
    # DDP takes the bucket in bytes as a 64-bit integer; 2**20 MiB (1 TiB) is above any device's memory.
    "parallel.ddp_bucket_mb": Range(1, 2**20),
    "lora.rank": COUNT, "lora.alpha": Range(0, math.inf, low_open=True), "lora.dropout": FRACTION,
    "monitor.metrics_port": Range(0, 65535), "monitor.interval_s": Range(0, 86400, low_open=True),
    "tracking.timeout_s": Range(1, 3600),
}


def config_items(cfg: Config):
    """(section.key, value) of every key: what validate checks, and the params a tracker logs."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            yield f"{section.name}.{f.name}", getattr(values, f.name)


def _check_value(name: str, value: Any) -> None:
    """Numbers in their range, floats finite, strings without control characters (so that config.toml is
    always valid TOML and every message stays one line)."""
    if isinstance(value, str):
        bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cs")), None)
        if bad is not None:
            raise ConfigError(f"{name} must not contain control characters, got {value!r}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        if name in RANGES and value not in RANGES[name]:
            raise ConfigError(f"{name} must be {RANGES[name]}, got {value}")


def validate(cfg: Config) -> None:
    """Checks that need no model, no data and no process group; the rest is checked where it is known."""
    for name, value in config_items(cfg):
        _check_value(name, value)
    t, p = cfg.training, cfg.parallel
    check_choice(t.on_nonfinite, ("stop", "skip", "rollback"), "training.on_nonfinite")
    check_choice(t.mixed_precision, ("fp32", "bf16", "fp16"), "training.mixed_precision")
    check_loss_scaling(t)
    check_choice(t.lr_decay, ("cosine", "linear"), "training.lr_decay")
    check_choice(t.param_dtype, ("float32", "bfloat16"), "training.param_dtype")
    check_choice(t.device, ("auto", "cpu", "cuda"), "training.device")
    check_choice(p.data_parallel, DATA_PARALLEL, "parallel.data_parallel")
    for problem in choice_problems(p.pp_schedule, t.activation_checkpointing):  # the layout check's own words
        raise ConfigError(problem)
    if p.dp_shard == 0:
        raise ConfigError(f"parallel.dp_shard must be -1 (auto) or at least 1, got {p.dp_shard}")
    if t.lr * t.weight_decay >= 1:  # AdamW scales weights by 1 - lr * weight_decay each step
        raise ConfigError(f"training.lr * training.weight_decay must be below 1 (else every step flips the weights' "
                          f"sign), got {t.lr} * {t.weight_decay}")
    if t.hang_timeout >= t.timeout_s:  # 0 (derived) is always below; the watchdog must fire first to name the rank
        raise ConfigError(f"training.hang_timeout={t.hang_timeout:g} s must be below training.timeout_s={t.timeout_s} "
                          f"s, the process-group timeout, which would end a hung step first without naming the rank; "
                          f"lower training.hang_timeout (0 derives it, at most half of training.timeout_s) or raise "
                          f"training.timeout_s")
    # training.task's own rules are its Task's (scalenlp.train.tasks), which sits above this module: the trainer,
    # validate_run and `scalenlp train` check them after these.
    if cfg.model.init and cfg.tokenizer.path:
        raise ConfigError(f"tokenizer.path={cfg.tokenizer.path!r} contradicts model.init, which brings its own "
                          f"tokenizer; remove tokenizer.path")
    if not cfg.monitor.metrics_host.strip():  # an empty address would listen on every interface
        raise ConfigError("monitor.metrics_host is empty; give the address to listen on, e.g. 127.0.0.1 (this "
                          "machine only) or 0.0.0.0 (every interface)")
    profile_steps(cfg)
    check_lora(cfg)
    check_tracking(cfg)


def check_loss_scaling(t: TrainingConfig) -> None:
    """training.loss_scale_* belong to fp16, whose gradients they scale; fp16 and bf16 weights exclude each other."""
    if t.mixed_precision != "fp16":
        changed = [f"training.{f.name}" for f in dataclasses.fields(t)
                   if f.name.startswith("loss_scale_") and getattr(t, f.name) != f.default]
        if changed:
            raise ConfigError(f"{changed[0]} is set but only fp16 scales its loss; set training.mixed_precision=fp16 "
                              f"or remove {changed[0]}")
    elif t.param_dtype == "bfloat16":
        raise ConfigError("training.mixed_precision=fp16 contradicts training.param_dtype=bfloat16 (bf16 weights); "
                          "keep one: param_dtype=float32 with fp16, or mixed_precision=fp32 with bf16 weights")


def check_lora(cfg: Config) -> None:
    """[lora]'s own rules; those that need the model (ranks, targets) are checked where it is built."""
    lora = cfg.lora
    check_choice(lora.quantize_base, ("", "nf4"), "lora.quantize_base")
    check_choice(lora.pack_frozen, ("auto", "onednn", "transposed", "mkl", "cast", "off"), "lora.pack_frozen")
    if not (lora.rank or lora.init):
        changed = [f"lora.{f.name}" for f in dataclasses.fields(lora) if getattr(lora, f.name) != f.default]
        if changed:
            raise ConfigError(f"{changed[0]} is set but LoRA is off; set lora.rank (e.g. 16) or lora.init, or "
                              f"remove {changed[0]}")
        return
    if not cfg.model.init:
        raise ConfigError("LoRA fine-tunes a pretrained model: set model.init (a checkpoint, Hugging Face folder or "
                          ".gguf file) as the frozen base")


# What MLflow's client opens: a tracking server, a local folder, a database (SQLAlchemy's dialects), Databricks.
MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def check_tracking(cfg: Config) -> None:
    """[tracking]'s own rules: a URI MLflow can open, W&B's options only with a project."""
    tracking = cfg.tracking
    check_choice(tracking.wandb_mode, ("online", "offline"), "tracking.wandb_mode")
    uri = tracking.mlflow_uri.strip()
    scheme = uri.partition(":")[0].partition("+")[0].lower()  # postgresql+psycopg2:// names its driver after a +
    if uri and ("://" not in uri and scheme != "databricks" or scheme not in MLFLOW_SCHEMES):
        raise ConfigError(f"tracking.mlflow_uri={tracking.mlflow_uri!r} is not an MLflow tracking URI; give "
                          f"http(s)://HOST:PORT for a tracking server, file:///PATH for a local folder or a database "
                          f"URI (scheme one of {', '.join(MLFLOW_SCHEMES)})")
    if not tracking.wandb_project and tracking.wandb_mode != "online":
        raise ConfigError("tracking.wandb_mode is set but W&B is off; set tracking.wandb_project, or remove "
                          "tracking.wandb_mode")


def profile_steps(cfg: Config) -> tuple[int, int] | None:
    """profile.steps as (first, last), both within training.steps; None when empty."""
    text, steps = cfg.profile.steps, cfg.training.steps
    if not text.strip():
        return None
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text, re.ASCII)
    if match is None or not 1 <= int(match[1]) <= int(match[2]) <= steps:
        raise ConfigError(f"profile.steps={text!r} is not a range FIRST-LAST of training steps with "
                          f"1 <= FIRST <= LAST <= training.steps ({steps}), e.g. 3-5")
    return int(match[1]), int(match[2])


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as TOML."""
    Path(path).write_text(config_toml(cfg))


def config_toml(cfg: Config) -> str:
    """The resolved config as TOML text (every value is a str/int/float/bool)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every config key with its default and help, for --help-config."""
    out = []
    for section in dataclasses.fields(Config):
        out.append(f"[{section.name}]")
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"  {section.name}.{f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(out)
