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

Under mixed precision (autocast) the products run in a lower dtype, on the weight cast anew each step (the forward
casts it; the backward reuses that cast): 106M of SmolLM2's parameters read in float32 and written in bf16 every
step. Every layout then holds ``W`` cast once to that dtype (``frozen_operands``' ``dtype``: the same values autocast
would cast it to), ``W`` itself staying beside it for what needs it exactly (merging, products outside autocast):

- "cast": ``W`` cast, nothing more. On the AMX Xeon above (bf16, 128 rows, one thread) a step's frozen products
  took 137 ms so against 302 ms cast per step, the output projection's 28 against 121 ms;
- "onednn" and "transposed" as above, of the cast ``W`` ("mkl" is float32's only): oneDNN's 104 ms.

Each costs a second copy of the weight; train/frozen_packing.py measures which, if any, pays on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scalenlp.models.onednn import pack, packed_linear

LAYOUTS = ("onednn", "transposed", "mkl", "cast")
# torch.compile's: Inductor fails on oneDNN's opaque packed weights (an InductorError, torch 2.13); the transposed
# and cast copies are plain tensors it takes as inputs, MKL's packed W an input of an operator of ours (``mkl_linear``).
COMPILABLE = ("transposed", "mkl", "cast")


def available_layouts(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The layouts this PyTorch can hold for products in ``dtype``: oneDNN's needs a build with oneDNN (and its
    kernels for bf16 or fp16), MKL's one with MKL (x86) and float32; "cast" is a lower dtype's only."""
    onednn = torch.backends.mkldnn.is_available() and {
        torch.float32: True, torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}.get(dtype, False)
    full = dtype == torch.float32
    have = {"onednn": onednn, "mkl": full and torch.backends.mkl.is_available(), "cast": not full}
    return tuple(name for name in LAYOUTS if have.get(name, True))


def refusal(layout: str, dtype: torch.dtype, compile: bool) -> str | None:
    """Why a run whose frozen products are in ``dtype`` (under torch.compile where ``compile``) cannot hold its base
    in ``layout``; None where it can."""
    if layout == "cast" and dtype == torch.float32:
        return "cast holds the base in training.mixed_precision's dtype, and this run computes in float32"
    if layout == "mkl" and dtype != torch.float32:
        return f"MKL packs float32 weights, and this run computes the products in {dtype} (autocast)"
    if compile and layout not in COMPILABLE:
        return "training.compile lowers the products itself, and cannot take oneDNN's packed weights"
    if layout not in available_layouts(dtype):
        return f"this PyTorch has no oneDNN kernels for {dtype}"
    return None


def run_layouts(dtype: torch.dtype, compile: bool = False) -> tuple[str, ...]:
    """The layouts a run whose frozen products are in ``dtype`` (under torch.compile where ``compile``) can hold its
    base in: those without a ``refusal``."""
    return tuple(name for name in LAYOUTS if refusal(name, dtype, compile) is None)


def products_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``x``'s products with a weight run in: autocast's where it is on, else ``x``'s own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


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


def frozen_operands(weight: torch.Tensor, layout: str, rows: int | None, dtype: torch.dtype | None = None) -> Operands:
    """The operands of a frozen ``weight`` W's forward product and input gradient in ``layout`` (see above), for
    products of about ``rows`` rows in ``dtype`` (default W's: W is cast to it first)."""
    weight = weight.detach().to(dtype or weight.dtype)
    if layout == "cast":
        return weight.t(), weight
    if layout == "onednn":
        return pack(weight, rows), pack(weight.t().contiguous(), rows)
    if layout == "transposed":
        return weight.t().contiguous(), weight
    if layout == "mkl":
        if weight.dtype != torch.float32:
            raise ValueError(f"the mkl layout packs float32 weights, not {weight.dtype}")
        if rows is None:
            raise ValueError("the mkl layout packs W for a number of rows; give the products' rows")
        return MklPacked(torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), weight, rows), weight
    raise ValueError(f"unknown frozen layout {layout!r}; one of {', '.join(LAYOUTS)}")


def frozen_product(x: torch.Tensor, operand: torch.Tensor | MklPacked, bias: torch.Tensor | None = None,
                   into: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times one operand of ``frozen_operands`` (``x W^T`` for the first, ``x W`` for the second), plus
    ``bias``; x of any leading shape. With ``into`` (x's rows by the product's columns, 2-D) instead of a bias, the
    product is added to it in place and it is returned: by the BLAS itself (``addmm_``) on a plain operand. x and
    the bias are cast to the operand's dtype, as autocast casts them for a product."""
    x, bias = x.to(operand.dtype), None if bias is None else bias.to(operand.dtype)
    if isinstance(operand, MklPacked):
        out = operand.product(x, bias)
    elif operand.is_mkldnn:
        out = packed_linear(x, operand, bias)
    elif into is not None:
        return into.addmm_(x, operand)
    else:
        out = x @ operand if bias is None else x @ operand + bias
    return out if into is None else into.add_(out)


def held_for(operands: Operands | None, x: torch.Tensor) -> Operands | None:
    """``operands`` where ``x``'s products run in their dtype, else None: a copy cast for autocast is not read
    outside it (the weight itself is)."""
    return operands if operands is not None and operands[1].dtype == products_dtype(x) else None


def frozen_dense(operands: Operands) -> torch.Tensor:
    """The weight W back from its operands, exactly where they hold it in its own dtype."""
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
