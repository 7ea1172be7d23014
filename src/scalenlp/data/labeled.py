"""Labelled examples for classification fine-tuning: read, label, tokenize, and batch with length bucketing.

Files: ``.tsv`` (header row, GLUE style), ``.csv`` (header row, quoted fields), ``.jsonl`` (one object per line)
and ``.parquet``. The text is under ``text_field`` or, failing that, ``sentence``/``content``/``text`` (GLUE
files name it differently from split to split); the label under ``label_field``; a second text for sentence
pairs under ``text_pair_field``. Rows that cannot be read, and rows with an empty text, are skipped and
reported with their line numbers (the first few, then a count), so one bad line does not cost a run.

Labels are strings ("0", "positive", ...) or whole numbers (read as their digits); any other JSON value (true,
2.5, a list) is a row that cannot be used. A row with a text or label that is not valid Unicode (a byte that is
not UTF-8, a lone surrogate) is skipped like any other. The label set comes from the training file, sorted (by value when
every label is a number), and travels with the checkpoint as a plain list; the eval file may only use labels
from it.

Batching is the token ``DataLoader``'s scheme one level up: the order of global batches depends only on
(seed, epoch), every data-parallel rank takes the same number of rows of each, so the global batch is the
same whatever the number of ranks, and a saved position resumes with any rank count. To cut padding, rows
are sorted by length within large random chunks before being cut into batches, and the batches are then
shuffled, so a batch holds rows of similar length without the epoch running from short to long.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from scalenlp.config import Config, DataConfig
from scalenlp.data.dataset import GlobalBatchLoader
from scalenlp.data.sources import read_tsv, tsv_text_column
from scalenlp.data.text import jsonl_rows, open_rows, text_problem
from scalenlp.errors import UserError, require

LABELED_FORMATS = (".tsv", ".csv", ".jsonl", ".parquet")
# Rows named one by one in a report of skipped rows; the rest are counted.
REPORT_ROWS = 5
# Label of a row that only fills an evaluation batch up to the same size on every rank; scores skip it.
IGNORE_LABEL = -100

# One row as read: (line number, text, pair text or None, label); the values are checked after reading.
_Row = tuple[int, object, object, object]
# Where a reader reports a row it cannot read: (line number, why).
_Skip = Callable[[int, str], None]


@dataclass
class LabeledExamples:
    """The usable rows of one file, in file order, labels as written (strings)."""
    path: Path
    texts: list[str]
    pairs: list[str] | None
    labels: list[str]
    lines: list[int]

    def __len__(self) -> int:
        return len(self.texts)


def read_labeled(path: str | Path, text_field: str, label_field: str, text_pair_field: str = "",
                 log: Callable[[str], None] = print) -> LabeledExamples:
    """Every usable row of a labelled file; unusable rows are reported through ``log`` and skipped."""
    f = Path(path).expanduser()
    if not f.is_file():
        raise UserError(f"labelled data file {str(f)!r} does not exist; give a {'/'.join(LABELED_FORMATS)} file")
    readers = {".tsv": _tsv_rows, ".csv": _csv_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows}
    reader = readers.get(f.suffix.lower())
    if reader is None:
        raise UserError(f"{f}: unsupported file type {f.suffix or '(no extension)'!r} for labelled data; "
                        f"use {', '.join(LABELED_FORMATS)}")
    out = LabeledExamples(f, [], [] if text_pair_field else None, [], [])
    skipped: list[tuple[int, str]] = []
    for line, text, pair, label in reader(f, text_field, label_field, text_pair_field,
                                          lambda line, why: skipped.append((line, why))):
        problem = _row_problem(text, pair, label, text_pair_field)
        if problem:
            skipped.append((line, problem))
            continue
        out.texts.append(text)
        if out.pairs is not None:
            out.pairs.append(pair)
        out.labels.append(_label_text(label))
        out.lines.append(line)
    if skipped:
        log(f"{f}: skipped {len(skipped)} row(s) that cannot be used:")
        for line, why in sorted(skipped)[:REPORT_ROWS]:
            log(f"  {f}:{line}: {why}")
        if len(skipped) > REPORT_ROWS:
            log(f"  ... and {len(skipped) - REPORT_ROWS} more")
    if not out.texts:
        raise UserError(f"{f} has no usable rows (need a text column and a {label_field!r} label column); "
                        f"check data.text_field / data.label_field")
    return out


def _row_problem(text, pair, label, text_pair_field: str) -> str | None:
    for name, value in (("text", text), *((("pair text", pair),) if text_pair_field else ())):
        if value is None or isinstance(value, str) and not value.strip():
            return f"empty {name}"
        if (problem := text_problem(value, name)) is not None:
            return problem
    if label is None or isinstance(label, str) and not label.strip():
        return "empty label"
    if isinstance(label, str) and (problem := text_problem(label, "the label")) is not None:
        return problem
    if _label_text(label) is None:
        return f"label {label!r} is not a string or a whole number"
    return None


def _label_text(label) -> str | None:
    """A label as the string it is known by: strings stripped, whole numbers (1, 1.0) as their digits; None for
    anything else. JSON's true and false are Python ints, but no class: refused, not a class "True"."""
    if isinstance(label, str):
        return label.strip() or None
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return str(label)
    if isinstance(label, float) and label.is_integer():
        return str(int(label))
    return None


def _columns(f: Path, header: list[str], text_field: str, label_field: str, text_pair_field: str
             ) -> tuple[int, int | None, int]:
    """Positions of the text, pair text and label in a header; a missing one is the user's to fix."""
    text = tsv_text_column(f, header, text_field)
    for name, key in ((label_field, "label_field"), (text_pair_field, "text_pair_field")):
        if name and name not in header:
            raise UserError(f"{f}: no column {name!r} (columns: {', '.join(header)}); set data.{key}")
    return text, header.index(text_pair_field) if text_pair_field else None, header.index(label_field)


def _tsv_rows(f: Path, text_field: str, label_field: str, text_pair_field: str,
              skip: _Skip) -> Iterator[_Row]:
    header, rows = read_tsv(f, skip)
    text, pair, label = _columns(f, header, text_field, label_field, text_pair_field)
    for line, row in rows:
        yield line, row[text], None if pair is None else row[pair], row[label]


def _csv_rows(f: Path, text_field: str, label_field: str, text_pair_field: str,
              skip: _Skip) -> Iterator[_Row]:
    with open_rows(f) as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        text, pair, label = _columns(f, header, text_field, label_field, text_pair_field)
        while True:
            line = reader.line_num + 1  # a quoted field may span lines: the row starts after the last one read
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                skip(line, f"not valid CSV ({e})")
                continue
            if not row:
                continue
            if len(row) != len(header):
                skip(line, f"{len(row)} comma-separated fields, the header has {len(header)}")
                continue
            yield line, row[text], None if pair is None else row[pair], row[label]


def _jsonl_rows(f: Path, text_field: str, label_field: str, text_pair_field: str,
                skip: _Skip) -> Iterator[_Row]:
    # The first object's keys act as the header: a wrong field name is one error, not a report of every line.
    names: tuple[str, str, str] | None = None
    for line, record, problem in jsonl_rows(f):
        if problem is not None:
            skip(line, problem)
            continue
        if not isinstance(record, dict):
            skip(line, f"a JSON {type(record).__name__}, not an object")
            continue
        if names is None:
            keys = list(record)
            t, p, lab = _columns(f, keys, text_field, label_field, text_pair_field)
            names = (keys[t], keys[p] if p is not None else "", keys[lab])
        missing = [n for n in names if n and n not in record]
        if missing:
            skip(line, f"no {', '.join(map(repr, missing))} field")
            continue
        yield line, record[names[0]], record[names[1]] if names[1] else None, record[names[2]]


def _parquet_rows(f: Path, text_field: str, label_field: str, text_pair_field: str,
                  skip: _Skip) -> Iterator[_Row]:
    pa = require("pyarrow", "parquet")
    pq = require("pyarrow.parquet", "parquet")

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f} is not a readable parquet file ({e})") from None
    header = pf.schema_arrow.names
    positions = _columns(f, header, text_field, label_field, text_pair_field)
    columns = [header[i] for i in positions if i is not None]
    row = 0
    for batch in pf.iter_batches(columns=columns, batch_size=4096):
        values = [batch.column(name).to_pylist() for name in columns]
        for i in range(batch.num_rows):
            row += 1  # parquet has no lines: rows are numbered from 1
            text, *rest = (v[i] for v in values)
            yield row, text, rest[0] if text_pair_field else None, rest[-1]


def label_names(labels: list[str]) -> list[str]:
    """The sorted label set: by value when every label is a number (so "10" follows "9"), else as text."""
    names = set(labels)
    try:
        values = {name: float(name) for name in names}
    except ValueError:
        return sorted(names)
    if all(math.isfinite(v) for v in values.values()):
        return sorted(names, key=lambda name: (values[name], name))
    return sorted(names)


def label_ids(examples: LabeledExamples, names: list[str]) -> np.ndarray:
    """Each row's index in ``names``; a label outside it (one training never saw) is an error."""
    index = {name: i for i, name in enumerate(names)}
    unseen: dict[str, int] = {}
    for label, line in zip(examples.labels, examples.lines):
        if label not in index:
            unseen.setdefault(label, line)
    if unseen:
        where = ", ".join(f"{label!r} (first at {examples.path}:{line})" for label, line in unseen.items())
        raise UserError(f"{examples.path} has label(s) the training data does not: {where}; the known labels are "
                        f"{', '.join(map(repr, names))}; fix the file or train on data that has them")
    return np.array([index[label] for label in examples.labels], dtype=np.int64)


@dataclass
class LabeledDataset:
    """Tokenized rows as one flat array of token ids with row offsets (ragged, unpadded), plus label ids."""
    ids: np.ndarray
    type_ids: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    pad_id: int

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def collate(self, rows: np.ndarray, labels: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """(input_ids, attention_mask, token_type_ids, labels) of ``rows``, padded to the longest of them."""
        width = int(self.lengths[rows].max())
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        token_type_ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            start, end = self.offsets[row], self.offsets[row + 1]
            input_ids[i, :end - start] = torch.from_numpy(self.ids[start:end].astype(np.int64))
            token_type_ids[i, :end - start] = torch.from_numpy(self.type_ids[start:end].astype(np.int64))
            attention_mask[i, :end - start] = 1
        labels = self.labels[rows] if labels is None else labels
        return input_ids, attention_mask, token_type_ids, torch.from_numpy(np.asarray(labels, dtype=np.int64))


def tokenize_labeled(examples: LabeledExamples, labels: np.ndarray, tokenizer: Tokenizer, max_len: int,
                     log: Callable[[str], None] = print) -> LabeledDataset:
    """Token ids of every row (with the tokenizer's special tokens, pairs as pairs), truncated to ``max_len``;
    one line through ``log`` counts the rows that were truncated."""
    tok = Tokenizer.from_str(tokenizer.to_str())  # a copy: padding and truncation are set on the tokenizer itself
    tok.no_padding()  # batches are padded to their own longest row, not to the tokenizer's fixed length
    is_pair = examples.pairs is not None
    shortest = tok.num_special_tokens_to_add(is_pair) + (2 if is_pair else 1)
    if max_len < shortest:
        raise UserError(f"a maximum length of {max_len} tokens leaves no room for text next to the tokenizer's "
                        f"special tokens; use training.seq_len >= {shortest}")
    tok.enable_truncation(max_len)
    inputs = list(zip(examples.texts, examples.pairs)) if is_pair else examples.texts
    encodings = tok.encode_batch(inputs)
    truncated = sum(1 for e in encodings if e.overflowing)
    if truncated:
        log(f"{examples.path}: {truncated} of {len(encodings)} rows are longer than {max_len} tokens and were "
            f"truncated; raise training.seq_len (up to the model's maximum) to keep more of them")
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int32, count=int(offsets[-1]))
    type_ids = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int8, count=int(offsets[-1]))
    # Padded positions are masked out of attention, so any valid id pads; 0 when the tokenizer names none.
    pad_id = (tokenizer.padding or {}).get("pad_id", 0)
    return LabeledDataset(ids, type_ids, offsets, labels, pad_id)


class LabeledLoader(GlobalBatchLoader):
    """This rank's share of each global batch of a labelled dataset, epoch after epoch, resumable at any batch."""

    size_key = "num_rows"

    def __init__(self, dataset: LabeledDataset, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, bucket_batches: int = DataConfig.bucket_batches):
        super().__init__(len(dataset), global_batch_size, dp_rank, dp_size, seed, shuffle)
        if len(dataset) < global_batch_size:
            raise UserError(f"the training data has {len(dataset)} usable rows, fewer than one global batch of "
                            f"{global_batch_size}; use more data or a smaller training.global_batch_size")
        self.dataset = dataset
        self.bucket_batches = bucket_batches
        self._order: tuple[int, np.ndarray] | None = None

    @classmethod
    def for_run(cls, dataset: LabeledDataset, cfg: Config, dp_rank: int, dp_size: int) -> LabeledLoader:
        """The loader a training run's config asks for."""
        t, d = cfg.training, cfg.data
        return cls(dataset, t.global_batch_size, dp_rank, dp_size, t.seed, d.shuffle, d.bucket_batches)

    def batch_order(self, epoch: int) -> np.ndarray:
        """Row indices of every global batch of ``epoch``, shape (batches, global_batch_size), each batch sorted
        by length: a function of (seed, epoch) only. Without shuffling, the rows in file order, unsorted."""
        if self._order is None or self._order[0] != epoch:
            g = self.global_batch_size
            if not self.shuffle:
                self._order = (epoch, np.arange(self.batches_per_epoch * g).reshape(self.batches_per_epoch, g))
                return self._order[1]
            rng = np.random.default_rng([self.seed, epoch])
            # The rows that do not fill a last batch are dropped before bucketing: random rows, new each epoch.
            rows = rng.permutation(len(self.dataset))[:self.batches_per_epoch * g]
            lengths = self.dataset.lengths
            chunk = g * self.bucket_batches
            for start in range(0, len(rows), chunk):
                part = rows[start:start + chunk]
                rows[start:start + chunk] = part[np.argsort(lengths[part], kind="stable")]
            batches = rows.reshape(self.batches_per_epoch, g)
            self._order = (epoch, batches[rng.permutation(self.batches_per_epoch)])
        return self._order[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, token_type_ids, labels) of this rank's global_batch_size / dp_size rows."""
        epoch, batch = self.advance()
        rows = self.batch_order(epoch)[batch]
        # Ranks take every dp_size-th row of the length-sorted batch, so each gets a similar mix of lengths
        # (similar work per step) rather than the short or the long end.
        return self.dataset.collate(rows[self.dp_rank::self.dp_size])


def eval_batches(dataset: LabeledDataset, global_batch_size: int, dp_rank: int, dp_size: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's share of every row, once, in batches of rows of similar length. Every rank gets the same
    number of batches of the same size (sharded models run collectives in each forward), so a last batch that
    does not split evenly is filled with copies of a row labelled ``IGNORE_LABEL``, which scores skip."""
    order = np.argsort(dataset.lengths, kind="stable")
    for start in range(0, len(order), global_batch_size):
        batch = order[start:start + global_batch_size]
        share = batch[dp_rank::dp_size]
        labels = dataset.labels[share]
        fill = -(-len(batch) // dp_size) - len(share)
        if fill:
            share = np.concatenate([share, np.full(fill, batch[0])])
            labels = np.concatenate([labels, np.full(fill, IGNORE_LABEL)])
        yield dataset.collate(share, labels)
