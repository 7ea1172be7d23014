"""``training.task = "qa"``: extractive question answering, an encoder with a span head (start and end logits
for every token) fine-tuned on SQuAD-style questions.

Each question and its context become windows of training.seq_len tokens (data/spans.py); a window is a training
row labelled with the answer's first and last token, or with the first token when it does not hold the answer.
The loss is the mean of the start and end cross-entropies, as the reference recipe (transformers' run_qa) has
it. Evaluation answers every question of data.eval_path from the n-best spans of all its windows and scores the
answers with SQuAD's exact match and F1 (train/squad.py); questions are shared out over the data-parallel ranks
whole, so each rank puts its own questions' windows back together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from scalenlp.config import Config, ConfigError
from scalenlp.data.labeled import LabeledLoader
from scalenlp.data.spans import QAWindows, best_answer, make_windows, read_qa
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.mesh import ParallelDims, dp_rank
from scalenlp.train.loss import autocast
from scalenlp.train.scores import all_reduce_counts
from scalenlp.train.squad import question_scores
from scalenlp.train.tasks.base import Task
from scalenlp.train.tasks.classification import build_classifier


def span_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Summed start and end cross-entropies of one (micro-)batch (input_ids, attention_mask, token_type_ids,
    (start, end) labels), in fp32; the trainer divides by the 2 labels a row counts."""
    return span_loss_of(model(*batch[:3]), batch[1], batch[3])


def span_loss_of(logits: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed loss of (B, T, 2) logits. Padding is no candidate: a window's loss is the same however wide
    the batch it came in (transformers' model leaves the padded positions in the softmax)."""
    logits = logits.float().masked_fill(~attention_mask.bool()[..., None], torch.finfo(torch.float32).min)
    return (F.cross_entropy(logits[..., 0], labels[:, 0], reduction="sum")
            + F.cross_entropy(logits[..., 1], labels[:, 1], reduction="sum"))


def load_windows(path: str, cfg: Config, tokenizer, log: Callable[[str], None]) -> QAWindows:
    return make_windows(read_qa(path, log), tokenizer, cfg.training.seq_len, cfg.data.doc_stride, path, log)


def rank_windows(windows: QAWindows, rank: int, size: int) -> np.ndarray:
    """The windows of every ``size``-th question from ``rank`` on, shortest first (less padding)."""
    mine = np.flatnonzero(windows.example % size == rank)
    return mine[np.argsort(windows.data.lengths[mine], kind="stable")]


@torch.no_grad()
def evaluate_qa(model: torch.nn.Module, windows: QAWindows, batch_size: int, rank: int, size: int,
                device: torch.device, group, cfg: Config, autocast: Callable[[], object],
                allow_empty: bool = False) -> dict[str, float]:
    """eval_loss, exact_match and f1 (percent) over every question of ``windows``, this rank answering its share;
    the same on every rank of ``group`` (the data-parallel ranks). ``allow_empty``: the empty answer may win
    (SQuAD v2.0)."""
    mine = rank_windows(windows, rank, size)
    # Sharded models run collectives in each forward: every rank runs as many batches as the busiest one, the
    # extra ones on a copy of a window whose output is dropped.
    batches = max(-(-len(rank_windows(windows, r, size)) // batch_size) for r in range(size))
    start_logits, end_logits = {}, {}
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for b in range(batches):
        rows = mine[b * batch_size:(b + 1) * batch_size]
        real = len(rows)
        if real == 0:
            rows = np.zeros(1, dtype=np.int64)
        input_ids, attention_mask, token_type_ids, labels = (x.to(device) for x in windows.data.collate(rows))
        with autocast():
            logits = model(input_ids, attention_mask, token_type_ids).float()
        logits = logits[:real]
        loss += span_loss_of(logits, attention_mask[:real], labels[:real])
        for row, lg in zip(rows[:real], logits.cpu()):
            n = int(windows.data.lengths[row])
            start_logits[row], end_logits[row] = lg[:n, 0], lg[:n, 1]
    em = f1 = 0.0
    by_question: dict[int, list[int]] = {}
    for row in sorted(start_logits):
        by_question.setdefault(int(windows.example[row]), []).append(row)
    for q, rows in by_question.items():
        example = windows.examples[q]
        answer = best_answer([start_logits[r] for r in rows], [end_logits[r] for r in rows],
                             [windows.spans[r] for r in rows], example.context, cfg.data.n_best,
                             cfg.data.max_answer_len, allow_empty)
        scores = question_scores(answer.text, [text for text, _ in example.answers])
        em, f1 = em + scores[0], f1 + scores[1]
    total = all_reduce_counts(torch.tensor([em, f1, len(by_question), loss.item(), len(start_logits)],
                                           dtype=torch.float64, device=device), group)
    questions, counted = total[2].item(), total[4].item()
    return {"eval_loss": total[3].item() / (2 * counted), "exact_match": 100 * total[0].item() / questions,
            "f1": 100 * total[1].item() / questions}


class QuestionAnswering(Task):
    best_scores = ("f1", "exact_match")
    model_class = Encoder

    def validate(self, cfg: Config) -> None:
        if not cfg.model.init or not cfg.data.path:
            raise ConfigError("training.task=\"qa\" needs model.init (an encoder checkpoint, e.g. a BERT folder) and "
                              "data.path (SQuAD .json or .jsonl questions)")
        if cfg.checkpoint.keep_best and not cfg.data.eval_path:
            raise ConfigError("checkpoint.keep_best needs data.eval_path: the best checkpoint is judged on it")
        if cfg.data.doc_stride >= cfg.training.seq_len:
            raise ConfigError(f"data.doc_stride={cfg.data.doc_stride} must be below training.seq_len="
                              f"{cfg.training.seq_len}, the window it overlaps; lower it (128 for 384-token windows "
                              f"is the usual)")
        super().validate(cfg)

    def check_checkpoint(self, cfg: Config, args: ModelArgs | EncoderArgs) -> None:
        if not isinstance(args, EncoderArgs):
            raise ConfigError(f"model.init={cfg.model.init!r} is a decoder; training.task=\"qa\" needs an encoder "
                              f"(a BERT-family checkpoint)")
        if args.task not in ("embedding", "question_answering"):
            raise ConfigError(f"model.init={cfg.model.init!r} is a {args.task} model; training.task=\"qa\" starts from "
                              f"an encoder without a head or a question-answering one")

    def build_data(self, cfg: Config, run_dir: Path, pretrained: Pretrained, dp_index: int, dp_size: int,
                   log: Callable[[str], None]) -> LabeledLoader:
        # Every rank reads and windows the questions (a few seconds for SQuAD's size); nothing is cached.
        self.train = load_windows(cfg.data.path, cfg, pretrained.tokenizer, log)
        self.eval = load_windows(cfg.data.eval_path, cfg, pretrained.tokenizer, log) if cfg.data.eval_path else None
        self.tokenizer = pretrained.tokenizer
        # Unanswerable questions (SQuAD v2.0) in either file: the model learns, and may answer, "no answer".
        self.allow_empty = any(not e.answers for w in (self.train, self.eval) if w for e in w.examples)
        log(f"qa: {len(self.train.examples):,} training questions in {len(self.train):,} windows"
            + (f", {len(self.eval.examples):,} eval questions in {len(self.eval):,} windows" if self.eval else ""))
        return LabeledLoader.for_run(self.train.data, cfg, dp_index, dp_size)

    def build_model(self, cfg: Config, pretrained: Pretrained, device: torch.device) -> tuple[EncoderArgs, Encoder]:
        self.check_checkpoint(cfg, pretrained.args)
        # The span head reads every token's hidden state, never the pooler: the model is built without it, as
        # transformers' ...ForQuestionAnswering is.
        args = dataclasses.replace(pretrained.args, task="question_answering", labels=[],
                                   dropout=cfg.model.dropout).without_pooler()
        try:
            args.check()
        except ValueError as e:
            raise ConfigError(f"model.init={cfg.model.init!r} cannot answer questions: {e}") from None
        return args, build_classifier(args, pretrained, device, where=cfg.model.init)

    def micro_batch_loss(self, model: torch.nn.Module, micro: tuple[torch.Tensor, ...],
                         dims: ParallelDims) -> torch.Tensor:
        return span_loss(model, micro)

    def evaluate(self, trainer: Any) -> dict[str, float] | None:
        """eval_loss, exact_match and f1 on every question of the eval file; None without one."""
        if self.eval is None:
            return None
        model, cfg = trainer.model_parts[0], trainer.cfg
        model.eval()
        scores = evaluate_qa(model, self.eval, max(1, cfg.training.global_batch_size // trainer.dims.dp),
                             dp_rank(trainer.mesh), trainer.dims.dp, trainer.device, trainer.dp_group, cfg,
                             lambda: autocast(trainer.device, cfg.training.mixed_precision), self.allow_empty)
        model.train()
        return scores

    def describe(self, scores: dict[str, float]) -> str:
        return (f"eval loss {scores['eval_loss']:.4f} | exact match {scores['exact_match']:.2f} | "
                f"F1 {scores['f1']:.2f}")
