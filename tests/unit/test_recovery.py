"""Failure as a non-event, its parts in one process: a restart tells itself from a relaunch, sets damaged checkpoints
aside, hashes what it resumes from once and keeps the global batch on fewer ranks; the watchdog's timeout and
diagnosis, the fault injector, a torn metrics record, asynchronous saves (whole jobs restarted by torchrun:
tests/integration/test_fault_recovery.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from scalenlp import faults
from scalenlp.config import load_config
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.train import checkpoint, recovery, watchdog
from scalenlp.train.checkpoint import Checkpointer
from scalenlp.train.metrics import MetricsWriter
from scalenlp.train.trainer import train
from train_helpers import TINY, assert_same_checkpoints, train_here


def test_a_relaunch_is_not_a_restart(tmp_path, monkeypatch):
    """A launch's record names its agents; a new launch (new agents) does not continue it, a restart does."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert recovery.continues_launch(tmp_path) == (False, [recovery._agent()])
    recovery.record_launch(tmp_path, [recovery._agent()], restarted=False)
    assert recovery.continues_launch(tmp_path)[0]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-launch")
    assert not recovery.continues_launch(tmp_path)[0]
    recovery.record_launch(tmp_path, [recovery._agent()], restarted=True)  # a node joined: both listed
    assert len(json.loads((tmp_path / recovery.LAUNCH_FILE).read_text())["agents"]) == 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert recovery.continues_launch(tmp_path) == (False, [])  # one process outside torchrun never restarts


def test_a_requeued_slurm_job_is_a_restart(tmp_path, monkeypatch):
    """A requeued Slurm job (new agents, the same job, SLURM_RESTART_COUNT 1) continues its run; its first attempt,
    another job, or a job outside the record does not; and a requeued attempt injects no fault."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-7")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv(faults.ENV, "kill@0:3")
    assert not recovery.continues_launch(tmp_path)[0]
    recovery.record_launch(tmp_path, [recovery._agent()], restarted=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-7-attempt-2")  # new agents: what a requeue starts
    assert not recovery.continues_launch(tmp_path)[0] and faults.planned(0) == ("kill", 3)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert recovery.continues_launch(tmp_path)[0] and faults.planned(0) is None
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    assert not recovery.continues_launch(tmp_path)[0]


def test_fewer_ranks_keep_the_micro_batch_and_the_global_batch(corpus):
    cfg = load_config(None, [*TINY, f"data.path={corpus}", "training.global_batch_size=8"])
    saved = {"layout": [["pp", 1], ["dp_replicate", 1], ["dp_shard", 4], ["tp", 1]]}
    lines = []
    two = recovery.keep_micro_batch(cfg, saved, ParallelDims(1, 2, 1, 1, 2), lines.append)
    assert two.training.micro_batch_size == 2 and two.training.global_batch_size == 8
    assert lines == ["data-parallel ranks 4 -> 2: the global batch stays 8 sequences, as 2 micro-batches of 2 per "
                     "rank (training.micro_batch_size=2)"]
    assert recovery.keep_micro_batch(cfg, saved, ParallelDims(1, 4, 1, 1, 4), lines.append) is cfg
    chosen = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batch_size=4))
    assert recovery.keep_micro_batch(chosen, saved, ParallelDims(1, 2, 1, 1, 2), lines.append) is chosen


def test_a_restart_sets_damaged_checkpoints_aside(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "train_state.json").write_text("{}")  # no checksums: not whole
    lines = []
    recovery.set_aside_damaged(Checkpointer(root, 2, 0), lines.append)
    assert sorted(p.name for p in root.iterdir()) == ["step-2.damaged", "step-4.damaged"]
    assert len(lines) == 2 and all(line.startswith("warning: checkpoint") for line in lines)


def test_a_restart_hashes_the_checkpoint_it_resumes_from_once(tmp_path, corpus, monkeypatch):
    sets = [*TINY, f"data.path={corpus}", "checkpoint.every=2"]
    run = tmp_path / "run"
    train(load_config(None, [*sets, "training.steps=2"]), run)
    hashed = []
    manifest = checkpoint._manifest
    monkeypatch.setattr(checkpoint, "_manifest", lambda folder: hashed.append(folder.name) or manifest(folder))
    monkeypatch.setattr(recovery, "continues_launch", lambda run_dir: (True, []))  # as torchrun's restart finds it
    train(load_config(None, [*sets, "training.steps=4"]), run)
    assert hashed.count("step-2") == 1  # set aside nothing, then resumed from it
    assert "step-4.tmp" in hashed  # what it saved, before the rename


def test_the_hang_timeout_follows_the_steps_within_its_floor_and_ceiling():
    assert watchdog.hang_timeout(5.0, [], 300) == 5.0  # the override, as given
    assert watchdog.hang_timeout(0.0, [], 300) is None  # nothing measured yet
    assert watchdog.hang_timeout(0.0, [0.01, 0.02], 300) == watchdog.FLOOR_S
    assert watchdog.hang_timeout(0.0, [9.0, 12.0], 300) == 120.0
    assert watchdog.hang_timeout(0.0, [9.0, 20.0], 300) == 150.0  # before the process group's own timeout


def beat(rank, seq, done, where, age=0.0):
    return {"rank": rank, "time": 100.0 - age, "where": where,
            "collectives": {"0/default_pg": {"seq": seq, "op": "gloo:all_reduce", "sizes": [[]], "done": done}}}


def test_the_watchdog_names_the_rank_the_others_wait_for():
    behind = {0: beat(0, 7, False, "trainer.py:155 (_sum_over)"), 1: beat(1, 6, True, "faults.py:41 (inject)"),
              2: beat(2, 7, False, "trainer.py:155 (_sum_over)")}
    assert watchdog.diagnose(behind, 3, 100.0) == (
        "rank 1 has not joined gloo:all_reduce #7 on process group 0/default_pg, which rank 0, 2 wait(s) in at "
        "trainer.py:155 (_sum_over); rank 1 is at faults.py:41 (inject)")
    stuck = {r: beat(r, 7, False, "guard.py:67 (check_step)") for r in range(2)}
    assert "every rank is inside gloo:all_reduce #7" in watchdog.diagnose(stuck, 2, 100.0)
    silent = {0: beat(0, 7, False, "x"), 1: beat(1, 6, True, "y", age=60.0)}
    assert watchdog.diagnose(silent, 3, 100.0).startswith("rank 1, 2 gave no heartbeat")


def test_faults_are_injected_only_where_and_when_asked(monkeypatch):
    monkeypatch.setenv(faults.ENV, "kill@1:5")
    assert faults.planned(0) is None and faults.planned(1) == ("kill", 5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart runs clean
    assert faults.planned(1) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(faults.ENV, "explode@1:5")
    with pytest.raises(ValueError, match=re.escape("expected <kill|hang|sigterm|damage|raise|overflow>@<rank>:<step>")):
        faults.planned(1)
    faults.inject(("raise", 3), 2, None)  # not yet
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        faults.inject(("raise", 3), 3, None)


@pytest.mark.parametrize("before, kept", [
    (b"", b""),
    (b'{"step": 1}\n', b'{"step": 1}\n'),
    (b'{"step": 1}\n{"step": 2, "lo', b'{"step": 1}\n'),
    (b'{"step": 1, "lo', b""),
    (b'{"step": 1}\n' + b"x" * 70_000, b'{"step": 1}\n'),  # a tail longer than one block read back
])
def test_a_record_torn_by_a_killed_process_is_cut_before_the_resumed_run_appends(tmp_path, before, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(before)
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"step": 3})
    writer.close()
    assert path.read_bytes() == kept + b'{"step": 3}\n'


def test_async_save_writes_the_checkpoints_a_sync_save_writes(tmp_path, corpus):
    """One process (two ranks: tests/integration/test_fault_recovery.py)."""
    sets = [*TINY, f"data.path={corpus}", "training.steps=4", "checkpoint.every=1", "checkpoint.keep=2"]
    for mode in ("sync", "async"):
        train_here(tmp_path / mode, *sets, f"checkpoint.async_save={mode == 'async'}")
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
