"""Llama (``LlamaForCausalLM``), and what the families built like it share: the config keys they have in
common, the RoPE and sliding-window settings, and the tensor names (``model.layers.<i>.self_attn.q_proj``...),
which are ours (``layers.<i>.attention.wq``...) one for one; both sides rotate halves for RoPE, so no
permutation is needed."""

from __future__ import annotations

import torch

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs

MODEL_TYPE, CLASS, CONFIG = "llama", "LlamaForCausalLM", "LlamaConfig"
SHAPE = dict(norm="rmsnorm", activation="swiglu", position="rope")
# ModelArgs.rope_scaling's order, as HF names the "llama3" RoPE parameters.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Our norm -> HF's, in a Llama block; Gemma's blocks name four norms differently (gemma2.NORMS).
NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
LINEARS = (("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
           ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
           ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
           ("feed_forward.w2", "mlp.down_proj"))
OPTIONS = ("qkv_bias", "qk_norm", "norm_offset", "post_norms", "sliding_window", "rope_local_theta", "attn_scale",
            "attn_softcap", "logit_softcap", "embed_scale")


def matches(args: ModelArgs) -> bool:
    """A Llama-shaped model without any of the other families' options."""
    return (all(getattr(args, k) == v for k, v in SHAPE.items())
            and not any(getattr(args, k) for k in OPTIONS))


def rope(params: dict, family: str) -> tuple[float | None, dict]:
    """(base, the ModelArgs fields of its scaling) from one set of RoPE parameters (``rope_scaling`` /
    ``rope_parameters``): plain RoPE, linear scaling and Llama 3.1's are supported, anything else is one UserError."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None, "llama3", "linear"):
        raise UserError(f"{family}: RoPE scaling {kind!r} is not supported; only plain RoPE, linear and Llama 3.1's "
                        f"(llama3)")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params] if kind == "llama3" else []
    if missing:
        raise UserError(f"config.json's llama3 RoPE scaling lacks {', '.join(missing)}; it is not a complete "
                        f"Llama 3.1-style config")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{family}: partial_rotary_factor {params['partial_rotary_factor']} is not supported; "
                        f"only RoPE over the whole head")
    if kind == "linear":
        return params.get("rope_theta"), dict(rope_factor=float(params["factor"]))
    if kind == "llama3":
        return params.get("rope_theta"), dict(rope_scaling=tuple(params[k] for k in LLAMA3_ROPE_KEYS))
    return params.get("rope_theta"), {}


def scaling_config(args: ModelArgs) -> dict | None:
    """transformers' RoPE scaling parameters of a model, None for plain RoPE (the reverse of ``rope``)."""
    if args.rope_scaling:
        return dict(rope_type="llama3", **dict(zip(LLAMA3_ROPE_KEYS, args.rope_scaling)))
    return dict(rope_type="linear", factor=args.rope_factor) if args.rope_factor else None


def window(c: dict, n_layers: int, default_types=None) -> dict:
    """ModelArgs' sliding_window and local_layers: the layers ``layer_types`` calls sliding. A config.json
    without layer_types (as older transformers wrote them) gets ``default_types(c, n_layers)``, the family's
    own rule, or else every layer where ``sliding_window`` is set (Mistral, Phi-3)."""
    size = c.get("sliding_window") or 0
    types = c.get("layer_types")
    if types is None and default_types is not None:
        types = default_types(c, n_layers)
    if types is None:
        local = tuple(range(n_layers)) if size else ()
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UserError(f"config.json's layer_types has {', '.join(unknown)}; only sliding_attention and "
                            f"full_attention layers are supported")
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if local and not size:
        raise UserError("config.json names sliding_attention layers but no sliding_window; it is incomplete")
    return dict(sliding_window=size if local else 0, local_layers=local)


def window_everywhere(args: ModelArgs, family: str) -> int | None:
    """transformers' sliding_window of a family whose window, where set, covers every layer (Mistral, Phi-3)."""
    if args.local_layers and len(args.local_layers) != args.n_layers:
        raise UserError(f"{family} applies its sliding window to every layer; this model has it on layers "
                        f"{list(args.local_layers)} of {args.n_layers}, which {family} cannot express")
    return args.sliding_window or None


def window_config(args: ModelArgs) -> dict:
    """The transformers config keys of a sliding window (for families with ``layer_types``)."""
    types = ["sliding_attention" if i in args.local_layers else "full_attention" for i in range(args.n_layers)]
    return dict(sliding_window=args.sliding_window or None, layer_types=types)


def common(c: dict, family: str, **options) -> ModelArgs:
    """The ModelArgs of a Llama-like config.json: the keys they all share, then the family's ``options``."""
    heads, dim = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or dim // heads
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta, scaling = rope(params, family)
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if options.get("activation", "swiglu") == "swiglu" and act != "silu":
        raise UserError(f"{family} activation {act!r} is not supported; only silu (SwiGLU)")
    fields = dict(vocab_size=c["vocab_size"], dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
                  max_seq_len=c.get("max_position_embeddings", 2048), norm_eps=c.get("rms_norm_eps", 1e-6),
                  rope_theta=c.get("rope_theta") or theta or 10000.0, **scaling,
                  tie_embeddings=c.get("tie_word_embeddings", False),
                  fixed_head_dim=head_dim if head_dim != dim // heads else 0, **SHAPE)
    return ModelArgs(**(fields | options))


def common_config(args: ModelArgs) -> dict:
    """The transformers config keys every Llama-like family takes."""
    return dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.max_seq_len,
                rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings, head_dim=args.head_dim,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters=(scaling_config(args) or dict(rope_type="default")) | dict(rope_theta=args.rope_theta))


def args_from_config(c: dict) -> ModelArgs:
    if c.get("attention_bias", False) != c.get("mlp_bias", False):
        raise UserError("attention_bias and mlp_bias differ; only models with both or neither are supported")
    return common(c, "Llama", bias=c.get("attention_bias", False))


def config_kwargs(args: ModelArgs) -> dict:
    return dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.max_seq_len,
                rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, attention_bias=args.bias,
                mlp_bias=args.bias, tie_word_embeddings=args.tie_embeddings, head_dim=args.head_dim,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_scaling=scaling_config(args))


def pairs(args: ModelArgs, norms: dict[str, str] = NORMS) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor of a Llama-like model: biases where the model has them, per-head
    q/k norms, and the block's norms as ``norms`` names them."""
    out = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
           ("output.weight", "lm_head.weight")]
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out += [(ours + a + ".weight", hf + b + ".weight") for a, b in norms.items()]
        if args.qk_norm:
            out += [(ours + "attention.q_norm.weight", hf + "self_attn.q_norm.weight"),
                    (ours + "attention.k_norm.weight", hf + "self_attn.k_norm.weight")]
        for a, b in LINEARS:
            out.append((ours + a + ".weight", hf + b + ".weight"))
            if args.bias or args.qkv_bias and a in ("attention.wq", "attention.wk", "attention.wv"):
                out.append((ours + a + ".bias", hf + b + ".bias"))
    return out


def llama_pairs(n_layers: int, bias: bool) -> list[tuple[str, str]]:
    """A plain Llama's (our name, HF name) pairs (GGUF's tensor names are derived from them)."""
    return pairs(ModelArgs(n_layers=n_layers, bias=bias))


def renamed(state: dict[str, torch.Tensor], names: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """``state``'s tensors under the second name of each pair; a missing one is the checkpoint's fault."""
    try:
        return {new: state[old] for old, new in names}
    except KeyError as e:
        raise UserError(f"the Hugging Face checkpoint lacks {e.args[0]}; it does not match its config.json") from None


def to_hf(args: ModelArgs, ours: dict[str, torch.Tensor], norms: dict[str, str] = NORMS) -> dict[str, torch.Tensor]:
    return renamed(ours, pairs(args, norms))


def from_hf(args: ModelArgs, hf: dict[str, torch.Tensor], norms: dict[str, str] = NORMS) -> dict[str, torch.Tensor]:
    if args.tie_embeddings:  # HF state dicts may or may not list the tied head
        hf = {**hf, "lm_head.weight": hf.get("lm_head.weight", hf.get("model.embed_tokens.weight"))}
    return renamed(hf, [(h, ours) for ours, h in pairs(args, norms)])
