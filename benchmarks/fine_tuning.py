"""What the fine-tuning benchmarks (scalenlp train beside a plain transformers loop) share: the schedule's
command-line options, and a `scalenlp train` run read back from its metrics.jsonl."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from scalenlp.config import TrainingConfig


def add_schedule_arguments(parser: argparse.ArgumentParser, lr: float, warmup: float) -> None:
    """The options both sides of a comparison train with, and the processes and threads each side gets."""
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup", type=float, default=warmup, help="warm-up steps, as a fraction of the steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    parser.add_argument("--nproc", type=int, default=2, help="scalenlp DDP processes (1 thread each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformers loop (1 process)")


def schedule_of(args, steps: int) -> TrainingConfig:
    """AdamW with betas 0.9/0.999, warm-up then cosine to 0, gradient clipping at 1.0: both sides' schedule."""
    return TrainingConfig(steps=steps, global_batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,
                          warmup_steps=max(1, round(args.warmup * steps)), min_lr_ratio=0.0,
                          weight_decay=args.weight_decay, beta2=0.999, grad_clip=1.0)


def schedule_sets(args, schedule: TrainingConfig, seed: int, log_every: int) -> list[str]:
    """The --set values that give `scalenlp train` ``schedule`` (DDP on the CPU, no checkpoints)."""
    return ["training.device=cpu", "parallel.data_parallel=ddp", f"training.steps={schedule.steps}",
            f"training.global_batch_size={args.batch}", f"training.seq_len={args.seq_len}", f"training.lr={args.lr}",
            f"training.warmup_steps={schedule.warmup_steps}", f"training.min_lr_ratio={schedule.min_lr_ratio}",
            f"training.weight_decay={schedule.weight_decay}", f"training.beta2={schedule.beta2}",
            f"training.grad_clip={schedule.grad_clip}", f"model.dropout={args.dropout}", f"training.seed={seed}",
            f"training.log_every={log_every}", f"training.eval_every={schedule.steps}", "checkpoint.every=0",
            "checkpoint.export=false"]


def run_scalenlp(sets: list[str], nproc: int, run_dir: Path, score: str) -> dict:
    """`scalenlp train --nproc` with ``sets``, one thread a process: the seconds its steps took (start-up and
    evaluation left out), the wall time, the last logged loss and the last evaluation (the record with
    ``score``)."""
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", str(nproc)]
    for s in sets:
        cmd += ["--set", s]
    print("scalenlp:", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"scalenlp train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    counts = np.diff([0] + [r["step"] for r in steps])  # a record's step_time_s is the mean since the last one
    seconds = float(sum(n * r["step_time_s"] for n, r in zip(counts, steps)))
    return {"seconds": seconds, "wall": wall, "loss": steps[-1]["loss"], **[r for r in records if score in r][-1]}


def optimizer_step(model, optimizer, scheduler, loss) -> None:
    """The reference loop's update after a forward: backward, clip at 1.0, step, schedule, clear."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def print_table(rows: list[tuple[str, str, str]], other: str) -> None:
    """A markdown table of (figure, scalenlp's, ``other``'s) rows."""
    print(f"\n| {'':34} | {'scalenlp':>16} | {other:>16} |\n|{'-' * 36}|{'-' * 18}|{'-' * 18}|")
    for name, a, b in rows:
        print(f"| {name:34} | {a:>16} | {b:>16} |")
