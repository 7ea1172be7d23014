"""Faults injected into a 2-process training job, and what each costs: one table.

Each row runs `scalenlp train --nproc 2` on the debug model with one fault (SCALENLP_FAULT, see
src/scalenlp/faults.py, or a real full disk: a tmpfs mounted for the run, which needs root) and
compares the job's end with an uninterrupted run of the same config, measured in the same invocation:

- time to recover: the faulty job's wall time (every launch it needed) minus the uninterrupted one's (for
  the node kill, an uninterrupted run on the same two test hosts, see benchmarks/node_kill.py; for the Slurm
  requeue, an uninterrupted job on the same Slurm, see benchmarks/slurm_requeue.py);
- steps recomputed: steps trained before the fault and trained again after it, and how many of those lie
  before the newest checkpoint that was whole at the fault (the goal is none);
- data lost: whether the final weights and every step's loss equal the uninterrupted run's.

    python benchmarks/faults.py [--steps 12] [--every 3] [--fault-step 7] [--hang-timeout 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import node_kill  # noqa: E402  (benchmarks/node_kill.py, beside this script: two test hosts, one killed)
import slurm_requeue  # noqa: E402  (benchmarks/slurm_requeue.py: a real Slurm job killed and requeued)
from scalenlp import faults  # noqa: E402
from train_helpers import TINY, read_metrics, write_corpus  # noqa: E402  (the tests' tiny run and corpus)

RESUMED = node_kill.RESUMED  # the trainer's "resumed from ..." line
STOPPED = re.compile(r"stopped by SIGTERM after step (\d+)")


def launch(run_dir: Path, sets: list[str], fault: str = "", restarts: int = 1) -> tuple[float, str]:
    """One `scalenlp train` launch; (wall seconds, stderr)."""
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", "2",
           "--max-restarts", str(restarts)] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, proc.stderr


def outcome(run_dir: Path, reference: Path) -> str:
    """'none' when the final weights and every step's last loss equal the reference run's."""
    if not (run_dir / "export" / "model.safetensors").is_file():
        return "no final weights"
    a, b = (load_file(d / "export" / "model.safetensors") for d in (run_dir, reference))
    got = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    want = {r["step"]: r["loss"] for r in read_metrics(reference)}
    differ = max(float((a[k] - b[k]).abs().max()) for k in a)
    if got != want or differ:
        return f"losses {'equal' if got == want else 'differ'}, weights differ by up to {differ:.2e}"
    return "none"


def full_disk(work: Path, sets: list[str], checkpoint_bytes: int, other_bytes: int) -> tuple[float, str, str]:
    """A tmpfs that holds the data cache and two and a half checkpoints: with checkpoint.keep=2 the third save
    runs out of space. The job stops with one line; the operator makes room (here: a larger tmpfs) and
    resumes. (wall seconds of both launches, stderr of both, the error line)."""
    mount = work / "tmpfs"
    mount.mkdir()
    size = other_bytes + checkpoint_bytes * 5 // 2
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        first, err = launch(mount / "run", sets, restarts=0)
        line = next((x for x in err.splitlines() if "no space left" in x), "no ENOSPC seen")
        subprocess.run(["mount", "-o", f"remount,size={4 * size}", str(mount)], check=True)
        second, err2 = launch(mount / "run", [*sets, "checkpoint.resume=true"], restarts=0)
        shutil.copytree(mount / "run", work / "full-disk", ignore=shutil.ignore_patterns("checkpoints"))
        return first + second, err + err2, line
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3, help="checkpoint.every")
    p.add_argument("--fault-step", type=int, default=7, help="the step after which the fault is injected")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="training.hang_timeout for the hang row")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scalenlp-faults-"))
    corpus = write_corpus(work / "corpus.txt")
    sets = [*TINY, f"data.path={corpus}", f"training.steps={args.steps}", f"checkpoint.every={args.every}",
            "checkpoint.keep=2"]
    f = args.fault_step
    base_s, _ = launch(work / "uninterrupted", sets)
    reference = work / "uninterrupted"
    checkpoint_bytes = du(reference / "checkpoints" / f"step-{args.steps}")
    other_bytes = du(work / ".token_cache") + du(reference) - du(reference / "checkpoints")

    last_whole = f // args.every * args.every  # the newest checkpoint at the fault
    rows = []
    for name, fault, extra, whole in [
        ("rank kill (SIGKILL rank 1)", f"kill@1:{f}", [], last_whole),
        ("hang (rank 1 sleeps before a collective)", f"hang@1:{f}", [f"training.hang_timeout={args.hang_timeout}"],
         last_whole),
        ("damaged newest checkpoint, then rank 0 killed", f"damage@0:{f}", [], last_whole - args.every),
        ("SIGTERM to the launcher, then resumed", f"sigterm@0:{f}", [], None),
    ]:
        run = work / name.split()[0]
        wall, err = launch(run, [*sets, *extra], fault, restarts=0 if fault.startswith("sigterm") else 1)
        if fault.startswith("sigterm"):  # the scheduler's second submission
            again, err2 = launch(run, [*sets, *extra, "checkpoint.resume=true"], restarts=0)
            wall, err = wall + again, err + err2
        resumed = [int(s) for s in RESUMED.findall(err)]
        stopped = STOPPED.findall(err)  # SIGTERM stops at a step boundary after the signal, and saves there
        trained_before = int(stopped[0]) if stopped else f
        whole = trained_before if stopped else whole
        redone = trained_before - resumed[-1] if resumed else None
        rows.append((name, wall - base_s, redone, None if redone is None else max(0, whole - resumed[-1]),
                     outcome(run, reference)))
    if os.geteuid() == 0:
        wall, err, line = full_disk(work, sets, checkpoint_bytes, other_bytes)
        resumed = [int(s) for s in RESUMED.findall(err)]
        failed_save = (args.steps // args.every >= 3) * 3 * args.every  # the third save is the one without room
        rows.append(("full disk (tmpfs), space freed, resumed", wall - base_s,
                     failed_save - resumed[-1] if resumed else None, 0, outcome(work / "full-disk", reference)))
    else:
        rows.append(("full disk (tmpfs)", None, None, None, "skipped: mounting a tmpfs needs root"))
    rows.append(node_kill.measure(work, sets, args.steps, args.every, f))
    rows.append(slurm_requeue.measure(work, sets, args.steps, args.every, f))

    load = os.getloadavg()
    print(f"uninterrupted: {args.steps} steps, 2 gloo processes, checkpoint every {args.every} steps, {base_s:.1f} s "
          f"wall; fault after step {f}; load average {load[0]:.1f} on {os.cpu_count()} cores; torch {torch.__version__}")
    node_kill.print_table(rows)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
