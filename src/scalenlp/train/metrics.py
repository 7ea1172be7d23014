"""Metrics people can trust: tokens/s, MFU against a stated peak (scalenlp.train.peak), peak memory.

``tokens_per_sec`` counts every token the model computed on, padding included (SFT rows are padded to
training.seq_len, classification batches to their longest row), and MFU is derived from it: the model's
FLOPs on padding are spent all the same. SFT records add ``assistant_tokens_per_sec``, the tokens the loss
learns from (assistant turns, no prompts, markup or padding)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from scalenlp.hardware import resident_bytes


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resident_bytes(peak=True)


def drop_torn_line(path: Path) -> None:
    """Cut a last line without its newline: a process killed while writing it (a lost node, a restart) left
    a part of a record, and the resumed run's first record would be appended to it, making one line that no
    JSON reader parses. The records before it are kept."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        while end > 0:  # back from the end a block at a time: the file holds the whole run's records
            start = max(0, end - (1 << 16))
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


class _TensorBoard:
    """The records' numbers as TensorBoard scalars in <run_dir>/tensorboard."""

    def __init__(self, writer):
        self.writer = writer

    def log_record(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self, export: Path | None) -> None:
        self.writer.close()


class MetricsWriter:
    """One JSON object per line in <run_dir>/metrics.jsonl, written first, and each record's numbers to more
    sinks: TensorBoard when it is installed, and ``sinks`` ([tracking]'s trackers, scalenlp.train.tracking)."""

    def __init__(self, run_dir: Path, enabled: bool, sinks: list | None = None):
        self.enabled = enabled
        self.file = None
        self.sinks = []
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        drop_torn_line(path)
        self.file = open(path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.sinks.append(_TensorBoard(SummaryWriter(str(run_dir / "tensorboard"))))
        except ImportError:  # TensorBoard is optional
            pass
        self.sinks += sinks or []

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.log_record(record["step"], scalars)

    def close(self, export: Path | None = None) -> None:
        """Close the file and every sink; ``export``, the folder this run exported, goes to the trackers."""
        if self.file:
            self.file.close()
        for sink in self.sinks:
            sink.close(export)
