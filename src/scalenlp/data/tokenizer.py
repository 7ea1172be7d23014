"""Tokenizers: train a byte-level BPE on the corpus, or load a Hugging Face ``tokenizer.json``.

Byte-level BPE (GPT-2 style) maps every byte to a symbol before merging, so there is no unknown token and
``decode(encode(s)) == s`` for any string. Training has no randomness: the same corpus and vocabulary size
give the same tokenizer, which is what lets it be cached by the corpus' fingerprint.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scalenlp.errors import UserError

EOS = "<|endoftext|>"
TOKENIZER_CONFIG = "tokenizer_config.json"  # BOS, EOS and the chat template, in Hugging Face's field names
# Document-end and -start tokens of common tokenizer families, tried before the tokenizer's own config files.
# (GPT-2 / SmolLM, Llama 2 / Mistral, Llama 3, Gemma.)
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
MIN_VOCAB = 257  # the 256 byte symbols plus EOS
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens for single bytes


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens (fewer if the corpus has fewer useful merges)."""
    if vocab_size < MIN_VOCAB:
        raise UserError(f"tokenizer.vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
                        f"{MIN_VOCAB} (256 bytes + {EOS})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even those the corpus lacks
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` behind a path that names the file itself or a Hugging Face tokenizer folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise UserError(f"tokenizer folder {str(path)!r} has no tokenizer.json; only fast (tokenizers-library) "
                            f"tokenizers are supported: save one with AutoTokenizer(...).save_pretrained()")
    elif not p.is_file():
        raise UserError(f"tokenizer.path {str(path)!r} does not exist; give a tokenizer.json file or a folder "
                        f"holding one, or leave it empty to train a byte-level BPE")
    return p


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` file, or the one inside a Hugging Face tokenizer folder."""
    p = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise UserError(f"cannot load tokenizer {p}: {e}") from None


def _find_special_token_id(tokenizer: Tokenizer, path: str | Path | None, key: str,
                           candidates: tuple[str, ...]) -> int | None:
    """The id of a known token name, else of the ``key`` token in the folder's config files; None if neither."""
    for name in candidates:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    folder = None if path is None else Path(path) if Path(path).is_dir() else Path(path).parent
    for config_name in ("tokenizer_config.json", "special_tokens_map.json"):
        if folder is None or not (folder / config_name).is_file():
            continue
        try:
            token = json.loads((folder / config_name).read_text()).get(key)
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(token, dict):  # written as an AddedToken: {"content": "...", ...}
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return None


def find_eos_token_id(tokenizer: Tokenizer, path: str | Path | None = None) -> int | None:
    """The id of the document-end token: a known EOS name, else the eos_token in the folder's config
    files; None when the tokenizer has none."""
    return _find_special_token_id(tokenizer, path, "eos_token", EOS_CANDIDATES)


def find_bos_token_id(tokenizer: Tokenizer, path: str | Path | None = None) -> int | None:
    """The id of the document-start token, found as ``find_eos_token_id`` finds EOS; None when there is none."""
    return _find_special_token_id(tokenizer, path, "bos_token", BOS_CANDIDATES)


def eos_token_id(tokenizer: Tokenizer, path: str | Path | None = None) -> int:
    """``find_eos_token_id``, for callers that cannot do without one (documents must be separated)."""
    token_id = find_eos_token_id(tokenizer, path)
    if token_id is None:
        raise UserError(f"tokenizer {path or ''} has no end-of-document token ({', '.join(EOS_CANDIDATES)} or an "
                        f"eos_token in tokenizer_config.json / special_tokens_map.json); add one to the tokenizer")
    return token_id


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte each symbol of a byte-level BPE vocabulary (GPT-2's) stands for: printable bytes are written as
    themselves, the others as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(name: str) -> bytes | None:
    """The bytes a token stands for, from its vocabulary name: a byte-fallback ``<0xNN>`` or a name in byte-level
    BPE's alphabet; None for any other name. For tokens that are part of a character, whose text is none."""
    if match := BYTE_FALLBACK.fullmatch(name):
        return bytes([int(match.group(1), 16)])
    alphabet = _byte_level_alphabet()
    return bytes(alphabet[c] for c in name) if name and all(c in alphabet for c in name) else None
