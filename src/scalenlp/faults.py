"""Fault injection, the one test hook the library owns (training ranks and tensor-parallel inference ranks call
it; tests and benchmarks/faults.py set it); does nothing unless SCALENLP_FAULT is set.

SCALENLP_FAULT=<kind>@<rank>:<step> makes that rank fail on purpose once it has finished that step, on
the first attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT=0) and of a Slurm job (SLURM_RESTART_COUNT=0:
not requeued), so the restart runs clean:

- ``kill``: the rank SIGKILLs itself, as the kernel's OOM killer or a lost machine would end it.
- ``hang``: the rank sleeps for an hour before its next collective; the other ranks wait in it.
- ``sigterm``: the rank sends SIGTERM to its torchrun agent, as a scheduler does before a kill.
- ``damage``: the rank overwrites the middle of one shard of the newest checkpoint, then SIGKILLs itself:
  a checkpoint that looks complete but is not whole.
- ``raise``: the rank raises RuntimeError, as a failing kernel would. Tensor-parallel inference counts a step
  per forward (``raise@1:0``: rank 1's first forward fails).
- ``overflow``: once the gradients of that step (counted from 1) are reduced, one element of the rank's own
  becomes infinite, as an fp16 overflow within one shard of a gradient would make it; the run goes on.
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch
from torch.distributed.tensor import DTensor

from scalenlp.launch_env import slurm_requeued

ENV = "SCALENLP_FAULT"
KINDS = ("kill", "hang", "sigterm", "damage", "raise", "overflow")


def planned(rank: int) -> tuple[str, int] | None:
    """(kind, step) of the fault this rank is to inject in this attempt, if any."""
    spec = os.environ.get(ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or slurm_requeued(os.environ):
        return None
    kind, _, where = spec.partition("@")
    at_rank, _, step = where.partition(":")
    if kind not in KINDS or not at_rank.isdigit() or not step.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected <{'|'.join(KINDS)}>@<rank>:<step>")
    return (kind, int(step)) if int(at_rank) == rank else None


def overflow(fault: tuple[str, int] | None, step: int, params: list[torch.Tensor]) -> None:
    """Called by the trainer once step ``step``'s gradients are whole (reduced): where an ``overflow`` is
    planned for it, one element of this rank's gradients becomes infinite."""
    if fault != ("overflow", step):
        return
    grads = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None)
    grad = next(g for g in grads if g.numel())  # an uneven shard can be empty
    grad[(0,) * grad.dim()] = math.inf


def inject(fault: tuple[str, int] | None, step: int, checkpointer) -> None:
    """Called by the trainer after each step, and by each tensor-parallel inference rank before its forwards."""
    if fault is None or fault[1] != step or fault[0] == "overflow":  # that one is the gradient's (overflow)
        return
    kind = fault[0]
    if kind == "raise":
        raise RuntimeError(f"{ENV}: injected failure at step {step}")
    if kind == "hang":
        time.sleep(3600)
    elif kind == "sigterm":
        os.kill(os.getppid(), signal.SIGTERM)
        return
    if kind == "damage" and (newest := checkpointer.latest()) is not None:
        shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            f.write(b"\xff" * 64)
    os.kill(os.getpid(), signal.SIGKILL)
