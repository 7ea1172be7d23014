"""Two processes train as one: DDP, and DDP with gradient accumulation, take the steps of one process, and a job
launched with plain torchrun is the same job as `scalenlp train --nproc 2`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train_helpers import HANG_GUARD_S, TINY, cli_env, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # two-process runs: 20-60 s each here under load


@pytest.fixture(scope="module")
def sets(corpus):
    return [*TINY, f"data.path={corpus}", "training.steps=4", "checkpoint.export=false"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, sets):
    """`scalenlp train --nproc 2` (DDP), run once for both tests: its metrics records."""
    run = tmp_path_factory.mktemp("ddp") / "run"
    run_train(run, *sets, nproc=2)
    return read_metrics(run)


def test_ddp_two_processes_match_single_process(tmp_path, sets, two_processes):
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    assert [r["step"] for r in two_processes] == [1, 2, 3, 4]
    for a, b in zip(single, two_processes):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # Gradient accumulation (2 micro-batches per rank) is the same optimisation again.
    run_train(tmp_path / "accum", *sets, "training.micro_batch_size=1", nproc=2)
    for a, b in zip(single, read_metrics(tmp_path / "accum")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_plain_torchrun_launch_is_the_same_job(tmp_path, sets, two_processes):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "scalenlp", "train", "--run-dir", str(tmp_path / "torchrun")]
    for s in sets:
        torchrun += ["--set", s]
    proc = subprocess.run(torchrun, capture_output=True, text=True, env=cli_env(), timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "torchrun")] == [r["loss"] for r in two_processes]
