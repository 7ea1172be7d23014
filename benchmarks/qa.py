"""Fine-tuning all-MiniLM-L6-v2 for extractive question answering on SQuAD: `scalenlp train --nproc 2` (DDP)
beside a plain transformers loop written after the reference recipe (run_qa: AutoModelForQuestionAnswering, a
fast tokenizer cutting question + context into windows with a stride, start/end labels from offset mappings,
n-best post-processing), on the same windows and batches, measured in one run.

    python benchmarks/qa.py [--data ../shared/data/squad] [--steps 40] [--batch 16] [--seq-len 192]
                            [--doc-stride 64] [--train-questions N] [--dev-questions N] [--lr 2e-4]

Both sides train ``--steps`` steps of ``--batch`` windows of squad/train.json, in the same order (the batches
scalenlp's loader draws, which the transformers loop replays), with the same AdamW, warm-up + cosine schedule,
gradient clipping at 1.0 and dropout, in fp32; then both answer every question of squad/dev.json (or its first
``--dev-questions``) and are scored with SQuAD's exact match and F1. The transformers side makes its own windows
with transformers' tokenizer and checks that they are token for token scalenlp's, labels them and post-processes
its logits with code of its own (not scalenlp's). scalenlp runs 2 processes of 1 thread each (DDP, gloo); the
transformers loop 1 process with 2 threads, half its steps before the scalenlp run and half after, so that a
change in the machine's load affects both sides.

Samples/s counts training steps only (batching, forward, backward, clipping, optimizer), not start-up,
tokenizing or evaluation: scalenlp's from its metrics.jsonl, the loop's timed the same way here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from fine_tuning import (
    add_schedule_arguments,
    optimizer_step,
    print_table,
    run_scalenlp,
    schedule_of,
    schedule_sets,
)
from scalenlp.config import TrainingConfig
from scalenlp.data.labeled import LabeledLoader
from scalenlp.data.spans import make_windows, read_qa
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.models.packaged import packaged_model
from scalenlp.train.optim import build_scheduler, param_groups
from scalenlp.train.squad import squad_scores

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad"
MINILM = packaged_model("minilm")
SEED = 1234
LOG_EVERY = 5
N_BEST, MAX_ANSWER = 20, 30


def first_questions(source: Path, folder: Path, questions: int | None) -> Path:
    """``source``, or its first paragraphs holding ``questions`` questions, in SQuAD's layout."""
    if not questions:
        return source
    doc = json.loads(source.read_text())
    paragraphs, n = [], 0
    for article in doc["data"]:
        for p in article["paragraphs"]:
            if n < questions:
                paragraphs.append(p)
                n += len(p["qas"])
    out = folder / source.name
    out.write_text(json.dumps({"version": "1.1", "data": [{"title": "part", "paragraphs": paragraphs}]}))
    return out


class ReferenceLoop:
    """run_qa's recipe in a plain loop, run in parts so that it can bracket the scalenlp run."""

    def __init__(self, args, train: Path, dev: Path, schedule: TrainingConfig):
        from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # heavy, optional

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(MINILM)
        examples = read_qa(train, log=lambda _: None)
        self.train = self._windows([e.question for e in examples], [e.context for e in examples])
        self.train["labels"] = [self._label(self.train, i, examples[n].answers[0])
                                for i, n in enumerate(self.train["overflow_to_sample_mapping"])]
        self.dev_examples = read_qa(dev, log=lambda _: None)
        self.dev = self._windows([e.question for e in self.dev_examples], [e.context for e in self.dev_examples])
        self._check_same_windows(examples)
        torch.manual_seed(SEED)
        self.model = AutoModelForQuestionAnswering.from_pretrained(
            MINILM, hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
            attn_implementation="sdpa").train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, schedule.weight_decay), lr=schedule.lr,
                                           betas=(schedule.beta1, schedule.beta2), eps=1e-8, foreach=True)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        self.step, self.seconds, self.losses = 0, 0.0, []

    def _windows(self, questions: list[str], contexts: list[str]) -> dict:
        return self.tokenizer([q.lstrip() for q in questions], contexts, truncation="only_second",
                              max_length=self.args.seq_len, stride=self.args.doc_stride,
                              return_overflowing_tokens=True, return_offsets_mapping=True)

    def _label(self, windows: dict, i: int, answer: tuple[str, int]) -> tuple[int, int]:
        """run_qa's labels: the answer's first and last token when the window holds it whole, else (0, 0)."""
        text, start = answer
        end = start + len(text)
        sequence = windows.sequence_ids(i)
        offsets = windows["offset_mapping"][i]
        first = sequence.index(1)
        last = len(sequence) - 1 - sequence[::-1].index(1)
        if offsets[first][0] > start or offsets[last][1] < end:
            return 0, 0
        while first < len(offsets) and sequence[first] == 1 and offsets[first][0] <= start:
            first += 1
        while sequence[last] == 1 and offsets[last][1] >= end:
            last -= 1
        return first - 1, last + 1

    def _check_same_windows(self, examples) -> None:
        ours = make_windows(examples, load_tokenizer(MINILM), self.args.seq_len, self.args.doc_stride, "train",
                            log=lambda _: None)
        theirs = self.train["input_ids"]
        assert len(ours) == len(theirs), (len(ours), len(theirs))
        for i in range(len(ours)):
            row = ours.data.ids[ours.data.offsets[i]:ours.data.offsets[i + 1]].tolist()
            assert row == theirs[i], f"window {i} differs"
            assert tuple(ours.data.labels[i]) == self.train["labels"][i], f"window {i}: labels differ"
        self.windows = ours

    def _batch(self, rows, windows: dict) -> dict[str, torch.Tensor]:
        features = [{k: windows[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in rows]
        return self.tokenizer.pad(features, return_tensors="pt")  # to the longest window of the batch

    def train_steps(self, batches: np.ndarray) -> None:
        for rows in batches:
            start = time.perf_counter()
            batch = self._batch(rows, self.train)
            labels = torch.tensor([self.train["labels"][i] for i in rows])
            loss = self.model(**batch, start_positions=labels[:, 0], end_positions=labels[:, 1]).loss
            optimizer_step(self.model, self.optimizer, self.scheduler, loss)
            self.seconds += time.perf_counter() - start
            self.losses.append(loss.item())
            self.step += 1

    @torch.no_grad()
    def scores(self, batch: int) -> dict[str, float]:
        """Exact match and F1 on the dev questions, answers post-processed as run_qa does."""
        self.model.eval()
        order = np.argsort([len(x) for x in self.dev["input_ids"]], kind="stable")
        logits = {}
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            out = self.model(**self._batch(rows, self.dev))
            for r, s, e in zip(rows, out.start_logits, out.end_logits):
                n = len(self.dev["input_ids"][r])
                logits[r] = (s[:n].numpy(), e[:n].numpy())
        by_example = defaultdict(list)
        for i, n in enumerate(self.dev["overflow_to_sample_mapping"]):
            by_example[n].append(i)
        predictions = []
        for n, example in enumerate(self.dev_examples):
            best, text = -np.inf, ""
            for i in by_example[n]:
                start_logits, end_logits = logits[i]
                offsets, sequence = self.dev["offset_mapping"][i], self.dev.sequence_ids(i)
                for s in np.argsort(start_logits)[::-1][:N_BEST]:
                    for e in np.argsort(end_logits)[::-1][:N_BEST]:
                        if sequence[s] != 1 or sequence[e] != 1 or e < s or e - s + 1 > MAX_ANSWER:
                            continue
                        if start_logits[s] + end_logits[e] > best:
                            best = start_logits[s] + end_logits[e]
                            text = example.context[offsets[s][0]:offsets[e][1]]
            predictions.append(text)
        self.model.train()
        return squad_scores(predictions, [[t for t, _ in e.answers] for e in self.dev_examples])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="the SQuAD folder (default: ../shared/data/squad)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps, both sides")
    parser.add_argument("--batch", type=int, default=16, help="global batch size in windows, both sides")
    parser.add_argument("--seq-len", type=int, default=192, help="window length in tokens, question included")
    parser.add_argument("--doc-stride", type=int, default=64, help="tokens two windows of a context share")
    parser.add_argument("--train-questions", type=int, default=0, help="train on the first N questions (0: all)")
    parser.add_argument("--dev-questions", type=int, default=0, help="score the first N dev questions (0: all)")
    add_schedule_arguments(parser, lr=2e-4, warmup=0.1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    schedule = schedule_of(args, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        train = first_questions(args.data / "train.json", Path(tmp), args.train_questions)
        dev = first_questions(args.data / "dev.json", Path(tmp), args.dev_questions)
        ref = ReferenceLoop(args, train, dev, schedule)
        # The batches scalenlp's loader draws (one process sees all of each; DDP ranks split them).
        loader = LabeledLoader(ref.windows.data, args.batch, 0, 1, SEED, True)
        per_epoch = loader.batches_per_epoch
        batches = np.concatenate([loader.batch_order(epoch) for epoch in range(-(-args.steps // per_epoch))])
        batches = batches[:args.steps]
        print(f"MiniLM ({MINILM}) on SQuAD: {len(ref.windows.examples):,} train questions in {len(ref.windows):,} "
              f"windows of {args.seq_len} tokens (stride {args.doc_stride}); {args.steps} steps of {args.batch} "
              f"windows ({args.steps * args.batch / len(ref.windows):.2f} epochs), lr {args.lr} (AdamW betas "
              f"0.9/0.999, wd {args.weight_decay} on matrices, {schedule.warmup_steps} warm-up steps, cosine to 0), "
              f"dropout {args.dropout}, fp32, grad clip 1.0; dev: {len(ref.dev_examples):,} questions", flush=True)
        half = args.steps // 2
        ref.train_steps(batches[:half])
        print(f"transformers loop: first {half} steps, {half * args.batch / ref.seconds:.1f} samples/s", flush=True)
        before = ref.seconds
        sets = ["training.task=qa", f"model.init={MINILM}", f"data.path={train}", f"data.eval_path={dev}",
                f"data.doc_stride={args.doc_stride}", f"data.n_best={N_BEST}", f"data.max_answer_len={MAX_ANSWER}",
                *schedule_sets(args, schedule, SEED, LOG_EVERY)]
        ours = run_scalenlp(sets, args.nproc, Path(tmp) / "run", "f1")
        print(f"scalenlp: {args.steps * args.batch / ours['seconds']:.1f} samples/s, {ours['wall']:.0f} s wall in "
              f"all", flush=True)
        ref.train_steps(batches[half:])
        print(f"transformers loop: last {args.steps - half} steps, "
              f"{(args.steps - half) * args.batch / (ref.seconds - before):.1f} samples/s", flush=True)
        theirs = ref.scores(64)

    trained = args.steps * args.batch
    ours_rate, ref_rate = trained / ours["seconds"], trained / ref.seconds
    rows = [
        ("windows trained", f"{trained:,}", f"{trained:,}"),
        ("processes x threads", f"{args.nproc} x 1 (DDP)", f"1 x {args.threads}"),
        ("training samples/s", f"{ours_rate:.2f}", f"{ref_rate:.2f}"),
        (f"final train loss (last {LOG_EVERY} steps)", f"{ours['loss']:.4f}",
         f"{np.mean(ref.losses[-LOG_EVERY:]):.4f}"),
        ("dev exact match", f"{ours['exact_match']:.2f}", f"{theirs['exact_match']:.2f}"),
        ("dev F1", f"{ours['f1']:.2f}", f"{theirs['f1']:.2f}"),
    ]
    print_table(rows, "transformers")
    print(f"\nsamples/s ratio scalenlp / transformers: {ours_rate / ref_rate:.2f}x (goal >= 1.2x); F1 difference "
          f"{ours['f1'] - theirs['f1']:+.2f} (goal >= -1)")


if __name__ == "__main__":
    main()
