"""``training.task = "token_classification"``: an encoder with a per-token head, fine-tuned on BIO-tagged words
(named entities).

The tag set is read from the training file (data.path) and becomes the model's ``labels`` (logit order), so the
checkpoint and its exports (``...ForTokenClassification`` with id2label/label2id) carry it. The loss is the mean
cross-entropy over the first sub-token of every word of the global batch. Evaluation scores the whole eval file
(data.eval_path): each data-parallel rank predicts its share of windows, the predicted tag of every word is
summed over the ranks (each word is predicted by exactly one), and the entity-level precision, recall and F1 of
seqeval (exact span and type; micro-averaged and per type) come from the whole file, the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from scalenlp.config import Config, ConfigError
from scalenlp.data.entities import OUTSIDE, entity_scores
from scalenlp.data.labeled import LabeledLoader, eval_batches
from scalenlp.data.sft import IGNORE_INDEX
from scalenlp.data.tags import TaggedSentences, TaggedWindows, read_tagged, tag_ids, tag_names, tokenize_tagged
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.mesh import ParallelDims, dp_rank
from scalenlp.train.loss import autocast, sum_over
from scalenlp.train.tasks.base import Task
from scalenlp.train.tasks.classification import HEAD, build_classifier


@dataclass
class TaggingData:
    labels: list[str]
    train: TaggedWindows
    eval: TaggedWindows | None
    eval_sentences: TaggedSentences | None


def load_tagging_data(cfg: Config, tokenizer: Tokenizer, log: Callable[[str], None]) -> TaggingData:
    """The training and eval files, read, tagged and cut into windows of at most training.seq_len tokens."""
    d, window = cfg.data, cfg.training.seq_len
    train = read_tagged(d.path, log)
    labels = tag_names(train)
    if len(labels) < 2:
        raise UserError(f"{d.path} tags every word {OUTSIDE!r}; there are no entities to learn")
    windows = tokenize_tagged(train, tag_ids(train, labels, log), tokenizer, window)
    held_out = read_tagged(d.eval_path, log) if d.eval_path else None
    evaluation = tokenize_tagged(held_out, tag_ids(held_out, labels, log), tokenizer, window) if held_out else None
    for name, part in (("training", windows), ("eval", evaluation)):
        if part is not None and part.lost_words:
            log(f"token_classification: {part.lost_words} {name} word(s) become no token at all under this "
                f"tokenizer; they are not learnt and are predicted {OUTSIDE!r}")
    log(f"token_classification: {len(train):,} training sentences in {len(windows.train):,} windows of at most "
        f"{window} tokens, {len(held_out) if held_out else 0:,} eval sentences, tags {', '.join(labels)}")
    return TaggingData(labels, windows, evaluation, held_out)


def tagger_args(cfg: Config, pretrained: Pretrained, labels: list[str]) -> EncoderArgs:
    """model.init's encoder with a per-token head over ``labels``, without a pooler (a tagger never uses one, and
    transformers' ForTokenClassification has none)."""
    args = pretrained.args
    if args.task == "token_classification" and args.labels != labels:
        raise ConfigError(f"model.init={cfg.model.init!r} tags with {args.labels}, but {cfg.data.path} has tags "
                          f"{labels}; fine-tune from its encoder without the head, or use data with its tags")
    args = dataclasses.replace(args, task="token_classification", labels=labels, dropout=cfg.model.dropout,
                               pooler=False, pooling="mean" if args.pooling == "pooler" else args.pooling)
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model.init={cfg.model.init!r} cannot tag: {e}") from None
    return args


def build_tagger(args: EncoderArgs, pretrained: Pretrained, device: torch.device, where: str) -> Encoder:
    """The encoder with model.init's weights in fp32, as a classifier is built, less the pooler and any head
    that is not a tagger's (the new head starts from the caller's seed)."""
    keep = {k: v for k, v in pretrained.state.items() if not k.startswith(("pooler.", "qa_outputs."))
            and (pretrained.args.task == args.task or k not in HEAD)}
    return build_classifier(args, dataclasses.replace(pretrained, state=keep), device, where)


def tagging_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Summed cross-entropy over the counted tokens of one (micro-)batch (input_ids, attention_mask,
    token_type_ids, targets), in fp32."""
    input_ids, attention_mask, token_type_ids, targets = batch
    logits = model(input_ids, attention_mask, token_type_ids).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def predict_words(model: torch.nn.Module, windows: TaggedWindows, batch_size: int, dp_rank: int, dp_size: int,
                  device: torch.device, group, autocast: Callable[[], object]) -> tuple[np.ndarray, float]:
    """(the predicted tag id of every word of ``windows.gold``, -1 for words without a token; the mean loss over
    the words whose gold tag the model knows), this rank scoring its share of windows; the same on every rank."""
    # Each word is predicted on one rank: the others leave its slot at 0, so a sum over ranks of (tag + 1) is it.
    chosen = torch.zeros(len(windows.gold), dtype=torch.int64, device=device)
    gold = torch.from_numpy(windows.gold).to(device)
    loss = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, words counted
    for batch in eval_batches(windows.slots, batch_size, dp_rank, dp_size):
        input_ids, attention_mask, token_type_ids, slots = (x.to(device) for x in batch)
        with autocast():
            logits = model(input_ids, attention_mask, token_type_ids).float()
        scored = slots >= 0
        word_logits, word_slots = logits[scored], slots[scored]
        chosen[word_slots] = word_logits.argmax(-1) + 1
        targets = gold[word_slots]
        loss[0] += F.cross_entropy(word_logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss[1] += (targets != IGNORE_INDEX).sum()
    chosen, loss = sum_over(chosen, group), sum_over(loss, group)
    return (chosen - 1).cpu().numpy(), (loss[0] / loss[1].clamp(min=1)).item()


def score_predictions(windows: TaggedWindows, sentences: TaggedSentences, labels: list[str],
                      chosen: np.ndarray) -> dict:
    """seqeval's entity scores of the predicted tag ids ``chosen`` (-1: predicted O) against the file's tags."""
    names = labels + [OUTSIDE]  # index -1 reads as O
    starts = windows.sentence_starts
    predicted = [[names[i] for i in chosen[starts[s]:starts[s + 1]]] for s in range(len(sentences))]
    return entity_scores(sentences.tags, predicted)


def flat_scores(scores: dict) -> dict[str, float]:
    """entity_scores' result as metrics.jsonl keys: precision, recall, f1, then <type>_precision ... per type."""
    out = {k: float(scores[k]) for k in ("precision", "recall", "f1")}
    for kind, values in scores["types"].items():
        out.update({f"{kind}_{k}": float(values[k]) for k in ("precision", "recall", "f1")})
    return out


class TokenClassification(Task):
    best_scores = ("f1", "precision", "recall")
    model_class = Encoder
    also_trains = HEAD  # the new head trains in full beside LoRA adapters

    def validate(self, cfg: Config) -> None:
        if not cfg.model.init or not cfg.data.path:
            raise ConfigError("training.task=\"token_classification\" needs model.init (an encoder checkpoint, e.g. "
                              "a BERT folder) and data.path (a CoNLL-style or .jsonl file of tagged words)")
        if cfg.checkpoint.keep_best and not cfg.data.eval_path:
            raise ConfigError("checkpoint.keep_best needs data.eval_path: the best checkpoint is judged on it")
        super().validate(cfg)

    def check_checkpoint(self, cfg: Config, args: ModelArgs | EncoderArgs) -> None:
        if not isinstance(args, EncoderArgs):
            raise ConfigError(f"model.init={cfg.model.init!r} is a decoder; training.task=\"token_classification\" "
                              f"needs an encoder (a BERT-family checkpoint)")

    def build_data(self, cfg: Config, run_dir: Path, pretrained: Pretrained, dp_index: int, dp_size: int,
                   log: Callable[[str], None]) -> LabeledLoader:
        # Tagged sentences are few and quick to tokenize: every rank reads them, nothing is cached.
        self.data = load_tagging_data(cfg, pretrained.tokenizer, log)
        self.tokenizer = pretrained.tokenizer
        return LabeledLoader.for_run(self.data.train.train, cfg, dp_index, dp_size)

    def build_model(self, cfg: Config, pretrained: Pretrained, device: torch.device) -> tuple[EncoderArgs, Encoder]:
        args = tagger_args(cfg, pretrained, self.data.labels)
        return args, build_tagger(args, pretrained, device, where=cfg.model.init)

    def micro_batch_loss(self, model: torch.nn.Module, micro: tuple[torch.Tensor, ...],
                         dims: ParallelDims) -> torch.Tensor:
        return tagging_loss(model, micro)

    def evaluate(self, trainer: Any) -> dict[str, float] | None:
        """eval_loss and the entity scores (micro-averaged and per type) on the whole eval file; None without one."""
        data = self.data
        if data.eval is None:
            return None
        model, t = trainer.model_parts[0], trainer.cfg.training
        model.eval()
        chosen, loss = predict_words(model, data.eval, t.global_batch_size, dp_rank(trainer.mesh), trainer.dims.dp,
                                     trainer.device, trainer.dp_group,
                                     lambda: autocast(trainer.device, t.mixed_precision))
        model.train()
        return {"eval_loss": loss, **flat_scores(score_predictions(data.eval, data.eval_sentences, data.labels,
                                                                   chosen))}

    def describe(self, scores: dict[str, float]) -> str:
        return (f"eval loss {scores['eval_loss']:.4f} | entity precision {scores['precision']:.4f} | "
                f"recall {scores['recall']:.4f} | F1 {scores['f1']:.4f}")
