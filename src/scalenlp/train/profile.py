"""profile.steps=FIRST-LAST: a PyTorch profiler Chrome trace of those training steps, one file per rank.

torch.profiler runs on a schedule that records exactly steps FIRST..LAST of the trainer's count (step 1
is the first), after one warm-up step where there is one (its events are dropped: the profiler's own
start-up cost stays out of step FIRST). The profiler moves on to a step where that step begins, so each
``ProfilerStep#K`` range holds one whole iteration: the step and what follows it (metrics record,
evaluation, checkpoint); K is the profiler's own count from this attempt's first step. Inside it a
``step N`` range (the trainer's number) holds forward, backward, gradient collectives and optimizer step.
Collectives appear as their c10d ops (e.g. ``c10d::allreduce_``) and backend events (``gloo:all_reduce``,
``nccl:all_reduce``), compute as aten ops (and CUDA kernels on a GPU). The trace goes to
<run_dir>/traces/rank<R>.json, for Perfetto or chrome://tracing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

from scalenlp.files import replacing_file


class StepProfiler:
    """Traces steps ``first..last`` if the run reaches them; nothing at all otherwise."""

    def __init__(self, steps: tuple[int, int] | None, done: int, trace: Path, device: torch.device,
                 log: Callable[[str], None]):
        self.prof, self.trace = None, trace
        if steps is None:
            return
        first, self.last = steps
        if done >= first:
            log(f"profile.steps={first}-{self.last}: this run resumed at step {done}, past step {first}; "
                f"nothing is traced")
            return
        before = first - 1 - done  # steps this attempt runs before the first traced one
        self.first_step = done + 1
        warmup = min(1, before)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        schedule = torch.profiler.schedule(skip_first=before - warmup, wait=0, warmup=warmup,
                                           active=self.last - first + 1, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._save)
        self.prof.start()

    def _save(self, prof: torch.profiler.profile) -> None:
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        with replacing_file(self.trace) as tmp:  # a reader never sees half a trace
            prof.export_chrome_trace(str(tmp))

    @contextlib.contextmanager
    def step(self, n: int):
        """Around training step ``n``."""
        if self.prof is not None and n > self.first_step:
            self.prof.step()  # the previous iteration ends here; after the last traced one, this writes the trace
            if n > self.last:
                self.close()
        if self.prof is None:
            yield
            return
        with record_function(f"step {n}"):
            yield

    def close(self) -> None:
        """Stop; a trace still recording (the run ended or stopped inside the range) is written."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
