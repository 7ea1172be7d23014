"""SIGTERM to the launcher of a two-process run reaches every rank: they save a checkpoint at the next step, and
`scalenlp train` exits 0 with one line saying so (one process, in this one: tests/unit/test_sigterm.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from scalenlp.train.checkpoint import read_train_state
from train_helpers import HANG_GUARD_S, TINY, cli_env, error_lines, read_metrics


@pytest.mark.slow  # a multi-process run: 30-40 s here
def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path, corpus):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "scalenlp", "train", "--nproc", "2", "--run-dir", str(run)]
    for s in [*TINY, f"data.path={corpus}", "training.steps=100000", "checkpoint.every=0"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and not error_lines(stderr)
    stopped = [line for line in stderr.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1, stderr[-3000:]
    last = read_metrics(run)[-1]["step"]
    assert f"after step {last} of 100000" in stopped[0]
    assert read_train_state(run / "checkpoints" / f"step-{last}")["step"] == last
    assert not (run / "export").exists()


