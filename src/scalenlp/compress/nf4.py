"""QLoRA's frozen base: linear weights in 4-bit NormalFloat (NF4, Dettmers et al., 2023) with double-quantized
scales, through torchao's ``NF4Tensor`` (PyTorch's own, what torchtune uses; the ``qlora`` extra).

Each block of 64 weights keeps one absmax scale; the scales are themselves quantized to int8 in blocks of 256
(double quantization), about 4.1 bits per weight in all. A linear over an NF4 weight dequantizes it to bf16 per
use and keeps only the NF4 tensor for backward (the weight never trains). Adapters on top
(models/adapters.py) stay float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from scalenlp.errors import ConfigError

BLOCK, SCALE_BLOCK = 64, 256  # the QLoRA paper's block sizes (weights per scale; scales per second-level scale)


def _to_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise ConfigError("lora.quantize_base=\"nf4\" needs torchao: pip install 'scalenlp[qlora]'") from None
    return to_nf4


@torch.no_grad()
def quantize_nf4(model: nn.Module, names: Iterable[str]) -> None:
    """Replace the weight of each named ``nn.Linear`` by its frozen NF4 form, in place."""
    to_nf4 = _to_nf4()
    for name in names:
        layer = model.get_submodule(name)
        weight = layer.weight
        if weight.numel() % BLOCK:
            raise ConfigError(f"layer {name} has {weight.numel()} weights, not a multiple of NF4's block of "
                              f"{BLOCK}; leave lora.quantize_base empty for this model")
        # The scales (one per block) are quantized in groups of 256 where their number allows, else in the
        # largest group that divides it, so that every shape quantizes.
        scale_block = math.gcd(weight.numel() // BLOCK, SCALE_BLOCK)
        nf4 = to_nf4(weight.detach().to(torch.bfloat16), BLOCK, scale_block)
        layer.weight = nn.Parameter(nf4, requires_grad=False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
