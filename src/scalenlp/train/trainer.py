"""The training loop: one process of a (possibly) distributed run, launched by torchrun or alone.

Setup: process group and mesh -> data (rank 0 prepares, everyone memory-maps) -> model built with
the same seed on every rank -> parallelize -> optimizer, schedule -> resume. Then each step:
split this rank's share of the global batch into micro-batches, accumulate gradients, clip, step,
and every ``log_every`` steps reduce the loss over data-parallel ranks and write one metrics record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from scalenlp.config import Config, ConfigError, profile_steps, save_config, validate
from scalenlp.data import DataLoader, TokenDataset, load_tokenizer, open_data, prepare_data
from scalenlp.data.dataset import document_positions
from scalenlp.data.sft import IGNORE_INDEX, ChatDataset
from scalenlp.data.labeled import LabeledLoader
from scalenlp.data.tokenizer import find_bos_token_id
from scalenlp.errors import UserError
from scalenlp.layout import Layout
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.flavors import SIZES, build_model, shape_args, shape_spec
from scalenlp.models.io import build_decoder, save_pretrained
from scalenlp.loader import read
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.mesh import ParallelDims, barrier, build_mesh, device_type, dp_rank, init_distributed
from scalenlp.parallel.data_parallel import skip_gradient_sync
from scalenlp.parallel.parallelize import check_layout, clip_grad_norm_, dp_mesh, loss_context, parallelize
from scalenlp.parallel.pipeline import build_pipeline
from scalenlp import faults
from scalenlp.train import recovery, watchdog
from scalenlp.train.checkpoint import STATE_FILE, Checkpointer, load_full_model, read_train_state
from scalenlp.train.guard import StepCheck, StopRequest, check_step, weights_finite
from scalenlp.train.classify import (build_classifier, classification_loss, classifier_args, evaluate_classifier,
                                     load_classification_data)
from scalenlp.train.metrics import MetricsWriter, peak_memory_bytes
from scalenlp.train.monitor import Monitor
from scalenlp.train.peak import peak_flops
from scalenlp.train.optim import build_optimizer, build_scheduler, lr_factor
from scalenlp.train.profile import StepProfiler


def _checkpoint_args(cfg: Config, pretrained: Pretrained) -> ModelArgs:
    """The checkpoint's architecture; model.* keys may restate it but not change it."""
    args = pretrained.args
    classify = cfg.training.task == "classification"
    if classify != isinstance(args, EncoderArgs):
        raise ConfigError(f"model.init={cfg.model.init!r} is " + (
            "a decoder; training.task=\"classification\" needs an encoder (a BERT-family checkpoint)" if classify else
            f"an encoder; training.task={cfg.training.task!r} needs a decoder (encoders train with "
            f"training.task=\"classification\")"))
    if cfg.model.family:
        raise ConfigError(f"model.family={cfg.model.family!r} contradicts model.init={cfg.model.init!r}, which brings "
                          "its own architecture; remove model.family")
    for key, field in (*SIZES.items(), ("vocab_size", "vocab_size"), ("max_seq_len", "max_seq_len")):
        value = getattr(cfg.model, key)
        if value and value != getattr(args, field, None):
            raise ConfigError(f"model.{key}={value} contradicts model.init={cfg.model.init!r}, whose model has "
                              f"{field}={getattr(args, field, None)}; remove model.{key} (0 follows the checkpoint)")
    vocab = pretrained.tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > args.vocab_size:
        raise ConfigError(f"model.init={cfg.model.init!r} has a tokenizer of {vocab} tokens but a model of only "
                          f"{args.vocab_size}; the checkpoint is inconsistent")
    return dataclasses.replace(args, dropout=cfg.model.dropout)


def resolve_model_args(cfg: Config, vocab_size: int | None = None, pretrained: Pretrained | None = None) -> ModelArgs:
    """The model this config trains: model.init's (``pretrained``), or the flavor's with ``vocab_size``,
    the tokenizer's when known."""
    if pretrained is not None:
        args = _checkpoint_args(cfg, pretrained)
    else:
        args = _flavor_args(cfg, vocab_size)
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len={cfg.training.seq_len} is over the model's max_seq_len "
                          f"{args.max_seq_len}; lower training.seq_len"
                          + ("" if pretrained else " or raise model.max_seq_len"))
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return args


def _flavor_args(cfg: Config, vocab_size: int | None) -> ModelArgs:
    """model.flavor with the model.* shape keys over it, read as `scalenlp plan --model` reads a shape; before
    the tokenizer exists (``vocab_size`` None) the BPE's target size stands in for its vocabulary."""
    if vocab_size and cfg.model.vocab_size and cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size} "
                          f"tokens; set it to 0 to follow the tokenizer")
    return shape_args(cfg.model, cfg.training.seq_len, vocab_size or cfg.tokenizer.vocab_size)


def batch_shape(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per micro-batch on one rank, micro-batches per step)."""
    local = cfg.training.global_batch_size // dims.dp
    if dims.pp > 1:  # the pipeline schedule splits the local batch into parallel.pp_microbatches itself
        return local, 1
    micro = Layout.from_config(cfg, dims.world_size).microbatch
    return micro, local // micro


def validate_run(cfg: Config, world_size: int, pretrained: Pretrained | None = None) -> ParallelDims:
    """Every check that needs no process group and no data, so a launcher can fail before starting N processes.
    With model.init the checkpoint is read here unless given (``pretrained``)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    if cfg.model.init and pretrained is None:
        pretrained = read(cfg.model.init)
    if pretrained is not None and pretrained.quantization is not None:
        raise ConfigError(f"model.init={cfg.model.init} is quantized ({pretrained.quantization.describe()}); fine-tune "
                          f"its floating-point original, then quantize the result")
    check_layout(resolve_model_args(cfg, pretrained=pretrained), dims, cfg)
    return dims


def pick_device(cfg: Config) -> torch.device:
    wanted = cfg.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is visible; use training.device=cpu or auto")
    if wanted == "cpu" or device_type() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def autocast(device: torch.device, mixed_precision: str):
    """bf16 autocast for matmuls (fp32 master weights, fp32 loss), or nothing for fp32."""
    if mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token loss of one (micro-)batch, in fp32 even under bf16 autocast; targets equal to
    IGNORE_INDEX count for nothing. Vocabulary-sharded logits (tensor parallelism with
    parallel.loss_parallel) need ``loss_context``; their loss, the same on every tp rank, comes back
    as a plain tensor."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
    return loss.to_local() if isinstance(loss, DTensor) else loss


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, dims: ParallelDims,
            input_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token loss of a whole model (not a pipeline stage): computed by the model chunk by chunk
    (no full logits), unless tensor parallelism shards them (run under ``loss_context`` then). ``input_pos``:
    (B, T) positions (data.reset_positions), else 0..T-1."""
    if dims.tp == 1:
        return model(inputs, input_pos=input_pos, targets=targets)
    return cross_entropy(model(inputs, input_pos=input_pos), targets, reduction="sum")


def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return value


def _mean_over(value: torch.Tensor, group) -> float:
    return (_sum_over(value, group) / (1 if group is None else dist.get_world_size(group))).item()


@dataclasses.dataclass
class _Window:
    """The steps one metrics record averages over: those since the last record (or rollback). The tokens and
    targets they saw are counted on the trainer, by ``train_step``."""
    loss: torch.Tensor
    steps: int = 0
    time: float = 0.0


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, stop: StopRequest | None = None):
        validate(cfg)  # a Config built in Python gets the checks load_config gives the CLI's
        self.cfg, self.run_dir, self.stop = cfg, Path(run_dir), stop
        watchdog.record_collectives()
        self.rank, self.world = init_distributed(cfg.training.timeout_s, cfg.training.param_dtype == "bfloat16")
        # model.init: every rank reads the checkpoint (memory-mapped where the format allows); its
        # tokenizer tokenizes the data, its weights are assigned below, its tokenizer config is exported.
        pretrained = read(cfg.model.init) if cfg.model.init else None
        self.tokenizer_config = pretrained.tokenizer_config if pretrained else {}
        self.dims = validate_run(cfg, self.world, pretrained)
        self.device = pick_device(cfg)
        self.mesh = build_mesh(self.dims)
        self.dp_group = None if self.mesh is None or self.dims.dp == 1 else dp_mesh(self.mesh, flat=True).get_group()
        self.is_main = self.rank == 0
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep, self.rank,
                                         cfg.checkpoint.async_save, self.log)
        # A restart by torchrun resumes by itself, from the newest checkpoint that is whole (see recovery.py).
        restarted, agents = recovery.continues_launch(self.run_dir)
        verified = None  # (path, train state) rank 0 has already checked
        if restarted and self.is_main:
            verified = recovery.set_aside_damaged(self.checkpointer, self.log)
        barrier()
        latest = self.checkpointer.latest() if cfg.checkpoint.resume or restarted else None
        self.rolled_back_to = None
        # Nothing is written to the run folder before every check has passed, the checkpoint's included.
        if self.is_main:
            if self.checkpointer.complete() and not cfg.checkpoint.resume and not restarted:
                raise UserError(f"{self.run_dir} already has checkpoints; pass --set checkpoint.resume=true to "
                                f"continue that run, or choose a new --run-dir")
            if cfg.checkpoint.resume and latest is None:
                self.log(f"checkpoint.resume=true but {self.run_dir / 'checkpoints'} has no complete checkpoint; "
                         f"starting from step 0")
            if latest is not None:
                self._check_resumable(latest, verified[1] if verified and verified[0] == latest
                                      else read_train_state(latest))
        barrier()
        if latest is not None:
            cfg = self.cfg = recovery.keep_micro_batch(cfg, json.loads((latest / STATE_FILE).read_text()),
                                                       self.dims, self.log)

        t = cfg.training
        self.micro_batch, self.accum = batch_shape(cfg, self.dims)
        self.classify = t.task == "classification"
        torch.manual_seed(t.seed)
        if self.classify:
            # Labelled rows are few and quick to tokenize: every rank reads them, nothing is cached.
            self.task_data = load_classification_data(cfg, pretrained.tokenizer, self.log)
            self.tokenizer = pretrained.tokenizer
            self.loader = LabeledLoader(self.task_data.train, t.global_batch_size, dp_rank(self.mesh), self.dims.dp,
                                        t.seed, cfg.data.shuffle)
            self.val = None
            self.model_args = classifier_args(cfg, pretrained, self.task_data.labels)
            model = build_classifier(self.model_args, pretrained, self.device, where=cfg.model.init)
            del pretrained
        else:
            # Data: one process per node tokenizes (the cache makes later runs instant), all memory-map.
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                prepare_data(cfg, self.run_dir, log=self.log, pretrained=pretrained)
            barrier()
            self.data = open_data(cfg, self.run_dir, pretrained)
            self.tokenizer = self.data.tokenizer_json
            dataset = ChatDataset if t.task == "sft" else TokenDataset
            self.loader = DataLoader(dataset(self.data.train_tokens, t.seq_len), t.global_batch_size,
                                     dp_rank(self.mesh), self.dims.dp, t.seed, cfg.data.shuffle)
            self.val = dataset(self.data.val_tokens, t.seq_len) if t.eval_every else None
            # (BOS, EOS) ids where documents start and end, for data.reset_positions.
            self.document_marks = (find_bos_token_id(load_tokenizer(self.data.tokenizer_json),
                                                     self.data.tokenizer_json), self.data.eos_id) \
                if cfg.data.reset_positions else None

            # Model: the checkpoint's weights, or the same seed everywhere, so every layout starts from the
            # weights of the single-process run. Either way the full model is built on every rank and then
            # parallelized (sharded, split into stages) exactly as a randomly initialised one.
            self.model_args = resolve_model_args(cfg, self.data.vocab_size, pretrained)
            if pretrained is not None:  # fp32 master weights, whatever the checkpoint's dtype
                model = build_decoder(self.model_args, pretrained.state, self.device, torch.float32,
                                      where=cfg.model.init).train()
                del pretrained  # the model holds the weights now
            else:
                model = build_model(self.model_args, self.device)
        self.n_params = model.num_params()
        self.flops_per_token = model.flops_per_token(t.seq_len)
        self.loss_weight = torch.ones((), device=self.device)  # see _weigh_loss
        if self.dims.pp > 1:
            self.pipeline, self.model_parts = build_pipeline(model, self.dims, self.mesh, cfg, self._pipeline_loss)
        else:
            self.pipeline, self.model_parts = None, [parallelize(model, self.dims, self.mesh, cfg)]
        self.optimizers = [build_optimizer(part, t, self.dims, self.mesh, cfg.parallel.data_parallel)
                           for part in self.model_parts]
        self.schedulers = [build_scheduler(opt, t) for opt in self.optimizers]
        self.scheduler = self.schedulers[0]  # all parts follow the same schedule
        torch.manual_seed(t.seed + 1 + self.rank)  # dropout streams differ per rank, reproducibly
        self.step = 0
        self.tokens_seen = 0  # by this rank since the last metrics record
        self.targets_seen = 0  # counted by the loss, all data-parallel ranks together, since then (a tensor)
        self.best: dict | None = None  # {"step", keep_best's metric: value} of the best evaluation so far
        if latest is not None:
            self._resume(latest)
            self.log(f"resumed from {latest} at step {self.step}")
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.toml")
            recovery.record_launch(self.run_dir, agents, restarted)
        # Under torchrun only: ending a hung attempt hands it to torchrun, which restarts it (or fails the job
        # now rather than at the process-group timeout); a lone process has no one to hand it to.
        self.watchdog = watchdog.Watchdog(self.run_dir, self.rank, self.world, t.hang_timeout, t.timeout_s,
                                          enabled=bool(agents))
        barrier()
        self.fault = faults.planned(self.rank)

        dtype = torch.bfloat16 if t.mixed_precision == "bf16" or t.param_dtype == "bfloat16" else torch.float32
        self.peak = peak_flops(self.device, dtype, t.peak_tflops)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main)
        self.monitor = Monitor(cfg.monitor, self.device, self.rank)

    # -- helpers --------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.rank == 0:
            tqdm.write(msg, file=sys.stderr)

    def _train_state(self) -> dict:
        t = self.cfg.training
        return {"data": self.loader.state_dict(), "scheduler": self.scheduler.state_dict(),
                "global_batch_size": t.global_batch_size, "seq_len": t.seq_len, "world_size": self.world,
                "layout": self.dims.names_and_sizes(), "best": self.best}

    def _check_resumable(self, path: Path, state: dict) -> None:
        t = self.cfg.training
        for key in ("global_batch_size", "seq_len"):
            if state.get(key) != getattr(t, key):
                raise UserError(f"checkpoint {path} was trained with training.{key}={state.get(key)}, this run has "
                                f"{getattr(t, key)}; the data position only carries over with the same value")

    def _resume(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model_parts, self.optimizers)
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        self.step = state["step"]
        self.best = state.get("best")

    def _roll_back(self, check: StepCheck) -> None:
        """training.on_nonfinite=rollback: the newest checkpoint's weights, optimizer and schedule, with the
        data read on from here (the same batches would lead to the same state). Once per checkpoint: a
        second failure before a newer one exists stops the run."""
        self.checkpointer.wait()
        latest = self.checkpointer.latest()
        if latest is None or latest == self.rolled_back_to:
            raise UserError(f"{check.describe(self.step)}, and "
                            + ("there is no checkpoint to roll back to" if latest is None else
                               f"it happened again after rolling back to {latest}")
                            + "; stopped before saving anything from it. Lower training.lr, or check the data")
        self.log(f"{check.describe(self.step)}; rolling back to {latest} (training.on_nonfinite=rollback)")
        if self.is_main:
            read_train_state(latest)
        barrier()
        data = self.loader.state_dict()
        self._resume(latest)
        self.loader.load_state_dict(data)
        self.rolled_back_to = latest

    def _new_window(self) -> _Window:
        self.tokens_seen = self.targets_seen = 0
        return _Window(torch.zeros((), device=self.device))

    # -- the step ---------------------------------------------------------------------------------
    def _weigh_loss(self, targets: torch.Tensor) -> None:
        """Set ``loss_weight`` so that summed micro-batch losses times it, summed over micro-batches and
        averaged over data-parallel ranks (as DDP / FSDP average gradients), give the mean over every
        counted target of the global batch. Targets are not all counted (SFT ignores all but the
        assistant's tokens) and their number differs between micro-batches and ranks, so averaging
        per-micro-batch means would give a token more weight the fewer counted tokens share its
        micro-batch, and so a different loss under each layout. One scalar all-reduce per step."""
        counted = _sum_over((targets != IGNORE_INDEX).sum().float(), self.dp_group)
        self.loss_weight = self.dims.dp / counted
        self.targets_seen += counted

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The schedule divides gradients by the number of micro-batches (it expects mean losses), and the
        # runner reports the mean of these values: multiplying by that number undoes both.
        microbatches = self.cfg.parallel.pp_microbatches or self.dims.pp
        return cross_entropy(logits, targets, reduction="sum") * self.loss_weight * microbatches

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, StepCheck]:
        """One optimizer step over this rank's share of the global batch; (loss, grad norm) on this rank and
        what every rank agreed on. A step whose loss or gradient is not finite updates nothing."""
        batch = [x.to(self.device, non_blocking=True) for x in self.loader.next_batch()]
        self.tokens_seen += batch[0].numel()
        self._weigh_loss(batch[-1])  # the targets (next token) or labels (classification) come last
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # the schedule runs the micro-batches (pp_microbatches) itself
            with autocast(self.device, self.cfg.training.mixed_precision):
                loss_sum += self.pipeline.step(*batch, self.positions(batch[0]))
        else:
            for i, micro in enumerate(zip(*(x.split(self.micro_batch) for x in batch))):
                # Gradients are reduced across data-parallel ranks only after the last micro-batch.
                with contextlib.nullcontext() if i == self.accum - 1 else skip_gradient_sync(self.model_parts):
                    with loss_context(self.dims, self.cfg):
                        with autocast(self.device, self.cfg.training.mixed_precision):
                            loss = self.micro_batch_loss(micro) * self.loss_weight
                        loss.backward()
                loss_sum += loss.detach()
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_mesh, second_copies = (self.mesh["pp"], self.pipeline.second_copies()) if self.pipeline else (None, [])
        # A tied embedding's two pipeline copies hold the same gradient: the norm counts it once.
        grad_norm = clip_grad_norm_(params, self.cfg.training.grad_clip, pp_mesh, counted_elsewhere=second_copies)
        check = check_step(loss_sum, grad_norm, self.stop)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            if check.finite:
                optimizer.step()
            scheduler.step()  # a skipped step still counts: the schedule stays a function of the step
            optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, check

    def micro_batch_loss(self, micro: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Summed loss of one micro-batch (``_weigh_loss`` turns it into its share of the global mean):
        next-token (inputs, targets), or classification (input_ids, attention_mask, token_type_ids, labels)."""
        if self.classify:
            return classification_loss(self.model_parts[0], micro)
        inputs, targets = micro
        return lm_loss(self.model_parts[0], inputs, targets, self.dims, self.positions(inputs))

    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The positions of packed windows under data.reset_positions (else None: 0..T-1)."""
        return None if self.document_marks is None else document_positions(inputs, *self.document_marks)

    def evaluate_classifier(self) -> dict[str, float]:
        """eval_loss, accuracy and macro_f1 on the whole eval file."""
        model = self.model_parts[0]
        model.eval()
        scores = evaluate_classifier(model, self.task_data.eval, self.cfg.training.global_batch_size,
                                     dp_rank(self.mesh), self.dims.dp, self.device, self.dp_group,
                                     len(self.task_data.labels),
                                     lambda: autocast(self.device, self.cfg.training.mixed_precision))
        model.train()
        return scores

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the counted targets of a fixed slice of the held-out split (the same rows every time)."""
        t = self.cfg.training
        # A pipeline schedule takes whole local batches only.
        unit = self.dims.dp * (self.micro_batch if self.pipeline is not None else 1)
        n = min(len(self.val), t.eval_batches * t.global_batch_size) // unit * unit
        if n == 0:
            return float("nan")
        for part in self.model_parts:
            part.eval()
        mine = list(range(dp_rank(self.mesh), n, self.dims.dp))
        total, counted = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        self.loss_weight = torch.ones((), device=self.device)  # the pipeline's losses are then plain sums
        for start in range(0, len(mine), self.micro_batch):
            inputs, targets = (x.to(self.device) for x in self.val.batch(mine[start:start + self.micro_batch]))
            counted += (targets != IGNORE_INDEX).sum()
            with autocast(self.device, t.mixed_precision):
                if self.pipeline is not None:
                    total += self.pipeline.eval(inputs, targets, self.positions(inputs))
                else:
                    with loss_context(self.dims, self.cfg):
                        total += lm_loss(self.model_parts[0], inputs, targets, self.dims, self.positions(inputs))
        for part in self.model_parts:
            part.train()
        total, counted = _sum_over(torch.stack([total, counted]), self.dp_group)
        return (total / counted).item()

    def save(self, wait: bool = True) -> Path:
        """Checkpoint this step; ``wait=False`` lets an asynchronous save (checkpoint.async_save) write on."""
        if not weights_finite(self.model_parts):
            latest = self.checkpointer.latest()
            raise UserError(f"step {self.step}: the weights are not finite after a finite gradient; nothing saved or "
                            f"exported (newest good checkpoint: {latest or 'none'}). Lower training.lr")
        return self.checkpointer.save(self.step, self.model_parts, self.optimizers, self._train_state(), wait)

    def export(self, checkpoint: Path, folder: str = "export", extra_files: dict[str, str] | None = None) -> None:
        """Rank 0 reads a checkpoint into one unsharded model (DCP reshards from any layout) and writes
        safetensors + model args (an encoder's with its labels) + tokenizer + resolved config to
        <run_dir>/<folder>."""
        if self.is_main:
            model = (Encoder if self.classify else Transformer)(self.model_args)
            load_full_model(checkpoint, model)
            out = save_pretrained(model, self.run_dir / folder, self.tokenizer,
                                  {"config.toml": (self.run_dir / "config.toml").read_text(), **(extra_files or {})},
                                  tokenizer_config=self.tokenizer_config)
            self.log(f"exported weights of {checkpoint.name}: {out}")
        barrier()

    def keep_if_best(self, scores: dict[str, float]) -> Path | None:
        """Save and export to <run_dir>/best when ``scores`` beat the best so far by checkpoint.keep_best;
        the checkpoint saved, if any."""
        metric = self.cfg.checkpoint.keep_best
        if not metric or self.best is not None and scores[metric] <= self.best[metric]:
            return None
        self.best = {"step": self.step, metric: scores[metric]}
        path = self.save()
        self.export(path, "best", {"best.json": json.dumps({**self.best, "scores": scores}, indent=1)})
        return path

    def evaluate_and_record(self) -> Path | None:
        """Evaluate, write the record to metrics.jsonl and log it; the checkpoint saved as the new best, if any."""
        if self.classify:
            if self.task_data.eval is None:
                return None
            scores = self.evaluate_classifier()
            self.metrics.write({"step": self.step, **scores})
            self.log(f"step {self.step:>6} | eval loss {scores['eval_loss']:.4f} | accuracy {scores['accuracy']:.4f}"
                     f" | macro-F1 {scores['macro_f1']:.4f}")
            return self.keep_if_best(scores)
        val = self.evaluate()
        self.metrics.write({"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        self.log(f"step {self.step:>6} | eval loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")
        return None

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.training
        self.log(f"model {cfg.model.init or shape_spec(cfg.model)}: {self.n_params / 1e6:.2f}M parameters, "
                 f"{self.flops_per_token / 1e6:.1f} MFLOPs/token | layout "
                 + " ".join(f"{n}={s}" for n, s in self.dims.names_and_sizes())
                 + (f" ({cfg.parallel.data_parallel})" if self.dims.dp > 1 else "")
                 + f" on {self.world} x {self.device.type} | batch {t.global_batch_size} x {t.seq_len} tokens "
                 f"({self.accum} micro-batch(es) of {self.micro_batch}/rank) | peak {self.peak.flops / 1e12:.3f} "
                 f"TFLOP/s per process ({self.peak.source})")
        records = []
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", disable=not self.is_main,
                   dynamic_ncols=True, file=sys.stderr)
        window = self._new_window()
        last_saved = None
        profiler = StepProfiler(profile_steps(cfg), self.step, self.run_dir / "traces" / f"rank{self.rank}.json",
                                self.device, self.log)
        while self.step < t.steps:
            start = time.perf_counter()
            self.watchdog.step_started(self.step + 1)
            with profiler.step(self.step + 1):
                loss, grad_norm, check = self.train_step()
            self.checkpointer.poll()
            window.loss += loss
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            window.time += time.perf_counter() - start
            window.steps += 1
            self.step += 1
            bar.update(1)
            faults.inject(self.fault, self.step, self.checkpointer)
            if not check.finite:
                if t.on_nonfinite == "stop":
                    latest = self.checkpointer.latest()
                    raise UserError(f"{check.describe(self.step)}; stopped before saving or exporting anything "
                                    f"from it (newest good checkpoint: {latest or 'none'}). Lower training.lr, or "
                                    f"set training.on_nonfinite=skip or rollback")
                if t.on_nonfinite == "rollback":
                    self._roll_back(check)
                    bar.n = self.step
                    window = self._new_window()
                    continue
                self.log(f"{check.describe(self.step)}; its update is skipped (training.on_nonfinite=skip)")
            if self.step % t.log_every == 0 or self.step == t.steps:
                # Tokens the model ran on, padding included (classification batches are padded to their longest
                # row, SFT rows to seq_len): the model computes on padding too, so MFU counts it.
                tokens_per_sec = self.tokens_seen * self.dims.dp / window.time
                mfu, peak_note = self.peak.mfu(tokens_per_sec / self.world * self.flops_per_token)
                if peak_note:
                    self.log(f"step {self.step}: {peak_note}")
                record = {
                    "step": self.step,
                    "loss": _mean_over(window.loss / window.steps, self.dp_group),
                    "lr": t.lr * lr_factor(self.step - 1, t),  # what this step ran with (the scheduler is one on)
                    "grad_norm": grad_norm.item(),
                    "tokens_per_sec": tokens_per_sec,
                    "mfu": mfu,
                    "peak_tflops": self.peak.flops / 1e12,
                    "peak_source": self.peak.source,
                    "peak_mem_bytes": peak_memory_bytes(self.device),
                    "step_time_s": window.time / window.steps,
                    "samples_per_sec": window.steps * t.global_batch_size / window.time,
                }
                if t.task == "sft":  # the tokens it learns from; tokens_per_sec counts padding too (see metrics.py)
                    record["assistant_tokens_per_sec"] = float(self.targets_seen) / window.time
                record.update(self.monitor.gather())  # every rank's CPU and memory (a collective)
                self.monitor.publish(record)
                records.append(record)
                self.metrics.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tokens_per_sec:,.0f}")
                self.log(f"step {self.step:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm "
                         f"{record['grad_norm']:.3f} | {tokens_per_sec:,.0f} tok/s | MFU {record['mfu']:.1%} | "
                         f"peak mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB"
                         + (f" | {record['assistant_tokens_per_sec']:,.0f} assistant tok/s" if t.task == "sft" else ""))
                window = self._new_window()
            self.watchdog.step_finished()  # evaluations and saves are bounded by training.timeout_s instead
            saved_best = None
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                saved_best = self.evaluate_and_record()
            stopping = check.stop and self.step < t.steps  # at the last step the run simply ends
            if saved_best is not None:
                last_saved = saved_best
            elif stopping or cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 or self.step == t.steps:
                last_saved = self.save(wait=stopping or self.step == t.steps)
            if stopping:
                bar.close()
                got = self.stop.signal if self.stop is not None and self.stop.signal else "a signal to another rank"
                self.log(f"stopped by {got} after step {self.step} of {t.steps}: checkpoint saved to {last_saved}; "
                         f"continue with --set checkpoint.resume=true")
                self.metrics.close()
                self.monitor.close()
                profiler.close()
                return records
        bar.close()
        profiler.close()
        if last_saved is None:  # resumed at the final step: nothing new was trained
            last_saved = self.checkpointer.latest()
        if cfg.checkpoint.export and last_saved is not None:
            self.export(last_saved)
        self.metrics.close()
        self.monitor.close()
        return records


def train(cfg: Config, run_dir: Path) -> list[dict]:
    """Run training in this process (one rank of a torchrun job, or alone); metric records of rank 0."""
    try:
        with StopRequest() as stop:
            trainer = Trainer(cfg, run_dir, stop)
            with trainer.watchdog:
                return trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
