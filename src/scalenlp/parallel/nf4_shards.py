"""QLoRA under tensor parallelism: each rank holds its own shard of each frozen block linear in NF4.

torchao's NF4 tensor cannot be a DTensor's local part: DTensor would run its matmul as aten ops NF4 lacks, and NF4
splits by rows only where a row-parallel layer's weight is split by columns. So once the TP plan has cut the model,
each rank quantizes its shard alone (a plain local tensor) and the layer takes its product on local parts, handing
back the DTensor its parallel style expects, as DTensor's own linear would.

Each shard is quantized by itself: its blocks of 64 run along its own rows and its scales' second level (groups and
their mean) is its own, so the base differs slightly from one quantized whole (where a block of the whole straddles
two shards, and by the second level's rounding of its scales).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

from scalenlp.compress.nf4 import freeze_weight, quantize_weight
from scalenlp.models.adapters import LoRALinear, base_product


class _LocalShard:
    """A frozen linear whose weight is this rank's TP shard in NF4, with the layout the plan gave it."""

    tp_layout: tuple[DeviceMesh, tuple[Placement, ...]]
    weight: torch.Tensor
    bias: torch.Tensor | None

    def base(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """A column-parallel shard (Shard(0), whole input) gives this rank's output columns, and its input's
        gradient is a partial sum over the ranks; a row-parallel one (Shard(1), input sharded alike) gives a
        partial sum, which the style reduces."""
        mesh, placements = self.tp_layout
        colwise = placements[0] == Shard(0)
        local = base_product(x.to_local(grad_placements=[Partial()] if colwise else None), self.weight, None)
        out = DTensor.from_local(local, mesh, [Shard(local.ndim - 1) if colwise else Partial()], run_check=False)
        return out if not with_bias or self.bias is None else out + self.bias


class NF4ShardLinear(_LocalShard, nn.Linear):
    """A frozen block linear that no adapter wraps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


class NF4ShardLoRALinear(_LocalShard, LoRALinear):
    """An adapted one: its DoRA norms are taken over the whole weight, as a DTensor of the shards."""

    def _lora_operands(self, x: torch.Tensor) -> None:
        return None  # the op-by-op layer: its base product is the shard's (``base``), a DTensor of the shards

    def dense_weight(self) -> torch.Tensor:
        return DTensor.from_local(super().dense_weight(), *self.tp_layout, run_check=False)


@torch.no_grad()
def quantize_tp_shards(model: nn.Module, names: Iterable[str]) -> None:
    """After the plan has sharded the model: replace each named linear's weight (a DTensor) by this rank's shard
    in NF4. The class changes in place, so the hooks ``parallelize_module`` put on the layer stay."""
    for name in names:
        layer = model.get_submodule(name)
        weight = layer.weight
        freeze_weight(layer, quantize_weight(name, weight.to_local()))
        layer.__class__ = NF4ShardLoRALinear if isinstance(layer, LoRALinear) else NF4ShardLinear
        layer.tp_layout = (weight.device_mesh, weight.placements)


@torch.no_grad()
def reset_magnitudes(model: nn.Module) -> None:
    """Set every DoRA magnitude to the row norms of its adapted weight, as a fresh adapter has it: the base changed
    after the adapters were added (quantized shard by shard)."""
    for layer in model.modules():
        if isinstance(layer, LoRALinear) and layer.lora_magnitude is not None:
            norm, magnitude = layer._adapted_norm(), layer.lora_magnitude
            if isinstance(norm, DTensor):  # a row-parallel layer's norms come out reduced otherwise than kept
                norm = norm.redistribute(placements=magnitude.placements)
            magnitude.copy_(norm)
