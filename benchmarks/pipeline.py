"""Pipeline bubble and activation memory of each schedule, measured, beside the theory.

    python benchmarks/pipeline.py [--forward-ms 20]

Runs the real torch.distributed.pipelining schedules that scalenlp uses (GPipe, 1F1B, interleaved
1F1B with 2 stages per rank) on p = 2 and 4 processes and m = 4, 8, 16 microbatches. Each stage's
compute is a fixed-duration wait (forward t, backward 2t, a whole model's worth split evenly over
the stages), so that the measurement isolates the schedule from the CPU contention of p processes
on this 2-core machine. Idle fraction = 1 - (time a rank spends computing) / (step time), averaged
over ranks; theory (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) with v stages per rank for
interleaved 1F1B (the bubble divided by v). Peak activations = the most microbatches whose
activations a rank holds at once, in units of one rank's layers (theory: GPipe m, 1F1B p on the
first stage, interleaved p·(1 + (p-1)/(p·v))).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from scalenlp.parallel.pipeline import SCHEDULES
from scalenlp.testing.ranks import spawn_ranks

MICROBATCHES = (4, 8, 16)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
DIM = 16


class Meter:
    """This rank's compute time and how many microbatches' activations it holds (now, at most)."""

    def __init__(self):
        self.busy, self.live, self.peak = 0.0, 0, 0


class TimedWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, forward_s, meter):
        start = time.perf_counter()
        time.sleep(forward_s)
        meter.live += 1
        meter.peak = max(meter.peak, meter.live)
        ctx.forward_s, ctx.meter = forward_s, meter
        ctx.save_for_backward(x, w)
        meter.busy += time.perf_counter() - start
        return x * w

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        x, w = ctx.saved_tensors
        time.sleep(2 * ctx.forward_s)
        ctx.meter.live -= 1
        ctx.meter.busy += time.perf_counter() - start
        return grad * w, (grad * x).sum(0), None, None


class Stage(nn.Module):
    def __init__(self, forward_s: float, meter: Meter):
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))
        self.forward_s, self.meter = forward_s, meter

    def forward(self, x):
        return TimedWork.apply(x, self.w, self.forward_s, self.meter)


def measure(schedule_name: str, m: int, p: int, rank: int, model_forward_s: float) -> dict:
    v = 2 if schedule_name == "interleaved_1f1b" else 1
    meter = Meter()
    stage_s = model_forward_s / (p * v)
    stage_ids = range(rank, p * v, p)
    stages = [PipelineStage(Stage(stage_s, meter), s, p * v, torch.device("cpu")) for s in stage_ids]
    cls = SCHEDULES[schedule_name]
    loss_fn = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    schedule = cls(stages[0], m, loss_fn=loss_fn) if v == 1 else cls(stages, m, loss_fn=loss_fn)
    x, y = torch.randn(m, DIM), torch.randn(m, DIM)

    def step():
        kwargs = {"target": y} if rank == p - 1 else {}
        schedule.step(x, **kwargs) if rank == 0 else schedule.step(**kwargs)

    step()  # warm-up: shape inference and buffer allocation
    dist.barrier()
    # The warm-up's shape-inference forward never runs backward: start the count from zero.
    meter.busy, meter.live, meter.peak = 0.0, 0, 0
    start = time.perf_counter()
    step()
    elapsed = time.perf_counter() - start
    dist.barrier()
    # Interleaved stages are 1/v of a rank's layers: count held activations in whole-rank units.
    return {"idle": 1 - meter.busy / elapsed, "peak": meter.peak / v, "elapsed": elapsed}


def _worker(rank: int, p: int, forward_s: float, out: str) -> None:
    results = {}
    for name in SCHEDULE_NAMES:
        for m in MICROBATCHES:
            mine = measure(name, m, p, rank, forward_s)
            everyone = [None] * p
            dist.all_gather_object(everyone, mine)
            results[f"{name}/{m}"] = everyone
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def theory(name: str, p: int, m: int) -> tuple[float, str]:
    """Idle fraction and the peak microbatches held by rank 0 (interleaved: p·(1 + (p-1)/(p·v)),
    Narayanan et al., 2021, in whole-rank units)."""
    v = 2 if name == "interleaved_1f1b" else 1
    peak = {"gpipe": m, "1f1b": min(p, m), "interleaved_1f1b": p * (1 + (p - 1) / (p * v))}[name]
    return (p - 1) / (v * m + p - 1), f"{peak:g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=float, default=40.0, help="forward time of the whole model per microbatch")
    args = parser.parse_args()
    print(f"forward {args.forward_ms:.0f} ms + backward {2 * args.forward_ms:.0f} ms per microbatch for the whole model")
    print(f"{'schedule':<18}{'p':>3}{'m':>4}{'idle measured':>15}{'idle theory':>13}{'peak act. (rank 0)':>20}"
          f"{'theory':>8}{'step s':>8}")
    for p in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "pipeline.json")
            spawn_ranks(_worker, p, args.forward_ms / 1000, out)
            results = json.loads(Path(out).read_text())
        for name in SCHEDULE_NAMES:
            for m in MICROBATCHES:
                ranks = results[f"{name}/{m}"]
                idle = sum(r["idle"] for r in ranks) / p
                idle_theory, peak_theory = theory(name, p, m)
                print(f"{name:<18}{p:>3}{m:>4}{idle:>15.3f}{idle_theory:>13.3f}{ranks[0]['peak']:>20g}"
                      f"{peak_theory:>8}{ranks[0]['elapsed']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
