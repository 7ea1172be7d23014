"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, GELU; its ``Conv1D`` stores weights as
(in, out), the transpose of ``nn.Linear``, and fuses q, k and v into one ``c_attn``."""

from __future__ import annotations

import torch

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs

MODEL_TYPE, CLASS, CONFIG = "gpt2", "GPT2LMHeadModel", "GPT2Config"
SHAPE = dict(norm="layernorm", activation="gelu", position="learned", bias=True)


def matches(args: ModelArgs) -> bool:
    return (all(getattr(args, k) == v for k, v in SHAPE.items()) and args.n_kv_heads == args.n_heads
            and args.n_heads * args.head_dim == args.dim)  # GPT2Config has no head size of its own


def args_from_config(c: dict) -> ModelArgs:
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"GPT-2 activation {c['activation_function']!r} is not supported; only gelu_new (tanh)")
    return ModelArgs(vocab_size=c["vocab_size"], dim=c["n_embd"], n_layers=c["n_layer"], n_heads=c["n_head"],
                     ffn_dim=c.get("n_inner") or 4 * c["n_embd"], max_seq_len=c["n_positions"],
                     norm_eps=c.get("layer_norm_epsilon", 1e-5),
                     tie_embeddings=c.get("tie_word_embeddings", True), **SHAPE)


def config_kwargs(args: ModelArgs) -> dict:
    return dict(vocab_size=args.vocab_size, n_positions=args.max_seq_len, n_embd=args.dim, n_layer=args.n_layers,
                n_head=args.n_heads, n_inner=args.ffn_dim, activation_function="gelu_new",
                layer_norm_epsilon=args.norm_eps, tie_word_embeddings=args.tie_embeddings, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


def _pairs(n_layers: int):
    """(our name, HF name, transposed) for every GPT-2 tensor except the fused q/k/v."""
    pairs = [("tok_embeddings.weight", "transformer.wte.weight", False),
             ("pos_embeddings.weight", "transformer.wpe.weight", False),
             ("norm.weight", "transformer.ln_f.weight", False), ("norm.bias", "transformer.ln_f.bias", False),
             ("output.weight", "lm_head.weight", False)]
    for i in range(n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for a, b in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            pairs += [(ours + a + ".weight", hf + b + ".weight", False), (ours + a + ".bias", hf + b + ".bias", False)]
        for a, b in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"), ("feed_forward.w2", "mlp.c_proj")):
            pairs += [(ours + a + ".weight", hf + b + ".weight", True), (ours + a + ".bias", hf + b + ".bias", False)]
    return pairs


def to_hf(args: ModelArgs, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {hf: ours[name].t() if transposed else ours[name] for name, hf, transposed in _pairs(args.n_layers)}
    for i in range(args.n_layers):
        a, hf = f"layers.{i}.attention.", f"transformer.h.{i}.attn.c_attn."
        state[hf + "weight"] = torch.cat([ours[a + w + ".weight"] for w in ("wq", "wk", "wv")]).t()
        state[hf + "bias"] = torch.cat([ours[a + w + ".bias"] for w in ("wq", "wk", "wv")])
    return state


def from_hf(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # GPT2Model (no LM head) saves its weights without the prefix.
    hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf.items()}
    if args.tie_embeddings:
        hf.setdefault("lm_head.weight", hf.get("transformer.wte.weight"))
    state = {name: hf[h].t() if transposed else hf[h] for name, h, transposed in _pairs(args.n_layers)}
    for i in range(args.n_layers):
        a, h = f"layers.{i}.attention.", f"transformer.h.{i}.attn.c_attn."
        for w, part in zip(("wq", "wk", "wv"), hf[h + "weight"].t().split(args.dim)):
            state[a + w + ".weight"] = part
        for w, part in zip(("wq", "wk", "wv"), hf[h + "bias"].split(args.dim)):
            state[a + w + ".bias"] = part
    return state
