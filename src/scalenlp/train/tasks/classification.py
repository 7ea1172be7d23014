"""``training.task = "classification"``: an encoder with a sequence-classification head, fine-tuned on labelled rows.

The label set is read from the training file (data.path) and becomes the model's ``labels`` (logit order), so
the checkpoint and every export carry it. The head is new (random, from the run's seed) unless model.init is
already a classifier over the same labels. Evaluation scores the whole eval file (data.eval_path), sharded over
the data-parallel ranks, and reports accuracy and macro-F1 of the counts summed over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from scalenlp.config import Config, ConfigError
from scalenlp.data.labeled import (
    IGNORE_LABEL,
    LabeledDataset,
    LabeledLoader,
    eval_batches,
    label_ids,
    label_names,
    read_labeled,
    tokenize_labeled,
)
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.io import cast_state
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.mesh import ParallelDims, dp_rank
from scalenlp.train.loss import autocast
from scalenlp.train.scores import all_reduce_counts, classification_scores, confusion_matrix
from scalenlp.train.tasks.base import Task

HEAD = ("classifier.weight", "classifier.bias")


@dataclass
class ClassificationData:
    labels: list[str]
    train: LabeledDataset
    eval: LabeledDataset | None


def load_classification_data(cfg: Config, tokenizer: Tokenizer, log: Callable[[str], None]) -> ClassificationData:
    """The training and eval files, read, labelled and tokenized to at most training.seq_len tokens a row."""
    d = cfg.data

    def tokenized(path: str, labels: list[str] | None) -> tuple[LabeledDataset, list[str]]:
        examples = read_labeled(path, d.text_field, d.label_field, d.text_pair_field, log=log)
        labels = labels or label_names(examples.labels)
        return tokenize_labeled(examples, label_ids(examples, labels), tokenizer, cfg.training.seq_len, log), labels

    train, labels = tokenized(d.path, None)
    if len(labels) < 2:
        raise UserError(f"{d.path} has one label only ({labels[0]!r}); a classifier needs at least two")
    evaluation = tokenized(d.eval_path, labels)[0] if d.eval_path else None
    log(f"classification: {len(train):,} training rows, {len(evaluation) if evaluation else 0:,} eval rows, "
        f"labels {', '.join(labels)}")
    return ClassificationData(labels, train, evaluation)


def classifier_args(cfg: Config, pretrained: Pretrained, labels: list[str]) -> EncoderArgs:
    """model.init's encoder with a classification head over ``labels``."""
    args = pretrained.args
    if args.task == "classification" and args.labels != labels:  # the checkpoint's head already classifies
        raise ConfigError(f"model.init={cfg.model.init!r} classifies into {args.labels}, but {cfg.data.path} has "
                          f"labels {labels}; fine-tune from its encoder without the head, or use data with its labels")
    args = dataclasses.replace(args, task="classification", labels=labels, dropout=cfg.model.dropout)
    if not args.uses_pooler_head:
        # RoBERTa's and DistilBERT's heads have a dense layer of their own: a pooler would get no gradient (DDP
        # refuses that) and their ...ForSequenceClassification has none.
        args = args.without_pooler()
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model.init={cfg.model.init!r} cannot classify: {e}") from None
    return args


def build_classifier(args: EncoderArgs, pretrained: Pretrained, device: torch.device, where: str,
                     head: tuple[str, ...] | None = None) -> Encoder:
    """The encoder with model.init's weights in fp32; a head (the weights named ``head``, by default the task head
    ``args`` name, which for RoBERTa's and DistilBERT's classifiers has a dense layer of its own) the checkpoint
    lacks keeps its random init (seeded by the caller, so every rank starts from the same one)."""
    head = args.head_names if head is None else head
    # A model built without the checkpoint's pooler (its head never reads one) leaves that weight behind.
    state = {k: v for k, v in pretrained.state.items() if args.pooler or not k.startswith("pooler.")}
    model = Encoder(args).to(device)
    missing, unexpected = model.load_state_dict(cast_state(state, device, torch.float32), strict=False)
    if unexpected or set(missing) - set(head):
        wrong = (unexpected or sorted(set(missing) - set(head)))[0]
        raise UserError(f"the weights in {where} do not match its model arguments: "
                        f"{'unexpected' if unexpected else 'missing'} {wrong!r}")
    return model.train()


def classification_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Summed cross-entropy of one (micro-)batch (input_ids, attention_mask, token_type_ids, labels), in fp32."""
    input_ids, attention_mask, token_type_ids, labels = batch
    return F.cross_entropy(model(input_ids, attention_mask, token_type_ids).float(), labels,
                           ignore_index=IGNORE_LABEL, reduction="sum")


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, dataset: LabeledDataset, batch_size: int, dp_rank: int, dp_size: int,
                        device: torch.device, group, num_classes: int,
                        autocast: Callable[[], object]) -> dict[str, float]:
    """eval_loss, accuracy and macro_f1 over every row of ``dataset``, this rank scoring its share; the same on
    every rank of ``group`` (the data-parallel ranks)."""
    counts = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    loss = torch.zeros(1, dtype=torch.float64, device=device)
    for batch in eval_batches(dataset, batch_size, dp_rank, dp_size):
        input_ids, attention_mask, token_type_ids, labels = (x.to(device) for x in batch)
        with autocast():
            logits = model(input_ids, attention_mask, token_type_ids).float()
        loss += F.cross_entropy(logits, labels, ignore_index=IGNORE_LABEL, reduction="sum")
        counts += confusion_matrix(logits.argmax(-1), labels, num_classes)
    # One all-reduce: the counts are whole numbers, exact in float64.
    total = all_reduce_counts(torch.cat([counts.flatten(), loss]), group)
    counts = total[:-1].reshape(num_classes, num_classes)
    return {"eval_loss": (total[-1] / counts.sum()).item(), **classification_scores(counts)}


class Classification(Task):
    best_scores = ("accuracy", "macro_f1")
    model_class = Encoder

    def validate(self, cfg: Config) -> None:
        if not cfg.model.init or not cfg.data.path:
            raise ConfigError("training.task=\"classification\" needs model.init (an encoder checkpoint, e.g. a "
                              "BERT folder) and data.path (a labelled .tsv/.csv/.jsonl/.parquet file)")
        if cfg.checkpoint.keep_best and not cfg.data.eval_path:
            raise ConfigError("checkpoint.keep_best needs data.eval_path: the best checkpoint is judged on it")
        super().validate(cfg)

    def check_checkpoint(self, cfg: Config, args: ModelArgs | EncoderArgs) -> None:
        if not isinstance(args, EncoderArgs):
            raise ConfigError(f"model.init={cfg.model.init!r} is a decoder; training.task=\"classification\" needs "
                              f"an encoder (a BERT-family checkpoint)")

    def build_data(self, cfg: Config, run_dir: Path, pretrained: Pretrained, dp_index: int, dp_size: int,
                   log: Callable[[str], None]) -> LabeledLoader:
        # Labelled rows are few and quick to tokenize: every rank reads them, nothing is cached.
        self.data = load_classification_data(cfg, pretrained.tokenizer, log)
        self.tokenizer = pretrained.tokenizer
        return LabeledLoader.for_run(self.data.train, cfg, dp_index, dp_size)

    def build_model(self, cfg: Config, pretrained: Pretrained, device: torch.device) -> tuple[EncoderArgs, Encoder]:
        args = classifier_args(cfg, pretrained, self.data.labels)
        return args, build_classifier(args, pretrained, device, where=cfg.model.init)

    def micro_batch_loss(self, model: torch.nn.Module, micro: tuple[torch.Tensor, ...],
                         dims: ParallelDims) -> torch.Tensor:
        return classification_loss(model, micro)

    def evaluate(self, trainer: Any) -> dict[str, float] | None:
        """eval_loss, accuracy and macro_f1 on the whole eval file; None without one."""
        if self.data.eval is None:
            return None
        model, t = trainer.model_parts[0], trainer.cfg.training
        model.eval()
        scores = evaluate_classifier(model, self.data.eval, t.global_batch_size, dp_rank(trainer.mesh),
                                     trainer.dims.dp, trainer.device, trainer.dp_group, len(self.data.labels),
                                     lambda: autocast(trainer.device, t.mixed_precision))
        model.train()
        return scores

    def describe(self, scores: dict[str, float]) -> str:
        return (f"eval loss {scores['eval_loss']:.4f} | accuracy {scores['accuracy']:.4f} | "
                f"macro-F1 {scores['macro_f1']:.4f}")
