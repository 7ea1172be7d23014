"""``training.task = "sft"``: supervised fine-tuning of model.init on chat conversations, one per row, rendered
with its chat template, the loss on the assistant's tokens only (data/sft.py). Otherwise the base Task's next-token
training and held-out loss."""

from __future__ import annotations

import torch

from scalenlp.config import Config, ConfigError
from scalenlp.data.sft import CHAT_ROWS, ChatDataset
from scalenlp.train.tasks.base import Task


class ChatFineTuning(Task):
    rows = CHAT_ROWS
    dataset = ChatDataset

    def validate(self, cfg: Config) -> None:
        super().validate(cfg)
        if not cfg.model.init:
            raise ConfigError("training.task=\"sft\" needs model.init: the chat template and tokenizer come from "
                              "the pretrained checkpoint")
        if not cfg.data.path:
            raise ConfigError("training.task=\"sft\" needs data.path: a .jsonl file with a `messages` list per line")

    def record(self, targets_seen: torch.Tensor | int, seconds: float) -> dict[str, float]:
        # The tokens it learns from; tokens_per_sec counts padding too (see metrics.py).
        return {"assistant_tokens_per_sec": float(targets_seen) / seconds}

    def progress(self, record: dict) -> str:
        return f" | {record['assistant_tokens_per_sec']:,.0f} assistant tok/s"
