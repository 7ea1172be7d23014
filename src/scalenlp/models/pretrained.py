"""What every checkpoint reader returns: a ``Pretrained`` (arguments, weights under our names, tokenizer
and its config). Its own module so that the readers (io, hf, gguf) and the loader that dispatches to
them import it without importing each other."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from scalenlp.data.chat import special_token
from scalenlp.data.tokenizer import TOKENIZER_CONFIG
from scalenlp.errors import UserError


@dataclass
class Pretrained:
    args: Any  # ModelArgs for decoders, EncoderArgs for encoders
    state: dict[str, torch.Tensor]  # our parameter names; a tied output projection may be absent
    tokenizer: Tokenizer
    tokenizer_config: dict = field(default_factory=dict)  # bos_token, eos_token, chat_template, add_bos_token
    source: str = "export"  # export | hf | gguf
    path: Path = Path()
    quantization: Any = None  # a compress.quantized.Quantization for a quantized export
    # GGUF only: our weight name -> (GGML type name, the raw blocks as uint8 rows) for the Q4_0/Q4_1/Q8_0 weights,
    # which quantization may take as they are instead of rounding the dequantized floats again.
    blocks: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)

    def token_id(self, key: str) -> int | None:
        """The id of a special token named in the tokenizer config (``bos_token``, ``eos_token``)."""
        token = special_token(self.tokenizer_config, key)
        return self.tokenizer.token_to_id(token) if token is not None else None


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
