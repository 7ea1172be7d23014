"""Turn the configured text into cached token files: once, on one process, reused by every later run.

Cache layout (``data.cache_dir``, default ``<run_dir>/../.token_cache``)::

    tokenizer-<key>/tokenizer.json        a trained BPE; key = corpus fingerprint + vocab size
                                          (or model.init's tokenizer and its config; key = its content)
    tokens-<key>/train.npy, val.npy       the token stream, split; key = corpus fingerprint + text field
                 meta.json                + tokenizer content + val_fraction
                                          (meta.json written last: its presence marks a complete entry)
                                          Or a task's own rows instead (``rows``: data/sft.py's
                                          chat rows), keyed by what decides them too.

A corpus fingerprint is the resolved path, size and modification time of each source file, so editing,
adding or removing a file re-tokenizes. Entries are built in a temporary folder and renamed into place,
so a crash or a concurrent run never leaves a half-written entry behind.

The validation split is the last ``val_fraction`` of the token stream (so a single large text file splits
too); the tokenizer is trained on the whole corpus.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from scalenlp.config import Config
from scalenlp.data.sources import Corpus, Piece, open_corpus
from scalenlp.data.tokenizer import TOKENIZER_CONFIG, eos_token_id, load_tokenizer, tokenizer_file, train_bpe
from scalenlp.errors import UserError

# Bump when the bytes a cache entry holds would change for the same inputs.
CACHE_FORMAT = 1
ENCODE_BATCH_CHARS = 4 << 20
ENCODE_BATCH_PIECES = 2048
T = TypeVar("T")


@dataclass
class DataFiles:
    tokenizer_json: Path  # usable by tokenizers.Tokenizer.from_file
    train_tokens: Path    # .npy token stream (uint16 if vocab < 65536 else uint32), documents separated by EOS
    val_tokens: Path
    eos_id: int
    vocab_size: int


@dataclass
class Plan:
    """Everything prepare_data and open_data agree on before anything is read."""
    cache_dir: Path
    corpus: Corpus
    tokenizer_json: Path
    trains_tokenizer: bool
    vocab_size: int
    # model.init's checkpoint (a scalenlp.models.pretrained.Pretrained, read by the caller: the data layer uses
    # only its tokenizer, tokenizer_config and path), whose tokenizer is written to the cache
    pretrained: Any = None


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _plan(cfg: Config, run_dir: Path, pretrained: Any) -> Plan:
    cache_dir = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else \
        Path(run_dir).resolve().parent / ".token_cache"
    corpus = open_corpus(cfg.data.path, cfg.data.text_field)
    if pretrained is not None:
        # Keyed by content: the token cache below is keyed by this file's hash, so the same data read
        # with another checkpoint's tokenizer gets its own entry.
        key = _key({"format": CACHE_FORMAT, "tokenizer": pretrained.tokenizer.to_str()})
        return Plan(cache_dir, corpus, cache_dir / f"tokenizer-{key}" / "tokenizer.json", False, 0, pretrained)
    if cfg.tokenizer.path:
        return Plan(cache_dir, corpus, tokenizer_file(cfg.tokenizer.path), False, 0)
    if corpus.tokenized:
        raise UserError(f"data.path={cfg.data.path} holds token files (.npy), whose ids mean something only to the "
                        f"tokenizer that made them: name it with tokenizer.path (or model.init)")
    key = _key({"format": CACHE_FORMAT, "corpus": corpus.fingerprint(), "vocab_size": cfg.tokenizer.vocab_size})
    return Plan(cache_dir, corpus, cache_dir / f"tokenizer-{key}" / "tokenizer.json", True,
                 cfg.tokenizer.vocab_size)


class PackedText:
    """The rows of a cache entry by default: every document tokenized into one stream, EOS after each, its
    last data.val_fraction held out. Another kind of rows (data/sft.py's ChatRows) has the same three members."""
    unit = "tokens"  # what the entry's train and val counts count, in the log

    def cache_key(self, plan: Plan, cfg: Config) -> dict:
        """What decides the rows besides the corpus, the tokenizer and data.val_fraction."""
        return {}

    def build(self, plan: Plan, cfg: Config, tokens_dir: Path, log: Callable[[str], None]) -> None:
        """Write the entry ``tokens_dir`` (through ``build_entry``)."""
        _tokenize(plan, cfg.data.val_fraction, tokens_dir, log)


PACKED_TEXT = PackedText()


def _tokens_dir(plan: Plan, cfg: Config, rows: Any) -> Path:
    key = _key({"format": CACHE_FORMAT, "corpus": plan.corpus.fingerprint(),
                "tokenizer": _file_sha256(plan.tokenizer_json), "val_fraction": cfg.data.val_fraction,
                **rows.cache_key(plan, cfg)})
    return plan.cache_dir / f"tokens-{key}"


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder into place; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _new_tmp(final: Path) -> Path:
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def _data_files(tokens_dir: Path, tokenizer_json: Path) -> DataFiles:
    meta = json.loads((tokens_dir / "meta.json").read_text())
    return DataFiles(tokenizer_json=tokenizer_json, train_tokens=tokens_dir / "train.npy",
                     val_tokens=tokens_dir / "val.npy", eos_id=meta["eos_id"], vocab_size=meta["vocab_size"])


def prepare_data(cfg: Config, run_dir: Path, log: Callable[[str], None] = print,
                 pretrained: Any = None, rows: Any = PACKED_TEXT) -> DataFiles:
    """Resolve sources, train or load the tokenizer, tokenize once into cached token files (run on one rank).
    With ``pretrained`` (model.init's checkpoint) its tokenizer is used. ``rows``: what the files hold, packed
    text or a task's own rows (data/sft.py's CHAT_ROWS: conversations rendered with the chat template)."""
    plan = _plan(cfg, run_dir, pretrained)
    plan.cache_dir.mkdir(parents=True, exist_ok=True)
    log(f"data: {plan.corpus.description}")
    if plan.trains_tokenizer:
        if plan.tokenizer_json.is_file():
            log(f"tokenizer: cache hit {plan.tokenizer_json}")
        else:
            _train_tokenizer(plan, log)
    elif pretrained is not None:
        if not plan.tokenizer_json.is_file():
            _save_tokenizer(pretrained, plan.tokenizer_json.parent)
        log(f"tokenizer: from {pretrained.path} ({plan.tokenizer_json})")
    else:
        log(f"tokenizer: {plan.tokenizer_json}")
    tokens_dir = _tokens_dir(plan, cfg, rows)
    if (tokens_dir / "meta.json").is_file():
        files = _data_files(tokens_dir, plan.tokenizer_json)
        log(f"tokens: cache hit {tokens_dir} ({_count(files.train_tokens):,} train, "
            f"{_count(files.val_tokens):,} val {rows.unit})")
        return files
    rows.build(plan, cfg, tokens_dir, log)
    return _data_files(tokens_dir, plan.tokenizer_json)


def open_data(cfg: Config, run_dir: Path, pretrained: Any = None, rows: Any = PACKED_TEXT) -> DataFiles:
    """Find the token files prepare_data made for this config and ``rows`` (cheap; every rank, after a
    barrier)."""
    plan = _plan(cfg, run_dir, pretrained)
    if plan.trains_tokenizer and not plan.tokenizer_json.is_file():
        raise UserError(f"no trained tokenizer in {plan.cache_dir} for this corpus and vocab size: "
                        f"prepare_data must run (on rank 0) before open_data")
    tokens_dir = _tokens_dir(plan, cfg, rows)
    if not (tokens_dir / "meta.json").is_file():
        raise UserError(f"no token files in {plan.cache_dir} for this data and tokenizer: prepare_data must run "
                        f"(on rank 0) before open_data, with the same config and unchanged source files")
    return _data_files(tokens_dir, plan.tokenizer_json)


def _count(token_file: Path) -> int:
    return int(np.load(token_file, mmap_mode="r").shape[0])


class _TextCounter:
    """Passes texts through while counting documents and characters, for logs and the empty-corpus check."""

    def __init__(self, pieces: Iterable[Piece]):
        self.pieces, self.documents, self.chars = pieces, 0, 0

    def __iter__(self) -> Iterator[Piece]:
        for piece in self.pieces:
            self.documents += piece.ends_document
            self.chars += len(piece.text)
            yield piece

    def summary(self, corpus: Corpus) -> str:
        what = "docstrings from the Python standard library" if corpus.builtin else \
            "document" if self.documents == 1 else "documents"
        return f"{self.documents:,} {what}, {self.chars / 1e6:.1f} M characters"


def _no_text(corpus: Corpus) -> UserError:
    return UserError(f"no text found in {corpus.description} (every document is empty); check data.path and, "
                     f"for .jsonl/.parquet/.tsv, data.text_field={corpus.text_field!r}")


def _train_tokenizer(plan: Plan, log: Callable[[str], None]) -> None:
    start = time.perf_counter()
    counter = _TextCounter(plan.corpus.pieces())
    tokenizer = train_bpe((p.text for p in counter), plan.vocab_size)
    if counter.chars == 0:
        raise _no_text(plan.corpus)
    final = plan.tokenizer_json.parent
    tmp = _new_tmp(final)
    tokenizer.save(str(tmp / "tokenizer.json"))
    _publish(tmp, final)
    log(f"tokenizer: trained byte-level BPE, vocab {tokenizer.get_vocab_size()}, on {counter.summary(plan.corpus)} "
        f"in {time.perf_counter() - start:.1f}s (cached at {plan.tokenizer_json})")


def _batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= ENCODE_BATCH_CHARS or len(batch) >= ENCODE_BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_stream(corpus: Corpus, tokenizer, eos: int, dtype, path: Path) -> _TextCounter:
    """Tokenize every document into one flat file, EOS after each; returns the document/character counts."""
    counter = _TextCounter(corpus.pieces())
    with open(path, "wb") as out:
        for batch in _batches(counter):
            ids = []
            for piece, enc in zip(batch, tokenizer.encode_batch([p.text for p in batch])):
                ids.append(enc.ids)
                # EOS closes a document unless the tokenizer's own template already ended it with one.
                if piece.ends_document and not (enc.ids and enc.ids[-1] == eos):
                    ids.append((eos,))
            np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype).tofile(out)
    return counter


def _copy_tokens(corpus: Corpus, vocab_size: int, eos: int, dtype, path: Path) -> int:
    """Concatenate the corpus' .npy token files into one flat file, each checked to be ids of this tokenizer;
    returns the number of documents (EOS tokens)."""
    documents = 0
    with open(path, "wb") as out:
        for f in corpus.files:
            try:
                ids = np.load(f, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read token file {f} ({e}); save token ids with numpy.save") from None
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise UserError(f"token file {f} holds a {ids.ndim}-D {ids.dtype} array; it must be a 1-D integer "
                                f"array of token ids (documents separated by EOS)")
            # One pass, in slices: the files may be larger than memory. A bad id found after some slices were
            # written leaves only the temporary folder, which build_entry removes.
            for start in range(0, len(ids), 1 << 24):
                part = np.asarray(ids[start:start + (1 << 24)])
                low, high = int(part.min()), int(part.max())
                if not 0 <= low <= high < vocab_size:
                    raise UserError(f"token file {f} has ids from {low} to {high} (at least), outside the "
                                    f"tokenizer's 0..{vocab_size - 1}: it was made with another tokenizer; set "
                                    f"tokenizer.path to that one")
                documents += int(np.count_nonzero(part == eos))
                part.astype(dtype, copy=False).tofile(out)
    return documents


def build_entry(final: Path, fill: Callable[[Path], T]) -> T:
    """Let ``fill`` write a temporary folder, then publish it as ``final`` (nothing half-written is ever
    seen); returns what ``fill`` returns."""
    tmp = _new_tmp(final)
    try:
        result = fill(tmp)
        _publish(tmp, final)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published


def _save_tokenizer(pretrained: Any, folder: Path) -> None:
    """The checkpoint's tokenizer as a cache entry; its config goes alongside, where ``eos_token_id`` looks."""
    def fill(tmp: Path) -> None:
        pretrained.tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / TOKENIZER_CONFIG).write_text(json.dumps(pretrained.tokenizer_config, indent=2))
    build_entry(folder, fill)


def _tokenize(plan: Plan, val_fraction: float, tokens_dir: Path, log: Callable[[str], None]) -> None:
    start = time.perf_counter()
    tokenizer = load_tokenizer(plan.tokenizer_json)
    eos = eos_token_id(tokenizer, plan.tokenizer_json.parent)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size < 1 << 16 else np.uint32)

    def fill(tmp: Path) -> tuple[str, int, int]:
        if plan.corpus.tokenized:
            documents, chars = _copy_tokens(plan.corpus, vocab_size, eos, dtype, tmp / "stream.bin"), None
            read = f"{documents:,} documents already tokenized"
        else:
            counter = _write_stream(plan.corpus, tokenizer, eos, dtype, tmp / "stream.bin")
            documents, chars, read = counter.documents, counter.chars, counter.summary(plan.corpus)
        total = (tmp / "stream.bin").stat().st_size // dtype.itemsize
        if total == 0:
            raise _no_text(plan.corpus)
        tokens = np.memmap(tmp / "stream.bin", dtype=dtype, mode="r")
        n_val = round(total * val_fraction)
        np.save(tmp / "train.npy", tokens[:total - n_val])
        np.save(tmp / "val.npy", tokens[total - n_val:])
        del tokens
        (tmp / "stream.bin").unlink()
        (tmp / "meta.json").write_text(json.dumps({
            "eos_id": eos, "vocab_size": vocab_size, "dtype": dtype.name, "train_tokens": total - n_val,
            "val_tokens": n_val, "documents": documents, "characters": chars,
            "sources": plan.corpus.description, "tokenizer": str(plan.tokenizer_json),
        }, indent=2))
        return read, total, n_val

    read, total, n_val = build_entry(tokens_dir, fill)
    log(f"tokens: read {read}; {total:,} tokens ({total - n_val:,} train, "
        f"{n_val:,} val) in {time.perf_counter() - start:.1f}s (cached at {tokens_dir})")
