"""Named model sizes. The large ones exist for the planner and for GPUs: build them with
``build_model(..., device="meta")``, never materialised on a CPU."""

from __future__ import annotations

import dataclasses

import torch

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
