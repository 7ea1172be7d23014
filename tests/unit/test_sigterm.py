"""SIGTERM (what Kubernetes and batch schedulers send before a kill) to a one-process run: it saves a checkpoint at
the next step, says how to continue, and `scalenlp train` exits 0 (several ranks through the launcher:
tests/integration/test_sigterm_ranks.py)."""

from __future__ import annotations

import re
import signal

from scalenlp.train import trainer as trainer_module
from scalenlp.train.checkpoint import read_train_state
from train_helpers import TINY, error_lines, main_train, read_metrics


class Unhandled(Exception):
    """SIGTERM reached the handler the test installed: the run did not take it."""


def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path, corpus, capsys, monkeypatch):
    log = trainer_module.Trainer.log

    def log_then_terminate(self, msg):  # the signal arrives while the run is in its loop, after step 2
        log(self, msg)
        if re.match(r"step +2 \| loss", msg):
            signal.raise_signal(signal.SIGTERM)
        assert not re.match(r"step +5 \| loss", msg), "the run went on after SIGTERM"

    def unhandled(signum, frame):
        raise Unhandled

    monkeypatch.setattr(trainer_module.Trainer, "log", log_then_terminate)
    previous = signal.signal(signal.SIGTERM, unhandled)  # not pytest's default, which would end this process
    try:
        run = tmp_path / "run"
        assert main_train(run, *TINY, f"data.path={corpus}", "training.steps=100000", "checkpoint.every=0") == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    stderr = capsys.readouterr().err
    assert not error_lines(stderr)
    stopped = [line for line in stderr.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1, stderr[-3000:]
    last = read_metrics(run)[-1]["step"]
    assert last in (2, 3) and f"after step {last} of 100000" in stopped[0]
    assert read_train_state(run / "checkpoints" / f"step-{last}")["step"] == last
    assert not (run / "export").exists()
