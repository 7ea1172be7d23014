"""Where training text comes from: files a user names (.txt, .jsonl, .parquet, .tsv, or .npy token ids) or the
built-in corpus, the docstrings of the Python standard library this interpreter runs on.

A source is read as a stream of documents (strings); the tokenizer appends EOS after each one. A large .txt
file is yielded in pieces cut after blank lines that together stay one document (``Piece.ends_document``).
The formats and their fields: docs/training.md, "Data".
"""

from __future__ import annotations

import ast
import glob
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scalenlp.data.text import jsonl_rows, open_rows, text_problem
from scalenlp.errors import UserError, require

TEXT_TYPES = (".txt", ".jsonl", ".parquet", ".tsv")
TOKENS_TYPE = ".npy"
SUPPORTED = (*TEXT_TYPES, TOKENS_TYPE)
TXT_PIECE_CHARS = 1 << 20
TSV_TEXT_COLUMNS = ("sentence", "content", "text")
BUILTIN = "builtin:stdlib-docstrings"
# Folders of the standard library that hold tests or third-party code rather than library documentation.
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# Tests lower this to read a few modules only; None means the whole standard library.
BUILTIN_MAX_FILES: int | None = None


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool = True


def resolve_sources(path: str) -> list[Path]:
    """The files behind ``data.path``: a file, a folder (recursive, sorted) or a glob (sorted)."""
    if any(ch in path for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(path), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UserError(f"data.path glob {path!r} matches no files; check the pattern "
                            f"(use ** for subfolders, e.g. 'corpus/**/*.jsonl')")
        for f in files:
            _check_extension(f)
        return files
    p = Path(path).expanduser()
    if p.is_file():
        _check_extension(p)
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and not _hidden(f.relative_to(p)))
        files = [f for f in found if f.suffix.lower() in SUPPORTED]
        if not files:
            seen = sorted({f.suffix or f.name for f in found})
            raise UserError(f"data.path folder {str(p)!r} holds no {'/'.join(SUPPORTED)} files "
                            f"(found: {', '.join(seen) or 'nothing'}); point it at a folder of text data")
        return files
    raise UserError(f"data.path {str(p)!r} does not exist; give a file, folder or glob of "
                    f"{'/'.join(SUPPORTED)} files, or leave it empty for the built-in corpus")


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _check_extension(f: Path) -> None:
    if f.suffix.lower() not in SUPPORTED:
        raise UserError(f"{f}: unsupported file type {f.suffix or '(no extension)'!r}; data files must be "
                        f"{', '.join(SUPPORTED)} (convert it, or narrow data.path to exclude it)")


def read_pieces(files: list[Path], text_field: str) -> Iterator[Piece]:
    """Every document of every file, in order; blank documents are dropped."""
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".tsv": _read_tsv}
    for f in files:
        document_open = False
        for piece in readers[f.suffix.lower()](f, text_field):
            # A blank last piece of a started document still carries the document's end.
            if piece.text.strip() or (piece.ends_document and document_open):
                yield piece
                document_open = not piece.ends_document


def _open_text(f: Path):
    # newline=None turns CRLF and lone CR into LF, which untidy real files mix freely.
    return open(f, encoding="utf-8", newline=None)


def _decode_error(f: Path, e: UnicodeDecodeError) -> UserError:
    return UserError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); re-encode it as UTF-8")


def _read_txt(f: Path, text_field: str) -> Iterator[Piece]:
    try:
        with _open_text(f) as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        raise _decode_error(f, e) from None
    if not text.strip():
        return
    start = 0
    while len(text) - start > TXT_PIECE_CHARS:
        cut = text.find("\n\n", start + TXT_PIECE_CHARS)
        if cut < 0:
            break
        yield Piece(text[start:cut + 2], ends_document=False)
        start = cut + 2
    yield Piece(text[start:])


def _read_jsonl(f: Path, text_field: str) -> Iterator[Piece]:
    # A pre-training corpus refuses a bad line with its file:line rather than skipping it: its documents are not
    # counted one by one as labelled rows are, so a skipped line would go unnoticed.
    for lineno, record, problem in jsonl_rows(f):
        if problem is not None:
            raise UserError(f"{f}:{lineno}: {problem}; each line must be one JSON object of UTF-8 text")
        if not isinstance(record, dict) or text_field not in record:
            raise UserError(f"{f}:{lineno}: no {text_field!r} field; set data.text_field to the field "
                            f"holding the text" + (f" (this line has {', '.join(map(repr, record))})"
                                                   if isinstance(record, dict) else ""))
        text = record[text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise UserError(f"{f}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
        yield Piece(text)


def _read_parquet(f: Path, text_field: str) -> Iterator[Piece]:
    pa = require("pyarrow", "parquet")
    pq = require("pyarrow.parquet", "parquet")

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f} is not a readable parquet file ({e})") from None
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise UserError(f"{f}: no column {text_field!r} (columns: {', '.join(columns)}); set data.text_field")
    if not pa.types.is_string(pf.schema_arrow.field(text_field).type) and \
            not pa.types.is_large_string(pf.schema_arrow.field(text_field).type):
        raise UserError(f"{f}: column {text_field!r} holds {pf.schema_arrow.field(text_field).type}, not strings")
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield Piece(text)


def read_tsv(f: Path, on_bad_row: Callable[[int, str], None] | None = None
             ) -> tuple[list[str], Iterator[tuple[int, list[str]]]]:
    """Header and (line number, row) pairs of a tab-separated file without quoting (GLUE style). A row whose
    width differs from the header's, or that is not UTF-8 text, is an error, or, given ``on_bad_row``, reported
    to it and skipped."""
    fh = open_rows(f)
    first = fh.readline().rstrip("\n")
    if (problem := text_problem(first, "the header")) is not None:
        fh.close()
        raise UserError(f"{f}:1: {problem}")
    header = first.split("\t")

    def rows() -> Iterator[tuple[int, list[str]]]:
        with fh:
            for lineno, line in enumerate(fh, 2):
                line = line.rstrip("\n")
                if not line:
                    continue
                row = line.split("\t")
                problem = text_problem(line, "the row")
                if problem is None and len(row) != len(header):
                    problem = f"{len(row)} tab-separated fields, the header has {len(header)}"
                if problem is not None:
                    if on_bad_row is None:
                        raise UserError(f"{f}:{lineno}: {problem}; fix or remove the line")
                    on_bad_row(lineno, problem)
                    continue
                yield lineno, row

    return header, rows()


def tsv_text_column(f: Path, header: list[str], text_field: str) -> int:
    for name in (text_field, *TSV_TEXT_COLUMNS):
        if name in header:
            return header.index(name)
    raise UserError(f"{f}: no text column {text_field!r} in the header ({', '.join(header)}); "
                    f"set data.text_field to one of them")


def _read_tsv(f: Path, text_field: str) -> Iterator[Piece]:
    header, rows = read_tsv(f)
    column = tsv_text_column(f, header, text_field)
    for _, row in rows:
        yield Piece(row[column])


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """Python sources of the standard library, sorted, without its tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / n for n in sorted(filenames)
                     if n.endswith(".py") and not n.startswith("test_"))
    return files[:max_files]


def stdlib_docstrings(files: list[Path]) -> Iterator[str]:
    """Module, class and function docstrings of ``files``, in file order then source order."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for f in files:
        try:
            tree = ast.parse(f.read_bytes(), filename=str(f))
        except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid templates
            continue
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, kinds)),
                       key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                yield doc


@dataclass
class Corpus:
    """The resolved training text: which files, and how to read them as documents."""
    description: str
    files: list[Path]
    text_field: str
    builtin: bool
    tokenized: bool = False  # .npy token files, read by the token cache as they are (no text, no tokenizer run)
    _builtin_docs: list[str] | None = field(default=None, repr=False)

    def pieces(self) -> Iterator[Piece]:
        """A fresh pass over the documents (read twice: to train the tokenizer, then to tokenize)."""
        if self.builtin:
            # A few MB parsed from hundreds of modules: parse once, keep for the second pass.
            if self._builtin_docs is None:
                self._builtin_docs = list(stdlib_docstrings(self.files))
            return (Piece(doc) for doc in self._builtin_docs)
        return read_pieces(self.files, self.text_field)

    def fingerprint(self) -> dict:
        return {"builtin": self.builtin, "text_field": self.text_field, "files": source_fingerprint(self.files)}


def open_corpus(path: str, text_field: str) -> Corpus:
    """``data.path`` resolved to files (cheap: nothing is read yet); empty means the built-in corpus."""
    if not path.strip():
        files = stdlib_files(BUILTIN_MAX_FILES)
        if not files:
            raise UserError(f"the built-in corpus needs the Python standard library sources, but none were found "
                            f"under {sysconfig.get_paths()['stdlib']}; set data.path to your own text")
        return Corpus(f"built-in corpus: docstrings of the Python standard library ({len(files)} modules)",
                      files, text_field, builtin=True)
    files = resolve_sources(path)
    tokens = [f for f in files if f.suffix.lower() == TOKENS_TYPE]
    if tokens and len(tokens) < len(files):
        raise UserError(f"data.path {path!r} mixes token files ({tokens[0].name}, ...) with text files "
                        f"({next(f for f in files if f not in tokens).name}, ...); a corpus is one or the other: "
                        f"point data.path at either kind")
    kind = "token file(s)" if tokens else "file(s)"
    return Corpus(f"{len(files)} {kind} from {path}", files, text_field, builtin=False, tokenized=bool(tokens))


def source_fingerprint(files: list[Path]) -> list[tuple[str, int, int]]:
    """What identifies a set of source files for caching: resolved path, size and modification time."""
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return out
