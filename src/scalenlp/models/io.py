"""Exported models: ``model.safetensors`` + ``model_args.json`` (+ ``tokenizer.json``) in one folder.

This is what training hands to inference and to Hugging Face conversion. Loading builds the model on
the meta device and assigns the tensors read from safetensors, so nothing is allocated twice and
no pickle is ever read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables

WEIGHTS, ARGS, TOKENIZER = "model.safetensors", "model_args.json", "tokenizer.json"


def save_pretrained(model: Transformer, out_dir: str | Path, tokenizer_file: str | Path | None = None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Write to a temporary sibling folder, then rename over ``out_dir``: a crash leaves the old export intact.
    ``extra_files`` maps file names to text written alongside (for example the resolved config)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("output.weight", None)  # the same storage as tok_embeddings.weight; safetensors rejects aliases
    save_file(state, str(tmp / WEIGHTS))
    (tmp / ARGS).write_text(json.dumps(dataclasses.asdict(model.args), indent=2))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / TOKENIZER)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def load_model_args(path: str | Path) -> ModelArgs:
    file = Path(path) / ARGS
    if not file.is_file():
        raise UserError(f"{path} is not an exported model (no {ARGS}); pass a run's export/ folder")
    try:
        return ModelArgs(**json.loads(file.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise UserError(f"{file} is corrupt ({e}); re-export the model") from None


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> Transformer:
    """Load an exported model; ``dtype`` casts floating weights (RoPE tables stay float32)."""
    args = load_model_args(path)
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{path} has {ARGS} but no {WEIGHTS}; re-export the model")
    with torch.device("meta"):
        model = Transformer(args)
    try:
        state = load_file(str(weights), device=str(device))
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise UserError(f"cannot read {weights}: {e}") from None
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"{weights} does not match {ARGS}: {str(e).splitlines()[0]}") from None
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if args.position == "rope":  # non-persistent buffers are still on meta
        model.rope_cos, model.rope_sin = rope_tables(args, device=device)
    if dtype is not None:
        model.to(dtype)
        if args.position == "rope":
            model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval()
