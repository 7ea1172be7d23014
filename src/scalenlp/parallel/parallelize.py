"""Apply parallelisms to a model in the one correct order.

Order (per model, or per pipeline stage when pp > 1, see pipeline.py):
  TP -> activation checkpointing -> compile -> data parallel (DDP / ZeRO / HSDP).
- TP first: it replaces weights by DTensor shards, which everything after must see.
- Activation checkpointing wraps each block; compile then compiles each (checkpointed) block, so
  the recomputation is compiled too.
- Data parallelism last: it must own the final parameters (DDP's hooks, FSDP's sharded DTensors),
  and with TP it shards the already-TP-sharded weights along the other mesh dimension (2-D).

``check_layout`` runs before any process group exists, so an impossible layout is one error line.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from scalenlp.config import Config, ConfigError
from scalenlp.layout import Layout, ModelSizes, check
from scalenlp.models.adapters import adaptable
from scalenlp.models.decoder import ModelArgs, stack_projections
from scalenlp.models.encoder import EncoderArgs
from scalenlp.parallel.data_parallel import apply_ddp, apply_fsdp, apply_replicate, zero1_optimizer
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.parallel.tensor_parallel import apply_tp, vocab_parallel_loss

# Selective checkpointing keeps the outputs of the expensive ops (matmuls, attention) and recomputes
# the cheap memory-bound rest (norms, activations, RoPE, residual adds) in backward.
_OPS_TO_SAVE = [op for op in (
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
)]


def check_layout(model_args: ModelArgs | EncoderArgs, dims: ParallelDims, cfg: Config) -> None:
    """Raise ConfigError for a layout this model cannot run, before any process-group work: the one layout
    check the planner and the sharded server make too, and what only training has (CPU offload)."""
    p, t = cfg.parallel, cfg.training
    check(Layout.from_config(cfg, dims.world_size), ModelSizes.of(model_args, isinstance(model_args, EncoderArgs)),
          dims.world_size, t.seq_len, t.global_batch_size, error=ConfigError)
    if t.param_dtype == "bfloat16" and dims.dp > 1 and p.data_parallel in ("ddp", "zero1") and dims.tp == dims.pp == 1:
        raise ConfigError("training.param_dtype=\"bfloat16\" casts weights through FSDP, which "
                          f"parallel.data_parallel=\"{p.data_parallel}\" does not use here; choose \"zero2\" or "
                          f"\"zero3\", or training.mixed_precision=\"bf16\" (autocast)")
    if p.offload and not torch.cuda.is_available():  # its data-parallel needs are the layout check's
        raise ConfigError("parallel.offload=true moves FSDP's shards from a GPU to host memory: it needs a GPU; "
                          "set parallel.offload=false")


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per block: "full" keeps only each block's input, "selective" also
    keeps matmul/attention outputs. Composable ``checkpoint`` keeps parameter names unchanged."""
    if mode == "none":
        return
    context_fn = functools.partial(create_selective_checkpoint_contexts, _OPS_TO_SAVE) if mode == "selective" else None
    for block in model.layers.values():
        if context_fn is None:
            checkpoint(block, preserve_rng_state=False)
        else:
            checkpoint(block, preserve_rng_state=False, context_fn=context_fn)


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: blocks are identical, so one compiled graph is reused, and
    FSDP's per-block hooks stay outside the graphs. The chunked loss is compiled on its own too."""
    for block in model.layers.values():
        block.compile(fullgraph=False)
    model.compile_loss = True


def dp_mesh(mesh: DeviceMesh, flat: bool) -> DeviceMesh:
    """The data-parallel part of the mesh: 1-D "dp" (replicate x shard flattened) for DDP and
    ZeRO-1; for FSDP, "dp_shard" alone or (dp_replicate, dp_shard) when replicas exist (HSDP)."""
    if flat:
        try:
            with warnings.catch_warnings():
                # PyTorch advises keeping the object _flatten returned instead of slicing it from the
                # root again; the root is the one mesh every caller holds, so the slice is the lookup.
                warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
                return mesh["dp"]
        except KeyError:
            return mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, cfg: Config) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallelism; returns the module to train
    (a DDP wrapper for ddp/zero1 without tp/pp, the model itself, sharded in place, otherwise)."""
    p, t = cfg.parallel, cfg.training
    stack_projections(model, t.stack_projections)
    if mesh is not None and dims.tp > 1:
        apply_tp(model, mesh["tp"], p.sequence_parallel, shard_logits=p.loss_parallel)
        if cfg.lora.quantize_base == "nf4":  # QLoRA: this rank's shard of each frozen block linear, in NF4
            from scalenlp.parallel.nf4_shards import quantize_tp_shards, reset_magnitudes  # torchao, optional

            quantize_tp_shards(model, adaptable(model))
            if not cfg.lora.init:  # a fresh DoRA magnitude is its base's row norms: the base as quantized now
                reset_magnitudes(model)
    apply_ac(model, t.activation_checkpointing)
    if t.compile:
        apply_compile(model)
    bf16 = t.mixed_precision == "bf16" or t.param_dtype == "bfloat16"
    if t.param_dtype == "bfloat16" and mesh is not None and dims.dp == 1:
        # FSDP over one rank shards nothing; its mixed-precision policy casts each unit's weights to bf16.
        return apply_fsdp(model, dp_mesh(mesh, flat=False), reshard_after_forward=False, bf16=True, offload=False)
    if mesh is None or dims.dp == 1:
        return model
    if p.data_parallel in ("ddp", "zero1"):
        if dims.tp == 1 and dims.pp == 1:
            return apply_ddp(model, dp_mesh(mesh, flat=True), p.ddp_bucket_mb)
        return apply_replicate(model, dp_mesh(mesh, flat=True), bf16=bf16)
    return apply_fsdp(model, dp_mesh(mesh, flat=False), reshard_after_forward=p.data_parallel == "zero3",
                      bf16=bf16, offload=p.offload)


def loss_context(dims: ParallelDims, cfg: Config) -> contextlib.AbstractContextManager:
    """The context that the loss of a model ``parallelize`` returned, and its backward, must run in:
    with tp > 1 and parallel.loss_parallel its logits are vocabulary-sharded DTensors, and
    cross-entropy over them is only right under ``loss_parallel``."""
    return vocab_parallel_loss(cfg.parallel.loss_parallel and dims.tp > 1)


def shard_optimizer_state(param_groups: list, optimizer_class: type[torch.optim.Optimizer], dims: ParallelDims,
                          mesh: DeviceMesh | None, data_parallel: str, **defaults) -> torch.optim.Optimizer:
    """The optimizer for one model part: ``optimizer_class(param_groups, **defaults)``, with its state
    partitioned over the data-parallel ranks when ``data_parallel`` (parallel.data_parallel) is "zero1".
    A ZeRO-1 optimizer's ``.optim`` is the local optimizer over this rank's share of the parameters:
    checkpoint that one (its state is keyed by parameter name, so it reshards like any other)."""
    if data_parallel == "zero1" and mesh is not None and dims.dp > 1:
        return zero1_optimizer(param_groups, optimizer_class, dp_mesh(mesh, flat=True), **defaults)
    return optimizer_class(param_groups, **defaults)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_mesh: DeviceMesh | None = None,
                    counted_elsewhere: Iterable[nn.Parameter] = ()) -> torch.Tensor:
    """Global L2 gradient norm over every layout, then clip to ``max_norm`` (0 = only measure).
    ``counted_elsewhere`` are clipped but left out of the norm: parameters whose gradient another
    rank counts (the last pipeline stage's copy of a tied embedding, see pipeline.py).

    Gradients may be plain tensors or DTensors on different meshes (TP-sharded weights on
    (dp, tp), replicated norms on dp only), and with pipelining each rank holds only its stages'.
    Every element of a stage's gradient lives on world/pp ranks, split over the mesh dimensions it
    is sharded on and copied over the rest; so each rank adds its local squares divided by the
    number of copies, and one all-reduce over all ranks gives the same total on every rank (which
    keeps replicas identical after clipping).
    """
    params = [p for p in parameters if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    stage_ranks = dist.get_world_size() // (pp_mesh.size() if pp_mesh is not None else 1) \
        if dist.is_initialized() else 1
    by_layout: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else (None, ())
        by_layout.setdefault(key, []).append(p)
    uncounted = {id(p) for p in counted_elsewhere}
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for (mesh, placements), group in by_layout.items():
        # Sharded (Shard, or FSDP's strided shard under TP) dims split an element's copies; Replicate
        # dims copy it; Partial (sequence-parallel norms) holds addends, summed here first.
        shards = math.prod(mesh.size(d) for d, pl in enumerate(placements) if not (pl.is_replicate() or pl.is_partial()))
        summed = [Replicate() if pl.is_partial() else pl for pl in placements]
        local = [p.grad.redistribute(placements=summed).to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in group if id(p) not in uncounted]
        if local:
            total_sq += torch.nn.utils.get_total_norm(local, 2.0).float() ** 2 * (shards / stage_ranks)
    if dist.is_initialized():
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    if max_norm > 0:
        for group in by_layout.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
