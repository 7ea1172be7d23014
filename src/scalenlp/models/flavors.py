"""Named model sizes, and the one reading of a model shape: a flavor with ``model.*`` keys over it
(``--set model.flavor=debug --set model.layers=3``), or a shape alone (``model.flavor=""``), the same
keys that ``scalenlp plan --model flavor=debug,layers=3`` takes. The large flavors exist for the planner
and for GPUs: build them with ``build_model(..., device="meta")``, never materialised on a CPU."""

from __future__ import annotations

import dataclasses
import math

import torch

from scalenlp.config import ModelConfig, load_config
from scalenlp.errors import ConfigError
from scalenlp.models.decoder import ModelArgs, Transformer

_GPT2 = dict(norm="layernorm", activation="gelu", position="learned", tie_embeddings=True, bias=True)
_LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False, bias=False)

FLAVORS: dict[str, ModelArgs] = {
    # Tests and the built-in demo: a few layers, vocabulary from the tokenizer trained on the run's data.
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=256, **_LLAMA),
    "debug-gpt2": ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=256, **_GPT2),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=4, ffn_dim=1024, max_seq_len=512, **_GPT2),
    "small-llama": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=512, **_LLAMA),
    # Published shapes.
    "gpt2-124m": ModelArgs(vocab_size=50257, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_seq_len=1024,
                           **_GPT2),
    "gpt2-350m": ModelArgs(vocab_size=50257, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, max_seq_len=1024,
                           **_GPT2),
    "llama-1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                          max_seq_len=8192, rope_theta=500000.0, **{**_LLAMA, "tie_embeddings": True}),
    "llama-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                          max_seq_len=8192, rope_theta=500000.0, **_LLAMA),
    "llama-70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                           max_seq_len=8192, rope_theta=500000.0, **_LLAMA),
}


FAMILIES = {"llama": _LLAMA, "gpt2": _GPT2}
# model.<key> -> the ModelArgs field it sets over the flavor (0 keeps the flavor's).
SIZES = {"hidden": "dim", "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "ffn": "ffn_dim"}
# Every key of a shape, in the order a shape is written; model.vocab_size, max_seq_len and dropout are ModelArgs's own.
SHAPE_KEYS = ("flavor", "family", *SIZES, "vocab_size", "max_seq_len", "dropout")
_REQUIRED = ("hidden", "layers", "heads")  # a shape without a flavor has no sizes to fall back on


def shape_keys(model: ModelConfig) -> dict:
    """The shape keys a model section sets (the flavor always, the rest where they differ from the default)."""
    default = ModelConfig()
    return {k: getattr(model, k) for k in SHAPE_KEYS if k == "flavor" or getattr(model, k) != getattr(default, k)}


def shape_spec(model: ModelConfig) -> str:
    """The shape as `scalenlp plan --model` takes it: ``flavor=debug,layers=3``."""
    return ",".join(f"{k}={v}" for k, v in shape_keys(model).items())


def parse_shape(text: str) -> ModelConfig:
    """`scalenlp plan --model`: a flavor name, or ``key=value,...`` over SHAPE_KEYS (without ``flavor``, a shape
    alone), read into a model section exactly as ``--set model.key=value`` is."""
    items = [part.strip() for part in text.split(",") if part.strip()] if "=" in text else [f"flavor={text}"]
    overrides = ["model.flavor="]
    for item in items:
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in SHAPE_KEYS:
            raise ConfigError(f"model shape {text!r}: {item!r} is not key=value with a key among {', '.join(SHAPE_KEYS)}")
        overrides.append(f"model.{key}={value}")
    return load_config(overrides=overrides).model


def shape_args(model: ModelConfig, seq: int, vocab_size: int = 0) -> ModelArgs:
    """The decoder a model section describes: model.flavor's ModelArgs (or, with no flavor, model.family's style
    and the sizes given), with each shape key it sets in place of the flavor's value. ``seq`` is the longest
    sequence of a shape without a flavor unless model.max_seq_len says; ``vocab_size`` the vocabulary where
    model.vocab_size is 0 (the tokenizer's). A shape that cannot be built is one ConfigError line."""
    spec = shape_spec(model)
    if model.family and model.family not in FAMILIES:
        raise ConfigError(f"model shape {spec}: family={model.family!r} is not one of {' | '.join(FAMILIES)}")
    if model.flavor:
        if model.flavor not in FLAVORS:
            raise ConfigError(f"model.flavor={model.flavor!r} is unknown; choose one of {', '.join(FLAVORS)}, or set it "
                            f"empty and give the shape ({', '.join(f'model.{k}' for k in _REQUIRED)}, ...)")
        base = dataclasses.replace(FLAVORS[model.flavor], **FAMILIES.get(model.family, {}))
    else:
        missing = [k for k in _REQUIRED if not getattr(model, k)]
        if missing:
            raise ConfigError(f"model shape {spec}: without a flavor it needs {', '.join(missing)}; "
                            "give them or a flavor")
        family = model.family or "llama"
        # Without a flavor the MLP is the family's usual width: 4h for GPT-2, 8h/3 rounded up to 256 for Llama;
        # n_kv_heads=0 is as many as heads (multi-head attention).
        ffn = 4 * model.hidden if family == "gpt2" else 256 * math.ceil(8 * model.hidden / 3 / 256)
        base = ModelArgs(vocab_size=0, dim=model.hidden, n_layers=model.layers, n_heads=model.heads,
                         n_kv_heads=model.kv_heads, ffn_dim=ffn, max_seq_len=seq, **FAMILIES[family])
    sizes = {field: getattr(model, key) for key, field in SIZES.items() if getattr(model, key)}
    args = dataclasses.replace(base, **sizes, dropout=model.dropout,
                               vocab_size=model.vocab_size or vocab_size or base.vocab_size,
                               max_seq_len=model.max_seq_len or base.max_seq_len)
    if not args.vocab_size:
        raise ConfigError(f"model shape {spec}: give vocab_size (a shape without a flavor has no vocabulary)")
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model shape {spec}: {e}") from None
    return args


def model_args(flavor: str, **overrides) -> ModelArgs:
    """A copy of the flavor's ModelArgs with overrides applied (vocab_size, max_seq_len, dropout, ...)."""
    if flavor not in FLAVORS:
        raise KeyError(f"unknown model flavor {flavor!r}; choose one of {', '.join(FLAVORS)}")
    return dataclasses.replace(FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})


def build_model(args: ModelArgs, device: str | torch.device = "cpu") -> Transformer:
    """Build on ``device`` and initialise once, by the family's recipe (``Transformer.init_weights``), from
    the global RNG; "meta" allocates nothing (for counting, planning, or sharding before materialising
    with ``to_empty`` + ``init_weights``)."""
    with torch.device("meta"):  # skips nn.Linear's own initialisation, which init_weights would overwrite
        model = Transformer(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        if args.tie_embeddings:  # to_empty gives each module its own tensor
            model.output.weight = model.tok_embeddings.weight
        model.init_weights()
    return model
