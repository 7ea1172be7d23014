"""Compression for inference, measured in one run: quantization and pruning of SmolLM2-135M-Instruct and of an
SST-2 classifier (MiniLM fine-tuned here), each beside the fp32 and bf16 baselines.

  python benchmarks/compression.py [--max-tokens 4096] [--seq 512] [--new-tokens 32] [--repeats 2]
                                   [--sst2-run RUN] [--sst2-rows 3200] [--skip-prune] [--recovery-steps 20]

SmolLM2 rows (every linear of its packaged GGUF file is Q4_1, 4-bit in blocks of 32, so fp32 is those weights
dequantized; the quantized rows round them again, except "GGUF Q4_1 codes as they are", which maps the file's own
codes onto the int4 kernel; "AWQ calibrated" is `scalenlp quantize --calibration` over ``--awq-samples`` windows of
512 tokens of WikiText-2 valid, its calibration time printed): WikiText-2 test perplexity (``scalenlp eval``'s
sliding windows, ``--seq`` tokens moving by ``--seq``, over the first ``--max-tokens`` tokens; floating layers in
fp32 as `scalenlp eval` runs by default, so a quantized row differs from fp32 by its quantization alone) and greedy
decode tokens/s through the engine at batch 1 and 8 (``--new-tokens`` each; the serving dtype: bf16 for the floating
layers of a quantized model, as `scalenlp serve --quantize` runs on this CPU). The decode timings of all rows are
interleaved ``--repeats`` times and the best kept, so load from other processes hits every row alike. Pruning rows
come from ``benchmarks/pruning.py``'s helpers (calibration on WikiText-2 validation); masked methods keep dense
shapes, so their speed is fp32's.

SST-2 rows: a MiniLM classifier fine-tuned by ``scalenlp train`` on the first ``--sst2-rows`` training rows
(or ``--sst2-run``, an existing run folder), scored on all of dev.tsv through the encoder engine (batches of
32 texts of similar length): accuracy and sentences/s.

Model bytes are the weights held in memory: every parameter and buffer but the RoPE tables and KV cache, each
storage once. int8dyn's fbgemm copy (for single tokens) is not a tensor and is not counted: the table says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from classify import head_rows
from pruning import DATA as WIKITEXT
from pruning import calibration_batches, prune_row, recover
from scalenlp.cli.evaluate import perplexity
from scalenlp.compress.awq import awq
from scalenlp.compress.quantized import Quantization, build_quantized
from scalenlp.data.labeled import read_labeled
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.encoder_engine import EncoderEngine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, load, read
from scalenlp.models.io import save_pretrained
from scalenlp.models.packaged import packaged_model

DATA = WIKITEXT.parent  # shared/data, found beside the repository or above it
# (row name, dtype of the floating layers when serving, quantization)
VARIANTS = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
            ("int8 weight-only", torch.bfloat16, Quantization("int8")),
            ("int4 weight-only, group 64", torch.bfloat16, Quantization("int4", 64)),
            ("int4 weight-only, group 32", torch.bfloat16, Quantization("int4", 32)),
            ("int8 dynamic", torch.bfloat16, Quantization("int8dyn"))]
# SmolLM2's packaged file stores its linears as GGUF Q4_1 blocks of 32: the rows above round its dequantized weights
# again (as for any float checkpoint); this one takes the file's 4-bit codes as they are.
GGUF_ROW = ("int4 group 32, GGUF Q4_1 codes as they are", torch.bfloat16, Quantization("int4", 32))
# `scalenlp quantize --calibration`: activation-aware scales and clipping (scalenlp.compress.awq) from WikiText-2 valid.
AWQ_ROW = ("int4 weight-only, group 64, AWQ calibrated", torch.bfloat16, Quantization("int4", 64))
PRUNE_METHODS = (("magnitude 50%", "magnitude", 0.5), ("wanda 50%", "wanda", 0.5), ("2:4 (wanda score)", "2:4", 0.5))
NOTES = {"int8 dynamic": "+ fbgemm's packed copy"}


def model_bytes(model: torch.nn.Module) -> int:
    tensors = [t for name, t in model.named_buffers() if "rope" not in name and ".cache." not in name]
    tensors += list(model.parameters())
    return sum({(t.untyped_storage().data_ptr(), t.dtype): t.untyped_storage().nbytes() for t in tensors}.values())


def decode_tokens_per_sec(engine: Engine, batch: int, new_tokens: int) -> float:
    """Greedy decode tokens/s of ``batch`` concurrent prompts. One engine per model for every batch size: the
    engine packs a bf16 model's weights in place, after which a second engine cannot set up its cache."""
    prompts = ["The history of the city begins"] * batch
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    return batch * new_tokens / (time.perf_counter() - start)


def awq_builder(pre, args):
    """AWQ_ROW's model in a given dtype, from one calibration of the file's weights as floats (timed: `scalenlp
    quantize --calibration` takes about as long)."""
    start = time.perf_counter()
    model = instantiate(pre, dtype=torch.float32)
    calibration = calibration_batches(DATA / "wikitext2" / "valid.txt", pre.tokenizer, args.awq_samples, 512)
    grams = awq(model, calibration, AWQ_ROW[2])
    state = model.state_dict()
    print(f"AWQ calibration: {args.awq_samples} x 512 tokens of WikiText-2 valid, "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return partial(build_quantized, pre.args, state, AWQ_ROW[2], True, grams=grams)


def sst2_run(args, tmp: Path) -> Path:
    """The classifier's run folder: ``--sst2-run``, or a short fine-tune with the normal trainer."""
    if args.sst2_run:
        return args.sst2_run
    train = head_rows(DATA / "sst2" / "train.tsv", tmp, args.sst2_rows)
    run_dir = tmp / "sst2-run"
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", "1"]
    for s in ["training.task=classification", f"model.init={packaged_model('minilm')}", f"data.path={train}",
              f"data.eval_path={DATA / 'sst2' / 'dev.tsv'}", "training.device=cpu", f"training.steps={args.sst2_rows // 32}",
              "training.global_batch_size=32", "training.seq_len=64", "training.lr=5e-5", "training.warmup_steps=5",
              "training.eval_every=0", "checkpoint.every=0", "training.log_every=10"]:
        cmd += ["--set", s]
    print("SST-2 fine-tune:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    return run_dir


def classifier_rows(args, tmp: Path) -> tuple[list[dict], str]:
    run = sst2_run(args, tmp)
    pre = read(run)
    dev = read_labeled(DATA / "sst2" / "dev.tsv", "text", "label", log=lambda _: None)
    engines = {}
    for name, dtype, spec in VARIANTS:
        model = instantiate(pre, dtype=dtype, quantize=spec)
        engines[name] = (EncoderEngine(model, pre.tokenizer, forward_batch=32).start(), model_bytes(model))
    rows = {name: {"name": name, "bytes": nbytes, "speed": [0.0]} for name, (_, nbytes) in engines.items()}
    for _ in range(args.repeats):
        for name, (engine, _) in engines.items():
            start = time.perf_counter()
            probabilities = engine.run("classify", dev.texts)
            rows[name]["speed"][0] = max(rows[name]["speed"][0], len(dev.texts) / (time.perf_counter() - start))
            predicted = [engine.labels[int(i)] for i in probabilities.argmax(-1)]
            rows[name]["quality"] = sum(p == t for p, t in zip(predicted, dev.labels)) / len(dev.labels)
    for engine, _ in engines.values():
        engine.stop()
    return list(rows.values()), f"SST-2 dev accuracy ({len(dev.texts)} rows) | classifier {run}"


def decoder_rows(args, tmp: Path) -> tuple[list[dict], str]:
    checkpoint = packaged_model("smollm2")
    pre = read(checkpoint)
    dequantized = dataclasses.replace(pre, blocks={})  # the file's weights as floats only: rounded again
    text = (DATA / "wikitext2" / "test.txt").read_text()
    ids = pre.tokenizer.encode(text).ids[:args.max_tokens]
    rows, timed = [], {}
    for name, dtype, spec in [*VARIANTS, GGUF_ROW, AWQ_ROW]:
        build = (awq_builder(pre, args) if name == AWQ_ROW[0] else
                 partial(instantiate, pre if name == GGUF_ROW[0] else dequantized, quantize=spec))
        # Quality with the floating layers in fp32 (bf16's own row excepted), as `scalenlp eval` measures.
        model = build(dtype=torch.bfloat16 if name == "bf16" else torch.float32)
        ppl = perplexity(model, ids, args.seq, args.seq).perplexity
        del model
        gc.collect()
        timed[name] = build(dtype=dtype)
        rows.append({"name": name, "quality": ppl, "bytes": model_bytes(timed[name])})
        print(f"{name}: perplexity {ppl:.3f}", flush=True)
    if not args.skip_prune:
        calibration = calibration_batches(DATA / "wikitext2" / "valid.txt", pre.tokenizer, args.calibration_samples, 128)
        for name, method, share in PRUNE_METHODS:
            row = prune_row(checkpoint, method, share, calibration, ids, args.seq)
            rows.append({"name": f"pruned {name}", "quality": row["ppl"], "bytes": model_bytes(row["model"]),
                         "same_speed_as": "fp32"})
            print(f"pruned {name}: perplexity {row['ppl']:.3f}", flush=True)
            del row
            gc.collect()
        row = prune_row(checkpoint, "structured", args.structured_sparsity, calibration, ids, args.seq)
        name = f"pruned structured {args.structured_sparsity:.0%}"
        rows.append({"name": name, "quality": row["ppl"], "bytes": model_bytes(row["model"])})
        timed[name] = row["model"]
        if args.recovery_steps:
            export = save_pretrained(row["model"], tmp / "pruned", pre.tokenizer, tokenizer_config=pre.tokenizer_config)
            recovered, _ = load(recover(export, tmp / "recovery-run", args.recovery_steps))
            name = f"{name} + {args.recovery_steps} recovery steps"
            rows.append({"name": name, "quality": perplexity(recovered, ids, args.seq, args.seq).perplexity,
                         "bytes": model_bytes(recovered)})
            timed[name] = recovered
    engines = {name: Engine(model, pre.tokenizer, max_batch=8, max_seq_len=args.new_tokens + 16).start()
               for name, model in timed.items()}
    speeds = {name: [0.0, 0.0] for name in timed}
    for _ in range(args.repeats):  # interleaved, best kept
        for name, engine in engines.items():
            for i, batch in enumerate((1, 8)):
                speeds[name][i] = max(speeds[name][i], decode_tokens_per_sec(engine, batch, args.new_tokens))
    for engine in engines.values():
        engine.stop()
    for row in rows:
        row["speed"] = speeds.get(row.get("same_speed_as", row["name"]))
    return rows, (f"WikiText-2 test perplexity, first {len(ids):,} tokens, windows of {args.seq} moving by {args.seq} "
                  f"| decode: {args.new_tokens} new tokens per sequence")


def print_table(title: str, rows: list[dict], quality: str, speed_columns: list[str]) -> None:
    """A markdown table: each row beside the first (fp32)."""
    base = rows[0]
    print(f"\n{title}")
    header = [f"{'method':<44}", f"{'model MiB':>9}", f"{quality:>10}", f"{'vs fp32':>8}"]
    header += [f"{c:>20}" for c in speed_columns] + ["note"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in header) + "|")
    for row in rows:
        change = row["quality"] / base["quality"] - 1
        cells = [f"{row['name']:<44}", f"{row['bytes'] / 2**20:>9.1f}", f"{row['quality']:>10.4f}",
                 f"{change:>+8.2%}" if row is not base else f"{'':>8}"]
        for i, _ in enumerate(speed_columns):
            value = row["speed"][i] if row.get("speed") else None
            cells.append(f"{value:>9.1f} ({value / base['speed'][i]:>5.2f}x)".rjust(20) if value else f"{'-':>20}")
        cells.append(NOTES.get(row["name"], "") + ("same shapes as fp32: its speed" if row.get("same_speed_as") else ""))
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=4096, help="WikiText-2 test tokens scored per model")
    parser.add_argument("--seq", type=int, default=512, help="perplexity window (and stride)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per sequence when timing")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved timings per row (best kept)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sst2-run", type=Path, default=None, help="an SST-2 classifier run folder to reuse")
    parser.add_argument("--sst2-rows", type=int, default=3200, help="training rows of the short fine-tune")
    parser.add_argument("--skip-prune", action="store_true", help="quantization rows only")
    parser.add_argument("--calibration-samples", type=int, default=64)
    parser.add_argument("--awq-samples", type=int, default=32, help="AWQ calibration windows of 512 tokens")
    parser.add_argument("--structured-sparsity", type=float, default=0.5)
    parser.add_argument("--recovery-steps", type=int, default=20, help="0 skips the recovery fine-tune")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        decoder, decoder_setup = decoder_rows(args, tmp)
        gc.collect()
        classifier, classifier_setup = classifier_rows(args, tmp)
    print(f"\nCompression, measured in one run ({time.perf_counter() - start:.0f} s) | {args.threads} thread(s) | "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs | torch {torch.__version__}")
    print_table(f"SmolLM2-135M-Instruct | {decoder_setup}", decoder, "perplexity",
                ["decode tok/s, b1", "decode tok/s, b8"])
    print_table(f"MiniLM SST-2 classifier | {classifier_setup}", classifier, "accuracy", ["sentences/s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
