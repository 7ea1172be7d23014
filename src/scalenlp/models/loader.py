"""One loader for every checkpoint a user can name: a training run folder, an export folder, a Hugging
Face model folder (``config.json`` + safetensors) or a ``.gguf`` file.

Each reader turns its format into a ``Pretrained``: model arguments, a state dict under our parameter
names (memory-mapped where the format allows), the tokenizer and its ``tokenizer_config`` (BOS, EOS, chat
template, in Hugging Face's field names). ``instantiate`` then builds the model on the meta device and
assigns those tensors, so the weights are never held twice. ``generate``, ``serve``, ``eval``, ``export``
and the training key ``model.init`` all go through ``load``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from scalenlp.errors import UserError

TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass
class Pretrained:
    args: Any  # ModelArgs for decoders, EncoderArgs for encoders
    state: dict[str, torch.Tensor]  # our parameter names; a tied output projection may be absent
    tokenizer: Tokenizer
    tokenizer_config: dict = field(default_factory=dict)  # bos_token, eos_token, chat_template, add_bos_token
    source: str = "export"  # export | hf | gguf
    path: Path = Path()

    def token_id(self, key: str) -> int | None:
        """The id of a special token named in the tokenizer config (``bos_token``, ``eos_token``)."""
        token = self.tokenizer_config.get(key)
        if isinstance(token, dict):  # written as an AddedToken: {"content": "...", ...}
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None


def checkpoint_kind(path: str | Path) -> tuple[str, Path]:
    """('export' | 'hf' | 'gguf', the path to read) for anything ``--checkpoint`` accepts."""
    from scalenlp.models.io import ARGS

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
                    f"folder) and no config.json (a Hugging Face folder)")


def read(path: str | Path) -> Pretrained:
    """Read a checkpoint of any kind into a ``Pretrained`` (no model built yet)."""
    kind, p = checkpoint_kind(path)
    if kind == "gguf":
        from scalenlp.models.gguf import read_gguf

        return read_gguf(p)
    if kind == "hf":
        from scalenlp.models.hf import read_hf_folder

        return read_hf_folder(p)
    from scalenlp.models.io import read_export

    return read_export(p)


def read_tokenizer_config(folder: Path) -> dict:
    """The folder's ``tokenizer_config.json`` (empty when absent), with a ``chat_template.jinja`` file
    folded in as ``chat_template`` (newer transformers write the template there)."""
    config: dict = {}
    file = folder / TOKENIZER_CONFIG
    if file.is_file():
        try:
            config = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{file} is not valid JSON ({e}); fix or remove it") from None
    template = folder / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text()
    return config


def instantiate(pre: Pretrained, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model on the meta device and assign the checkpoint's tensors to it."""
    from scalenlp.models.io import build

    return build(pre.args, pre.state, device, dtype, where=str(pre.path))


def load(path: str | Path, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None) -> tuple[nn.Module, Pretrained]:
    """(model in eval mode, what was read): the one entry point for every checkpoint kind."""
    pre = read(path)
    return instantiate(pre, device, dtype), pre
