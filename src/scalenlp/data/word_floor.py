"""A lower bound on how many tokens a text becomes, found without tokenizing it: what lets a server refuse a
request that is surely over its token limit before paying for the tokenizer (seconds of CPU for megabytes).

A word here is a run of characters between spaces, tabs and line breaks that holds at least one letter or digit.
Each such word is one token or more under a tokenizer that (1) splits on every space, tab and line break, (2) never
deletes a letter or digit while normalizing, and (3) gives every piece at least one token (WordPiece's [UNK], a
byte-level alphabet, an unknown token or byte fallback). ``counts_words`` reads a tokenizer's JSON for those three
properties, from a list of components known to have them; any other tokenizer gets no bound from words (0), so a
model whose normalizer rewrites text (a ``Replace``) is never refused on a guess. Only these four separators are
taken: Python's ``str.split`` also splits on characters (U+001C-U+001F) that a BERT normalizer deletes, which
would join two "words" into one token. Words without a letter or digit are not counted: a lone combining accent
or a zero-width character can be deleted by normalization and become no token at all.
"""

from __future__ import annotations

import itertools
import json
import re

from tokenizers import Tokenizer

# From the start of a word (after a separator, or the text's start) up to its first letter or digit: one match per
# counted word. [^\W_] is a letter or digit (\w less the underscore).
_WORD = re.compile(r"(?<![^ \t\n\r])[^ \t\n\r]*?[^\W_]")
SEPARATORS = " \t\n\r"

# Normalizers that change letters and digits (case, accents, compatibility forms) but never delete one.
_KEEPING_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip"}
# Pre-tokenizers that split on every separator above, and others that only split further, never deleting.
_SPLITTING = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_FURTHER = {"Digits"}


def words(text: str, most: int | None = None) -> int:
    """The words of ``text`` that each become at least one token (see the module's note), counted up to ``most``:
    the scan stops there, so that its cost is bounded by the count wanted, not by the text's length."""
    return sum(1 for _ in itertools.islice(_WORD.finditer(text), most))


def counts_words(tokenizer: Tokenizer) -> bool:
    """Whether every word of a text (``words``) is surely one token or more under this tokenizer."""
    spec = json.loads(tokenizer.to_str())
    if any(any(c in SEPARATORS for c in t["content"]) for t in spec.get("added_tokens") or []):
        return False  # an added token matched across a separator makes two words one token
    normalizers = _flat(spec.get("normalizer"), "normalizers")
    pre = _flat(spec.get("pre_tokenizer"), "pretokenizers")
    byte_level = any(p["type"] == "ByteLevel" and p.get("use_regex", True) for p in pre)
    splits = byte_level or any(p["type"] in _SPLITTING for p in pre)
    keeps = all(n["type"] in _KEEPING_NORMALIZERS for n in normalizers)
    pre_keeps = all(p["type"] in _SPLITTING | _FURTHER or p["type"] == "ByteLevel" for p in pre)
    model = spec["model"]
    covers = (model["type"] == "WordPiece"
              or (model["type"] == "BPE" and (byte_level or model.get("unk_token") is not None
                                              or model.get("byte_fallback", False)))
              or (model["type"] == "Unigram" and model.get("unk_id") is not None))
    return splits and keeps and pre_keeps and covers


def _flat(component: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as the list of its parts (a Sequence's, nested ones flattened)."""
    if component is None:
        return []
    if component["type"] == "Sequence":
        return [part for inner in component[key] for part in _flat(inner, key)]
    return [component]
