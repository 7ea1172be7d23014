"""QLoRA's frozen base: linear weights in 4-bit NormalFloat (NF4, Dettmers et al., 2023) with double-quantized
scales, through torchao's ``NF4Tensor`` (PyTorch's own, what torchtune uses; the ``qlora`` extra).

Each block of 64 weights keeps one absmax scale; the scales are themselves quantized to int8 in groups of up to
256 (double quantization; ``scale_block``), about 4.1-4.2 bits per weight in all. A linear over an NF4 weight
dequantizes it per use and keeps only the NF4 tensor for backward (the weight never trains): to bf16, QLoRA's
compute dtype, on a GPU; to float32 on the CPU, which ran faster on both CPUs measured, with bf16 instructions
or without (models/adapters.py ``dequantizes_to_float32``). Adapters on top (models/adapters.py) stay
float32. ZeRO-2/3 shard an NF4 weight by rows through torchao's FSDP2 extension
(``fsdp_pre_all_gather``), gathering it for use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from scalenlp.errors import ConfigError

BLOCK, SCALE_BLOCK = 64, 256  # the QLoRA paper's block sizes (weights per scale; scales per second-level scale)
SHARDS = 8  # ZeRO-2/3 ranks that every weight's second-level groups split over evenly, where its shape allows


def _to_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise ConfigError("lora.quantize_base=\"nf4\" needs torchao: pip install 'scalenlp[qlora]'") from None
    return to_nf4


def scale_block(blocks: int) -> int:
    """How many block scales one second-level scale covers in a weight of ``blocks`` blocks: the largest power
    of two up to 256 that leaves a multiple of SHARDS groups (of gcd(blocks, SHARDS) where fewer divide it).

    ZeRO-2/3 split an NF4 weight by rows into equal shards, and torchao splits each of its inner tensors evenly,
    so every shard must hold whole groups. Sizing them for SHARDS ranks, whatever this run's layout, quantizes
    the base alike in one process and sharded, so a run resumes on another layout over the same base."""
    return math.gcd(blocks // math.gcd(blocks, SHARDS), SCALE_BLOCK)


def check_shardable(model: nn.Module, names: Iterable[str], shards: int, tp: int = 1,
                    split_dim: Callable[[str], int | None] | None = None) -> None:
    """Raise ConfigError unless each named linear's NF4 weight can be held under this layout: with tensor
    parallelism (``tp`` > 1) each rank quantizes its own shard, which must be whole blocks; with ZeRO-2/3
    (``shards`` > 1) that weight (or shard) is split into ``shards`` row shards of whole scale groups (FSDP2
    would pad an uneven split, which an NF4 tensor cannot take). ``split_dim(name)``: the dim TP splits a
    linear's weight along (0, 1 or None; parallel/tensor_parallel.py), needed when ``tp`` > 1."""
    for name in names:
        rows, cols = model.get_submodule(name).weight.shape
        dim = split_dim(name) if tp > 1 else None
        rows, cols = (rows // tp, cols) if dim == 0 else (rows, cols // tp) if dim == 1 else (rows, cols)
        held = f"{name} ({rows} x {cols}{' on each tensor-parallel rank' if dim is not None else ''}"
        if dim is not None and rows * cols % BLOCK:  # a whole weight's blocks: quantize_nf4 checks them
            raise ConfigError(f"lora.quantize_base=\"nf4\" under parallel.tp={tp} quantizes each rank's shard in "
                              f"blocks of {BLOCK} weights; {held}) is not whole blocks: use another parallel.tp")
        blocks = rows * cols // BLOCK
        groups = blocks // scale_block(blocks)
        if shards > 1 and (rows % shards or groups % shards):
            raise ConfigError(f"lora.quantize_base=\"nf4\" with ZeRO-2/3 splits each NF4 weight into {shards} "
                              f"shards of whole rows and scale groups; {held}, {groups} groups) "
                              f"does not split so: use fewer parallel.dp_shard ranks, or "
                              f"parallel.data_parallel=\"ddp\" or \"zero1\"")


def quantize_weight(name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (layer ``name``'s, or its tensor-parallel shard) in NF4, double-quantized scales included."""
    if weight.numel() % BLOCK:
        raise ConfigError(f"layer {name} has {weight.numel()} weights, not a multiple of NF4's block of "
                          f"{BLOCK}; leave lora.quantize_base empty for this model")
    return _to_nf4()(weight.detach().to(torch.bfloat16), BLOCK, scale_block(weight.numel() // BLOCK))


def freeze_weight(layer: nn.Linear, weight: torch.Tensor) -> None:
    """Make ``weight`` the layer's frozen weight (and freeze its bias)."""
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        layer.bias.requires_grad_(False)


@torch.no_grad()
def quantize_nf4(model: nn.Module, names: Iterable[str]) -> None:
    """Replace the weight of each named ``nn.Linear`` by its frozen NF4 form, in place."""
    for name in names:
        layer = model.get_submodule(name)
        freeze_weight(layer, quantize_weight(name, layer.weight))
