"""A node lost mid-run: two test hosts (network namespaces) x 2 processes, elastic (--nnodes 1:2), one host's
every process SIGKILLed after a step; what it costs, beside an uninterrupted two-host run of the same job.

- time to recover: the job's wall time minus the uninterrupted run's (also: from the kill to the first step
  trained after it, most of it torchrun noticing the lost node and waiting for others to join);
- steps recomputed: steps trained before the kill and again after it, and how many of those lie before the
  newest checkpoint at the kill (the goal is none);
- data lost: whether every step is there, with the uninterrupted run's losses and final weights (to float32
  rounding: the attempt after the kill sums the gradients of 2 processes instead of 4).

`measure` gives benchmarks/faults.py its node-kill row; run alone, this prints that row, and a second one with
the survivor's rendezvous waiting ``--rdzv-last-call`` seconds for the lost host instead of torchrun's 30. Needs root.

    python benchmarks/node_kill.py [--steps 30] [--every 5] [--kill-after 8] [--rdzv-last-call 5]
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
from scalenlp.testing.hosts import start_train, unavailable, virtual_hosts  # noqa: E402
from train_helpers import TINY, last_step, read_metrics, write_corpus  # noqa: E402  (the tests' tiny run)

RESUMED = re.compile(r"resumed from \S*step-(\d+) at step")
NAME = "node kill (every process of 1 of 2 hosts)"


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def two_hosts_job(run_dir: Path, sets: list[str], nnodes: str, kill_after: int | None = None,
                  launch: tuple[str, ...] = ()):
    """One job over two fresh test hosts, ``launch`` added to `scalenlp train`'s flags; (wall s, seconds from the
    kill to the next step trained, last step logged before the kill, output of the host that stayed)."""
    args = ["--run-dir", str(run_dir), "--nproc", "2", "--nnodes", nnodes, "--max-restarts", "1", *launch]
    args += [a for s in sets for a in ("--set", s)]
    with virtual_hosts(2) as hosts:
        start = time.perf_counter()
        stays, goes = [start_train(h, hosts[0], args, env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True) for h in hosts]
        recover_s = killed_at = None
        if kill_after is not None:
            while last_step(run_dir) < kill_after and stays.poll() is None:
                time.sleep(0.02)
            hosts[1].kill()
            killed, killed_at = time.perf_counter(), last_step(run_dir)
            seen = len(read_metrics(run_dir))
            while len(read_metrics(run_dir)) == seen and stays.poll() is None:  # the restart's first step
                time.sleep(0.02)
            recover_s = time.perf_counter() - killed
        out = stays.communicate()[0]
        goes.communicate()
        wall = time.perf_counter() - start
    if stays.returncode != 0:
        raise SystemExit(f"the job failed ({stays.returncode}):\n{out[-3000:]}")
    return wall, recover_s, killed_at, out


def data_lost(run_dir: Path, reference: Path, steps: int) -> str:
    got = {r["step"]: r["loss"] for r in read_metrics(run_dir)}  # the last record of each step counts
    want = {r["step"]: r["loss"] for r in read_metrics(reference)}
    if sorted(got) != list(range(1, steps + 1)):
        return f"steps missing: {sorted(set(range(1, steps + 1)) - set(got))}"
    loss_rel = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    a, b = (load_file(d / "export" / "model.safetensors") for d in (run_dir, reference))
    weights = max(float((a[k] - b[k]).abs().max()) for k in a)
    verdict = "none" if loss_rel < 1e-5 and weights < 1e-5 else "losses or weights differ"
    return f"{verdict} (every step; losses within {loss_rel:.1e} relative, weights within {weights:.1e})"


def measure(work: Path, sets: list[str], steps: int, every: int, kill_after: int,
            last_call: int | None = None) -> tuple:
    """faults.py's row: (name, extra wall s, steps recomputed, of those before the newest checkpoint, data lost).
    ``sets`` must hold training.steps=steps and checkpoint.every=every; ``last_call``: --rdzv-last-call."""
    name = NAME if last_call is None else f"{NAME}, --rdzv-last-call {last_call}"
    reason = unavailable()
    if reason:
        return name, None, None, None, f"skipped: {reason}"
    shutil.rmtree(work / "node-kill", ignore_errors=True)
    base, _, _, _ = two_hosts_job(work / "two-hosts", sets, "2")
    launch = () if last_call is None else ("--rdzv-last-call", str(last_call))
    wall, recover_s, killed_at, out = two_hosts_job(work / "node-kill", sets, "1:2", kill_after, launch)
    resumed = [int(s) for s in RESUMED.findall(out)]
    if not resumed:
        return name, wall - base, None, None, "did not resume"
    row = kill_row(name, wall - base, killed_at, resumed[-1], every,
                   data_lost(work / "node-kill", work / "two-hosts", steps), recover_s)
    shutil.rmtree(work / "two-hosts")
    return row


def kill_row(name: str, extra_s: float, killed_at: int, resumed: int, every: int, lost: str, recover_s: float) -> tuple:
    """A table row of a job killed after step ``killed_at`` that resumed from step ``resumed``."""
    newest = killed_at // every * every  # the newest checkpoint at the kill
    return (name, extra_s, killed_at - resumed, max(0, newest - resumed),
            f"{lost}; {recover_s:.1f} s from the kill to the next step")


def parse_kill_run(p: argparse.ArgumentParser, prefix: str) -> tuple[argparse.Namespace, Path, list[str]]:
    """``p`` given --steps, --every and --kill-after and parsed; a new work folder; the tiny run's sets on its
    corpus."""
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint.every")
    p.add_argument("--kill-after", type=int, default=8, help="the kill comes once this step is logged")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    sets = [*TINY, f"data.path={write_corpus(work / 'corpus.txt')}", f"training.steps={args.steps}",
            f"checkpoint.every={args.every}", "checkpoint.keep=2"]
    return args, work, sets


def print_table(rows: list[tuple]) -> None:
    """The fault table, one row per (name, extra wall s, steps recomputed, before the newest checkpoint, data lost);
    benchmarks/faults.py prints its rows with it too."""
    print(f"{'fault':<48} {'time to recover':>16} {'steps recomputed':>17} {'before last ckpt':>17}  data lost")
    for name, extra_s, redone, early, lost in rows:
        print(f"{name:<48} {'-' if extra_s is None else f'{extra_s:+.1f} s':>16} "
              f"{'-' if redone is None else redone:>17} {'-' if early is None else early:>17}  {lost}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rdzv-last-call", type=int, default=5, help="the second row's rendezvous wait (seconds)")
    args, work, sets = parse_kill_run(p, "scalenlp-node-kill-")
    rows = [measure(work, sets, args.steps, args.every, args.kill_after, last_call)
            for last_call in (None, args.rdzv_last_call)]
    load = os.getloadavg()
    print(f"{args.steps} steps, 2 hosts x 2 gloo processes, checkpoint every {args.every} steps, host 2 killed "
          f"after step {args.kill_after}; load average {load[0]:.1f} on {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    print_table(rows)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
