"""The loss every task's step computes: in fp32 under bf16 autocast, summed per micro-batch, reduced over ranks.

A micro-batch's loss is a sum, not a mean: the trainer weighs it by the number of counted targets of the whole
global batch (see Trainer._weigh_loss), so every target weighs the same under any layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from scalenlp.parallel.mesh import ParallelDims


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


def sum_over(value: torch.Tensor, group) -> torch.Tensor:
    """``value`` summed over the ranks of ``group`` (None: this rank's alone)."""
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return value
