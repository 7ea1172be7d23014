"""Phi-3 (``Phi3ForCausalLM``): a Llama whose checkpoint fuses q, k and v into ``qkv_proj`` and the MLP's gate
and up into ``gate_up_proj`` (gate first); the model keeps them apart, as every other family, and they are
split on reading and joined on export. Its long-context RoPE (longrope, formerly "su") is not supported."""

from __future__ import annotations

import torch

from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import llama

MODEL_TYPE, CLASS, CONFIG = "phi3", "Phi3ForCausalLM", "Phi3Config"
FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def args_from_config(c: dict) -> ModelArgs:
    return llama.common(c, "Phi-3", hf_type=MODEL_TYPE, **llama.window(c, c["num_hidden_layers"]))


def config_kwargs(args: ModelArgs) -> dict:
    return llama.common_config(args) | dict(sliding_window=llama.window_everywhere(args, "Phi-3"),
                                            original_max_position_embeddings=args.max_seq_len)


def to_hf(args: ModelArgs, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = llama.to_hf(args, ours)
    for i in range(args.n_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in FUSED:
            hf[prefix + fused + ".weight"] = torch.cat([hf.pop(prefix + p + ".weight") for p in parts])
    return hf


def from_hf(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = dict(hf)
    q, kv, ffn = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    for i in range(args.n_layers):
        prefix = f"model.layers.{i}."
        for (fused, parts), sizes in zip(FUSED, ((q, kv, kv), (ffn, ffn))):
            weight = hf.pop(prefix + fused + ".weight", None)
            if weight is not None:  # else llama.from_hf names the first missing tensor
                hf.update({prefix + p + ".weight": w for p, w in zip(parts, weight.split(sizes))})
    return llama.from_hf(args, hf)
