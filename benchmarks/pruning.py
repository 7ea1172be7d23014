"""Pruning SmolLM2-135M-Instruct: quality and decode speed of each method, measured in one run.

  python benchmarks/pruning.py [--checkpoint FILE] [--max-tokens 8192] [--calibration-samples 64]
                               [--structured-sparsity 0.5] [--recovery-steps 20] [--repeats 3]

Prints one table: WikiText-2 test perplexity (scalenlp eval's sliding windows over the first --max-tokens
tokens) of the dense model, magnitude 50%, Wanda 50%, 2:4 (Wanda's score) and structured pruning before
and after a short recovery fine-tune, each with its parameter count and decode tokens/s at batch 1 and 8
(the engine, fp32, greedy), dense and pruned runs interleaved --repeats times. Calibration and the
recovery fine-tune read WikiText-2's validation split, never the test split.

The recovery fine-tune is the normal trainer with the pruned export as ``model.init``:

  scalenlp train --run-dir RUN --set model.init=PRUNED_EXPORT --set data.path=wikitext2/valid.txt \\
      --set training.steps=20 --set training.lr=1e-4 ...      (the exact line is printed)

``prune_row`` and ``decode_tokens_per_sec`` are what benchmarks/compression.py reuses for its prune rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scalenlp.cli.evaluate import perplexity
from scalenlp.compress.calibration import calibration_batches
from scalenlp.compress.prune import prune
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import load
from scalenlp.models.io import save_pretrained
from scalenlp.models.packaged import packaged_model

DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents[1:] if (p / "shared" / "data").is_dir()),
            Path("shared/data")) / "wikitext2"
METHODS = (("magnitude 50%", "magnitude", 0.5), ("wanda 50%", "wanda", 0.5), ("2:4 (wanda score)", "2:4", 0.5))


def decode_tokens_per_sec(model, tokenizer, batch: int = 1, new_tokens: int = 64) -> float:
    """Greedy decode tokens/s of the engine on ``model`` for ``batch`` concurrent prompts."""
    engine = Engine(model, tokenizer, max_batch=batch, max_seq_len=new_tokens + 16).start()
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prompts = ["The history of the city begins"] * batch
        engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        engine.generate(prompts, params)
        return batch * new_tokens / (time.perf_counter() - start)
    finally:
        engine.stop()
        model.clear_kv_cache()


def prune_row(checkpoint, method: str, share: float, calibration, ids: list[int], seq: int = 512) -> dict:
    """One pruned model's figures: parameters and WikiText-2 perplexity (the model is returned for timing)."""
    model, _ = load(checkpoint)
    model = prune(model, method, share, calibration=calibration)
    return {"model": model, "params": model.num_params(), "ppl": perplexity(model, ids, seq, seq).perplexity}


def recover(export: Path, run_dir: Path, steps: int) -> Path:
    """A short fine-tune of a pruned export with the normal trainer; returns the run's export folder."""
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir),
           "--set", f"model.init={export}", "--set", f"data.path={DATA / 'valid.txt'}",
           "--set", f"training.steps={steps}", "--set", "training.lr=1e-4", "--set", "training.warmup_steps=3",
           "--set", "training.global_batch_size=4", "--set", "training.seq_len=128",
           "--set", "training.eval_every=0", "--set", "checkpoint.every=0", "--set", "training.log_every=10"]
    print("recovery:", " ".join(cmd[1:]).replace(sys.executable, "python"), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    return run_dir / "export"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=8192, help="test tokens scored per model")
    parser.add_argument("--calibration-samples", type=int, default=64)
    parser.add_argument("--structured-sparsity", type=float, default=0.5)
    parser.add_argument("--recovery-steps", type=int, default=20, help="0 skips the recovery fine-tune")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decode timings per model")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or packaged_model("smollm2")
    dense, pre = load(checkpoint)
    ids = pre.tokenizer.encode((DATA / "test.txt").read_text()).ids[:args.max_tokens]
    calibration = calibration_batches(DATA / "valid.txt", pre.tokenizer, args.calibration_samples, 128)
    rows = {"dense": {"model": dense, "params": dense.num_params(), "ppl": perplexity(dense, ids, 512, 512).perplexity}}
    for name, method, share in METHODS:
        rows[name] = prune_row(checkpoint, method, share, calibration, ids)
        del rows[name]["model"]  # same shapes as dense: its dense matmuls cost what dense's do
        gc.collect()
        print(name, f"{rows[name]['ppl']:.2f}", flush=True)
    structured = f"structured {args.structured_sparsity:.0%}"
    rows[structured] = prune_row(checkpoint, "structured", args.structured_sparsity, calibration, ids)
    if args.recovery_steps:
        with tempfile.TemporaryDirectory() as tmp:
            export = save_pretrained(rows[structured]["model"], Path(tmp) / "pruned", pre.tokenizer,
                                     tokenizer_config=pre.tokenizer_config)
            recovered, _ = load(recover(export, Path(tmp) / "run", args.recovery_steps))
        name = f"{structured} + {args.recovery_steps} recovery steps"
        rows[name] = {"model": recovered, "params": recovered.num_params(),
                      "ppl": perplexity(recovered, ids, 512, 512).perplexity}
    speeds = {(n, b): [] for n in ("dense", structured) for b in (1, 8)}  # recovery keeps the shapes
    for _ in range(args.repeats):  # interleaved: load from other processes hits both alike
        for (n, b), values in speeds.items():
            values.append(decode_tokens_per_sec(rows[n]["model"], pre.tokenizer, batch=b))
    print(f"\nSmolLM2-135M pruning | WikiText-2 test, first {len(ids):,} tokens, windows of 512 | calibration: "
          f"{args.calibration_samples} x 128 tokens of valid | fp32, {args.threads} thread(s), load average "
          f"{os.getloadavg()[0]:.1f} | decode: median of {args.repeats} interleaved runs, ratio to dense per pair")
    print(f"{'method':<40} {'parameters':>12} {'perplexity':>11} {'vs dense':>9} {'decode tok/s b1':>18} "
          f"{'decode tok/s b8':>18}")
    base = rows["dense"]["ppl"]
    for name, r in rows.items():
        timed_as = "dense" if name == "dense" else structured if name.startswith(structured) else None
        cells = []
        for b in (1, 8):
            if timed_as is None:
                cells.append("as dense")  # same shapes as dense: dense matmuls cost the same on CPU
                continue
            mine, dense_runs = speeds[(timed_as, b)], speeds[("dense", b)]
            ratio = statistics.median(x / d for x, d in zip(mine, dense_runs))
            cells.append(f"{statistics.median(mine):.1f}" + (f" ({ratio:.2f}x)" if timed_as != "dense" else ""))
        print(f"{name:<40} {r['params']:>12,} {r['ppl']:>11.2f} {r['ppl'] / base:>8.2f}x {cells[0]:>18} {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
