"""`scalenlp train` started by real schedulers, with no launch flags: Slurm (the script `scalenlp deploy slurm`
writes, submitted with sbatch to a cluster this test starts) and Open MPI's mpirun. Each run's losses equal
`scalenlp train --nproc 2`'s on the same config, step by step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalenlp.cli import main
from scalenlp.parallel.mesh import free_port
from scalenlp.testing import slurm
from train_helpers import HANG_GUARD_S, TINY, cli_env, last_step, read_metrics, run_train

# Long enough that the signal sent after step 3 lands well before the end: the debug model steps at ~45/s, and
# scancel's signal took 2-4 steps to land on an idle machine but 17 under CI's load (20 steps were too few).
STEPS = 200
SETS = [*TINY, f"training.steps={STEPS}", "checkpoint.export=false"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of `scalenlp train --nproc 2` on SETS."""
    run_dir = tmp_path_factory.mktemp("nproc2") / "run"
    run_train(run_dir, *SETS, nproc=2)
    return [r["loss"] for r in read_metrics(run_dir)]


def _job_env() -> dict[str, str]:
    """This interpreter's `scalenlp` first on PATH; a free port for the job (the one derived from the job id,
    20001 for a new cluster's first job, may be taken on a shared machine)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**cli_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_PORT": str(free_port())}


@pytest.mark.slow
def test_sbatch_script_trains_stops_on_signal_and_resumes_when_requeued(tmp_path, reference):
    """The written script on a real Slurm: its task forms the rendezvous from the allocation (c10d on its first
    node); SIGTERM to the job's tasks (what --signal sends before the time limit) saves a checkpoint and ends the
    job; requeued, the job resumes from that checkpoint, and its losses are those of the uninterrupted run."""
    reason = slurm.unavailable()
    if reason:
        pytest.skip(reason)
    config = tmp_path / "job.toml"
    config.write_text("")  # every value from SETS or the defaults, as the reference run
    out, run_dir = tmp_path / "slurm", tmp_path / "run"
    assert main(["deploy", "slurm", "--train", str(config), "--out", str(out), "--run-dir", str(run_dir),
                 "--nproc-per-node", "2", "--max-restarts", "0", *[a for s in SETS for a in ("--set", s)]]) == 0
    with slurm.cluster(tmp_path / "cluster") as cluster:
        job = cluster.sbatch(out / "train.sbatch", _job_env())
        deadline = time.monotonic() + HANG_GUARD_S
        while last_step(run_dir) < 3 and cluster.state(job) in ("PENDING", "RUNNING"):
            assert time.monotonic() < deadline, "the job never reached step 3"
            time.sleep(0.05)
        # Without --batch, scancel signals the job's steps (srun's tasks), as --signal=TERM@N does.
        subprocess.run(["scancel", "--signal=TERM", job], env=cluster.env, check=True)
        assert cluster.wait(job) == "COMPLETED"
        log = (out / f"job-{job}.log").read_text()
        stopped = last_step(run_dir)
        assert 3 <= stopped < STEPS and f"stopped by SIGTERM after step {stopped}" in log, log[-3000:]
        assert (run_dir / "checkpoints" / f"step-{stopped}").is_dir()

        # Slurm holds a requeued job for the test cluster's credential lifetime (slurm.CRED_EXPIRE_S) before it
        # may start again; starting it sooner (StartTime=now) raced slurmd's revocation of the first run's
        # credentials, and the job failed as "non-startable".
        subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True)
        assert cluster.wait(job) == "COMPLETED"
    log = (out / f"job-{job}.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped}'} at step {stopped}" in log, log[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == reference


@pytest.mark.slow
def test_mpirun_ranks_train_as_nproc(tmp_path, reference):
    """mpirun -np 2 scalenlp train: Open MPI's variables become the ranks, gloo the process group; the same
    losses as --nproc 2."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun: apt-get install openmpi-bin")
    env = _job_env()
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *[a for name in
              ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "MASTER_PORT") if name in env for a in ("-x", name)],
              sys.executable, "-m", "scalenlp", "train"]
    run_dir = tmp_path / "run"
    done = subprocess.run([*mpirun, "--run-dir", str(run_dir), *[a for s in SETS for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["loss"] for r in read_metrics(run_dir)] == reference
