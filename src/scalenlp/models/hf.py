"""Hugging Face checkpoints in and out: our GPT-2 family <-> ``GPT2LMHeadModel``, our Llama family <->
``LlamaForCausalLM``. Weights move as state dicts (no hub access); folders are written with
safetensors. Both sides use the same RoPE layout (rotate-half), so no permutation is needed;
GPT-2's ``Conv1D`` stores weights as (in, out), the transpose of ``nn.Linear``, and fuses q, k, v.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables
from scalenlp.models.pretrained import Pretrained, read_tokenizer_config

GPT2_SHAPE = dict(norm="layernorm", activation="gelu", position="learned", bias=True)
LLAMA_SHAPE = dict(norm="rmsnorm", activation="swiglu", position="rope")
# ModelArgs.rope_scaling's order, as HF names the "llama3" RoPE parameters.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def family(args: ModelArgs) -> str:
    """'gpt2' or 'llama': the Hugging Face class that computes exactly what this model computes."""
    if (all(getattr(args, k) == v for k, v in GPT2_SHAPE.items()) and args.n_kv_heads == args.n_heads
            and args.n_heads * args.head_dim == args.dim):  # GPT2Config has no head size of its own
        return "gpt2"
    if all(getattr(args, k) == v for k, v in LLAMA_SHAPE.items()):
        return "llama"
    raise UserError(f"no Hugging Face equivalent for norm={args.norm}, activation={args.activation}, "
                    f"position={args.position}, bias={args.bias}: GPT-2 needs {GPT2_SHAPE} and no GQA, "
                    f"Llama needs {LLAMA_SHAPE}")


def hf_config(args: ModelArgs):
    from transformers import GPT2Config, LlamaConfig

    if family(args) == "gpt2":
        return GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_seq_len, n_embd=args.dim,
                          n_layer=args.n_layers, n_head=args.n_heads, n_inner=args.ffn_dim,
                          activation_function="gelu_new", layer_norm_epsilon=args.norm_eps,
                          tie_word_embeddings=args.tie_embeddings, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                       num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                       num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.max_seq_len,
                       rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, attention_bias=args.bias,
                       mlp_bias=args.bias, tie_word_embeddings=args.tie_embeddings, head_dim=args.head_dim,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       rope_scaling=dict(rope_type="llama3", **dict(zip(LLAMA3_ROPE_KEYS, args.rope_scaling)))
                       if args.rope_scaling else None)


def args_from_hf(config) -> ModelArgs:
    """Our model arguments from a transformers config object or a ``config.json`` dict."""
    c = config if isinstance(config, dict) else config.to_dict()
    model_type = c.get("model_type")
    if model_type == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(f"GPT-2 activation {c['activation_function']!r} is not supported; only gelu_new (tanh)")
        return ModelArgs(vocab_size=c["vocab_size"], dim=c["n_embd"], n_layers=c["n_layer"], n_heads=c["n_head"],
                         ffn_dim=c.get("n_inner") or 4 * c["n_embd"], max_seq_len=c["n_positions"],
                         norm_eps=c.get("layer_norm_epsilon", 1e-5),
                         tie_embeddings=c.get("tie_word_embeddings", True), **GPT2_SHAPE)
    if model_type == "llama":
        heads, dim = c["num_attention_heads"], c["hidden_size"]
        head_dim = c.get("head_dim") or dim // heads
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None, "llama3"):
            raise UserError(f"RoPE scaling {kind!r} is not supported; only plain RoPE and Llama 3.1's (llama3)")
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope] if kind == "llama3" else []
        if missing:
            raise UserError(f"config.json's llama3 RoPE scaling lacks {', '.join(missing)}; it is not a complete "
                            f"Llama 3.1-style config")
        scaling = () if kind != "llama3" else tuple(rope[k] for k in LLAMA3_ROPE_KEYS)
        if c.get("hidden_act", "silu") != "silu":
            raise UserError(f"Llama activation {c['hidden_act']!r} is not supported; only silu (SwiGLU)")
        if c.get("attention_bias", False) != c.get("mlp_bias", False):
            raise UserError("attention_bias and mlp_bias differ; only models with both or neither are supported")
        return ModelArgs(vocab_size=c["vocab_size"], dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
                         n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
                         max_seq_len=c.get("max_position_embeddings", 2048), norm_eps=c.get("rms_norm_eps", 1e-6),
                         rope_theta=c.get("rope_theta") or rope.get("rope_theta", 10000.0), rope_scaling=scaling,
                         bias=c.get("attention_bias", False), tie_embeddings=c.get("tie_word_embeddings", False),
                         fixed_head_dim=head_dim if head_dim != dim // heads else 0, **LLAMA_SHAPE)
    raise UserError(f"cannot load a Hugging Face {model_type!r} model; supported: gpt2 (GPT2LMHeadModel), "
                    f"llama (LlamaForCausalLM and its relatives), bert (BertModel, BertForSequenceClassification, "
                    f"BertForTokenClassification)")


def read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / 'config.json'} is not valid JSON ({e})") from None


def read_hf_folder(folder: Path, config: dict) -> Pretrained:
    """A local Hugging Face decoder folder (its ``config.json`` already parsed): ``*.safetensors`` (one file
    or shards, memory-mapped) and ``tokenizer.json``. Never touches the hub."""
    args = args_from_hf(config)
    hf = read_safetensors(folder)
    if config.get("model_type") == "gpt2":  # GPT2Model (no LM head) saves its weights without the prefix
        hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf.items()}
    return Pretrained(args, from_hf_state_dict(args, hf), *read_hf_tokenizer(folder), "hf", folder)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's ``*.safetensors`` files (one file or shards), memory-mapped."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has a config.json but no .safetensors weights; save the model with "
                        f"save_pretrained(..., safe_serialization=True) (pickled .bin files are not read)")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            hf.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {f}: {e}") from None
    return hf


def read_hf_tokenizer(folder: Path) -> tuple[Tokenizer, dict]:
    """The folder's ``tokenizer.json`` and its ``tokenizer_config.json``."""
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer.json; only fast (tokenizers-library) tokenizers are supported")
    return load_tokenizer(folder), read_tokenizer_config(folder)


def _gpt2_pairs(n_layers: int):
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


def _llama_pairs(n_layers: int, bias: bool):
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
             ("output.weight", "lm_head.weight")]
    for i in range(n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(ours + "attention_norm.weight", hf + "input_layernorm.weight"),
                  (ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight")]
        for a, b in (("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
                     ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
                     ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
                     ("feed_forward.w2", "mlp.down_proj")):
            pairs.append((ours + a + ".weight", hf + b + ".weight"))
            if bias:
                pairs.append((ours + a + ".bias", hf + b + ".bias"))
    return pairs


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    args, ours = model.args, model.state_dict()
    if family(args) == "llama":
        return {hf: ours[name] for name, hf in _llama_pairs(args.n_layers, args.bias)}
    state = {hf: ours[name].t() if transposed else ours[name] for name, hf, transposed in _gpt2_pairs(args.n_layers)}
    for i in range(args.n_layers):
        a, hf = f"layers.{i}.attention.", f"transformer.h.{i}.attn.c_attn."
        state[hf + "weight"] = torch.cat([ours[a + w + ".weight"] for w in ("wq", "wk", "wv")]).t()
        state[hf + "bias"] = torch.cat([ours[a + w + ".bias"] for w in ("wq", "wk", "wv")])
    return {k: v.contiguous() for k, v in state.items()}


def from_hf_state_dict(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if args.tie_embeddings:  # HF state dicts may or may not list the tied head
        hf = {**hf, "lm_head.weight": hf.get("lm_head.weight", hf.get("transformer.wte.weight",
                                                                         hf.get("model.embed_tokens.weight")))}
    try:
        if family(args) == "llama":
            return {name: hf[h] for name, h in _llama_pairs(args.n_layers, args.bias)}
        state = {name: hf[h].t() if transposed else hf[h] for name, h, transposed in _gpt2_pairs(args.n_layers)}
        for i in range(args.n_layers):
            a, h = f"layers.{i}.attention.", f"transformer.h.{i}.attn.c_attn."
            for w, part in zip(("wq", "wk", "wv"), hf[h + "weight"].t().split(args.dim)):
                state[a + w + ".weight"] = part
            for w, part in zip(("wq", "wk", "wv"), hf[h + "bias"].split(args.dim)):
                state[a + w + ".bias"] = part
    except KeyError as e:
        raise UserError(f"the Hugging Face checkpoint lacks {e.args[0]}; it does not match its config.json") from None
    return {k: v.contiguous() for k, v in state.items()}


def to_hf(model: Transformer):
    """A transformers model computing the same function, on the same device and dtype."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    cls = GPT2LMHeadModel if family(model.args) == "gpt2" else LlamaForCausalLM
    ref = next(model.parameters())
    # Built for real (not on meta) so that HF's own non-persistent buffers (RoPE frequencies) exist.
    with torch.device(ref.device):
        hf = cls(hf_config(model.args)).to(ref.dtype)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"conversion mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.eval()


def from_hf(hf_model) -> Transformer:
    args = args_from_hf(hf_model.config)
    state = from_hf_state_dict(args, hf_model.state_dict())
    ref = next(hf_model.parameters())
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        state.pop("output.weight")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if args.position == "rope":
        model.rope_cos, model.rope_sin = rope_tables(args, device=ref.device)
    return model.eval()
