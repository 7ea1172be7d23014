"""A frozen weight's two products held in layouts chosen once: LoRA's frozen base (models/adapters.py
``pack_frozen``) and a frozen output projection in the chunked loss (models/loss.py).

A step computes ``x W^T`` (the forward) and ``dy W`` (the input's gradient) of a frozen ``W``, nothing else (no
weight gradient). ``F.linear`` reads ``W`` transposed for the first, and on the CPU the BLAS may run one layout
faster than the other. ``frozen_operands`` returns the right-hand operand of each product, computed by
``frozen_product``:

- "onednn": ``W`` and ``W^T`` reordered once into oneDNN's blocked layout (``W`` is then dropped);
- "transposed": a row-major copy of ``W^T`` beside ``W`` itself, so that neither product reads its operand
  transposed. On an AVX-512 Xeon (MKL, one thread, 128 rows) SmolLM2's forward products over 30 layers took
  259-272 ms on such copies against 281-294 ms on ``W`` transposed; the input gradients read ``W`` as before;
- "mkl": ``W`` packed once by MKL for the forward product (``cblas_sgemm_pack``), which a plain product repacks
  on every call, read by ``cblas_sgemm_compute`` for products of the rows it was packed for (others, and the
  input gradients, read ``W`` itself). On the same Xeon the output projection's two products ran 1.14x as fast
  so (the transposed copy's: 0.81x), gate/up's 1.13x (1.05x), a step's frozen products 1.09x (1.01x).

Each costs a second copy of the weight; train/frozen_packing.py measures which, if any, pays on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scalenlp.models.onednn import pack, packed_linear

LAYOUTS = ("onednn", "transposed", "mkl")
# torch.compile's: Inductor fails on oneDNN's opaque packed weights (an InductorError, torch 2.13); the transposed
# copy is a plain tensor it takes as an input, MKL's packed W an input of an operator of ours (``mkl_linear``).
COMPILABLE = ("transposed", "mkl")


def available_layouts() -> tuple[str, ...]:
    """The layouts this PyTorch can hold: oneDNN's needs a build with oneDNN, MKL's one with MKL (x86)."""
    have = {"onednn": torch.backends.mkldnn.is_available(), "mkl": torch.backends.mkl.is_available()}
    return tuple(name for name in LAYOUTS if have.get(name, True))


@torch.library.custom_op("scalenlp::mkl_linear", mutates_args=())
def mkl_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               rows: int) -> torch.Tensor:
    """MKL's product on ``packed`` (``MklPacked``) as an operator of our own: Inductor lowers ``mkl::_mkl_linear``
    itself, for the weights its freezing pass packs, and that lowering fails on ours (an InductorError, torch
    2.13); ours it calls as it is. In eager it costs ~13 us a call more than the op itself (61 calls a SmolLM2
    step: under 0.2%)."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@mkl_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      rows: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class MklPacked:
    """``weight`` (out, in) packed by MKL for ``x W^T`` of ``rows`` rows (an opaque buffer); a product of other
    rows reads ``weight``."""

    packed: torch.Tensor
    weight: torch.Tensor
    rows: int

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return mkl_linear(x, self.packed, self.weight, bias, self.rows)


Operands = tuple[torch.Tensor | MklPacked, torch.Tensor]


def frozen_operands(weight: torch.Tensor, layout: str, rows: int | None) -> Operands:
    """The operands of a frozen ``weight`` W's forward product and input gradient in ``layout`` (see above), for
    products of about ``rows`` rows."""
    weight = weight.detach()
    if layout == "onednn":
        return pack(weight, rows), pack(weight.t().contiguous(), rows)
    if layout == "transposed":
        return weight.t().contiguous(), weight
    if layout == "mkl":
        if rows is None:
            raise ValueError("the mkl layout packs W for a number of rows; give the products' rows")
        return MklPacked(torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), weight, rows), weight
    raise ValueError(f"unknown frozen layout {layout!r}; one of {', '.join(LAYOUTS)}")


def frozen_product(x: torch.Tensor, operand: torch.Tensor | MklPacked, bias: torch.Tensor | None = None,
                   into: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times one operand of ``frozen_operands`` (``x W^T`` for the first, ``x W`` for the second), plus
    ``bias``; x of any leading shape. With ``into`` (x's rows by the product's columns, 2-D) instead of a bias, the
    product is added to it in place and it is returned: by the BLAS itself (``addmm_``) on a plain operand."""
    if isinstance(operand, MklPacked):
        out = operand.product(x, bias)
    elif operand.is_mkldnn:
        out = packed_linear(x, operand, bias)
    elif into is not None:
        return into.addmm_(x, operand)
    else:
        out = x @ operand if bias is None else x @ operand + bias
    return out if into is None else into.add_(out)


def frozen_dense(operands: Operands) -> torch.Tensor:
    """The weight W back from its operands, exactly."""
    first, second = operands
    return first.to_dense() if isinstance(first, torch.Tensor) and first.is_mkldnn else second


class FrozenLinear(torch.autograd.Function):
    """``x W^T (+ b)`` of a frozen weight held as ``frozen_operands``: the forward on the first, the input's
    gradient on the second; a frozen weight and bias take no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor, bias: torch.Tensor | None):
        ctx.backward = backward  # a constant of the model: nothing of this step's to keep
        return frozen_product(x, forward, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = frozen_product(grad.contiguous(), ctx.backward) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None
