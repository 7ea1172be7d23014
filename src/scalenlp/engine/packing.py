"""CPU inference: linear weights reordered once into a blocked layout (float32 into scalenlp's panels of 16 output
rows, panel_linear.cpp, where it builds; oneDNN's for bf16, and for float32 elsewhere; an int8 output projection
into PyTorch's int4 kernel's, as two 4-bit halves).

A plain bf16 ``nn.Linear`` on CPU lets oneDNN reorder the weight on every call; at decode time,
when each weight is read once per token, that reorder costs as much as the product itself. Packing
at load time (what torch.compile's freezing does, here without the compile) gives the same
numbers faster. A module swap whose forward is one line. Idempotent: packing a packed model (a second
``Engine`` on the same model) finds nothing left to fuse or swap.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

from scalenlp.compress.quantized import (
    CPU_INT4_ROWS,
    INT4_NATIVE,
    INT8_NATIVE,
    KERNEL_DTYPE,
    Int4Linear,
    Int8Linear,
    add_bias,
    rows_of,
)
from scalenlp.engine.lora import FusedMultiLoRA, MultiLoRALinear
from scalenlp.models.adapters import unpackable
from scalenlp.models.onednn import pack, packed_linear
from scalenlp.native import NativeKernel

# The rows float32 weights are packed for. SmolLM2's 30 blocks and output projection as a decode step reads them
# (each weight streamed from memory once a step; benchmarks/RESULTS.md): packed for 32 rows, as vLLM's CPU build
# packs, the products took 0.39-0.97x the plain ``F.linear``'s time at 1, 4, 16 and 64 rows on one and two threads
# (two threads, 1 row: 23.6 against 38.3 ms; 16 rows: 49.7 against 85.6), packed for 1 row 0.61-1.03x. One weight
# timed from the cache, as first measured, made packing look slower at 1 row; a decode step does not read so.
# bf16 keeps the 1-row layout it was measured with.
FLOAT32_ROWS = 32

# The compiled decode step cannot take a packed (opaque mkldnn) weight as an input, and Inductor's caches refuse
# graphs holding one as a constant. So under torch.compile a PackedLinear is an opaque operator given the number of
# its packed weight in this process (a one-element tensor, an input like any buffer, so that the graph and its cache
# key are the same whichever numbers a process gives) that finds the weight: in C++ (packed_linear.cpp) where that
# builds, else here.
_PACKED: dict[int, weakref.ref] = {}
_NUMBERS = itertools.count()
# packed_linear.cpp's operators; where they do not build or SCALENLP_PACKED_LOOKUP=0, the Python operator below
# runs instead (36 us a call more).
native_lookup = NativeKernel(
    "scalenlp_packed_linear", Path(__file__).with_name("packed_linear.cpp"), "SCALENLP_PACKED_LOOKUP",
    register=lambda: torch.library.register_fake("scalenlp_packed::linear")(
        lambda x, number, bias, out_features: x.new_empty(*x.shape[:-1], out_features)))


@torch.library.custom_op("scalenlp::packed_linear", mutates_args=())
def packed_linear_by_number(x: torch.Tensor, number: torch.Tensor, bias: torch.Tensor | None,
                            out_features: int) -> torch.Tensor:
    return packed_linear(x, _PACKED[int(number)]().packed, bias)


@packed_linear_by_number.register_fake
def _(x: torch.Tensor, number: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    packed_for_inference = True  # read by compress.prune, which refuses packed models without importing the engine

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A layout tuned for decode's rows; any other batch (prefill) still computes correctly.
        rows = FLOAT32_ROWS if linear.weight.dtype == torch.float32 else 1
        self.register_buffer("packed", pack(linear.weight, rows), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        number = next(_NUMBERS)
        self.register_buffer("number", torch.tensor(number), persistent=False)
        self.native = native_lookup()
        if self.native:  # kept until this layer is collected
            torch.ops.scalenlp_packed.keep(number, self.packed)
            weakref.finalize(self, torch.ops.scalenlp_packed.forget, number)
        else:
            _PACKED[number] = weakref.ref(self, lambda _: _PACKED.pop(number, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            lookup = torch.ops.scalenlp_packed.linear if self.native else packed_linear_by_number
            return lookup(x, self.number, self.bias, self.out_features)
        return packed_linear(x, self.packed, self.bias)


PANEL_ROWS = 16  # output rows of a panel (panel_linear.cpp's NR)
# panel_linear.cpp's float32 product; on CPUs without AVX2 and FMA, where it does not build, or with
# SCALENLP_PANEL_LINEAR=0, float32 takes oneDNN's packed weights.
panel_kernel = NativeKernel(
    "scalenlp_panel_linear", Path(__file__).with_name("panel_linear.cpp"), "SCALENLP_PANEL_LINEAR",
    needs=("avx2", "fma"), register=lambda: torch.library.register_fake("scalenlp_panel::linear")(
        lambda x, panels, bias, out_features: x.new_empty(*x.shape[:-1], out_features)))


class PanelLinear(nn.Module):
    """A float32 linear on panel_linear.cpp's kernel: the weight (out, in) as (ceil(out / 16), in, 16), each panel
    the 16 output rows' weights interleaved along the inputs, zero-padded to whole panels (as is the bias). A plain
    tensor, unlike oneDNN's packed one, so a compiled step takes it as an input like any buffer."""
    packed_for_inference = True

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        panels = -(-self.out_features // PANEL_ROWS)
        pad = panels * PANEL_ROWS - self.out_features
        weight = torch.nn.functional.pad(linear.weight.detach(), (0, 0, 0, pad))
        self.register_buffer("panels", weight.view(panels, PANEL_ROWS, self.in_features).transpose(1, 2).contiguous(),
                             persistent=False)
        bias = None if linear.bias is None else torch.nn.functional.pad(linear.bias.detach(), (0, pad))
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.scalenlp_panel.linear(x, self.panels, self.bias, self.out_features)


def packed(linear: nn.Linear) -> nn.Module:
    """The engine's CPU product for ``linear`` (of a model ``can_pack`` takes): float32 on scalenlp's panels where
    panel_linear.cpp builds; else, and for bf16, on oneDNN's packed weight."""
    return PanelLinear(linear) if linear.weight.dtype == torch.float32 and panel_kernel() else PackedLinear(linear)


class PackedInt8Linear(nn.Module):
    """An int8 weight-only linear run on PyTorch's CPU int4 kernel, each weight q split into 4-bit halves,
    q = 16 h + l with h in -8..7 and l in 0..15: the weight becomes (N, 2K) codes, h + 8 for the first K inputs
    (scale 16 s, zero 0) and l for the last K (scale s, zero 8 s), and the input is x twice. The kernel
    dequantizes (code - 8) * scale + zero exactly in float32 (4-bit codes times 8-bit scales), so the product is
    the int8 kernel's up to the order of float32 sums. Why: ``aten._weight_int8pack_mm`` reads its (N, K) weight
    a few rows at a time, and with weights streamed from memory (as at decode time) it ran slower than oneDNN's
    packed bf16 product on twice the bytes (SmolLM2's gate/up 409 against 316 us, its output projection 5.4
    against 4.1 ms; 4.7 ms as halves); the int4 kernel's blocked layout streams. SmolLM2-135M decode step
    without sampling, one thread, best of 12 interleaved rounds: 30.9 -> 28.5 ms CPU time (fp32: 58.8).
    Same bytes as the int8 weight, plus scales per group of inputs (12% more at 576 inputs). The cost: the kernel
    multiplies 2K inputs, which only streaming one row hides; with more rows the int8 kernel was faster (SmolLM2
    through the engine, per-round median against fp32: batch 1 1.57x -> 2.07x, batch 8 1.42x -> 1.22x; a
    512-token prefill 1.9 -> 3.0 s CPU, fp32 1.5): ``pack_linears`` runs the output projection alone this way."""
    packed_for_inference = True

    def __init__(self, linear: Int8Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        K = self.in_features
        self.group_size = halves_group(K)
        q = linear.weight.to(torch.int32)
        codes = torch.cat([(q >> 4) + 8, q & 15], dim=1)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        s = linear.scales.float()
        high = torch.stack([16 * s, torch.zeros_like(s)], dim=-1)[None].expand(K // self.group_size, -1, -1)
        low = torch.stack([s, 8 * s], dim=-1)[None].expand(K // self.group_size, -1, -1)
        self.register_buffer("scales_and_zeros", torch.cat([high, low]).to(KERNEL_DTYPE).contiguous(),
                             persistent=False)
        self.register_buffer("bias", linear.bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = rows_of(x, self.in_features)
        # cat, not repeat: repeat took 10 times as long at decode time (profiled).
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x2d, x2d], dim=1), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        return add_bias(y.view(*x.shape[:-1], self.out_features).to(x.dtype), self.bias)


def halves_group(in_features: int) -> int | None:
    """The largest group the CPU int4 kernel takes that divides ``in_features`` (fewer scales to read), or None."""
    return next((g for g in (256, 128, 64, 32) if in_features % g == 0), None)


def can_pack_int8(linear: nn.Module) -> bool:
    # The CPU int4 kernel's tiles of output rows, and whole groups of inputs; not where scalenlp's int8 kernel runs
    # (SmolLM2's output projection, one row, one thread: 3.01 ms against the halves' 8.88 and
    # _weight_int8pack_mm's 6.18; benchmarks/lowbit_products.py).
    return (type(linear) is Int8Linear and linear.kernel != INT8_NATIVE and linear.weight.device.type == "cpu"
            and linear.out_features % CPU_INT4_ROWS == 0 and halves_group(linear.in_features) is not None)


def onednn_bf16() -> bool:
    """Whether oneDNN reports bf16 kernels on this CPU (which says nothing of their speed: see engine/dtype.py)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(model: nn.Module) -> bool:
    """Plain (not sharded) CPU weights: float32 where this PyTorch has oneDNN, bf16 where oneDNN computes in bf16.
    A tensor-parallel engine's model (engine/sharded.py, not an nn.Module) packs nothing: its ranks run the shards."""
    if not isinstance(model, nn.Module):
        return False
    ref = next(model.parameters())
    if ref.dtype == torch.bfloat16:
        return ref.device.type == "cpu" and type(ref) is nn.Parameter and onednn_bf16()
    return unpackable(ref) is None  # as LoRA's frozen base packs: float32, CPU, unsharded, oneDNN


def pack_for_inference(model: nn.Module) -> int:
    """What the engine packs for its CPU products, compiled or not: every linear of a model ``can_pack`` takes
    (``pack_linears``). Returns how many."""
    return pack_linears(model) if can_pack(model) else 0


def _fusable(linear: nn.Module) -> bool:
    # An int4 linear on PyTorch's kernels keeps only that kernel's layout, which does not stack.
    return (type(linear) is nn.Linear or type(linear) is Int8Linear
            or type(linear) is Int4Linear and linear.kernel == INT4_NATIVE)


def _stacked(parts: tuple[nn.Linear, ...]) -> nn.Module:
    """One linear whose output is the parts' outputs side by side."""
    first = parts[0]
    if type(first) in (Int8Linear, Int4Linear):
        return type(first).stacked(parts)
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _fused(parts: tuple[nn.Module, ...]) -> nn.Module | None:
    """One linear whose output is the parts' outputs side by side, or None where they do not stack: plain parts
    stacked; parts served with adapters (engine/lora.py) on their bases stacked, each adding its adapters."""
    if all(_fusable(p) for p in parts):
        return _stacked(parts)
    if all(isinstance(p, MultiLoRALinear) and _fusable(p.base) for p in parts):
        return FusedMultiLoRA(_stacked(tuple(p.base for p in parts)), parts)
    return None


def fuse_projections(model: nn.Module) -> None:
    """Stack the projections that read the same input into one linear: each attention's query, key and
    value (``wqkv``) and a SwiGLU MLP's gate and up (``w13``), dropping the parts. One wide product per
    token streams the weights about 3% faster than three (q/k/v, gpt2-124m shape, bf16, batch 1, faster
    in 12 of 12 interleaved rounds; int8 weight-only SmolLM2, the whole decode step: 32.6 -> 30.9 ms, best of
    12 interleaved rounds). Inference only, before packing."""
    for module in model.modules():
        if getattr(module, "wqkv", False) is None:
            parts = (module.wq, module.wk, module.wv)
            if (fused := _fused(parts)) is not None:
                module.wqkv, module.qkv_heads = fused, [p.out_features // module.head_dim for p in parts]
                del module.wq, module.wk, module.wv
        if getattr(module, "w13", False) is None and (fused := _fused((module.w1, module.w3))) is not None:
            module.w13 = fused
            del module.w1, module.w3


def pack_linears(model: nn.Module) -> int:
    """Fuse the projections that share an input, then swap every nn.Linear for its ``packed`` form, and an int8
    output projection for a PackedInt8Linear, in place; returns how many. Inference only: the packed weights
    take no gradient, and a tied output projection gets its own packed copy."""
    fuse_projections(model)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, packed(child))
                swapped += 1
    # The output projection alone runs as halves: it reads one row per sequence, in prefill too (the last
    # token's), where they pay; the blocks' int8 kernel is faster at a prompt's many rows. SmolLM2 through the
    # engine, median of 3 interleaved rounds against fp32 (load 4): every int8 linear as halves: batch 1 2.08x,
    # batch 8 1.22x, a 512-token prefill 1.93x fp32's time; the output projection only: 1.92x, 1.29x, 1.22x;
    # none: 1.82x, 1.32x, 1.28x.
    output = getattr(model, "output", None)
    if output is not None and can_pack_int8(output):
        model.output = PackedInt8Linear(output)
        swapped += 1
        # The kernel changes, and the quantization's own line (prepare_all) named the int8 one.
        print("int8 output projection packed for CPU inference: aten._weight_int4pack_mm_for_cpu (its weight as two "
              "4-bit halves)", file=sys.stderr, flush=True)
    return swapped

