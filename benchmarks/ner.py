"""Fine-tuning all-MiniLM-L6-v2 for named entities on WNUT-17: `scalenlp train --nproc 2` (DDP,
training.task=token_classification) beside a plain transformers loop (AutoModelForTokenClassification from the same
folder, one process, the run_ner recipe), on the same sentences, measured in one run.

    python benchmarks/ner.py [--data ../shared/data/wnut17] [--steps 150] [--batch 16] [--lr 1e-4]
                             [--seed 1234[,7,...]]

Both sides take the same ``--steps`` batches of ``--batch`` sentences of train.conll in the order of a seeded
permutation on the HF side and scalenlp's own shuffled, length-bucketed order on the other; each sentence's words
tokenized as pre-split words, the tag on each word's first sub-token (-100 on the others and on special tokens),
padded to the longest of its batch; fp32, the same AdamW (decay on matrices only), warm-up + cosine schedule,
gradient clipping at 1.0 and dropout. ``--seq-len`` (128) holds every WNUT sentence, so a window is a sentence on
both sides. Then both tag every sentence of dev.conll and are scored at the entity level: scalenlp by its own
metrics.jsonl record, the HF loop by the seqeval package (exact span and type, micro-averaged). scalenlp runs 2
processes of 1 thread each (gloo); the HF loop 1 process of 2 threads. The HF loop trains half its steps before
the scalenlp run and half after, so a change in the machine's load during the run affects both sides.

Entity F1 on WNUT's dev set moves by a point or two from seed to seed on either side (the new head's init, dropout,
data order), so one seed cannot tell the two recipes apart: with several seeds the script ends with the mean F1 of
each side and the mean paired difference with its standard error. With dropout off, the same head init and the same
batches, the two train alike (tests/unit/test_tagging_task.py checks the losses step by step).

Samples/s counts training steps only (batching, forward, backward, clipping, optimizer), not start-up, tokenizing
or evaluation: scalenlp's from its metrics.jsonl, the HF loop's timed the same way here.
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

from scalenlp.config import DataConfig, TrainingConfig
from scalenlp.data.tags import read_tagged, tag_names
from scalenlp.models.packaged import packaged_model
from scalenlp.train.optim import build_scheduler, param_groups

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wnut17"
MINILM = packaged_model("minilm")
LOG_EVERY = 10  # steps between scalenlp's metrics records


class TransformersLoop:
    """transformers' token-classification recipe as a plain loop, run in parts so that it can bracket scalenlp's."""

    def __init__(self, args, train: Path, dev: Path, schedule: TrainingConfig):
        from transformers import AutoModelForTokenClassification, AutoTokenizer  # heavy, optional

        quiet = lambda _: None  # noqa: E731 - both files are read again, and reported, by scalenlp
        self.train_sentences, self.dev_sentences = read_tagged(train, quiet), read_tagged(dev, quiet)
        self.labels = tag_names(self.train_sentences)
        self.tokenizer = AutoTokenizer.from_pretrained(MINILM)
        self.train = self._aligned(self.train_sentences, args.seq_len)
        self.dev = self._aligned(self.dev_sentences, args.seq_len)
        torch.manual_seed(args.seed)
        self.model = AutoModelForTokenClassification.from_pretrained(
            MINILM, num_labels=len(self.labels), id2label=dict(enumerate(self.labels)),
            label2id={t: i for i, t in enumerate(self.labels)}, hidden_dropout_prob=args.dropout,
            attention_probs_dropout_prob=args.dropout, attn_implementation="sdpa").train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, schedule.weight_decay), lr=schedule.lr,
                                           betas=(schedule.beta1, schedule.beta2), eps=1e-8, foreach=True)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        rng = np.random.default_rng(args.seed)
        epochs = -(-schedule.steps * args.batch // len(self.train))
        order = np.concatenate([rng.permutation(len(self.train)) for _ in range(epochs)])
        self.batches = order[:schedule.steps * args.batch].reshape(schedule.steps, args.batch)
        self.step, self.seconds, self.losses = 0, 0.0, []

    def _aligned(self, sentences, seq_len: int) -> list[dict]:
        """run_ner's tokenize_and_align_labels: each word's tag on its first sub-token, -100 elsewhere (an eval tag
        training never saw also -100; it cannot be predicted, and the scoring below still counts it)."""
        index = {t: i for i, t in enumerate(self.labels)}
        encoded = self.tokenizer(sentences.words, is_split_into_words=True, truncation=True, max_length=seq_len)
        rows = []
        for i, tags in enumerate(sentences.tags):
            word_ids, before, labels = encoded.word_ids(i), None, []
            for w in word_ids:
                labels.append(-100 if w is None or w == before else index.get(tags[w], -100))
                before = w
            rows.append({"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i],
                         "labels": labels, "word_ids": word_ids})
        return rows

    def _batch(self, rows, data: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(data[i]["input_ids"]) for i in rows)
        batch = {key: torch.full((len(rows), width), fill, dtype=torch.long)
                 for key, fill in (("input_ids", self.tokenizer.pad_token_id), ("attention_mask", 0), ("labels", -100))}
        for r, i in enumerate(rows):
            for key in batch:
                batch[key][r, :len(data[i][key])] = torch.tensor(data[i][key])
        return batch

    def train_steps(self, n: int) -> None:
        for rows in self.batches[self.step:self.step + n]:
            start = time.perf_counter()
            loss = self.model(**self._batch(rows, self.train)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.seconds += time.perf_counter() - start
            self.losses.append(loss.item())
            self.step += 1

    @torch.no_grad()
    def entity_f1(self, batch: int) -> dict[str, float]:
        """seqeval's micro precision, recall and F1 on the dev sentences, each word tagged by its first sub-token."""
        from seqeval.metrics import f1_score, precision_score, recall_score

        self.model.eval()
        predicted = []
        for start in range(0, len(self.dev), batch):
            rows = list(range(start, min(start + batch, len(self.dev))))
            logits = self.model(**{k: v for k, v in self._batch(rows, self.dev).items() if k != "labels"}).logits
            for r, i in enumerate(rows):
                words, before = ["O"] * len(self.dev_sentences.words[i]), None
                for position, w in enumerate(self.dev[i]["word_ids"]):
                    if w is not None and w != before:
                        words[w] = self.labels[int(logits[r, position].argmax())]
                    before = w
                predicted.append(words)
        self.model.train()
        gold = self.dev_sentences.tags
        return {"precision": precision_score(gold, predicted), "recall": recall_score(gold, predicted),
                "f1": f1_score(gold, predicted)}


def run_scalenlp(args, train: Path, dev: Path, schedule: TrainingConfig, run_dir: Path) -> dict:
    sets = ["training.task=token_classification", f"model.init={MINILM}", f"data.path={train}",
            f"data.eval_path={dev}", "training.device=cpu", "parallel.data_parallel=ddp",
            f"training.steps={schedule.steps}", f"training.global_batch_size={args.batch}",
            f"training.seq_len={args.seq_len}", f"training.lr={args.lr}", f"training.warmup_steps={schedule.warmup_steps}",
            f"training.min_lr_ratio={schedule.min_lr_ratio}", f"training.weight_decay={schedule.weight_decay}",
            f"training.beta2={schedule.beta2}", f"training.grad_clip={schedule.grad_clip}", f"model.dropout={args.dropout}",
            f"training.seed={args.seed}", f"training.log_every={LOG_EVERY}", f"training.eval_every={schedule.steps}",
            f"data.bucket_batches={args.bucket_batches}", "checkpoint.every=0", "checkpoint.export=false"]
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", str(args.nproc)]
    for s in sets:
        cmd += ["--set", s]
    print("scalenlp:", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"scalenlp train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    # A record's step_time_s is the mean over the steps since the record before it.
    counts = np.diff([0] + [r["step"] for r in steps])
    seconds = float(sum(n * r["step_time_s"] for n, r in zip(counts, steps)))
    scores = [r for r in records if "f1" in r][-1]
    return {"seconds": seconds, "wall": wall, "loss": steps[-1]["loss"], **scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="the WNUT-17 folder (default: ../shared/data/wnut17)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps, both sides")
    parser.add_argument("--batch", type=int, default=16, help="global batch size in sentences, both sides")
    parser.add_argument("--seq-len", type=int, default=128, help="the window in tokens (128 holds every sentence)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", default="1234",
                        help="both sides' seed (head init, dropout, data order), or several comma-separated, each a "
                             "comparison of its own, then the mean over them: F1 moves by points between seeds")
    parser.add_argument("--bucket-batches", type=int, default=DataConfig.bucket_batches,
                        help="scalenlp's data.bucket_batches: global batches sorted by length together (1: random "
                             "batches, as the transformers loop draws them)")
    parser.add_argument("--warmup", type=float, default=0.06, help="warm-up steps, as a fraction of the steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    parser.add_argument("--nproc", type=int, default=2, help="scalenlp DDP processes (1 thread each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformers loop (1 process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(x) for x in args.seed.split(",")]

    train, dev = args.data / "train.conll", args.data / "dev.conll"
    schedule = TrainingConfig(steps=args.steps, global_batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,
                              warmup_steps=max(1, round(args.warmup * args.steps)), min_lr_ratio=0.0,
                              weight_decay=args.weight_decay, beta2=0.999, grad_clip=1.0)
    results = [compare(argparse.Namespace(**{**vars(args), "seed": seed}), train, dev, schedule) for seed in seeds]
    if len(results) > 1:
        summarize(results)


def compare(args: argparse.Namespace, train: Path, dev: Path, schedule: TrainingConfig) -> dict:
    """One seed: the transformers loop's first half, scalenlp's run, the loop's second half; both scored."""
    hf = TransformersLoop(args, train, dev, schedule)
    sentences = len(hf.train_sentences)
    print(f"\nseed {args.seed}: MiniLM ({MINILM}) on WNUT-17: {args.steps} steps of {args.batch} sentences "
          f"({args.steps * args.batch / sentences:.2f} epochs of {sentences:,}), seq_len {args.seq_len}, lr {args.lr} "
          f"(AdamW betas 0.9/0.999, wd {args.weight_decay} on matrices, {schedule.warmup_steps} warm-up steps, cosine "
          f"to 0), dropout {args.dropout}, fp32, grad clip 1.0; dev: {len(hf.dev_sentences):,} sentences", flush=True)
    hf.train_steps(args.steps // 2)
    first = (hf.step, hf.seconds)
    print(f"transformers loop: first {hf.step} steps, {hf.step * args.batch / hf.seconds:.1f} samples/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_scalenlp(args, train, dev, schedule, Path(tmp) / "run")
    print(f"scalenlp: {args.steps * args.batch / ours['seconds']:.1f} samples/s, {ours['wall']:.0f} s wall in all",
          flush=True)
    hf.train_steps(args.steps - hf.step)
    print(f"transformers loop: last {hf.step - first[0]} steps, "
          f"{(hf.step - first[0]) * args.batch / (hf.seconds - first[1]):.1f} samples/s", flush=True)
    theirs = hf.entity_f1(64)

    trained = args.steps * args.batch
    ours_rate, hf_rate = trained / ours["seconds"], trained / hf.seconds
    rows = [
        ("sentences trained", f"{trained:,}", f"{trained:,}"),
        ("processes x threads", f"{args.nproc} x 1 (DDP)", f"1 x {args.threads}"),
        ("training samples/s", f"{ours_rate:.1f}", f"{hf_rate:.1f}"),
        (f"final train loss (last {LOG_EVERY} steps)", f"{ours['loss']:.4f}", f"{np.mean(hf.losses[-LOG_EVERY:]):.4f}"),
        ("dev entity precision", f"{ours['precision']:.4f}", f"{theirs['precision']:.4f}"),
        ("dev entity recall", f"{ours['recall']:.4f}", f"{theirs['recall']:.4f}"),
        ("dev entity F1", f"{ours['f1']:.4f}", f"{theirs['f1']:.4f}"),
    ]
    print(f"\n| {'':34} | {'scalenlp':>16} | {'transformers':>16} |\n|{'-' * 36}|{'-' * 18}|{'-' * 18}|")
    for name, a, b in rows:
        print(f"| {name:34} | {a:>16} | {b:>16} |")
    print(f"\nsamples/s ratio scalenlp / transformers: {ours_rate / hf_rate:.2f}x; entity F1 difference "
          f"{ours['f1'] - theirs['f1']:+.4f}")
    return {"seed": args.seed, "ours_rate": ours_rate, "hf_rate": hf_rate, "ours_f1": ours["f1"],
            "hf_f1": theirs["f1"]}


def summarize(results: list[dict]) -> None:
    """Entity F1 moves by points from seed to seed on both sides (head init, dropout, data order), so the recipes
    are compared by the mean over seeds, with the standard error of the mean paired difference."""
    print(f"\n| {'seed':>6} | {'scalenlp F1':>11} | {'transformers F1':>15} | {'difference':>10} | {'samples/s ratio':>15} |"
          f"\n|{'-' * 8}|{'-' * 13}|{'-' * 17}|{'-' * 12}|{'-' * 17}|")
    for r in results:
        print(f"| {r['seed']:>6} | {r['ours_f1']:>11.4f} | {r['hf_f1']:>15.4f} | {r['ours_f1'] - r['hf_f1']:>+10.4f} | "
              f"{r['ours_rate'] / r['hf_rate']:>14.2f}x |")
    differences = np.array([r["ours_f1"] - r["hf_f1"] for r in results])
    error = differences.std(ddof=1) / np.sqrt(len(differences))
    print(f"\nover {len(results)} seeds: entity F1 scalenlp {np.mean([r['ours_f1'] for r in results]):.4f}, "
          f"transformers {np.mean([r['hf_f1'] for r in results]):.4f}; mean difference {differences.mean():+.4f} "
          f"(standard error {error:.4f}); samples/s ratio median "
          f"{np.median([r['ours_rate'] / r['hf_rate'] for r in results]):.2f}x")


if __name__ == "__main__":
    main()
