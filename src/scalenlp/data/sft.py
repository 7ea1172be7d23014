"""Supervised fine-tuning data: chat conversations rendered with the model's chat template, one row each,
with the loss on the assistant's tokens only.

Input: ``.jsonl`` files, one conversation per line as OpenAI's chat API takes it,
``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``. Each is
rendered by the pretrained checkpoint's chat template (``data/chat.py``) and stored as one row of
``seq_len + 1`` tokens beside its labels: the token itself where it belongs to an assistant turn,
``IGNORE_INDEX`` everywhere else (system and user turns, template markup, padding). A longer conversation
is cut at ``seq_len + 1`` tokens, a shorter one padded.

Rows are not packed several to a sequence as pre-training text is: attention is plain causal over the
whole row, so a conversation packed after another would see it, and its positions would not start at 0
as they do when the model is asked a question at inference. Padding costs compute on short rows instead,
little for chat sets whose conversations have similar lengths.

Lines that cannot be used (not UTF-8 or a lone surrogate, not JSON, a number too long to read, no ``messages``
list, an unknown role, a template that fails on them or passes the template worker's time or output limit, no
assistant token within the row) are skipped and reported with their line numbers. The last
``data.val_fraction`` of the conversations is the held-out split.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalenlp.config import Config
from scalenlp.data.chat import ChatError, chat_template, end_of_turn_ids, template_variables
from scalenlp.data.dataset import open_tokens
from scalenlp.data.prepare import Plan, build_entry
from scalenlp.data.sources import Corpus
from scalenlp.data.template_workers import TemplateWorkers
from scalenlp.data.text import jsonl_rows
from scalenlp.errors import UserError

# Bump when the rows written for the same inputs would change.
SFT_FORMAT = 1
IGNORE_INDEX = -100  # targets the loss skips (F.cross_entropy's default ignore_index)
REPORTED_PROBLEMS = 5  # skipped lines named in the log; the rest are counted


def read_conversations(files: list[Path]) -> Iterator[tuple[str, list | str]]:
    """("file:line", the line's ``messages``) for each non-blank line, or ("file:line", why it is unusable)."""
    for f in files:
        if f.suffix.lower() != ".jsonl":
            raise UserError(f"{f}: training.task=\"sft\" reads .jsonl files with a `messages` list per line; "
                            f"point data.path at such files")
        for lineno, record, problem in jsonl_rows(f):  # one bad line is skipped, not the file
            where = f"{f}:{lineno}"
            if problem is not None:
                yield where, problem
                continue
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                yield where, "no `messages` list"
                continue
            yield where, record["messages"]


def _masked_rows(templates, conversations, end_of_turn: list[int], problems: list[str]):
    """(file:line, ids, assistant mask) of each usable conversation; why the others are not, into ``problems``."""
    for where, messages in conversations:
        if isinstance(messages, str):
            problems.append(f"{where}: {messages}")
            continue
        try:
            yield where, *templates.masked_ids_blocking(messages, end_of_turn)
        except ChatError as e:
            problems.append(f"{where}: {e}")


def write_chat_rows(corpus: Corpus, pretrained: Any, cfg: Config, out_dir: Path,
                    log: Callable[[str], None]) -> None:
    """Render, tokenize and label every conversation into ``train.npy`` / ``val.npy`` (int32, shape
    (conversations, 2, seq_len + 1): tokens, labels) and ``meta.json`` in ``out_dir``."""
    tokenizer, config = pretrained.tokenizer, pretrained.tokenizer_config
    chat_template(config)  # a model without a template is refused before any row is read
    end_of_turn = end_of_turn_ids(tokenizer, config)
    width = cfg.training.seq_len + 1
    # Padding is never attended to by real tokens (causal attention, padding comes last) and never a
    # target, so any id serves; the end-of-turn token keeps the rows readable.
    pad = end_of_turn[0] if end_of_turn else 0
    rows, problems, truncated = [], [], 0
    # The template is the model file's code: rendered in a worker process under the server's time and output
    # limits, so that a row it never finishes is skipped like any other bad row.
    templates = TemplateWorkers(tokenizer, config, workers=1)
    try:
        for where, ids, mask in _masked_rows(templates, read_conversations(corpus.files), end_of_turn, problems):
            ids, mask = ids[:width], mask[:width]
            if not any(mask[1:]):  # the first token is never a target
                problems.append(f"{where}: no assistant token within the first training.seq_len+1={width} tokens")
                continue
            truncated += len(ids) == width
            row = np.full((2, width), IGNORE_INDEX, dtype=np.int32)
            row[0] = pad
            row[0, :len(ids)] = ids
            row[1, :len(ids)] = np.where(mask, ids, IGNORE_INDEX)
            rows.append(row)
    finally:
        templates.close()
    if problems:
        more = f" (and {len(problems) - REPORTED_PROBLEMS} more)" if len(problems) > REPORTED_PROBLEMS else ""
        log(f"data: skipped {len(problems)} line(s): " + "; ".join(problems[:REPORTED_PROBLEMS]) + more)
    if not rows:
        raise UserError(f"no usable conversation in {corpus.description}"
                        + (f": {problems[0]}" if problems else " (the files are empty)"))
    n_val = round(len(rows) * cfg.data.val_fraction)
    table = np.stack(rows)
    learnt = int((table[:, 1, 1:] != IGNORE_INDEX).sum())
    np.save(out_dir / "train.npy", table[:len(rows) - n_val])
    np.save(out_dir / "val.npy", table[len(rows) - n_val:])
    (out_dir / "meta.json").write_text(json.dumps({
        "eos_id": pad, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "task": "sft",
        "train_conversations": len(rows) - n_val, "val_conversations": n_val, "skipped": problems,
        "truncated": truncated, "sources": corpus.description, "assistant_tokens": learnt,
    }, indent=2))
    log(f"data: {len(rows):,} conversations ({len(rows) - n_val:,} train, {n_val:,} val), {truncated:,} cut at "
        f"{width} tokens, {learnt:,} assistant tokens to learn")


class ChatRows:
    """The token cache's entry of chat rows (``prepare_data(..., rows=CHAT_ROWS)``) instead of packed text."""
    unit = "conversations"  # what the entry's train and val counts count, in the log

    def cache_key(self, plan: Plan, cfg: Config) -> dict:
        """What decides the rows besides the files and the tokenizer: the template, its variables, the row length."""
        config = plan.pretrained.tokenizer_config
        return {"task": "sft",  # (in the key since the first chat rows: their cache entries stay valid)
                 "sft_format": SFT_FORMAT, "chat_template": chat_template(config),
                "variables": template_variables(config), "seq_len": cfg.training.seq_len}

    def build(self, plan: Plan, cfg: Config, tokens_dir: Path, log: Callable[[str], None]) -> None:
        if plan.corpus.tokenized:
            raise UserError(f"training.task=sft renders conversations with the chat template, so it needs text; "
                            f"data.path={cfg.data.path} holds token files (.npy)")
        build_entry(tokens_dir, lambda tmp: write_chat_rows(plan.corpus, plan.pretrained, cfg, tmp, log))


CHAT_ROWS = ChatRows()


class ChatDataset:
    """Rows of (tokens, labels) written by ``write_chat_rows``; a drop-in for ``TokenDataset`` in the loader."""

    def __init__(self, rows_file: Path, seq_len: int):
        self.token_file = Path(rows_file)
        self.rows = open_tokens(self.token_file)
        self.seq_len = seq_len
        if len(self.rows) == 0:
            raise UserError(f"{self.token_file} holds no conversations; use more data, or for the held-out split "
                            f"a larger data.val_fraction (or training.eval_every=0)")

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): the tokens, and the labels shifted by one (IGNORE_INDEX where nothing is learnt)."""
        rows = torch.from_numpy(self.rows[np.asarray(indices, dtype=np.int64)].astype(np.int64))
        return rows[:, 0, :-1], rows[:, 1, 1:]

    def shortfall(self, global_batch_size: int) -> str:
        return (f"{self.token_file} holds {len(self)} conversations, fewer than one global batch of "
                f"{global_batch_size}; use more conversations or a smaller training.global_batch_size")
