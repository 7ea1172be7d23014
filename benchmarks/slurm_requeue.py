"""A Slurm job's task killed mid-run and the job requeued: the script `scalenlp deploy slurm` writes, on a real
one-node Slurm (scalenlp.testing.slurm), 2 processes; every process of the job on the node SIGKILLed after a
step (as a lost node ends them), then `scontrol requeue` (what Slurm does itself when a node fails). Beside an
uninterrupted job of the same script on the same cluster:

- time to recover: the job's wall time, from sbatch to its end, minus the uninterrupted job's (also: from the
  kill to the first step trained after it, Slurm's requeue and the new attempt's start-up);
- steps recomputed: steps trained before the kill and again after it, and how many of those lie before the
  newest checkpoint at the kill (the goal is none);
- data lost: whether every step is there, with the uninterrupted job's losses and final weights.

`measure` gives benchmarks/faults.py its Slurm row; run alone, this prints that row. Needs root and Debian's
slurm-wlm.

    python benchmarks/slurm_requeue.py [--steps 30] [--every 5] [--kill-after 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import node_kill  # noqa: E402  (beside this script: the row's table and data-lost check)
from scalenlp.cli import main as scalenlp  # noqa: E402
from scalenlp.testing import slurm  # noqa: E402
from train_helpers import last_step, read_metrics  # noqa: E402

NAME = "Slurm job's task killed (SIGKILL), requeued"


def job_env() -> dict:
    """The job's environment: this interpreter's `scalenlp` first on PATH."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def kill_job_processes(cluster: slurm.Cluster, job: str) -> None:
    """SIGKILL every process of the job on the node (its batch shell, srun's task, the workers), as a lost node
    ends them: no signal handler runs, nothing is saved."""
    out = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, env=cluster.env,
                         check=True).stdout
    for line in out.splitlines()[1:]:  # PID JOBID STEPID LOCALID GLOBALID
        pid = int(line.split()[0])
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass


def run_job(cluster: slurm.Cluster, script: Path, run_dir: Path, kill_after: int | None = None):
    """Submit ``script``; with ``kill_after``, kill the job's processes once that step is logged, then requeue it.
    (wall s from sbatch to the end, seconds from the kill to the next step, last step logged before the kill)."""
    start = time.perf_counter()
    job = cluster.sbatch(script, job_env())
    recover_s = killed_at = None
    if kill_after is not None:
        while last_step(run_dir) < kill_after and cluster.state(job) in ("PENDING", "RUNNING"):
            time.sleep(0.02)
        kill_job_processes(cluster, job)
        killed, killed_at = time.perf_counter(), last_step(run_dir)
        seen = len(read_metrics(run_dir))
        failed = cluster.wait(job, 0.1)
        subprocess.run(["scontrol", "requeue", job], env=cluster.env, check=True)
        while len(read_metrics(run_dir)) == seen and cluster.state(job) not in slurm.DONE:
            time.sleep(0.02)
        recover_s = time.perf_counter() - killed
        print(f"job {job}: {failed} after the kill, requeued", file=sys.stderr)
    state = cluster.wait(job, 0.1)
    if state != "COMPLETED":
        raise SystemExit(f"job {job} ended {state}: see {script.parent}")
    return time.perf_counter() - start, recover_s, killed_at


def measure(work: Path, sets: list[str], steps: int, every: int, kill_after: int) -> tuple:
    """faults.py's row: (name, extra wall s, steps recomputed, of those before the newest checkpoint, data lost).
    ``sets`` must hold training.steps=steps and checkpoint.every=every."""
    reason = slurm.unavailable()
    if reason:
        return NAME, None, None, None, f"skipped: {reason}"
    config = work / "slurm-job.toml"
    config.write_text("")  # the values are the sets'
    scripts = {}
    for name in ("uninterrupted", "requeued"):
        out = work / f"slurm-{name}"
        shutil.rmtree(out, ignore_errors=True)
        assert scalenlp(["deploy", "slurm", "--train", str(config), "--out", str(out), "--run-dir", str(out / "run"),
                         "--nproc-per-node", "2", "--max-restarts", "0",
                         *[a for s in sets for a in ("--set", s)]]) == 0
        scripts[name] = out / "train.sbatch"
    with slurm.cluster(work / "slurm-cluster") as cluster:
        base, _, _ = run_job(cluster, scripts["uninterrupted"], scripts["uninterrupted"].parent / "run")
        run_dir = scripts["requeued"].parent / "run"
        wall, recover_s, killed_at = run_job(cluster, scripts["requeued"], run_dir, kill_after)
    resumed = [int(s) for s in node_kill.RESUMED.findall("\n".join(p.read_text() for p in
                                                                     run_dir.parent.glob("*.log")))]
    if not resumed:
        return NAME, wall - base, None, None, "did not resume"
    return node_kill.kill_row(NAME, wall - base, killed_at, resumed[-1], every,
                              node_kill.data_lost(run_dir, scripts["uninterrupted"].parent / "run", steps), recover_s)


def main() -> None:
    args, work, sets = node_kill.parse_kill_run(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                                                "scalenlp-slurm-requeue-")
    row = measure(work, sets, args.steps, args.every, args.kill_after)
    load = os.getloadavg()
    print(f"{args.steps} steps, one Slurm node x 2 gloo processes, checkpoint every {args.every} steps, the job's "
          f"processes killed after step {args.kill_after}; load average {load[0]:.1f} on {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    node_kill.print_table([row])
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
