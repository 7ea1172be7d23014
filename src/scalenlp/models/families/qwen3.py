"""Qwen3 (``Qwen3ForCausalLM``): a Llama with an RMSNorm over each head's query and key before RoPE, an
explicit head size, and Qwen2's optional sliding window."""

from __future__ import annotations

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import llama, qwen2

MODEL_TYPE, CLASS, CONFIG = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"


def args_from_config(c: dict) -> ModelArgs:
    if c.get("attention_bias", False):
        raise UserError("Qwen3 with attention_bias is not supported; only the published Qwen3 (no biases)")
    return llama.common(c, "Qwen3", qk_norm=True, hf_type=MODEL_TYPE, **qwen2.window(c))


def config_kwargs(args: ModelArgs) -> dict:
    return llama.common_config(args) | qwen2.window_config(args) | dict(attention_bias=False)


to_hf, from_hf = llama.to_hf, llama.from_hf
