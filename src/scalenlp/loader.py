"""One loader for every checkpoint a user can name: a training run folder, an export folder, a Hugging
Face model folder (``config.json`` + safetensors) or a ``.gguf`` file.

Each reader turns its format into a ``Pretrained``: model arguments, a state dict under our parameter
names (memory-mapped where the format allows), the tokenizer and its ``tokenizer_config`` (BOS, EOS, chat
template, in Hugging Face's field names). ``instantiate`` then builds the model on the meta device and
assigns those tensors, so the weights are never held twice. ``generate``, ``serve``, ``eval``, ``export``
and the training key ``model.init`` all go through ``load``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from scalenlp.compress.quantized import Quantization, build_quantized, read_quantization
from scalenlp.errors import UserError
from scalenlp.models.gguf import read_gguf
from scalenlp.models.hf import read_hf_config, read_hf_folder
from scalenlp.models.hf_encoder import is_encoder_config, read_encoder_folder
from scalenlp.models.io import ARGS, build, read_export
from scalenlp.models.memory import check_fits
from scalenlp.models.pretrained import Pretrained

# The least a quantized weight takes (int4): what the memory check prices a quantized model at.
QUANTIZED_BYTES = 0.5


def checkpoint_kind(path: str | Path) -> tuple[str, Path]:
    """('export' | 'hf' | 'gguf', the path to read) for anything ``--checkpoint`` accepts."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf", p
        raise UserError(f"{p} is a file but not a .gguf model; pass a .gguf file, a run folder, an export "
                        f"folder or a Hugging Face model folder")
    if not p.is_dir():
        raise UserError(f"checkpoint {str(path)!r} does not exist; pass a run folder, an export folder, a Hugging "
                        f"Face model folder or a .gguf file")
    for candidate in (p, p / "export"):
        if (candidate / ARGS).is_file():
            return "export", candidate
    if (p / "config.json").is_file():
        return "hf", p
    raise UserError(f"{p} is not a model: it has no {ARGS} (a scalenlp export), no export/ folder (a run "
                    f"folder) and no config.json (a Hugging Face folder); {_contents(p)}")


def _contents(folder: Path) -> str:
    """What a folder that is not a model holds, for its error line; an export whose replacement was interrupted
    (export.old, left between the two renames of models.io.replacing_folder) is named as the way back."""
    try:
        names = sorted(c.name + "/" * c.is_dir() for c in folder.iterdir())
    except OSError as e:
        return f"its contents cannot be listed ({e.strerror})"
    held = f"it holds {', '.join(names[:5])}{f' and {len(names) - 5} more' if len(names) > 5 else ''}" if names \
        else "it is empty"
    if (folder / "export.old" / ARGS).is_file():
        held += " (export.old/ is the previous export, left by an interrupted write: rename it to export/ to load it)"
    return held


def read(path: str | Path) -> Pretrained:
    """Read a checkpoint of any kind into a ``Pretrained`` (no model built yet)."""
    kind, p = checkpoint_kind(path)
    if kind == "gguf":
        pre = read_gguf(p)
    elif kind == "hf":
        config = read_hf_config(p)
        pre = (read_encoder_folder if is_encoder_config(config) else read_hf_folder)(p, config)
    else:
        pre = read_export(p)
        pre.quantization = read_quantization(p)
    check_token_ids(pre)
    return pre


def check_token_ids(pre: Pretrained) -> None:
    """Every id the tokenizer gives (BOS and EOS among them) names one of the model's embeddings: a larger one would
    fail inside the first forward pass of whoever sent it."""
    top = max(pre.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= pre.args.vocab_size:
        raise UserError(f"{pre.path}: its tokenizer gives token ids up to {top:,}, but the model has "
                        f"{pre.args.vocab_size:,} token embeddings; the tokenizer does not belong to these weights")


def instantiate(pre: Pretrained, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                quantize: Quantization | None = None, shard=None) -> nn.Module:
    """Build the model on the meta device and assign the checkpoint's tensors to it; ``quantize`` swaps its
    linears for quantized ones (a quantized export is built quantized without it). ``shard``: a quantized
    model's tensor-parallel slicing (``compress.quantized.build_quantized``)."""
    if quantize is not None and pre.quantization is not None:
        raise UserError(f"{pre.path} is already quantized ({pre.quantization.describe()}); load it without "
                        f"--quantize, or quantize its floating-point original")
    if quantize is not None or pre.quantization is not None:
        check_fits(pre.args, device, QUANTIZED_BYTES, str(pre.path))
        return build_quantized(pre.args, pre.state, quantize or pre.quantization, quantize is not None, device, dtype,
                               where=str(pre.path), blocks=pre.blocks, shard=shard)
    return build(pre.args, pre.state, device, dtype, where=str(pre.path))


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
         quantize: Quantization | None = None) -> tuple[nn.Module, Pretrained]:
    """(model in eval mode, what was read): the one entry point for every checkpoint kind."""
    pre = read(path)
    return instantiate(pre, device, dtype, quantize), pre
