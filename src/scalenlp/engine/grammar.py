"""Constrained decoding with llguidance: a request that carries a grammar samples only the tokens its grammar allows.

A request's grammar is llguidance's grammar text (made here from a JSON schema or a Lark grammar), so that it
travels as a string in ``SamplingParams`` (to a Ray replica too). The engine gives each such request a
``Constraint``: a matcher over the model's vocabulary, and the bitmask of the tokens allowed next. The mask of
the next step is computed in a worker thread as soon as the sampled token has advanced the matcher (llguidance
releases the GIL meanwhile), so that it overlaps the next forward instead of following it; ``constrain`` then
only waits for it, unpacks it and masks that request's row of logits. Rows without a grammar cost nothing.

llguidance was picked over xgrammar because it needs no torch build of its own, takes a Hugging Face
``tokenizers`` JSON as it is (the engine's tokenizer), and compiles a JSON schema lazily, in milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

import torch

# JSON written without optional whitespace: a model cannot then fill its output with endless spaces, and the
# text is as short as the schema allows.
COMPACT = {"whitespace_flexible": False}
_BITS = 32  # llguidance's masks are int32 words


def _llguidance():
    """The llguidance module, or a UserError naming the extra that installs it."""
    from scalenlp.errors import require

    return require("llguidance", "serve")


class GrammarError(ValueError):
    """A grammar llguidance refuses; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of compact JSON that validates against ``schema``; GrammarError naming what llguidance
    does not support in it."""
    LLMatcher = _llguidance().LLMatcher
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    except ValueError as e:
        raise GrammarError(f"{param} is not a JSON Schema this server can decode with: {e}", param) from None
    return _checked(grammar, param, f"{param} is not a JSON Schema this server can decode with")


def lark_grammar(lark: str, param: str, refusal: str | None = None) -> str:
    """The grammar of a Lark grammar's text (llguidance's dialect: ``%json {schema}`` embeds a JSON schema);
    ``refusal`` begins the error when llguidance refuses it."""
    LLMatcher = _llguidance().LLMatcher
    return _checked(LLMatcher.grammar_from_lark(lark), param,
                    refusal or f"{param} is not a Lark grammar this server can decode with")


# Lines of llguidance's errors that quote the grammar or point into it ("  2 | call: ...", "    ^^^^").
_QUOTE = re.compile(r"^\s*(\d+ \||[\^ ]+$)")


def _checked(grammar: str, param: str, refusal: str) -> str:
    """``grammar`` if llguidance accepts it; else GrammarError with its reason on one line."""
    LLMatcher = _llguidance().LLMatcher
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        reason = " ".join(line.strip() for line in problem.splitlines() if line.strip() and not _QUOTE.match(line))
        raise GrammarError(f"{refusal}: {reason}", param)
    return grammar


class Grammars:
    """One model's vocabulary as llguidance sees it (built on first use: 0.9 s for SmolLM2's 49,152 tokens here),
    and the thread that computes masks ahead of the forward."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self._tokenizer_json = tokenizer.to_str()
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()
        # One thread: masks of one step are computed one after another while the engine thread runs the forward.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scalenlp-grammar")

    def tokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                # The end tokens are the engine's stop tokens: a complete grammar allows exactly those next.
                self._lltokenizer = _llguidance().LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._stop_ids or None)
            return self._lltokenizer

    def start(self, grammar: str) -> Constraint:
        """A constraint at the start of ``grammar``, its first mask on the way; GrammarError if it does not
        compile for this vocabulary."""
        LLMatcher = _llguidance().LLMatcher
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile for this model's vocabulary: "
                               f"{matcher.get_error().splitlines()[0]}", "response_format")
        constraint = Constraint(matcher, self)
        constraint.prefetch()
        return constraint

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Constraint:
    """One request's matcher and its next mask. The engine thread and the mask thread never touch the matcher at
    once: a mask is computed after ``advance`` and waited for before the next."""

    def __init__(self, matcher, grammars: Grammars):
        self.matcher = matcher
        self.grammars = grammars
        self.words = torch.full(((grammars.vocab_size + _BITS - 1) // _BITS,), -1, dtype=torch.int32)
        self._pending: concurrent.futures.Future | None = None

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * self.words.element_size())

    def prefetch(self) -> None:
        self._pending = self.grammars.pool.submit(self._fill)

    def mask(self) -> torch.Tensor:
        """The allowed-token bitmask (int32 words) of the next token."""
        if self._pending is None:
            self._fill()
        else:
            self._pending.result()
            self._pending = None
        return self.words

    def advance(self, token: int) -> bool:
        """Feed the sampled token; True when the grammar is complete and nothing may follow. The next mask starts
        computing at once."""
        if not self.matcher.consume_token(token):
            # llguidance's error goes on with its parser's whole state: its first line says what went wrong.
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed: "
                               f"{self.matcher.get_error().splitlines()[0]}")
        if self.matcher.is_stopped():
            return True
        self.prefetch()
        return False


def constrain(constraints: list[Constraint | None], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (B, V) with -inf on every token a row's constraint forbids; rows without one are untouched."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    words = torch.stack([constraints[i].mask() for i in rows])
    shifts = torch.arange(_BITS, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :logits.shape[-1]].bool()
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


def response_grammar(response_format: dict | None, guided_grammar: str | None) -> str | None:
    """The grammar of a request's ``response_format`` (OpenAI's) or ``guided_grammar`` (vLLM's Lark extension);
    None for free text. GrammarError naming the field and what is wrong with it."""
    if response_format is not None and guided_grammar is not None:
        raise GrammarError("send response_format or guided_grammar, not both", "guided_grammar")
    if guided_grammar is not None:
        return lark_grammar(guided_grammar, "guided_grammar")
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise GrammarError('response_format.json_schema must be an object with a "name" string and a "schema" '
                               'object: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                               "response_format")
        # Without a schema OpenAI takes any JSON object; strict or not, the output here always matches the schema.
        return json_schema_grammar(spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")
    raise GrammarError(f"response_format.type is {json.dumps(kind)}; it must be one of \"text\", \"json_object\", "
                       f"\"json_schema\"", "response_format")
