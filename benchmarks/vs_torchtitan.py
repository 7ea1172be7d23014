"""scalenlp against torchtitan on one machine: tokens/s, loss and peak memory per process, side by side.

    python benchmarks/vs_torchtitan.py --work /tmp/titan-work [--steps 20] [--rounds 1] [--rows fp32,bf16,fsdp] [--compile]

Drives the shared peer (../shared/peers/torchtitan: torchtitan 0.3.0's llama3 debug model, 6.16M
parameters, sequence 2048, batch 8, its test tokenizer, the substitute text): ``--work`` holds the
peer's venv and data as its README sets them up. Each round runs every row for both trainers, one
after the other (interleaved, so the machine's load falls on both alike), and the table shows each
round's figures:
- tok/s: wall-clock tokens per second over steps 4..N (both trainers' first steps warm up);
- loss at step N (both deterministic, same seed; the data order is each trainer's own);
- peak RSS: the largest resident set of any process of the run (getrusage of a wrapper's children).
The load average before each run is printed beside it: on a shared machine the ratios are the figure.
Both trainers run eager (torchtitan's configs leave compile off), or with ``--compile`` both compile each
transformer block (scalenlp's training.compile, torchtitan's --compile.enable, which also compiles its loss);
the table's title says which.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT.parent / "shared" / "peers" / "torchtitan"  # where the repo sits beside shared/, as in CI
SEQ, BATCH = 2048, 8

# row -> (processes, threads per process, parameter dtype)
ROWS = {"fp32": (1, 2, "float32"), "bf16": (1, 2, "bfloat16"), "fsdp": (2, 1, "float32")}
LABELS = {"fp32": "1 process x 2 threads, fp32", "bf16": "1 process x 2 threads, bf16",
          "fsdp": "2 processes x 1 thread, FSDP / ZeRO-3, fp32"}

# Runs a command and prints the largest peak RSS (KiB) of its descendants as the last line.
_RSS_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def run_measured(cmd: list[str], env: dict, log: Path) -> int:
    """Run ``cmd`` with output to ``log``; the peak RSS in bytes of its largest process."""
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, *cmd], env=env, stdout=subprocess.PIPE,
                              stderr=f, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}); see {log}")
    return int(proc.stdout.strip().splitlines()[-1]) * 1024


def throughput(walls: dict[int, float], last: int) -> float:
    """Tokens/s between the ends of step 3 and step ``last``."""
    return SEQ * BATCH * (last - 3) / (walls[last] - walls[3])


def titan_run(peer: Path, work: Path, row: str, steps: int, name: str, compiled: bool) -> dict:
    procs, threads, dtype = ROWS[row]
    log = work / "logs" / f"{name}.log"
    env = dict(os.environ, WORK=str(work))
    cmd = ["bash", str(peer / "run_bench.sh"), name, str(procs), str(BATCH // procs), str(threads),
           "--training.steps", str(steps), "--training.mixed-precision-param", dtype,
           *(["--compile.enable"] if compiled else []), "activation-checkpoint:none"]  # the subcommand comes last
    rss = run_measured(cmd, env, work / f"{name}.wrapper.log")
    pattern = re.compile(r"\[titan\] (\S+ \S+) - root - INFO - step:\s+(\d+)\s+loss:\s+([\d.]+)")
    walls, losses = {}, {}
    for line in log.read_text().splitlines():
        m = pattern.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            step = int(m.group(2))
            walls[step] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            losses[step] = float(m.group(3))
    return {"tok_s": throughput(walls, steps), "loss": losses[steps], "rss": rss}


def scalenlp_run(peer: Path, work: Path, row: str, steps: int, name: str, data: Path, compiled: bool) -> dict:
    procs, threads, dtype = ROWS[row]
    run_dir = work / "scalenlp-runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = ["model.flavor=titan-debug", "model.vocab_size=2048", f"tokenizer.path={peer / 'assets' / 'tokenizer'}",
            f"data.path={data}", f"data.cache_dir={work / 'scalenlp-token-cache'}",
            f"training.seq_len={SEQ}", f"training.global_batch_size={BATCH}", f"training.steps={steps}",
            # torchtitan's debug-model recipe: AdamW 8e-4, 2 warm-up steps, decay to 0, clip 1, seed 42.
            "training.lr=8e-4", "training.warmup_steps=2", "training.min_lr_ratio=0", "training.seed=42",
            "training.log_every=1", "training.eval_every=0", "checkpoint.every=0", "checkpoint.export=false",
            f"training.param_dtype={dtype}", f"training.compile={str(compiled).lower()}"]
    if procs > 1:
        sets.append("parallel.data_parallel=zero3")
    args = [a for s in sets for a in ("--set", s)]
    driver = [str(peer / "scalenlp_titan_flavor.py"), "--run-dir", str(run_dir), *args]
    launch = [sys.executable, *driver] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", *driver]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    env.pop("WORLD_SIZE", None)
    rss = run_measured(launch, env, work / f"{name}.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if "loss" in r}
    return {"tok_s": throughput({s: r["wall"] for s, r in records.items()}, steps), "loss": records[steps]["loss"],
            "rss": rss, "mfu": records[steps]["mfu"], "peak_source": records[steps]["peak_source"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("WORK", "titan-work")),
                        help="the peer's WORK folder (venv/, pydoc_text/data.json)")
    parser.add_argument("--peer", type=Path, default=PEER, help="the shared peer's folder")
    parser.add_argument("--steps", type=int, default=20, help="steps per run; 200 for the longer loss comparison")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--compile", action="store_true", help="both trainers compile each transformer block")
    args = parser.parse_args()
    work = args.work.resolve()
    if not (work / "venv" / "bin" / "torchrun").exists():
        print(f"error: {work}/venv has no torchtitan; set it up as {args.peer}/README.md says", file=sys.stderr)
        return 2
    (work / "logs").mkdir(exist_ok=True)
    # scalenlp reads .jsonl; the peer's substitute data is JSON lines named data.json.
    data = work / "pydoc_text" / "data.jsonl"
    if not data.exists():
        data.symlink_to("data.json")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    results = []
    for rnd in range(args.rounds):
        for row in rows:
            for trainer in ("torchtitan", "scalenlp"):
                load = os.getloadavg()[0]
                name = f"{trainer}-{row}-{rnd}"
                out = (titan_run(args.peer, work, row, args.steps, name, args.compile) if trainer == "torchtitan"
                       else scalenlp_run(args.peer, work, row, args.steps, name, data, args.compile))
                results.append({"round": rnd, "row": row, "trainer": trainer, "load": load, **out})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print("\nboth trainers " + ("compiled (per transformer block)" if args.compile else "eager"))
    print(f"{'config':<46}{'round':>6}{'torchtitan tok/s':>18}{'scalenlp tok/s':>16}{'ratio':>7}"
          f"{f'loss@{args.steps} tt':>13}{'scalenlp':>10}{'peak RSS tt':>13}{'scalenlp':>10}{'load':>11}")
    for rnd in range(args.rounds):
        for row in rows:
            tt, sn = (next(r for r in results if (r["round"], r["row"], r["trainer"]) == (rnd, row, t))
                      for t in ("torchtitan", "scalenlp"))
            print(f"{LABELS[row]:<46}{rnd:>6}{tt['tok_s']:>18,.0f}{sn['tok_s']:>16,.0f}{sn['tok_s'] / tt['tok_s']:>7.2f}"
                  f"{tt['loss']:>13.3f}{sn['loss']:>10.3f}{tt['rss'] / 2**30:>10.2f} GiB{sn['rss'] / 2**30:>6.2f} GiB"
                  f"{tt['load']:>5.1f}/{sn['load']:.1f}")
    print(f"\nscalenlp's MFU peak: {results[-1]['peak_source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
