"""Failure as a non-event, through `scalenlp train --nproc 2 --max-restarts 1`: a rank killed, a checkpoint damaged or
a rank hung, and the job ends with the losses and weights of a run that never failed."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from scalenlp import faults
from train_helpers import TINY, assert_same_checkpoints, read_metrics, run_train


def final_records(run_dir):
    """The last record of every step: a restart appends the steps it recomputes again."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def weights(run_dir):
    return load_file(run_dir / "export" / "model.safetensors")


def faulty_run(run_dir, sets, fault, restarts=1):
    env = {faults.ENV: fault}
    os.environ.update(env)
    try:
        return run_train(run_dir, *sets, nproc=2, extra=["--max-restarts", str(restarts)], check=False)
    finally:
        os.environ.pop(faults.ENV)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=8", "checkpoint.every=2", "checkpoint.keep=2"]
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_train(run, *sets, nproc=2)
    return sets, run


@pytest.mark.slow  # multi-process
@pytest.mark.parametrize("fault, resumed_from", [("kill@1:5", "step-4"), ("damage@0:5", "step-2")])
def test_a_killed_rank_restarts_and_ends_as_if_nothing_happened(tmp_path, uninterrupted, fault, resumed_from):
    sets, reference = uninterrupted
    run = tmp_path / "run"
    proc = faulty_run(run, sets, fault)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {run / 'checkpoints' / resumed_from} at step" in proc.stderr
    if fault.startswith("damage"):
        assert "is damaged" in proc.stderr and "sets it aside as step-4.damaged" in proc.stderr
        assert (run / "checkpoints" / "step-4.damaged").is_dir()
    got, want = final_records(run), final_records(reference)
    assert sorted(got) == list(range(1, 9))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]
    a, b = weights(run), weights(reference)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow  # multi-process
def test_a_hung_rank_is_named_its_stacks_written_and_the_job_restarted(tmp_path, uninterrupted):
    sets, reference = uninterrupted
    run = tmp_path / "run"
    proc = faulty_run(run, [*sets, "training.hang_timeout=5"], "hang@1:5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    named = [line for line in proc.stderr.splitlines() if line.startswith("error: hang:")]
    assert len(named) == 1, proc.stderr[-4000:]
    assert "exceeded 5.0 s" in named[0] and "rank 1 has not joined gloo:all_reduce" in named[0]
    assert "rank 1 is at faults.py" in named[0]
    (folder,) = (p for p in (run / "hang").iterdir() if p.is_dir())
    for rank in (0, 1):
        assert "(most recent call first)" in (folder / f"stacks-rank{rank}.txt").read_text()
    assert "in inject" in (folder / "stacks-rank1.txt").read_text()  # the sleeping rank's own stack
    report = json.loads((folder / "report.json").read_text())
    assert report["message"] in named[0]
    got, want = final_records(run), final_records(reference)
    assert [got[s]["loss"] for s in sorted(got)] == [want[s]["loss"] for s in sorted(want)]


@pytest.mark.slow  # multi-process
def test_async_save_writes_the_checkpoints_a_sync_save_writes(tmp_path, corpus):
    """Two ranks (one process: tests/unit/test_recovery.py)."""
    sets = [*TINY, f"data.path={corpus}", "training.steps=4", "checkpoint.every=1", "checkpoint.keep=2"]
    for mode in ("sync", "async"):
        run_train(tmp_path / mode, *sets, f"checkpoint.async_save={mode == 'async'}", nproc=2)
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
