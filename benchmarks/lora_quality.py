"""What LoRA learns against a full fine-tune, each through `scalenlp train --nproc 2`, in one run:

    OMP_NUM_THREADS=1 python benchmarks/lora_quality.py [--only facts|sst2] [--sst2-rows 8000]

- facts: the README demo (configs/demo.toml: SmolLM2-135M-Instruct under ZeRO-3 on made-up facts), in full as the
  demo runs it, and with LoRA (rank 16, alpha 32, every linear of the blocks, lr 1e-3) for ``--lora-steps`` steps;
  each asked the held-out wordings (configs/demo/facts_heldout.jsonl, `scalenlp eval --chat`): answers right.
- sst2: the packaged MiniLM fine-tuned for SST-2 sentiment on the first ``--sst2-rows`` rows of train.tsv (DDP,
  batch 32, seq_len 64), in full (lr 5e-5) and with LoRA (rank 16, alpha 32, lr 5e-4; the new classification head
  trains in full, as PEFT's modules_to_save), the same steps and rows; accuracy on all 872 dev sentences.

Each side's trained parameters and training seconds are printed beside its score.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from classify import head_rows
from scalenlp.models.packaged import packaged_model

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"
SCALENLP = [sys.executable, "-m", "scalenlp"]
LORA = ["lora.rank=16", "lora.alpha=32"]


def train(run: Path, *sets: str, config: Path | None = None) -> tuple[float, str]:
    """`scalenlp train --nproc 2` with ``config`` and these overrides: the seconds it took, and the parameters it
    trained as its start-up line says ("139.40M parameters (4.884M trained: LoRA)")."""
    start = time.perf_counter()
    cmd = [*SCALENLP, "train", "--nproc", "2", "--run-dir", str(run), *(["--config", str(config)] if config else [])]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    found = re.search(r"[\d.]+[MK] parameters( \([^)]*\))?", out.stderr)
    return time.perf_counter() - start, found.group(0) if found else "parameters not logged"


def facts(work: Path, lora_steps: int) -> None:
    smol, heldout = packaged_model("smollm2"), ROOT / "configs" / "demo" / "facts_heldout.jsonl"
    print(f"made-up facts: configs/demo.toml on SmolLM2-135M-Instruct, 2 processes, ZeRO-3; {heldout.name}")
    for name, sets in (("full", []), ("lora", [*LORA, "training.lr=1e-3", f"training.steps={lora_steps}"])):
        run = work / f"facts-{name}"
        seconds, params = train(run, f"model.init={smol}", *sets, config=ROOT / "configs" / "demo.toml")
        out = subprocess.run([*SCALENLP, "eval", "--checkpoint", str(run), "--chat", str(heldout), "--json"],
                             check=True, capture_output=True, text=True)
        score = json.loads(out.stdout.strip().splitlines()[-1])
        steps = next((s.split("=")[1] for s in sets if s.startswith("training.steps=")), "18")
        print(f"  {name:>4}: {score['correct']} of {score['total']} held-out answers right | {steps} steps, "
              f"{seconds:.0f} s | {params}")


def sst2(work: Path, rows: int) -> None:
    minilm, steps = packaged_model("minilm"), rows // 32
    train_rows = head_rows(SST2 / "train.tsv", work, rows)
    common = ["training.task=classification", f"model.init={minilm}", f"data.path={train_rows}",
              f"data.eval_path={SST2 / 'dev.tsv'}", "training.seq_len=64", "training.global_batch_size=32",
              f"training.steps={steps}", f"training.eval_every={steps}", "training.warmup_steps=10",
              "checkpoint.every=0"]
    print(f"SST-2: MiniLM, the first {rows:,} training rows ({steps} steps of 32), DDP over 2 processes; "
          f"accuracy on dev.tsv")
    scores = {}
    for name, sets in (("full", ["training.lr=5e-5"]), ("lora", [*LORA, "training.lr=5e-4"])):
        run = work / f"sst2-{name}"
        seconds, params = train(run, *common, *sets)
        last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        scores[name] = [r for r in last if "accuracy" in r][-1]["accuracy"]
        print(f"  {name:>4}: accuracy {scores[name]:.4f} | {seconds:.0f} s | {params}")
    print(f"  lora - full = {100 * (scores['lora'] - scores['full']):+.2f} points (goal: within 1.5)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("facts", "sst2"))
    parser.add_argument("--lora-steps", type=int, default=36, help="LoRA's steps on the facts (the demo's: 18)")
    parser.add_argument("--sst2-rows", type=int, default=8000)
    parser.add_argument("--work", type=Path, help="run folders go here (default: a temporary folder)")
    args = parser.parse_args()
    if args.only != "facts" and not (SST2 / "train.tsv").is_file():
        print(f"error: {SST2} is not here; run with --only facts", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.only != "sst2":
            facts(work, args.lora_steps)
        if args.only != "facts":
            sst2(work, args.sst2_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
