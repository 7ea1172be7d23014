"""Gemma 2 (``Gemma2ForCausalLM``): GeGLU (GELU's tanh form), RMSNorms that scale by (1 + w), token
embeddings scaled by sqrt(dim), a norm before and after both attention and MLP, scores scaled by
``query_pre_attn_scalar ** -0.5`` and soft-capped, soft-capped logits, and local (sliding-window) layers
alternating with global ones."""

from __future__ import annotations

import math

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import llama

MODEL_TYPE, CLASS, CONFIG = "gemma2", "Gemma2ForCausalLM", "Gemma2Config"
NORMS = {"attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}


def layer_types(c: dict, n_layers: int) -> list[str]:
    """Gemma 2's rule where config.json lists no layer_types: even layers local, odd ones global."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(n_layers)]


def gemma_options(c: dict, family: str) -> dict:
    """The options every Gemma shares (Gemma 3 adds to them)."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UserError(f"{family} activation {act!r} is not supported; only gelu_pytorch_tanh (GeGLU)")
    if c.get("attention_bias", False):
        raise UserError(f"{family} with attention_bias is not supported; only the published {family} (no biases)")
    if c.get("use_bidirectional_attention"):
        raise UserError(f"{family} with use_bidirectional_attention is not supported; only causal attention")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return dict(activation="geglu", norm_offset=1.0, post_norms=True, embed_scale=math.sqrt(c["hidden_size"]),
                attn_scale=(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                attn_softcap=c.get("attn_logit_softcapping") or 0.0,
                logit_softcap=c.get("final_logit_softcapping") or 0.0,
                tie_embeddings=c.get("tie_word_embeddings", True),
                fixed_head_dim=head_dim if head_dim != c["hidden_size"] // c["num_attention_heads"] else 0)


def args_from_config(c: dict) -> ModelArgs:
    return llama.common(c, "Gemma 2", hf_type=MODEL_TYPE, **gemma_options(c, "Gemma 2"),
                        **llama.window(c, c["num_hidden_layers"], layer_types))


def gemma_config(args: ModelArgs) -> dict:
    """The transformers config keys every Gemma shares."""
    scalar = args.attn_scale ** -2
    return llama.common_config(args) | llama.window_config(args) | dict(
        hidden_activation="gelu_pytorch_tanh", attention_bias=False,
        query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar)) else scalar,
        attn_logit_softcapping=args.attn_softcap or None, final_logit_softcapping=args.logit_softcap or None)


def config_kwargs(args: ModelArgs) -> dict:
    return gemma_config(args)


def to_hf(args, ours):
    return llama.to_hf(args, ours, NORMS)


def from_hf(args, hf):
    return llama.from_hf(args, hf, NORMS)
