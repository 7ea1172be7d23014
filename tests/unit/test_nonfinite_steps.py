"""A step whose loss or gradient is not finite: training.on_nonfinite stops (keeping the last good checkpoint),
skips that update, or rolls back to the last checkpoint and reads on, stopping if it happens again."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scalenlp.errors import UserError
from scalenlp.models.io import load_pretrained
from scalenlp.train.tasks import base as task_base
from train_helpers import TINY, read_metrics, train_here


def in_process(run_dir: Path, corpus: Path, *sets: str):
    return train_here(run_dir, *TINY, f"data.path={corpus}", *sets)


def nan_at(steps: set[int] | None, after: int = 0):
    """lm_loss that answers NaN at the given steps (or every step after ``after``): one call per step."""
    calls = {"n": 0}
    real = task_base.lm_loss

    def patched(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        bad = calls["n"] in steps if steps is not None else calls["n"] > after
        return loss * math.nan if bad else loss
    return patched


def assert_finite_export(run: Path) -> None:
    model = load_pretrained(run / "export")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_step_stops_by_default_and_keeps_the_good_checkpoint(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    with pytest.raises(UserError, match=r"step 3: the loss is not finite on rank 0 .*step-2"):
        in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "checkpoint.keep=1")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert not (run / "export").exists()


def test_nonfinite_step_skip_drops_only_that_update(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    in_process(run, corpus, "training.steps=4", "training.on_nonfinite=skip")
    losses = [r["loss"] for r in read_metrics(run)]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for x in losses[:2] + losses[3:])
    assert_finite_export(run)


def test_nonfinite_step_rollback_reads_on_and_stops_if_it_recurs(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "training.on_nonfinite=rollback")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 3 again, on the next batch
    # Each record's throughput counts its own step's 4 x 32 tokens, not those of the step rolled back.
    assert [r["tokens_per_sec"] * r["step_time_s"] for r in records] == pytest.approx([4 * 32] * 4)
    assert_finite_export(run)

    again = tmp_path / "again"
    monkeypatch.setattr(task_base, "lm_loss", nan_at(None, after=2))
    with pytest.raises(UserError, match="happened again after rolling back to .*step-2"):
        in_process(again, corpus, "training.steps=6", "checkpoint.every=2", "training.on_nonfinite=rollback")
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["step-2"]


