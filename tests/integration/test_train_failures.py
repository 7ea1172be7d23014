"""`scalenlp train` as a subprocess fails as a user sees it: bad input is one `error:` line and exit 2 with no
traceback (the other bad inputs, through the CLI's main in this process: tests/unit/test_training_run.py), and a
crashed rank ends the job instead of leaving the others hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from train_helpers import HANG_GUARD_S, TINY, cli_env, error_lines, run_train


@pytest.mark.slow  # a CLI process that imports torch before it reads the config: 10-20 s here under load
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, corpus):
    proc = run_train(tmp_path / "run", *TINY, f"data.path={corpus}", "training.stepz=3", check=False)
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "unknown config key 'training.stepz'" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_a_crashed_rank_does_not_leave_the_others_hanging(tmp_path, corpus):
    cmd = [sys.executable, "-m", "scalenlp", "train", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    for s in [*TINY, f"data.path={corpus}", "training.steps=100000", "training.timeout_s=60"]:
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks are in the loop
        assert launcher.poll() is None, launcher.communicate()[1]
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-f", "-P", str(launcher.pid), "scalenlp"], capture_output=True, text=True)
    pids = [int(p) for p in workers.stdout.split()]
    assert len(pids) == 2, workers
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode != 0
    assert error_lines(stderr) and "failed" in error_lines(stderr)[-1]
