"""The one check for text that comes from outside: a request, a data file, a terminal.

Python strings may hold lone surrogates (U+D800-U+DFFF) that no UTF-8 text has: JSON's ``"\\ud800"`` escape makes
one, and so does a byte that is not UTF-8 read with ``errors="surrogateescape"`` (how Python hands over a command
line, and how the row-by-row readers here open files, so that one bad byte costs its row, not the whole file). The
tokenizers cannot encode them, so every route, command and data reader asks ``text_problem`` before tokenizing,
and answers in its own way: a 400, one error line, or a skipped row with its file and line.

JSON rows have two more ways to fail after they parse as text: a number of more digits than Python converts
(``sys.get_int_max_str_digits``, a ``ValueError``) and nesting deeper than the parser recurses; ``json_row`` turns
both, and invalid JSON, into a reason.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scalenlp.errors import UserError

# The surrogates Python's "surrogateescape" error handler makes from the bytes 0x80-0xFF that are not UTF-8.
_ESCAPED_BYTES = range(0xDC80, 0xDD00)


def text_problem(text: object, what: str = "the text", max_chars: int | None = None, limit: str = "") -> str | None:
    """Why ``text`` cannot be tokenized, or None: not a string, a lone surrogate (with its position), or more than
    ``max_chars`` characters (``limit`` names the setting, e.g. " (--max-text-chars)")."""
    if not isinstance(text, str):
        return f"{what} is {type(text).__name__}, not a string"
    if max_chars is not None and len(text) > max_chars:
        return f"{what} holds {len(text):,} characters; at most {max_chars:,} are taken{limit}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if code in _ESCAPED_BYTES:
            return (f"{what} is not valid Unicode text: byte 0x{code - 0xDC00:02X} at character {e.start} is not "
                    f"UTF-8; re-encode it as UTF-8")
        return (f"{what} is not valid Unicode text (a lone surrogate, U+{code:04X}, at character {e.start}); "
                f"send UTF-8 text")
    return None


def check_text(text: object, what: str, max_chars: int | None = None, limit: str = "",
               error: type[Exception] = UserError) -> None:
    """``error(text_problem(...))`` when there is a problem: for callers that refuse rather than skip."""
    problem = text_problem(text, what, max_chars, limit)
    if problem is not None:
        raise error(problem)


def json_strings(value: Any, what: str = "the value") -> Iterator[tuple[str, str]]:
    """(path, string) for every string in a parsed JSON value, keys included, in document order; a key's path is
    ``a key of <its object's path>``, a value's ``messages[1].content``."""
    stack = [(what, value)]
    while stack:  # by hand: a deep document must not meet Python's recursion limit here
        path, item = stack.pop()
        if isinstance(item, str):
            yield path, item
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):  # reversed onto the stack, to come off in order
                stack.append((f"{path}.{key}", child))
                stack.append((f"a key of {path}", key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))


def json_problem(value: Any, what: str = "the value") -> str | None:
    """Why a parsed JSON value cannot be used as text, or None: the first string anywhere in it (key or value)
    that is not valid text, named by its path."""
    return next((problem for path, text in json_strings(value, what)
                 if (problem := text_problem(text, path)) is not None), None)


def parse_json(text: str) -> Any:
    """``json.loads``, with every failure a ValueError that says why in words a user can act on."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # A row is one line; a whole document (SQuAD's .json) says which of its lines.
        raise ValueError(f"not valid JSON ({e.msg}{f' at line {e.lineno}' if e.lineno > 1 else ''})") from None
    except ValueError:  # the only other ValueError the decoder raises is an integer's digit limit
        raise ValueError(f"a number longer than {sys.get_int_max_str_digits()} digits, which JSON readers "
                         f"refuse") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def json_row(line: str) -> tuple[Any, str | None]:
    """(the parsed value, None) for a line of a JSONL file, or (None, why the row cannot be used): bytes that are
    not UTF-8, invalid JSON, a number too long to read, a string that is not valid Unicode."""
    problem = text_problem(line, "the line")
    if problem is None:
        try:
            value = parse_json(line)
        except ValueError as e:
            return None, str(e)
        problem = json_problem(value, "the row")
        if problem is None:
            return value, None
    return None, problem


def jsonl_rows(f: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, the parsed value, None), or (line number, None, why it cannot be used), for every line of a
    JSONL file that is not blank (``json_row``, one line at a time)."""
    with open_rows(f) as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield number, *json_row(line)


def open_rows(f: Path):
    """A text file opened to be read row by row: a byte that is not UTF-8 becomes a surrogate that
    ``text_problem`` reports with that row, instead of an error that ends the whole file. Universal newlines
    (CRLF and lone CR read as LF), as untidy real files mix them."""
    return open(f, encoding="utf-8", errors="surrogateescape", newline=None)
