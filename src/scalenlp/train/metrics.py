"""Metrics people can trust: tokens/s, MFU against a stated peak, peak memory.

Peak FLOP/s: on a GPU we know, the datasheet's dense figure; anywhere else, a matmul measured at
start-up on this process (so with N processes sharing a CPU each measures its own share). The log
says which, because an MFU is only as good as the peak it divides by.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from scalenlp.hardware import DEVICES, GPU_NAMES, resident_bytes


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """Sustained FLOP/s of a square matmul on this process's share of the device."""
    gen = torch.Generator(device).manual_seed(0)  # leave the training RNG streams untouched
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return 2 * size**3 * iters / elapsed


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for marker, key in GPU_NAMES.items():
            if marker in name:
                precision = "bf16" if dtype == torch.bfloat16 else "fp32"
                return DEVICES[key].peak_flops(precision), f"datasheet {key} dense {precision}"
    flops = measure_matmul_flops(device, dtype, size=2048 if device.type == "cuda" else 1024)
    return flops, f"measured {str(dtype).removeprefix('torch.')} matmul on {device.type}"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resident_bytes(peak=True)


class MetricsWriter:
    """One JSON object per line in <run_dir>/metrics.jsonl, and TensorBoard when it is installed."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # TensorBoard is optional
            self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
