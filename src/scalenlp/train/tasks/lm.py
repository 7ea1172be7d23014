"""``training.task = "lm"``: next-token loss on packed text, windows of training.seq_len + 1 tokens cut from
the token stream with documents one after another (EOS between them). Everything but data.reset_positions is
the base Task's defaults."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from scalenlp.config import Config
from scalenlp.data import DataLoader, load_tokenizer
from scalenlp.data.dataset import document_positions
from scalenlp.data.tokenizer import find_bos_token_id
from scalenlp.models.pretrained import Pretrained
from scalenlp.train.tasks.base import Task


class LanguageModeling(Task):
    packs_documents = True

    def build_data(self, cfg: Config, run_dir: Path, pretrained: Pretrained | None, dp_index: int, dp_size: int,
                   log: Callable[[str], None]) -> DataLoader:
        loader = super().build_data(cfg, run_dir, pretrained, dp_index, dp_size, log)
        # (BOS, EOS) ids where documents start and end, for data.reset_positions.
        self.document_marks = (find_bos_token_id(load_tokenizer(self.tokenizer), self.tokenizer),
                               self.files.eos_id) if cfg.data.reset_positions else None
        return loader

    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Under data.reset_positions, positions that restart at each document of a packed window."""
        return None if self.document_marks is None else document_positions(inputs, *self.document_marks)
