"""Data parallelism: DDP, ZeRO-1 / ZeRO-2 / ZeRO-3 and HSDP, all on the run's DeviceMesh.

What each stage of ZeRO (Rajbhandari et al., 2020) shards across the N data-parallel ranks, and
which PyTorch piece does it (fp32 Adam: 4 bytes/param weights, 4 grads, 8 optimizer state):
- ddp:   nothing (4Ψ + 4Ψ + 8Ψ per rank)              -> DistributedDataParallel (FSDP2's
                                                          ``replicate`` with TP or PP)
- zero1: optimizer state (4Ψ + 4Ψ + 8Ψ/N)              -> DDP (``replicate`` with TP or PP)
                                                          + ZeroRedundancyOptimizer
- zero2: + gradients (4Ψ + 4Ψ/N + 8Ψ/N)                -> FSDP2, parameters kept gathered after forward
- zero3: + parameters (4Ψ/N + 4Ψ/N + 8Ψ/N)             -> FSDP2, each block regathered per use
With dp_replicate > 1 the FSDP variants become HSDP: sharded within a dp_shard group, replicated
across dp_replicate groups (gradients reduce-scattered inside, all-reduced across).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from scalenlp.models.adapters import is_nf4


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_mb: int) -> DDP:
    """Replicate ``model`` over the (flattened, 1-D) data-parallel mesh; gradients all-reduced in buckets."""
    device = next(model.parameters()).device
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        # A LoRA run's frozen base: every rank read it from model.init, so DDP need not broadcast it at the start
        # (which an NF4 tensor, QLoRA's, cannot go through).
        DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
    # Gradients as views into the all-reduce buckets: otherwise DDP holds a second copy of them (4Ψ).
    return DDP(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               device_ids=None if device.type == "cpu" else [device.index])


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, *, bf16: bool) -> nn.Module:
    """DDP semantics (full replicas, gradients all-reduced) built on FSDP2's machinery, for the
    cases classic DDP cannot serve: DTensor (tensor-parallel) weights, and pipeline stages, whose
    per-microbatch backwards DDP's bucket rebuilding does not survive."""
    mp_policy = _mp_policy(bf16)
    # An NF4 weight (QLoRA's base, built alike on every rank and never trained) is left out: replicate's
    # all-gather hands torchao's FSDP2 extension one output where it expects its three inner tensors.
    kwargs = dict(mesh=dp_mesh, mp_policy=mp_policy, ignored_params={p for p in model.parameters() if is_nf4(p)})
    for block in model.layers.values():
        replicate(block, **kwargs)
    replicate(model, **kwargs)
    return model


def _mp_policy(bf16: bool) -> MixedPrecisionPolicy:
    # Gradients are reduced in fp32 even when compute is bf16: summing N ranks' bf16 values loses bits.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, bf16: bool,
               offload: bool) -> nn.Module:
    """Shard ``model`` (a Transformer or a pipeline stage of one) with FSDP2, one unit per block.

    ``dp_mesh`` is 1-D (dp_shard) for ZeRO-2/3, 2-D (dp_replicate, dp_shard) for HSDP. Per-block
    units let a block's all-gather overlap the previous block's compute and bound the memory of
    gathered parameters to about one block. The root unit (embeddings, final norm, output) is never
    resharded after forward: backward needs it first.
    """
    kwargs = dict(mesh=dp_mesh, mp_policy=_mp_policy(bf16))
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is needed again at once by backward, so regathering it would be waste.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


class ShardedStateOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose parameters may also be DTensors (tensor-parallel shards, or the
    weights FSDP2's ``replicate`` manages under TP or PP), which c10d's broadcast does not take.
    Every rank of a data-parallel group holds the same local shard of each parameter (same tp
    coordinate, same pipeline stage), so the owner's local tensor is the whole update to send."""

    def _broadcast_params_from_rank(self, rank: int) -> list:
        owner = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(p.data.to_local() if isinstance(p, DTensor) else p.data, src=owner,
                               group=self.process_group, async_op=True)
                for group in self._partition_parameters()[rank] for p in group["params"]]


def zero1_optimizer(params: Iterable, optimizer_class: type[torch.optim.Optimizer], dp_mesh: DeviceMesh,
                    **defaults) -> ZeroRedundancyOptimizer:
    """``optimizer_class`` whose state is partitioned over the data-parallel ranks: each rank updates
    its share of the parameters and broadcasts them. ``params`` may be param groups (weight decay)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        # ZeroRedundancyOptimizer takes the first group at construction and the rest with add_param_group.
        first, *rest = params
        optimizer = ShardedStateOptimizer(first["params"], optimizer_class=optimizer_class,
                                          process_group=dp_mesh.get_group(),
                                          **(defaults | {k: v for k, v in first.items() if k != "params"}))
        for group in rest:
            optimizer.add_param_group(group)
        return optimizer
    return ShardedStateOptimizer(params, optimizer_class=optimizer_class, process_group=dp_mesh.get_group(),
                                 **defaults)


@contextlib.contextmanager
def skip_gradient_sync(model_parts: list[nn.Module]) -> Iterator[None]:
    """Accumulate gradients locally for the micro-batches run inside; the first backward outside
    synchronises them all. Use it for every micro-batch of an optimizer step but the last.

    DDP skips its all-reduce. FSDP keeps reduce-scattering every micro-batch, because unsharded
    gradients would cost the memory that ZeRO-2/3 exist to save; HSDP skips only the all-reduce
    across replicas, which is the part that crosses the slow links.
    """
    with contextlib.ExitStack() as stack:
        fsdp_parts = [part for part in model_parts if isinstance(part, FSDPModule)]
        for part in model_parts:
            if isinstance(part, DDP):
                stack.enter_context(part.no_sync())
        for part in fsdp_parts:
            part.set_requires_all_reduce(False)  # no-op without a replicate dimension
        try:
            yield
        finally:
            for part in fsdp_parts:
                part.set_requires_all_reduce(True)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state, for checkpointing: ZeRO-1's local share (its state is
    keyed by parameter name, so the shares of all ranks make up the whole state in any layout), with
    the current hyperparameters (learning rate) copied in, since ZeRO-1 copies them only at step()."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _copy_hyperparameters(optimizer.param_groups, optimizer.optim.param_groups)
        return optimizer.optim
    return optimizer


def restore_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """After loading a checkpoint into ``local_optimizer(optimizer)``: ZeRO-1 copies its own groups'
    hyperparameters over the local ones at step(), so the loaded values must go there too."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _copy_hyperparameters(optimizer.optim.param_groups, optimizer.param_groups)


def _copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
    for s, d in zip(src, dst, strict=True):
        d.update({k: v for k, v in s.items() if k != "params"})
