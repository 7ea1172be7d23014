"""Hardware facts that training and planning both read: the accelerator table (each value overridable from
the command line), the CUDA names that map onto it, this process's resident memory, and where figures measured
on this machine are cached (training's MFU peak, serving's dtype); and the one OpenMP fact an engine's thread
needs (``release_openmp_workers``).

Peaks and memory are datasheet values. Bandwidths are what collectives achieve, not link maxima:
``intra_node_bw`` is the all-reduce bus bandwidth NCCL reaches over NVLink inside one 8-GPU node,
``nic_bw`` the network bandwidth of the one NIC each GPU has to other nodes. ``gemm_efficiency``
is the fraction of peak a large, well-shaped matmul reaches in a real training step; it is the
one per-device constant calibrated from published training runs (see scalenlp.plan.calibrate).
``--device cpu`` measures this machine instead (scalenlp.plan.measure).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scalenlp.errors import UserError
from scalenlp.files import write_file

GiB = 2**30

# Fitted once by scalenlp.plan.calibrate (python -m scalenlp.plan.calibrate prints them); see its docstring.
GPU_GEMM_HALF_DIM = 134.2
GPU_ELEMENTWISE_TRAFFIC = 4.62
A100_GEMM_EFFICIENCY = 0.771
H100_GEMM_EFFICIENCY = 0.631  # below the A100's: a 700 W H100 clocks down under sustained matmul load
GPU_OVERLAP_CONTENTION = 0.244
GPU_DECODE_LAYER_OVERHEAD = 5.25e-05


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops_bf16: float  # dense, FLOP/s
    peak_flops_fp32: float  # dense, FLOP/s (plain fp32, no TF32)
    memory_bytes: float
    hbm_bw: float  # bytes/s that memory-bound kernels (norms, softmax, optimizer) stream
    intra_node_bw: float  # all-reduce bus bandwidth inside a node, bytes/s
    nic_bw: float  # bytes/s per device to other nodes
    latency_s: float  # per hop of a ring collective or a point-to-point send
    gemm_efficiency: float  # fraction of peak a large matmul reaches (calibrated)
    gemm_half_dim: float  # a matmul dimension this small halves the efficiency (calibrated)
    elementwise_traffic: float  # HBM bytes moved by memory-bound kernels per stored activation byte (calibrated)
    runtime_bytes: float  # memory the runtime holds before the model: CUDA context, NCCL, allocator slack
    op_overhead_s: float = 0.0  # launch/dispatch cost per kernel that the device does not hide
    # Cross-entropy forward + backward per fp32 logit, where measured (CPU); else derived from the bandwidth.
    loss_s_per_logit: float | None = None
    # FLOP/s of fused causal attention (forward + backward), where measured (CPU); else priced as matmuls.
    attention_flops: float | None = None
    # Host-side cost of PyTorch's wrappers per microbatch, where the device does not hide it (measured on CPU):
    fsdp_unit_overhead_s: float = 0.0  # per FSDP unit (hooks, gathers' latency, DTensor optimizer)
    tp_linear_overhead_s: float = 0.0  # per tensor-parallel linear (DTensor dispatch and redistribution)
    # Time of the vocabulary-parallel loss over a shard of the logits against a fused loss over as many
    # (measured on CPU; 1 elsewhere, where its extra passes are assumed as cheap as the fused kernel's).
    vocab_parallel_loss_factor: float = 1.0
    # Time of an all-gather / reduce-scatter over the ring algorithm's at intra_node_bw / nic_bw (measured on CPU,
    # where gloo's are far slower than its all-reduce; NCCL's run at the ring's pace).
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    # Whether collectives run beside compute (a GPU: NCCL on its own SMs and copy engines). On a CPU gloo's
    # threads take the same cores the matmuls use, so data-parallel traffic adds to the step instead of hiding.
    overlaps_communication: bool = True
    # Fraction of the communication time hidden behind compute that slows that compute anyway (NCCL's kernels
    # take SMs and memory bandwidth from the matmuls beside them); fitted on published FSDP runs (plan.calibrate).
    overlap_contention: float = 0.0
    # Where measured (CPU): bytes/s a decode step streams its weights (and KV cache) at from memory, measured
    # through the engine's own linear kernel at one row, which pays no first-touch page cost unlike hbm_bw's fresh
    # outputs but reads at about half the rate of a plain sum over a buffer; and the host time a decode step spends
    # per layer and per step outside its arithmetic (dispatching ~50 small ops a layer). Elsewhere hbm_bw, and on GPUs the per-layer
    # figure fitted on a published serving benchmark (kernel launches and the engine's own work; plan.calibrate).
    read_bw: float | None = None
    decode_layer_overhead_s: float = 0.0
    decode_step_overhead_s: float = 0.0
    # Where measured (CPU, through the engine itself: scalenlp.plan.measure.engine_overheads): what each sequence of
    # the batch adds to a step's host time, per layer (attention's per-row kernel work, the cache's scatter) and per
    # step (the sampler's rows, detokenizing, the callback), the sampler's time per logit, and the FLOP/s of attention
    # over the KV cache (one query a row under a mask, far below the training kernel's rate). Elsewhere 0 / None: the
    # GPU per-layer figure is fitted on lmdeploy's rows at batch 1-64 with no per-sequence term, and holds them.
    decode_layer_sequence_overhead_s: float = 0.0
    decode_sequence_overhead_s: float = 0.0
    sample_s_per_logit: float = 0.0
    decode_attention_flops: float | None = None
    # Latency of a ring step that crosses nodes (NIC, switches, NCCL's proxy thread); None: latency_s (one node).
    nic_latency_s: float | None = None
    # Where a device can offload to its host (parallel.offload: FSDP keeps the sharded weights, gradients and optimizer
    # state in host memory and steps the optimizer there): bytes/s each way over the device's host link, and the host
    # memory bandwidth per device that the host optimizer streams. None: no host to offload to (the CPU is the host).
    host_link_bw: float | None = None
    host_bw: float | None = None
    host_memory_bytes: float | None = None  # the host's memory per device, which offloaded states must fit

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_bf16 if precision == "bf16" else self.peak_flops_fp32


# Ring step latencies: NCCL's tuning model (src/graph/tuning.cc) prices a Simple-protocol ring step at 3.4-5.7 us
# over NVLink and 6.6-9.6 us over the network, plus a base latency of 8.4 us per collective; latency_s, 10 us,
# covers NVLink's step with its share of the base, nic_latency_s NCCL's larger network figure plus the same share.
_GPU_SHAPE = dict(gemm_half_dim=GPU_GEMM_HALF_DIM, elementwise_traffic=GPU_ELEMENTWISE_TRAFFIC,
                  latency_s=10e-6, nic_latency_s=15e-6, runtime_bytes=1.5 * GiB,
                  overlap_contention=GPU_OVERLAP_CONTENTION, decode_layer_overhead_s=GPU_DECODE_LAYER_OVERHEAD)
# The DGX-class servers below (and the clouds' equivalents) have 2 TiB of host memory for their 8 GPUs.
HOST_MEMORY_PER_GPU = 2 * 2**40 / 8

DEVICES: dict[str, DeviceSpec] = {
    # DGX A100: NVLink3, 600 GB/s per GPU both ways (datasheet), ~230 GB/s all-reduce bus bandwidth in nccl-tests;
    # one ConnectX-6 HDR 200 Gb/s NIC per GPU, 25 GB/s (a rail each: 8 per node, 1,600 Gb/s, as MosaicML's and
    # Meta's A100 clusters have; nccl-tests across DGX A100 nodes report ~185-190 GB/s bus bandwidth per node).
    # Host: PCIe 4.0 x16 per GPU, 32 GB/s each way (the A100 datasheet's 64 GB/s both ways); two 8-channel DDR4-3200
    # sockets (DGX A100's EPYC 7742s, Azure NDm A100 v4's EPYC 7V12s), 409.6 GB/s for 8 GPUs; 2 TiB of it per
    # 8 GPUs (DGX A100 640GB datasheet: "2TB"; NDm A100 v4: 1,900 GiB).
    "a100-80gb": DeviceSpec("a100-80gb", peak_flops_bf16=312e12, peak_flops_fp32=19.5e12, memory_bytes=80 * GiB,
                            hbm_bw=2.04e12, intra_node_bw=230e9, nic_bw=25e9,
                            gemm_efficiency=A100_GEMM_EFFICIENCY, host_link_bw=32e9, host_bw=409.6e9 / 8,
                            host_memory_bytes=HOST_MEMORY_PER_GPU,
                            **_GPU_SHAPE),
    # HGX H100 SXM: NVLink4, 900 GB/s per GPU both ways (datasheet), ~360 GB/s all-reduce bus bandwidth in
    # nccl-tests without NVLink SHARP; one ConnectX-7 NDR 400 Gb/s NIC per GPU, 50 GB/s (3,200 Gb/s per node).
    # Host: PCIe 5.0 x16 per GPU, 64 GB/s each way (datasheet: 128 GB/s both ways); DGX H100's two Xeon 8480C
    # sockets, 8 channels of DDR5-4800 each, 614.4 GB/s for 8 GPUs, 2 TiB of it (datasheet: "2TB"; DGX H200 has the
    # same host).
    "h100-sxm": DeviceSpec("h100-sxm", peak_flops_bf16=989e12, peak_flops_fp32=67e12, memory_bytes=80 * GiB,
                           hbm_bw=3.35e12, intra_node_bw=360e9, nic_bw=50e9,
                           gemm_efficiency=H100_GEMM_EFFICIENCY, host_link_bw=64e9, host_bw=614.4e9 / 8,
                           host_memory_bytes=HOST_MEMORY_PER_GPU,
                           **_GPU_SHAPE),
    # The H100's compute die with 141 GB of faster HBM3e.
    "h200": DeviceSpec("h200", peak_flops_bf16=989e12, peak_flops_fp32=67e12, memory_bytes=141e9,
                       hbm_bw=4.8e12, intra_node_bw=360e9, nic_bw=50e9,
                       gemm_efficiency=H100_GEMM_EFFICIENCY, host_link_bw=64e9, host_bw=614.4e9 / 8,
                       host_memory_bytes=HOST_MEMORY_PER_GPU, **_GPU_SHAPE),
}

_UNITS = {"memory_gb": ("memory_bytes", 1e9), "memory_gib": ("memory_bytes", GiB)}


def parse_overrides(text: str | None) -> dict[str, float]:
    """``key=value,...`` over DeviceSpec fields (plus memory_gb / memory_gib) -> field values."""
    fields = {f.name for f in dataclasses.fields(DeviceSpec)} - {"name"}
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or (key not in fields and key not in _UNITS):
            raise UserError(f"--device-spec {item!r}: expected key=value with key one of "
                            f"{', '.join(sorted(fields | set(_UNITS)))}")
        try:
            number = float(value)
        except ValueError:
            raise UserError(f"--device-spec {item!r}: {value!r} is not a number") from None
        if not math.isfinite(number):
            raise UserError(f"--device-spec {item!r}: must be a finite number")
        if number < 0 or (number == 0 and key not in ("latency_s", "nic_latency_s", "op_overhead_s", "runtime_bytes")):
            raise UserError(f"--device-spec {item!r}: must be positive")
        field, scale = _UNITS.get(key, (key, 1.0))
        out[field] = number * scale
    return out


def get_device(name: str, overrides: dict[str, float] | None = None) -> DeviceSpec:
    if name not in DEVICES:
        raise UserError(f"unknown device {name!r}; choose one of {', '.join([*DEVICES, 'cpu'])} "
                        "(cpu measures this machine)")
    return dataclasses.replace(DEVICES[name], **(overrides or {}))


# CUDA device names -> the datasheet entries above (one table of peaks for the whole project).
GPU_NAMES = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb"}


def proc_bytes(path: str, key: str) -> int:
    """A "key: N kB" figure of a Linux /proc file (/proc/self/status, /proc/meminfo), in bytes: OSError where the
    file does not exist (not Linux), KeyError where it has no such key."""
    with open(path) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields[key].split()[0]) * 1024


def resident_bytes(peak: bool) -> int:
    """This process's resident set: its peak or its size now. On Linux from /proc (VmHWM, VmRSS), not
    getrusage, whose peak Linux carries across exec from the spawning process: a run started from a
    large Python process would report that process's size. Elsewhere getrusage's peak is all there is."""
    try:
        return proc_bytes("/proc/self/status", "VmHWM" if peak else "VmRSS")
    except (OSError, KeyError):
        import resource  # POSIX only; Windows has neither /proc nor this module

        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return usage if sys.platform == "darwin" else usage * 1024  # macOS reports bytes, Linux KiB


def available_memory() -> int | None:
    """Bytes of memory this machine can still give out without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        return proc_bytes("/proc/meminfo", "MemAvailable")
    except (OSError, KeyError, ValueError):
        return None


def cache_dir() -> Path:
    """Where figures measured on this machine are kept between runs: ``$XDG_CACHE_HOME/scalenlp``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scalenlp"


def engine_cache_path(kind: str, device, key: str, suffix: str = ".json") -> Path:
    """Where a figure the engine measured once for this ``device``, PyTorch version and thread count is cached:
    ``kind`` (what was measured) and ``key`` (the model shape's) name it further; ``suffix``, what the file holds
    (the compiled decode step's artifacts are bytes)."""
    import torch

    return cache_dir() / (f"{kind}-{slug(processor_name(device))}-torch-{slug(torch.__version__)}-"
                          f"{torch.get_num_threads()}t-{key}{suffix}")


def processor_name(device) -> str:
    """The GPU's name for a CUDA ``device`` (a torch.device), else the CPU's model name."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def slug(text: str) -> str:
    """``text`` as a file-name part: lower-case letters, digits and dashes."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def cached_record(path: Path, measure: Callable[[], dict], valid: Callable[[dict], dict] = dict) -> tuple[dict, bool]:
    """The figure cached at ``path`` (what ``valid`` makes of it; it raises ValueError, KeyError or TypeError for
    a record it does not take), else ``measure()``'s, cached there; and whether it was measured now. Every
    measured-once figure (the MFU peak, the served dtype, whether to compile) is kept so, per machine."""
    try:
        return valid(json.loads(path.read_text())), False
    except (OSError, ValueError, KeyError, TypeError):  # absent, or not a record this version wrote: measure again
        record = measure()
        write_cached(path, record)
        return record, True


def write_cached(path: Path, value: dict) -> None:
    """Write a measured figure atomically: several processes may measure and write at the same time. A cache that
    cannot be written costs only a measurement next run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(value), shared=True)
    except OSError:
        pass


def time_rounds(passes: dict[str, list[Callable[[], None]]], rounds: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[list[float]]]:
    """Per candidate, per round, the seconds of each of its ``passes`` (run in their order), for a figure measured
    once per machine (the served dtype, lora.pack_frozen). Rounds alternate the candidates in alternating order, so
    a neighbour's burst slows both halves of a round alike; a candidate runs its passes once untimed right before it
    times them, so that its timing pays neither a first call's one-time costs nor what the other candidate left
    behind (its weights in the caches)."""
    timings: dict[str, list[list[float]]] = {name: [] for name in passes}
    for r in range(rounds):
        for name in list(passes)[::1 if r % 2 else -1]:
            for run in passes[name]:
                run()
            marks = [clock()]
            for run in passes[name]:
                run()
                marks.append(clock())
            timings[name].append([end - start for start, end in zip(marks, marks[1:])])
    return timings


def release_openmp_workers() -> bool:
    """End the calling thread's idle OpenMP workers, before another thread (an engine's loop) takes over the
    model's work: GNU OpenMP (PyTorch's on Linux) keeps a team of workers for every thread that ever ran a parallel
    region, and once it manages more threads than there are CPUs its workers spin only ~100 times before sleeping.
    With the loading thread's team still there, each of a batch-1 step's short parallel products then waited for a
    sleeping worker: on 2 cores an int4 product took as long on 2 threads as on 1 (77 against 79 us). Returns
    whether a libgomp ended them; other OpenMP runtimes (Intel's, LLVM's) and older libgomps are left as they
    are."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # the copy torch loaded, not a new one
    except OSError:
        return False
    pause = getattr(gomp, "omp_pause_resource_all", None)  # OpenMP 5.0: GCC 9 and later
    return pause is not None and pause(1) == 0  # omp_pause_soft: the threads end; the next region starts new ones
