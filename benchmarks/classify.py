"""Fine-tuning all-MiniLM-L6-v2 for SST-2 sentiment: `scalenlp train --nproc 2` (DDP) beside a plain Hugging Face
loop (AutoModelForSequenceClassification from the same folder, one process), on the same rows, measured in one run.

    python benchmarks/classify.py [--data ../shared/data/sst2] [--rows N] [--batch 32] [--seq-len 64] [--lr 5e-5]

Both sides train on the first ``--rows`` rows of train.tsv (default: all 67,349, one epoch), ``rows // batch``
steps of ``--batch`` rows (the rows that do not fill a last batch are dropped), each batch padded to its longest
row (truncated at ``--seq-len`` tokens), in fp32, with the same AdamW (decay on matrices only), warm-up + cosine
schedule, gradient clipping at 1.0 and dropout; then both score every row of dev.tsv. scalenlp runs 2 processes
of 1 thread each (DDP, gloo); the HF loop runs in 1 process with 2 threads. The HF loop trains half its steps
before the scalenlp run and half after, so a change in the machine's load during the run affects both sides.

Samples/s counts training steps only (batching, forward, backward, clipping, optimizer), not start-up, tokenizing
or evaluation: scalenlp's from its metrics.jsonl, the HF loop's timed the same way here. scalenlp batches rows of
similar length together (length bucketing) and the HF loop batches them in random order, so the table also gives
the mean padded width of a batch on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from scalenlp.config import TrainingConfig
from scalenlp.data.labeled import label_ids, label_names, read_labeled
from scalenlp.models.packaged import packaged_model
from scalenlp.train.optim import build_scheduler, param_groups

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"
MINILM = packaged_model("minilm")
SEED = 1234
# scalenlp writes a metrics record every this many steps (each record's all-reduce of the loss costs a little).
LOG_EVERY = 10


def head_rows(source: Path, folder: Path, rows: int) -> Path:
    """``source`` itself, or its header and first ``rows`` rows (line endings kept) when that is fewer."""
    lines = source.read_bytes().splitlines(keepends=True)
    if rows >= len(lines) - 1:
        return source
    out = folder / source.name
    out.write_bytes(b"".join(lines[:rows + 1]))
    return out


class HFLoop:
    """A plain transformers fine-tuning loop, run in parts so that it can bracket the scalenlp run."""

    def __init__(self, args, train: Path, dev: Path, schedule: TrainingConfig):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # heavy, optional

        examples = read_labeled(train, "sentence", "label", log=lambda _: None)
        self.labels = label_names(examples.labels)
        dev_examples = read_labeled(dev, "sentence", "label", log=lambda _: None)
        self.tokenizer = AutoTokenizer.from_pretrained(MINILM)
        self.train = self._tokenized(examples.texts, label_ids(examples, self.labels), args.seq_len)
        self.dev = self._tokenized(dev_examples.texts, label_ids(dev_examples, self.labels), args.seq_len)
        torch.manual_seed(SEED)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            MINILM, num_labels=len(self.labels), hidden_dropout_prob=args.dropout,
            attention_probs_dropout_prob=args.dropout, attn_implementation="sdpa").train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, schedule.weight_decay), lr=schedule.lr,
                                           betas=(schedule.beta1, schedule.beta2), eps=1e-8, foreach=True)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        rows = np.random.default_rng(SEED).permutation(len(self.train))[:schedule.steps * args.batch]
        self.batches = rows.reshape(schedule.steps, args.batch)
        self.step, self.seconds, self.widths, self.losses = 0, 0.0, [], []

    def _tokenized(self, texts: list[str], labels: np.ndarray, seq_len: int) -> list[dict]:
        encoded = self.tokenizer(texts, truncation=True, max_length=seq_len)
        return [{**{k: v[i] for k, v in encoded.items()}, "labels": int(labels[i])} for i in range(len(texts))]

    def _batch(self, rows, data: list[dict]) -> dict[str, torch.Tensor]:
        return self.tokenizer.pad([data[i] for i in rows], return_tensors="pt")  # to the longest row

    def train_steps(self, n: int) -> None:
        for rows in self.batches[self.step:self.step + n]:
            start = time.perf_counter()
            batch = self._batch(rows, self.train)
            loss = self.model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.seconds += time.perf_counter() - start
            self.widths.append(batch["input_ids"].shape[1])
            self.losses.append(loss.item())
            self.step += 1

    @torch.no_grad()
    def accuracy(self, batch: int) -> float:
        self.model.eval()
        order = np.argsort([len(r["input_ids"]) for r in self.dev], kind="stable")
        right = 0
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            b = self._batch(rows, self.dev)
            right += int((self.model(**b).logits.argmax(-1) == b["labels"]).sum())
        self.model.train()
        return right / len(self.dev)


def run_scalenlp(args, train: Path, dev: Path, schedule: TrainingConfig, run_dir: Path) -> dict:
    sets = ["training.task=classification", f"model.init={MINILM}", f"data.path={train}", f"data.eval_path={dev}",
            "training.device=cpu", "parallel.data_parallel=ddp", f"training.steps={schedule.steps}",
            f"training.global_batch_size={args.batch}", f"training.seq_len={args.seq_len}", f"training.lr={args.lr}",
            f"training.warmup_steps={schedule.warmup_steps}", f"training.min_lr_ratio={schedule.min_lr_ratio}",
            f"training.weight_decay={schedule.weight_decay}", f"training.beta2={schedule.beta2}",
            f"training.grad_clip={schedule.grad_clip}", f"model.dropout={args.dropout}", f"training.seed={SEED}",
            f"training.log_every={LOG_EVERY}", f"training.eval_every={schedule.steps}", "checkpoint.every=0",
            "checkpoint.export=false"]
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", str(args.nproc)]
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
    train_records = [r for r in records if "loss" in r]
    # Each record averages the steps since the one before it.
    steps = np.diff([0] + [r["step"] for r in train_records])
    seconds = float(sum(n * r["step_time_s"] for n, r in zip(steps, train_records)))
    tokens = sum(n * r["step_time_s"] * r["tokens_per_sec"] for n, r in zip(steps, train_records))
    final = [r for r in records if "accuracy" in r][-1]
    return {"seconds": seconds, "wall": wall, "width": tokens / (schedule.steps * args.batch),
            "loss": train_records[-1]["loss"], **final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="the SST-2 folder (default: ../shared/data/sst2)")
    parser.add_argument("--rows", type=int, default=None, help="train on the first N rows (default: all, one epoch)")
    parser.add_argument("--batch", type=int, default=32, help="global batch size, both sides")
    parser.add_argument("--seq-len", type=int, default=64, help="longest row in tokens (longer ones are truncated)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=float, default=0.06, help="warm-up steps, as a fraction of the steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    parser.add_argument("--nproc", type=int, default=2, help="scalenlp DDP processes (1 thread each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the HF loop (1 process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train = head_rows(args.data / "train.tsv", tmp, args.rows or sys.maxsize)
        dev = args.data / "dev.tsv"
        file_rows = len((args.data / "train.tsv").read_bytes().splitlines()) - 1
        rows = len(train.read_bytes().splitlines()) - 1
        steps = rows // args.batch
        schedule = TrainingConfig(steps=steps, global_batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,
                                  warmup_steps=max(1, round(args.warmup * steps)), min_lr_ratio=0.0,
                                  weight_decay=args.weight_decay, beta2=0.999, grad_clip=1.0)
        print(f"MiniLM ({MINILM}) on SST-2: {rows:,} of {file_rows:,} train rows, {steps} steps of {args.batch}, "
              f"seq_len {args.seq_len}, lr {args.lr} (AdamW betas 0.9/0.999, wd {args.weight_decay} on matrices, "
              f"{schedule.warmup_steps} warm-up steps, cosine to 0), dropout {args.dropout}, fp32, grad clip 1.0",
              flush=True)

        hf = HFLoop(args, train, dev, schedule)
        hf.train_steps(steps // 2)
        print(f"HF loop: first {hf.step} steps, {hf.step * args.batch / hf.seconds:.1f} samples/s", flush=True)
        first_half = (hf.step, hf.seconds)
        ours = run_scalenlp(args, train, dev, schedule, tmp / "run")
        print(f"scalenlp: {steps * args.batch / ours['seconds']:.1f} samples/s, {ours['wall']:.0f} s wall in all",
              flush=True)
        hf.train_steps(steps - hf.step)
        second = (hf.step - first_half[0]) * args.batch / (hf.seconds - first_half[1])
        print(f"HF loop: last {hf.step - first_half[0]} steps, {second:.1f} samples/s", flush=True)
        hf_accuracy = hf.accuracy(128)

    trained = steps * args.batch
    ours_rate, hf_rate = trained / ours["seconds"], trained / hf.seconds
    rows_out = [
        ("rows trained", f"{trained:,}", f"{trained:,}"),
        ("epochs (of the whole train file)", f"{trained / file_rows:.3f}", f"{trained / file_rows:.3f}"),
        ("processes x threads", f"{args.nproc} x 1 (DDP)", f"1 x {args.threads}"),
        ("training samples/s", f"{ours_rate:.1f}", f"{hf_rate:.1f}"),
        ("mean padded width (tokens)", f"{ours['width']:.1f}", f"{np.mean(hf.widths):.1f}"),
        ("padded tokens/s", f"{ours_rate * ours['width']:,.0f}", f"{hf_rate * np.mean(hf.widths):,.0f}"),
        ("final train loss (last 10 steps)", f"{ours['loss']:.4f}", f"{np.mean(hf.losses[-LOG_EVERY:]):.4f}"),
        ("dev accuracy", f"{ours['accuracy']:.4f}", f"{hf_accuracy:.4f}"),
        ("dev macro-F1", f"{ours['macro_f1']:.4f}", "-"),
    ]
    print(f"\n| {'':34} | {'scalenlp':>16} | {'HF loop':>16} |\n|{'-' * 36}|{'-' * 18}|{'-' * 18}|")
    for name, a, b in rows_out:
        print(f"| {name:34} | {a:>16} | {b:>16} |")
    print(f"\nsamples/s ratio scalenlp / HF: {ours_rate / hf_rate:.2f}x (goal >= 1.0x); dev accuracy goal >= 0.87 "
          f"after one full epoch")


if __name__ == "__main__":
    main()
