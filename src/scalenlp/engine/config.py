"""Typed engine options: ``EngineConfig`` (the decoder engine) and ``EncoderEngineConfig`` (the encoder
batcher), each the one place where its options are named, defaulted, documented and checked.

An option has one name from flag to field: ``--max-batch`` is ``max_batch``. A command declares the flags
with ``add_arguments(parser)`` and builds the config once with ``from_args(args)``; the Python API and
the tests build it directly (``EngineConfig("runs/demo", max_batch=4)``); a Ray replica receives it as it
is (dataclasses pickle). ``check()`` raises the one-line ``UserError`` a command prints; the engines call it
before loading anything. Each field's ``help`` is its documentation and its flag's help text alike.

No torch here: `scalenlp --help` imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalenlp.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_CHOICES = ("auto", "on", "off")  # engine/compile_choice.py decides auto
METHOD_CHOICES = ("int8", "int4", "int8dyn")  # compress.quantized.METHODS, without importing torch for --help
METHOD_HELP = ("int8: int8 weights, a scale per output channel; int4: 4-bit weights, a scale and zero per group of "
               "--group-size inputs; int8dyn: int8 weights and int8 activations")


def option(default: Any = dataclasses.MISSING, *, help: str, repr: bool = True, **flag) -> Any:
    """A config field and its command-line flag: ``help`` documents both, ``flag`` holds argparse's other
    keywords (``type``, ``choices``, ``action``). A field without a default is a required flag."""
    return dataclasses.field(default=default, repr=repr, metadata={"help": help, **flag})


class Options:
    """What a config dataclass built from ``option`` fields can do with its flags."""

    @classmethod
    def add_arguments(cls, parser, names: Collection[str] | None = None, *, skip: Collection[str] = (),
                      **overrides: dict) -> None:
        """Declare the flag of each field (those in ``names`` when given, less ``skip``), in field order.
        ``overrides`` maps a field to argparse keywords that replace its own, for a command whose default
        differs (``dtype={"default": "float32", "help": ...}``)."""
        for f in dataclasses.fields(cls):
            if (names is not None and f.name not in names) or f.name in skip:
                continue
            kwargs = dict(f.metadata)
            if f.default is dataclasses.MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = f.default
            kwargs.update(overrides.get(f.name, {}))
            parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)

    @classmethod
    def from_args(cls, args, **given):
        """The config of parsed flags: a field whose flag the command does not declare keeps its default;
        ``given`` sets fields that no flag names (or replaces a flag's value)."""
        flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**flagged, **given})

    def at_least(self, minimum: int, *names: str) -> None:
        """UserError ``--name must be at least N`` for the first of these fields set below ``minimum``."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < minimum:
                raise UserError(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")


@dataclass(frozen=True)
class BaseEngineConfig(Options):
    """The options both engines take: where the model is and how it is loaded, how long a sequence may be
    and how many requests may wait."""

    checkpoint: str | Path = option(help="a run folder, an export folder, a Hugging Face model folder or a .gguf file")
    dtype: str = option("auto", choices=DTYPES,
                        help="weight dtype; auto (default) = bf16 on CUDA, on a CPU float32 or bf16, whichever runs this "
                             "model faster here (timed once, cached)")
    device: str | None = option(None, help="cpu | cuda | cuda:N | mps (default: cuda when present, else cpu; mps, "
                                               "Apple silicon's GPU, only when asked for, without --compile)")
    quantize: str | None = option(None, choices=METHOD_CHOICES,
                                  help="quantize the linear layers at load (" + METHOD_HELP + ")")
    group_size: int = option(64, type=int, help="with --quantize int4: inputs per scale (default 64; 32 takes a GGUF "
                                                "file's Q4_0/Q4_1 blocks as they are)")
    max_seq_len: int | None = option(None, type=int,
                                     help="positions per sequence: a decoder's slot holds prompt + output, an "
                                          "encoder cuts longer texts (default: the model's context length, or where "
                                          "a sentence-transformers folder cuts)")
    max_queue: int = option(64, type=int, help="waiting requests before answering 429")

    def check(self) -> None:
        self.at_least(1, "max_queue")


# The options of serving LoRA adapters: for `serve` (and the Python API), whose requests name an adapter.
LORA_OPTIONS = ("lora", "max_loras", "max_lora_rank")
# The options of every command that loads a model, generating or not (eval, classify, embed).
LOAD_OPTIONS = ("checkpoint", "dtype", "device", "quantize", "group_size")
SHARED_OPTIONS = tuple(f.name for f in dataclasses.fields(BaseEngineConfig))


@dataclass(frozen=True)
class EngineConfig(BaseEngineConfig):
    """The decoder engine's options (`generate`, `chat`, `serve`, ``LLM``)."""

    max_batch: int = option(64, type=int, help="most requests running at once, as the KV cache's blocks allow "
                                                "(default 64)")
    kv_cache_tokens: int | None = option(None, type=int,
                                         help="positions the paged KV cache holds over all running requests "
                                              "(default: 8 x --max-seq-len, what 8 full-length sequences take)")
    block_size: int = option(16, type=int, help="positions per KV cache block (default 16)")
    no_prefix_caching: bool = option(False, action="store_true",
                                     help="compute every prompt in full; by default a prompt's leading blocks "
                                          "computed before for another request (same tokens, same adapter) are reused")
    token_budget: int = option(2048, type=int,
                               help="tokens one engine step computes: one per running request, the rest for prompts; "
                                    "a longer prompt is computed in chunks over several steps (default 2048)")
    speculative_tokens: int = option(0, type=int,
                                     help="speculative decoding: up to this many draft tokens per request and step, "
                                          "proposed by prompt lookup (what followed the latest earlier occurrence of "
                                          "its last tokens in its prompt and output) and verified in the decode "
                                          "step's forward; greedy output is unchanged, sampled output keeps its "
                                          "distribution (default 0: off; on a CPU it measured slower, see docs/serving.md)")
    draft: str | None = option(None, metavar="CHECKPOINT",
                               help="with --speculative-tokens: a smaller model with the same tokenizer (any "
                                    "checkpoint the loader reads) proposes the draft tokens, greedily, instead of "
                                    "prompt lookup")
    compile: str = option("auto", choices=COMPILE_CHOICES, nargs="?", const="on",
                          help="torch.compile the decode step: on (--compile alone), off, or auto (default): compile "
                               "where it measured at least 1.1x as fast on this machine for this model's shape "
                               "(timed once, cached; the start-up line says why); SCALENLP_COMPILE=on|off decides "
                               "auto without timing")
    tp: int = option(1, type=int, help="tensor-parallel processes for one model (gloo on CPU, NCCL on GPUs)")
    # A list, not a tuple: argparse's "append" extends the default it is given.
    lora: list[str] | None = option(None, action="append", metavar="NAME=PATH",
                                    help="serve the LoRA adapter in folder PATH (PEFT's or a run's export/adapter) "
                                         "as model NAME, beside the base model; repeat for more")
    max_loras: int | None = option(None, type=int,
                                   help="adapter slots, for --lora and adapters loaded at run time (default: the "
                                        "number of --lora; 0 without: no adapters, the base model's own speed)")
    max_lora_rank: int | None = option(None, type=int,
                                       help="largest adapter rank served; smaller ranks are padded to it (default: "
                                            "the largest --lora rank, or 16)")

    def check(self) -> None:
        self.at_least(1, "max_batch", "kv_cache_tokens", "block_size", "token_budget")
        self.at_least(2, "max_seq_len")  # a prompt token and an output token
        self.at_least(0, "max_loras", "speculative_tokens")
        self.at_least(1, "max_lora_rank")
        if self.draft and not self.speculative_tokens:
            raise UserError("--draft proposes draft tokens for speculative decoding; give --speculative-tokens K "
                            "(how many per step) too")
        if self.draft and self.tp > 1:
            raise UserError("--draft is not supported with --tp yet; drop one of them")
        if self.compile not in COMPILE_CHOICES:
            raise UserError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")
        if self.tp > 1 and self.compile == "on":
            raise UserError("--compile is not supported with --tp yet; drop one of them")
        adapters = self.adapters()
        if self.max_loras is not None and self.max_loras < len(adapters):
            raise UserError(f"--max-loras {self.max_loras} is fewer than the {len(adapters)} --lora adapters; "
                            f"raise it to at least {len(adapters)}")
        if self.serves_adapters and (self.tp > 1 or self.compile == "on"):
            raise UserError("LoRA adapters are not served with --tp or --compile yet; drop those, or merge the "
                            "adapter into the model (scalenlp export --merge) and serve that")
        super().check()

    def __post_init__(self) -> None:
        # The Python API's compile=True / False, as --compile on / off.
        object.__setattr__(self, "compile", {True: "on", False: "off"}.get(self.compile, self.compile))

    def adapters(self) -> dict[str, str]:
        """{name: folder} of the --lora flags; a malformed or repeated one is a UserError."""
        found: dict[str, str] = {}
        for entry in self.lora or ():
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise UserError(f"--lora {entry!r} must be NAME=PATH (the model name requests use, and the "
                                f"adapter's folder), e.g. --lora sql=runs/sql/export/adapter")
            if name.strip() in found:
                raise UserError(f"--lora names {name.strip()!r} twice; give each adapter its own name")
            found[name.strip()] = path.strip()
        return found

    @property
    def serves_adapters(self) -> bool:
        return bool(self.lora) or bool(self.max_loras)


@dataclass(frozen=True)
class EncoderEngineConfig(BaseEngineConfig):
    """The encoder batcher's options (`serve` on an encoder, `classify`, `embed`)."""

    forward_batch: int = option(32, type=int,
                                help="most texts in one forward pass; concurrent requests share it (default 32)")
    pass_tokens: int = option(256, type=int,
                              help="most token positions in one forward pass, padding included; a longer text "
                                   "runs alone. It bounds how long a small request waits behind a large one: on "
                                   "a CPU MiniLM computes about as many tokens a second in passes of 256 as of "
                                   "8,192, and at 256 a short text is never padded to a full-length one beside it "
                                   "(default 256; on a GPU, where larger passes are faster per token, raise it)")
    batch_wait_ms: float = option(2.0, type=float,
                                  help="how long a text waits for others to fill its forward pass (default 2)")
    short_pass_tokens: int = option(64, type=int,
                                    help="a second worker runs passes of texts this short, at most this many "
                                         "positions, beside the first worker's, so that a short request does not "
                                         "wait for a long pass to end; 0: one worker (default 64)")
    max_batch_texts: int = option(2048, type=int,
                                  help="most inputs one request may carry; more is answered 400 (default 2048)")
    max_text_chars: int = option(32768, type=int,
                                 help="most characters in one input text, checked before it is tokenized; a longer "
                                      "text is answered 400 (default 32768, far past any encoder's context)")
    max_request_tokens: int = option(16384, type=int,
                                     help="most tokens one served request may encode, counted after tokenizing and "
                                          "truncating each text; more is answered 400 before any forward pass, so "
                                          "that one request cannot hold the encoder for minutes (default 16384: 64 "
                                          "texts of 256 tokens)")

    def check(self) -> None:
        if self.forward_batch < 1 or self.max_batch_texts < 1:
            raise UserError(f"the batch sizes must be at least 1, got {self.forward_batch} and {self.max_batch_texts}")
        self.at_least(1, "max_text_chars", "max_request_tokens", "pass_tokens")
        self.at_least(0, "short_pass_tokens")
        super().check()
