"""Metrics people can trust: tokens/s, MFU against a stated peak (scalenlp.train.peak), peak memory.

``tokens_per_sec`` counts every token the model computed on, padding included (SFT rows are padded to
training.seq_len, classification batches to their longest row), and MFU is derived from it: the model's
FLOPs on padding are spent all the same. SFT records add ``assistant_tokens_per_sec``, the tokens the loss
learns from (assistant turns, no prompts, markup or padding)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scalenlp.hardware import resident_bytes


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
