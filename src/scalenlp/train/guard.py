"""What keeps a run from turning good state into bad: a step whose loss or gradient is not finite, and
a stop request (SIGTERM, as Kubernetes and batch schedulers send before a kill).

Both are decided once per step by one small all-reduce, so every rank takes the same decision at the
same step: a rank that alone saw a NaN, or alone got the signal, cannot leave the others in a
collective it will never join.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class StopRequest:
    """SIGTERM becomes a request to stop at the next step boundary instead of killing the process."""

    def __init__(self):
        self.signal: str | None = None

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame) -> None:
        self.signal = signal.Signals(signum).name


@dataclass
class StepCheck:
    """What every rank agreed on after one step's backward pass."""
    loss_ranks: list[int]  # ranks whose loss is not finite
    grad_ranks: list[int]  # ranks whose gradient norm is not finite
    stop: bool  # some rank was asked to stop

    @property
    def finite(self) -> bool:
        return not (self.loss_ranks or self.grad_ranks)

    def describe(self, step: int) -> str:
        parts = [f"{what} is not finite on rank {', '.join(map(str, ranks))}"
                 for what, ranks in (("the loss", self.loss_ranks), ("the gradient norm", self.grad_ranks)) if ranks]
        return f"step {step}: {' and '.join(parts)}"


def check_step(loss: torch.Tensor, grad_norm: torch.Tensor, stop: StopRequest | None,
               overflow_expected: bool = False) -> StepCheck:
    """Agree over all ranks on this step's finiteness and on stopping. One all-reduce of 2 x world + 1
    numbers; the .tolist() is a host sync the optimizer step would otherwise not need, the price of never
    applying a NaN update. ``overflow_expected`` (fp16's loss scaling): a gradient that is not finite is the
    loss scaler's to handle, which skips that update and lowers the scale; only the loss is checked here."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    flags = torch.zeros(2 * world + 1, device=loss.device)
    flags[2 * rank] = (~torch.isfinite(loss)).float()
    flags[2 * rank + 1] = 0.0 if overflow_expected else (~torch.isfinite(grad_norm)).float()
    flags[-1] = float(stop is not None and stop.signal is not None)
    if dist.is_initialized():
        dist.all_reduce(flags)
    got = flags.tolist()
    return StepCheck(loss_ranks=[r for r in range(world) if got[2 * r]],
                     grad_ranks=[r for r in range(world) if got[2 * r + 1]], stop=bool(got[-1]))


def weights_finite(parts: list[nn.Module]) -> bool:
    """Whether every weight on every rank is finite: checked before a checkpoint is written, so that a
    finite loss and gradient followed by a non-finite update can still never be saved or exported. Frozen
    weights (a LoRA base, perhaps NF4) are never updated, so only trained ones are looked at."""
    local = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                for part in parts for p in part.parameters() if p.requires_grad)
    flag = torch.tensor([float(not local)], device=next(parts[0].parameters()).device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return flag.item() == 0
