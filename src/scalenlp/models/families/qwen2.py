"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): a Llama with a bias on q, k and v only, and optionally a sliding
window on the layers from ``max_window_layers`` on."""

from __future__ import annotations

from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import llama

MODEL_TYPE, CLASS, CONFIG = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"


def layer_types(c: dict, n_layers: int) -> list[str]:
    """Qwen's rule where config.json lists no layer_types: a window only with use_sliding_window, and then
    on the layers from max_window_layers on."""
    if not c.get("use_sliding_window"):
        return ["full_attention"] * n_layers
    start = c.get("max_window_layers", n_layers)
    return ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]


def window(c: dict) -> dict:
    if not c.get("use_sliding_window"):  # Qwen keeps a sliding_window value it does not use
        c = {**c, "sliding_window": None}
    return llama.window(c, c["num_hidden_layers"], layer_types)


def args_from_config(c: dict) -> ModelArgs:
    return llama.common(c, "Qwen2", qkv_bias=True, hf_type=MODEL_TYPE, **window(c))


def window_config(args: ModelArgs) -> dict:
    return dict(use_sliding_window=bool(args.local_layers), max_window_layers=args.n_layers,
                **llama.window_config(args))


def config_kwargs(args: ModelArgs) -> dict:
    return llama.common_config(args) | window_config(args)


to_hf, from_hf = llama.to_hf, llama.from_hf
