"""The peak memory a run reports is its own process's, not that of the process that started it."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_peak_memory_is_the_process_own_not_its_spawner():
    """Linux carries getrusage's peak across exec: a run started from a large process must not report it."""
    ballast = torch.ones(256 * 2**20)  # 1 GiB resident in this process
    probe = "from scalenlp.hardware import resident_bytes; print(resident_bytes(peak=True))"
    child_peak = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                    check=True).stdout)
    assert child_peak < 0.8 * ballast.numel() * ballast.element_size()
