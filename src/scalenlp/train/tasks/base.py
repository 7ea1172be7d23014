"""The Task interface, with the defaults of a decoder learning the next token of rows from the token cache.

A task is what depends on what is learnt: its config rules, each rank's data, the model and its head, the loss
of one micro-batch, evaluation, what the export holds and what a metrics record adds. The trainer owns the rest
(process group, layout, optimizer, checkpoints, the loop) and asks the task. One Task object serves one run:
``build_data`` keeps what evaluation and the export need later (held-out rows, the tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scalenlp.config import Config, ConfigError, check_choice
from scalenlp.data import DataLoader, TokenDataset, open_data, prepare_data
from scalenlp.data.prepare import PACKED_TEXT
from scalenlp.data.sft import IGNORE_INDEX
from scalenlp.models.adapter_io import read_adapter
from scalenlp.models.adapters import (
    LoraSpec,
    adaptable,
    add_adapters,
    freeze_all_but_adapters,
    load_adapter_weights,
    match_targets,
)
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.encoder import EncoderArgs
from scalenlp.models.flavors import SIZES, build_model, shape_args
from scalenlp.models.io import build_decoder
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.mesh import ParallelDims, barrier, dp_rank
from scalenlp.parallel.parallelize import loss_context
from scalenlp.train.loss import autocast, lm_loss, sum_over


class Task:
    """Defaults: a decoder trained on next-token loss over windows of the token cache (``rows``, read by
    ``dataset``), scored by its loss on the held-out split. Subclasses override what their task does otherwise."""

    best_scores: tuple[str, ...] = ()  # scores of evaluate() checkpoint.keep_best may judge by (higher is better)
    packs_documents = False  # rows hold documents one after another, so data.reset_positions applies
    rows: Any = PACKED_TEXT  # what data preparation writes to the token cache (data/prepare.py)
    dataset = TokenDataset  # what reads those rows back as (inputs, targets)
    model_class: type[torch.nn.Module] = Transformer  # what the export holds

    # -- config -----------------------------------------------------------------------------------
    def validate(self, cfg: Config) -> None:
        """This task's config rules; config.validate has checked those every run shares."""
        if cfg.checkpoint.keep_best and not self.best_scores:
            raise ConfigError("checkpoint.keep_best applies to the tasks scored by evaluation (classification, qa, "
                              f"token_classification), not training.task={cfg.training.task!r}; remove it")
        if cfg.data.reset_positions and not self.packs_documents:
            raise ConfigError(f"data.reset_positions applies to packed text (training.task=\"lm\"); "
                              f"training.task={cfg.training.task!r} starts every row at position 0 already: remove it")
        check_choice(cfg.checkpoint.keep_best, ("",) + self.best_scores, "checkpoint.keep_best")

    def check_checkpoint(self, cfg: Config, args: ModelArgs | EncoderArgs) -> None:
        """model.init's model (``args``) is of the kind this task trains."""
        if isinstance(args, EncoderArgs):
            raise ConfigError(f"model.init={cfg.model.init!r} is an encoder; training.task={cfg.training.task!r} "
                              f"needs a decoder (encoders train with training.task=\"classification\")")

    def model_args(self, cfg: Config, pretrained: Pretrained | None = None,
                   vocab_size: int | None = None) -> ModelArgs | EncoderArgs:
        """The model this config trains, as far as it is known without data: model.init's (``pretrained``), or
        the flavor's with ``vocab_size``, the tokenizer's when known."""
        if pretrained is not None:
            self.check_checkpoint(cfg, pretrained.args)
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

    # -- data and model ----------------------------------------------------------------------------
    def build_data(self, cfg: Config, run_dir: Path, pretrained: Pretrained | None, dp_index: int, dp_size: int,
                   log: Callable[[str], None]) -> DataLoader:
        """This rank's loader of training batches (``dp_index`` of ``dp_size`` data-parallel ranks); keeps the
        held-out rows and the tokenizer (``self.tokenizer``, a Tokenizer or its file) for later."""
        # One process per node tokenizes (the cache makes later runs instant), all memory-map.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            prepare_data(cfg, run_dir, log=log, pretrained=pretrained, rows=self.rows)
        barrier()
        self.files = open_data(cfg, run_dir, pretrained, self.rows)
        self.tokenizer = self.files.tokenizer_json
        t = cfg.training
        loader = DataLoader(self.dataset(self.files.train_tokens, t.seq_len), t.global_batch_size, dp_index, dp_size,
                            t.seed, cfg.data.shuffle)
        self.val = self.dataset(self.files.val_tokens, t.seq_len) if t.eval_every else None
        return loader

    def build_model(self, cfg: Config, pretrained: Pretrained | None,
                    device: torch.device) -> tuple[ModelArgs | EncoderArgs, torch.nn.Module]:
        """(model args, the whole model in fp32 on ``device``), after ``build_data``: the checkpoint's weights, or
        random ones from the seed the trainer set, so every layout starts from the single-process run's weights."""
        args = self.model_args(cfg, pretrained, self.files.vocab_size)
        if pretrained is not None:  # fp32 master weights, whatever the checkpoint's dtype
            return args, build_decoder(args, pretrained.state, device, torch.float32, where=cfg.model.init).train()
        return args, build_model(args, device)

    def add_adapters(self, cfg: Config, model: torch.nn.Module, quantize: bool = True) -> None:
        """[lora]: wrap the targeted linears of ``model`` (built by ``build_model``, or on the meta device to check
        the config) with adapters, from lora.init or fresh (from the global RNG), and freeze all else but an
        encoder's task head (new, so it trains in full: PEFT's modules_to_save); with ``quantize`` and
        lora.quantize_base, the frozen block linears become NF4 first (under tensor parallelism, later: see
        ``parallelize``)."""
        lora = cfg.lora
        if not (lora.rank or lora.init):
            return
        if lora.init:
            spec, weights = read_adapter(lora.init, model.args)
            if lora.rank and lora.rank != spec.rank:
                raise ConfigError(f"lora.rank={lora.rank} contradicts lora.init={lora.init!r}, an adapter of rank "
                                  f"{spec.rank}; remove lora.rank")
            spec = dataclasses.replace(spec, dropout=lora.dropout)
            targets = list(weights)
        else:
            spec = LoraSpec(lora.rank, lora.alpha, lora.dropout, lora.use_rslora, lora.dora)
            targets = match_targets(model, lora.targets)
        # Under tensor parallelism each rank quantizes only its shard, once the plan has cut it (parallelize).
        if quantize and lora.quantize_base == "nf4" and cfg.parallel.tp == 1:
            from scalenlp.compress.nf4 import quantize_nf4  # torchao, an optional extra

            quantize_nf4(model, adaptable(model))
        add_adapters(model, spec, targets)
        self.lora_spec = spec  # what the export writes beside the adapter
        if lora.init:
            load_adapter_weights(model, weights, lora.init)
        freeze_all_but_adapters(model, getattr(model.args, "head_names", ()))

    # -- the step ----------------------------------------------------------------------------------
    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The positions of ``inputs``' tokens where they are not 0..T-1 in each row (else None)."""
        return None

    def counted_targets(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """How many targets of ``batch`` the loss counts: its last tensor's, but those equal to IGNORE_INDEX."""
        return (batch[-1] != IGNORE_INDEX).sum()

    def micro_batch_loss(self, model: torch.nn.Module, micro: tuple[torch.Tensor, ...],
                         dims: ParallelDims) -> torch.Tensor:
        """Summed loss of one micro-batch, (inputs, targets) here, on a whole model (not a pipeline stage)."""
        inputs, targets = micro
        return lm_loss(model, inputs, targets, dims, self.positions(inputs))

    # -- evaluation and records ----------------------------------------------------------------------
    def evaluate(self, trainer: Any) -> dict[str, float] | None:
        """The scores of one evaluation of ``trainer``'s model (the running Trainer: its model_parts, pipeline,
        cfg, dims, mesh, dp_group, device and micro_batch), the same on every rank; None: nothing to score."""
        loss = self._held_out_loss(trainer)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}

    def describe(self, scores: dict[str, float]) -> str:
        """``scores`` in the log line of an evaluation."""
        return f"eval loss {scores['val_loss']:.4f} | perplexity {scores['val_ppl']:.2f}"

    def record(self, targets_seen: torch.Tensor | int, seconds: float) -> dict[str, float]:
        """What a metrics record adds, from the targets all ranks counted over its ``seconds`` of steps."""
        return {}

    def progress(self, record: dict) -> str:
        """What the progress line of ``record`` adds."""
        return ""

    @torch.no_grad()
    def _held_out_loss(self, trainer: Any) -> float:
        """Mean loss over the counted targets of a fixed slice of the held-out split (the same rows every time)."""
        t, dims, micro, device = trainer.cfg.training, trainer.dims, trainer.micro_batch, trainer.device
        # A pipeline schedule takes whole local batches only.
        unit = dims.dp * (micro if trainer.pipeline is not None else 1)
        n = min(len(self.val), t.eval_batches * t.global_batch_size) // unit * unit
        if n == 0:
            return float("nan")
        for part in trainer.model_parts:
            part.eval()
        mine = list(range(dp_rank(trainer.mesh), n, dims.dp))
        total, counted = torch.zeros((), device=device), torch.zeros((), device=device)
        for start in range(0, len(mine), micro):
            inputs, targets = (x.to(device) for x in self.val.batch(mine[start:start + micro]))
            counted += (targets != IGNORE_INDEX).sum()
            with autocast(device, t.mixed_precision):
                if trainer.pipeline is not None:
                    total += trainer.pipeline.eval(inputs, targets, self.positions(inputs))
                else:
                    with loss_context(dims, trainer.cfg):
                        total += lm_loss(trainer.model_parts[0], inputs, targets, dims, self.positions(inputs))
        for part in trainer.model_parts:
            part.train()
        total, counted = sum_over(torch.stack([total, counted]), trainer.dp_group)
        return (total / counted).item()


def _checkpoint_args(cfg: Config, pretrained: Pretrained) -> ModelArgs | EncoderArgs:
    """The checkpoint's architecture; model.* keys may restate it but not change it."""
    args = pretrained.args
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


def _flavor_args(cfg: Config, vocab_size: int | None) -> ModelArgs:
    """model.flavor with the model.* shape keys over it, read as `scalenlp plan --model` reads a shape; before
    the tokenizer exists (``vocab_size`` None) the BPE's target size stands in for its vocabulary."""
    if vocab_size and cfg.model.vocab_size and cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size} "
                          f"tokens; set it to 0 to follow the tokenizer")
    return shape_args(cfg.model, cfg.training.seq_len, vocab_size or cfg.tokenizer.vocab_size)
