"""``--device cpu``: measure this machine instead of assuming a spec.

- matmul rate over shapes from thin to square, fitted to the cost model's matmul time (arithmetic
  at peak · Π_d d/(d + half_dim), plus writing the result), which gives the CPU's peak and half dimension;
- memory bandwidth (a large elementwise add into a fresh tensor) and the dispatch cost of one small op;
- gloo all-reduce bandwidth and per-hop latency between two local processes, and the resident
  memory such a process holds before any model (the runtime share of the memory estimate).

Each process of a CPU run gets its share of the cores: torchrun gives each of several processes one
thread (OMP_NUM_THREADS=1), a single process keeps torch's default, so the matmul and bandwidth
figures are measured with that many threads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import socket
import subprocess
import sys
import time

import torch

from scalenlp.plan.devices import GPU_ELEMENTWISE_TRAFFIC, DeviceSpec

# (m, n, k): thin shapes like a small model's projections, up to square ones.
MATMUL_SHAPES = ((2048, 64, 64), (2048, 256, 64), (2048, 64, 256), (512, 512, 512), (1024, 1024, 1024),
                 (2048, 4096, 64))


def _rate(fn, work: float, min_time: float = 0.5) -> float:
    """Median of five timed batches of calls, in work units per second: on a shared machine the median is
    what a long run gets, the best is a moment when nobody else was running."""
    fn()
    times = []
    for _ in range(5):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time / 5 or reps == 0:
            fn()
            reps += 1
        times.append(elapsed / reps)
    return work / sorted(times)[2]


def matmul_rates(dtype: torch.dtype = torch.float32) -> list[tuple[tuple[int, int, int], float]]:
    out = []
    for m, n, k in MATMUL_SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out.append(((m, n, k), _rate(lambda: a @ b, 2.0 * m * n * k)))
    return out


def fit_matmul_curve(rates, bandwidth: float) -> tuple[float, float]:
    """(peak, half_dim) of the cost model's matmul time, flops / (peak · Π d/(d + half_dim)) + result
    bytes / bandwidth, by least squares in log space on the arithmetic part of each measured time."""
    arithmetic = []
    for (m, n, k), rate in rates:
        flops = 2.0 * m * n * k
        seconds = flops / rate - 4.0 * m * n / bandwidth
        arithmetic.append(((m, n, k), flops / max(seconds, 0.25 * flops / rate)))
    best = (math.inf, 0.0, 0.0)
    for step in range(200):
        half = 2 ** (step / 20)  # 1 .. ~1000
        logs = [math.log(r) - sum(math.log(d / (d + half)) for d in dims) for dims, r in arithmetic]
        log_peak = sum(logs) / len(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if err < best[0]:
            best = (err, math.exp(log_peak), half)
    return best[1], best[2]


def memory_bandwidth() -> float:
    """Bytes/s of a large elementwise op that allocates its output, as eager PyTorch ops do: on a CPU,
    first touching fresh pages costs as much as streaming them, so preallocated buffers overstate it."""
    a, b = torch.ones(1 << 23), torch.ones(1 << 23)
    return _rate(lambda: torch.add(a, b), 3 * 4 * a.numel(), min_time=0.3)


def op_overhead() -> float:
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    return 1.0 / _rate(lambda: a + b, 1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int) -> None:
    """One of the measuring processes (``python -m scalenlp.plan.measure RANK WORLD PORT``); rank 0 prints JSON."""
    import torch.distributed as dist

    import scalenlp.train.trainer  # noqa: F401  the training process's own imports count towards its runtime memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        small, large = torch.ones(1), torch.ones(1 << 22)  # 4 bytes; 16 MiB
        timings = {}
        for name, tensor, reps in (("small", small, 50), ("large", large, 5)):
            dist.all_reduce(tensor)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(tensor)
            timings[name] = (time.perf_counter() - start) / reps
        if rank == 0:
            print(json.dumps(dict(timings, nbytes=large.numel() * 4,
                                  rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
    finally:
        dist.destroy_process_group()


def gloo_allreduce() -> tuple[float, float, float]:
    """(bus bandwidth bytes/s, latency per hop s, resident bytes of a process with scalenlp's training
    imports and a gloo group, before any model), measured between two local processes."""
    world, port = 2, _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "scalenlp.plan.measure", str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, env=env, text=True) for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the gloo measurement processes failed; see their messages above")
    result = json.loads(outputs[0].strip().splitlines()[-1])
    hops = 2 * (world - 1)
    latency = result["small"] / hops
    bus_bw = hops / world * result["nbytes"] / max(result["large"] - result["small"], 1e-9)
    return bus_bw, latency, result["rss"]


def measure_cpu(processes: int = 1, overrides: dict[str, float] | None = None) -> DeviceSpec:
    """A DeviceSpec for one of ``processes`` training processes sharing this machine."""
    threads = 1 if processes > 1 else torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = memory_bandwidth()
        peak, half = fit_matmul_curve(matmul_rates(), bandwidth)
        bf16_ratio = _rate_ratio()
        overhead = op_overhead()
    finally:
        torch.set_num_threads(previous)
    bus_bw, latency, rss = gloo_allreduce()
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = DeviceSpec(
        name=f"cpu ({threads} thread{'s' if threads > 1 else ''} per process, measured)",
        peak_flops_bf16=peak * bf16_ratio, peak_flops_fp32=peak, memory_bytes=total_ram / processes,
        hbm_bw=bandwidth, intra_node_bw=bus_bw, nic_bw=bus_bw, latency_s=latency, gemm_efficiency=1.0,
        gemm_half_dim=half, elementwise_traffic=GPU_ELEMENTWISE_TRAFFIC, runtime_bytes=rss,
        op_overhead_s=overhead)
    return dataclasses.replace(spec, **(overrides or {}))


def _rate_ratio() -> float:
    """bf16 over fp32 matmul rate at a mid-sized shape (CPUs without bf16 units emulate it slowly)."""
    a32, b32 = torch.randn(512, 512), torch.randn(512, 512)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    return _rate(lambda: a16 @ b16, 1.0) / _rate(lambda: a32 @ b32, 1.0)


if __name__ == "__main__":
    _gloo_worker(*(int(a) for a in sys.argv[1:4]))
