"""Linear products on weights reordered once into oneDNN's blocked layout for the CPU (an opaque
``torch._mkldnn`` tensor): the plain ``F.linear`` lets the library reorder on every call, or run a product that
reads the plain row-major weight. Shared by inference's packed linears (engine/packing.py) and LoRA's frozen base
in training (models/adapters.py)."""

from __future__ import annotations

import torch


def pack(weight: torch.Tensor, rows: int | None) -> torch.Tensor:
    """``weight`` (out, in) reordered for products of about ``rows`` input rows (None: oneDNN's choice); any
    other number of rows still computes correctly. ``.to_dense()`` gives the weight back exactly."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` for ``packed`` = ``pack(W, ...)``; x of any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
