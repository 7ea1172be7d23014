"""The peak FLOP/s that MFU divides by, from a source stable enough to trust.

- ``training.peak_tflops`` when set: the user knows their hardware best.
- A GPU in the device table (scalenlp.hardware): the datasheet's dense figure.
- Anywhere else (a CPU, an unknown GPU): measured once per machine, thread count and dtype, and
  cached in ``$XDG_CACHE_HOME/scalenlp`` (``~/.cache/scalenlp``), so every run on the machine divides
  by the same figure. One timed matmul at start-up is not that: on a shared 2-core machine it
  came out anywhere between 0.04 and 0.4 TFLOP/s, and one run reported 83% MFU. The measurement is
  the best of many timed large matmuls after a warm-up, with the threads the run uses: noise only
  ever slows a matmul down, so the best is the machine's figure, not the neighbours'.

MFU never exceeds 1 (``Peak.mfu``). A measured peak is a lower bound of the true one: when a run
achieves more, the peak is raised to what was achieved, for this run and in the cache, and the run
says so; a datasheet's or the user's peak stays as given and the MFU is clamped to 1, with a warning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scalenlp.hardware import DEVICES, GPU_NAMES, cache_dir, cached_record, processor_name, slug, write_cached

# Large enough to reach the peak (a CPU's few cores, a GPU's many), small enough to time 20 of in seconds.
MATMUL_SIZE = {"cpu": 1024, "cuda": 4096}
WARMUP, REPEATS = 3, 20


@dataclass
class Peak:
    flops: float  # FLOP/s of one process
    source: str  # where the figure comes from, as metrics.jsonl records it
    cache: Path | None = None  # the cache file of a measured peak

    def mfu(self, achieved: float) -> tuple[float, str | None]:
        """(model FLOPs utilisation of ``achieved`` FLOP/s, at most 1; a line to log when the peak was
        below it). A measured peak was stale (measured while other work shared the cores): it is raised
        to the FLOP/s achieved, for this run and in the cache. A datasheet's or the user's figure stays
        as given, and the MFU is clamped to 1."""
        if achieved <= self.flops:
            return achieved / self.flops, None
        if self.cache is None:
            return 1.0, (f"throughput {achieved / 1e12:.3f} TFLOP/s per process is above the peak "
                         f"{self.flops / 1e12:.3f} ({self.source}); MFU shown as 1. Check the peak")
        note = (f"throughput {achieved / 1e12:.3f} TFLOP/s per process is above the measured peak "
                f"{self.flops / 1e12:.3f}, which was measured under load; the peak is raised to it (and cached)")
        self.flops = achieved
        self.source = self.source.split(" (raised", 1)[0] + " (raised to the throughput a run achieved)"
        write_cached(self.cache, {"flops": achieved, "source": self.source})
        return 1.0, note


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = REPEATS) -> float:
    """Best FLOP/s of ``repeats`` timed square matmuls after a warm-up, with this process's threads."""
    gen = torch.Generator(device).manual_seed(0)  # leave the training RNG streams untouched
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    best = float("inf")
    for i in range(WARMUP + repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0) -> Peak:
    """This process's peak FLOP/s and where it comes from (see the module docstring)."""
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if override_tflops:
        return Peak(override_tflops * 1e12, "training.peak_tflops")
    name = processor_name(device)
    if device.type == "cuda":
        for marker, key in GPU_NAMES.items():
            if marker in name:  # the table's GPUs run fp16 and bf16 matmuls at the same dense rate
                return Peak(DEVICES[key].peak_flops("fp32" if precision == "fp32" else "bf16"),
                            f"datasheet {key} dense {precision}")
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    path = cache_dir() / f"peak-{slug(name)}-{threads}t-{precision}.json"

    def measure() -> dict:
        size = MATMUL_SIZE.get(device.type, MATMUL_SIZE["cuda"])
        flops = measure_matmul_flops(device, dtype, size)
        if threads > 1:
            # Threads that wait for each other on busy cores can do worse than one: what one thread does is
            # a lower bound of what several can (on a loaded 2-core machine, 17 GFLOP/s with 2 threads, 44 with 1).
            torch.set_num_threads(1)
            try:
                flops = max(flops, measure_matmul_flops(device, dtype, size))
            finally:
                torch.set_num_threads(threads)
        return {"flops": flops, "source": f"measured: best of {REPEATS} {size}² {precision} matmuls on {name}, "
                                          f"{threads} thread{'s' if threads > 1 else ''} (or one, if faster), "
                                          f"cached in {path}"}

    record, _ = cached_record(path, measure, lambda r: {"flops": float(r["flops"]), "source": str(r["source"])})
    return Peak(record["flops"], record["source"], path)
