"""The loss every task's step computes: in fp32 under bf16 or fp16 autocast, summed per micro-batch, reduced over
ranks; under fp16 scaled before its backward pass (``loss_scaler``).

A micro-batch's loss is a sum, not a mean: the trainer weighs it by the number of counted targets of the whole
global batch (see Trainer._weigh_loss), so every target weighs the same under any layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.amp import GradScaler
from torch.distributed.tensor import DTensor

from scalenlp.config import TrainingConfig
from scalenlp.parallel.mesh import ParallelDims

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, mixed_precision: str):
    """bf16 or fp16 autocast for matmuls (fp32 master weights, fp32 loss), or nothing for fp32."""
    if mixed_precision in AUTOCAST:
        return torch.autocast(device.type, dtype=AUTOCAST[mixed_precision])
    return contextlib.nullcontext()


class AgreedGradScaler(GradScaler):
    """torch.amp.GradScaler for several ranks, whose gradients may be sharded (ZeRO-2/3, tp) or split into
    pipeline stages: every rank must agree on the inf check, to skip the same steps and keep the same scale.
    Torch's two ways fail here (2.13): FSDP's ShardedGradScaler all-reduces a found-inf of shape (1,) that
    the fused AdamW step cannot take, and DTensor's rule for the unscale kernel refuses tp's mix of DTensor
    and plain gradients (and agrees only within one mesh, not across pipeline stages). So each gradient's
    local part is unscaled, as a plain tensor, and the found inf summed over every rank."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        local: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    local.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():
            for (device, _), grads in local.items():  # offloaded shards sit on the CPU, the scale on the GPU
                found = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
                found_inf += found.to(found_inf.device)
        dist.all_reduce(found_inf)
        return {found_inf.device: found_inf}


def loss_scaler(t: TrainingConfig, device: torch.device) -> GradScaler | None:
    """fp16's dynamic loss scaler (None for fp32 and bf16, whose range needs none): torch's GradScaler in one
    process, AgreedGradScaler in several. DDP's reduced gradients are the same on every rank, so its inf
    check would agree without the all-reduce; one rule for every layout costs one number per step."""
    if t.mixed_precision != "fp16":
        return None
    scaler = GradScaler if not dist.is_initialized() or dist.get_world_size() == 1 else AgreedGradScaler
    return scaler(device.type, init_scale=t.loss_scale_init, growth_factor=t.loss_scale_growth,
                  backoff_factor=t.loss_scale_backoff, growth_interval=t.loss_scale_interval)


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
