"""Hugging Face decoder checkpoints in and out: a folder's ``config.json`` picks the family adapter
(scalenlp.models.families: GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3) that maps its
options and tensor names onto ours, and export goes back through the same adapter to the same class.
Weights move as state dicts (no hub access); folders are read and written as safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.errors import UserError
from scalenlp.models import families
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables
from scalenlp.models.limits import check_counts, read_from
from scalenlp.models.pretrained import Pretrained, read_tokenizer_config


def family(args: ModelArgs) -> str:
    """The Hugging Face model_type whose class computes exactly what this model computes."""
    return families.for_args(args).MODEL_TYPE


def hf_config(args: ModelArgs):
    import transformers

    return getattr(transformers, families.for_args(args).CONFIG)(**families.for_args(args).config_kwargs(args))


# config.json's counts (the families' names for them) -> the ModelArgs field each sets, checked before a family
# adapter divides by them or makes a list as long as them.
COUNTS = {"vocab_size": "vocab_size", "hidden_size": "dim", "n_embd": "dim", "num_hidden_layers": "n_layers",
          "n_layer": "n_layers", "num_attention_heads": "n_heads", "n_head": "n_heads",
          "num_key_value_heads": "n_kv_heads", "head_dim": "dim", "intermediate_size": "ffn_dim", "n_inner": "ffn_dim",
          "max_position_embeddings": "max_seq_len", "n_positions": "max_seq_len", "sliding_window": "sliding_window",
          "sliding_window_pattern": "n_layers", "query_pre_attn_scalar": "dim"}


def args_from_hf(config, where: str = "config.json") -> ModelArgs:
    """Our model arguments from a transformers config object or a ``config.json`` dict (``where``), checked: a
    count of the wrong type or out of range, or a shape that cannot be built, is one UserError naming the key."""
    c = config if isinstance(config, dict) else config.to_dict()
    with read_from(where):
        check_counts(c, COUNTS)
        args = families.for_config(c).args_from_config(c)
        args.check()
    return args


def read_hf_config(folder: Path) -> dict:
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} holds a JSON {type(config).__name__}, not an object of model settings")
    return config


def read_hf_folder(folder: Path, config: dict) -> Pretrained:
    """A local Hugging Face decoder folder (its ``config.json`` already parsed): ``*.safetensors`` (one file
    or shards, memory-mapped) and ``tokenizer.json``. Never touches the hub."""
    args = args_from_hf(config, str(folder / "config.json"))
    return Pretrained(args, from_hf_state_dict(args, read_safetensors(folder)), *read_hf_tokenizer(folder), "hf",
                      folder)


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


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    state = families.for_args(model.args).to_hf(model.args, model.state_dict())
    return {k: v.contiguous() for k, v in state.items()}


def from_hf_state_dict(args: ModelArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        state = families.for_args(args).from_hf(args, hf)
    except KeyError as e:
        raise UserError(f"the Hugging Face checkpoint lacks {e.args[0]}; it does not match its config.json") from None
    return {k: v.contiguous() for k, v in state.items()}


def to_hf(model: Transformer):
    """A transformers model computing the same function, on the same device and dtype."""
    import transformers

    cls = getattr(transformers, families.for_args(model.args).CLASS)
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
