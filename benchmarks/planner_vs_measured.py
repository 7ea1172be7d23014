"""The planner's predictions beside real `scalenlp train` runs on this machine.

For each model flavor and layout: measure this CPU (as `scalenlp plan --device cpu` does), predict the
step time and rank 0's peak memory, run the `scalenlp train` line the planner prints for that layout,
and read what the run measured (<run_dir>/metrics.jsonl: step_time_s and peak_mem_bytes, the resident
set on CPU). A run lasts at least --min-seconds by the prediction (fast layouts take more steps); the
measured step time is the median over its logging windows, the first (warm-up, allocator growth)
skipped. The CPU is measured right before and right after each run and the two predictions averaged:
on a shared machine what a core delivers drifts with everyone else's load, and the run sits between
the two measurements.

    python benchmarks/planner_vs_measured.py [--flavors debug,small] [--layouts single,ddp2,zero3x2,tp2,pp2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every process gets one core, the planner measures one thread

from scalenlp.layout import Layout  # noqa: E402
from scalenlp.plan.cost import Workload, memory_by_stage, model_shape, predict  # noqa: E402
from scalenlp.plan.measure import measure_cpu  # noqa: E402
from scalenlp.plan.planner import train_command  # noqa: E402
from scalenlp.plan.search import check_layout  # noqa: E402

SEQ, GLOBAL_BATCH = 128, 16
LAYOUTS = {
    "single": Layout(microbatch=16),
    "ddp2": Layout(dp_replicate=2, microbatch=8),
    "zero3x2": Layout(dp_shard=2, zero=3, microbatch=8),
    "tp2": Layout(tp=2, microbatch=16),
    "pp2": Layout(pp=2, microbatch=8),
}


def run_training(command: str, run_dir: Path, steps: int, log_every: int) -> list[dict]:
    words = shlex.split(command)
    assert words[:2] == ["scalenlp", "train"]
    extra = {"training.steps": steps, "training.log_every": log_every, "training.eval_every": 0,
             "checkpoint.every": 0, "checkpoint.export": "false", "training.device": "cpu"}
    argv = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), *words[2:]]
    for key, value in extra.items():
        argv += ["--set", f"{key}={value}"]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or line.startswith("error")]
        raise RuntimeError(errors[0].strip() if errors else done.stderr[-300:])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step_time_s" in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", default="debug,small")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--min-seconds", type=float, default=8.0,
                        help="run at least this long (by the prediction): more steps for fast layouts")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="planner_vs_measured_") as tmp:
        for flavor in args.flavors.split(","):
            shape = model_shape(flavor, SEQ)
            work = Workload(seq=SEQ, global_batch=GLOBAL_BATCH, precision="fp32")
            for name in args.layouts.split(","):
                layout = LAYOUTS[name]
                problems = check_layout(shape, work, layout, layout.devices, layout.devices)
                if problems:
                    rows.append((flavor, name, None, problems[0][1]))
                    continue
                measured = measure_cpu(processes=layout.devices)
                before = predict(shape, work, layout, measured, layout.devices)
                command = train_command(shape, work, layout, layout.devices, layout.devices)
                # Short steps get more of them, so that every run measures about as long (the noise of a shared
                # machine averages out over time, not over a step count).
                windows = max(args.steps, math.ceil(args.min_seconds / before.step_time_s)) // args.log_every
                try:
                    records = run_training(command, Path(tmp) / f"{flavor}-{name}", windows * args.log_every,
                                           args.log_every)[1:]
                except RuntimeError as e:
                    rows.append((flavor, name, None, f"the training run failed: {e}"))
                    continue
                after = predict(shape, work, layout, measure_cpu(processes=layout.devices), layout.devices)
                predicted_step = (before.step_time_s + after.step_time_s) / 2
                # Rank 0 writes the metrics: with a pipeline, the first stage's memory, not the largest stage's.
                predicted_mem = sum(memory_by_stage(shape, work, layout, measured)[0].values())
                measured_step = statistics.median(r["step_time_s"] for r in records)
                measured_mem = max(r["peak_mem_bytes"] for r in records)
                rows.append((flavor, name, (predicted_step, (before.step_time_s, after.step_time_s), measured_step,
                                            predicted_mem, measured_mem), command))
                parts = {k: round((before.time_breakdown_s[k] + after.time_breakdown_s[k]) / 2, 4)
                         for k in before.time_breakdown_s if before.time_breakdown_s[k]}
                print(f"{flavor} {name}: predicted {predicted_step:.3f} s ({before.step_time_s:.3f} before the run, "
                      f"{after.step_time_s:.3f} after; {parts}), {predicted_mem / 2**20:.0f} MiB; "
                      f"measured {measured_step:.3f} s, {measured_mem / 2**20:.0f} MiB", file=sys.stderr)

    print(f"\nseq {SEQ}, global batch {GLOBAL_BATCH}, fp32, one thread per process; memory = rank 0's peak "
          "resident set\n")
    header = (f"{'flavor':<8} {'layout':<9} {'step s pred':>11} {'(before, after)':>16} {'step s meas':>11} "
              f"{'error':>7} {'MiB pred':>9} {'MiB meas':>9} {'error':>7}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for flavor, name, figures, note in rows:
        if figures is None:
            print(f"{flavor:<8} {name:<9} not run: {note}")
            continue
        ps, (pb, pa), ms, pm, mm = figures
        worst = max(worst, abs(ps / ms - 1), abs(pm / mm - 1))
        print(f"{flavor:<8} {name:<9} {ps:>11.3f} {f'({pb:.3f}, {pa:.3f})':>16} {ms:>11.3f} {ps / ms - 1:>+7.1%} "
              f"{pm / 2**20:>9.0f} {mm / 2**20:>9.0f} {pm / mm - 1:>+7.1%}")
    print(f"\nlargest error: {worst:.1%} (target: within 25%). The step-time prediction averages the CPU measured "
          "before and after the run (both in brackets): their spread is what other load on this machine moves.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
