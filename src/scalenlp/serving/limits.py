"""``ServeLimits``: what a server accepts, whichever engine answers: body size, prompt length (in characters
before it is tokenized, in tokens after), tokens per choice, how long a client may take to send a request, and
the API key. `scalenlp serve` declares their flags and builds them once; the app (body size,
key), the generation backend (prompt and token limits) and the Ray router and replicas all receive them.

Its own module, not the app's: `scalenlp serve --help` imports it (through the serve command), and it stays
as light as the engine configs it sits beside, with no FastAPI, pydantic or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalenlp.auth import key_of
from scalenlp.data.text import json_strings
from scalenlp.engine.config import Options, option
from scalenlp.errors import UserError

DEFAULT_MAX_BODY_BYTES = 4 << 20  # four 128k-token prompts as JSON token ids (up to 7 bytes each) fit
API_KEY_ENV = "SCALENLP_API_KEY"
# The default --max-prompt-chars per token of the longest prompt: English averages about 4 characters a token, code
# a few more; a prompt past 16 is refused before its tokenizing (seconds and hundreds of MB for a 4 MB text) starts.
CHARS_PER_PROMPT_TOKEN = 16


@dataclass(frozen=True)
class ServeLimits(Options):
    """A server's request limits and key; None: no limit (no key)."""

    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, type=int, help="larger request bodies get 413 before they "
                                 f"are read (default {DEFAULT_MAX_BODY_BYTES})")
    max_prompt_tokens: int | None = option(None, type=int,
                                           help="longer prompts get 400 (default: the context length less one)")
    max_prompt_chars: int | None = option(None, type=int,
                                          help="longer prompts (for chat: all the messages' text together) get 400 "
                                               "before they are tokenized or rendered (default: "
                                               f"{CHARS_PER_PROMPT_TOKEN} per token of the longest prompt)")
    max_tokens_cap: int | None = option(None, type=int,
                                        help="most tokens one choice may generate; a larger max_tokens gets 400, and "
                                             "a request without max_tokens stops there (default: the end of the "
                                             "context)")
    drain_timeout: float = option(30.0, type=float,
                                  help="on SIGTERM (or Ctrl-C) the server stops accepting and lets the requests "
                                       "in flight finish for at most this many seconds, then cancels them (their "
                                       "queued work is dropped) and exits (default 30)")
    read_timeout: float = option(30.0, type=float,
                                 help="seconds a client has to send a whole request, headers and body, once its "
                                      "connection can take one (opened, or its last response sent); a connection "
                                      "that has not by then is closed, so half-sent requests hold nothing "
                                      "(default 30)")
    keep_alive_timeout: float = option(5.0, type=float,
                                       help="an idle keep-alive connection is closed after this many seconds "
                                            "(default 5)")
    template_timeout: float = option(2.0, type=float,
                                     help="seconds the model's chat template and tokenizer may take over one "
                                          "conversation; past it the chat request gets 400 and the worker process "
                                          "doing it is replaced (default 2)")
    template_max_bytes: int = option(1 << 20, type=int,
                                     help="most bytes of text the chat template may write for one conversation; "
                                          "more gets 400 (default 1048576)")
    template_workers: int = option(2, type=int,
                                   help="processes that render chat templates and tokenize their text, one "
                                        "conversation at a time each (default 2)")
    api_key: str | None = option(None, repr=False,
                                 help="require `Authorization: Bearer KEY` on every route but /health; other users "
                                      f"see it in `ps`, so prefer --api-key-file or the {API_KEY_ENV} environment "
                                      "variable")

    @classmethod
    def add_arguments(cls, parser, names=None, **kwargs) -> None:
        super().add_arguments(parser, names, **kwargs)
        parser.add_argument("--api-key-file", default=None, help="read the API key from the first line of this file")

    @classmethod
    def from_args(cls, args, **given) -> ServeLimits:
        """The limits of parsed flags, with the key from --api-key, --api-key-file or the environment."""
        return super().from_args(args, **{"api_key": api_key_of(args.api_key, args.api_key_file), **given})

    def check(self) -> None:
        self.at_least(1, "max_body_bytes", "max_prompt_tokens", "max_prompt_chars", "max_tokens_cap")
        self.at_least(0, "drain_timeout")
        self.at_least(1, "template_max_bytes", "template_workers")
        for name in ("read_timeout", "keep_alive_timeout", "template_timeout"):
            seconds = getattr(self, name)
            if not (seconds > 0 and math.isfinite(seconds)):
                raise UserError(f"--{name.replace('_', '-')} must be a number of seconds above 0, got {seconds}")


def api_key_of(api_key: str | None, api_key_file: str | None) -> str | None:
    """--api-key, else the first line of --api-key-file, else $SCALENLP_API_KEY; the last two keep
    the key out of the process list."""
    if api_key is not None and api_key_file is not None:
        raise UserError("--api-key and --api-key-file both give the API key; keep one")
    if api_key is not None:
        return api_key
    return key_of(api_key_file, "--api-key-file", API_KEY_ENV)


def text_chars(value: object) -> int:
    """Characters in every string of a parsed JSON value, keys included: what a chat template may write out."""
    return sum(len(text) for _, text in json_strings(value))
