"""Calibration text for the methods that look at activations (wanda and 2:4 pruning, AWQ): fixed windows of a
text file, so the same file always calibrates the same way."""

from __future__ import annotations

from pathlib import Path

import torch

from scalenlp.errors import UserError


def calibration_batches(path: str | Path, tokenizer, samples: int = 128, seq_len: int = 128,
                        batch_size: int = 8) -> list[torch.Tensor]:
    """``samples`` windows of ``seq_len`` tokens spread evenly over a text file, in (batch_size, seq_len)
    batches. Evenly spread, not random: the same file always gives the same calibration."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--calibration {path!r} is not a file; pass a UTF-8 text file (e.g. wikitext2/valid.txt)")
    if samples < 1 or seq_len < 2:
        raise UserError(f"calibration needs at least 1 sample of 2 tokens, got {samples} of {seq_len}")
    try:
        ids = tokenizer.encode(file.read_text(encoding="utf-8")).ids
    except UnicodeDecodeError as e:
        raise UserError(f"--calibration {path} is not UTF-8 text (byte {e.start}); convert it first") from None
    if len(ids) < seq_len:
        raise UserError(f"--calibration {path} has {len(ids)} tokens, fewer than one window of {seq_len}; "
                        f"pass a longer text")
    tokens = torch.tensor(ids)
    starts = torch.linspace(0, len(ids) - seq_len, samples).long().tolist()
    windows = torch.stack([tokens[s:s + seq_len] for s in starts])
    return list(windows.split(batch_size))
