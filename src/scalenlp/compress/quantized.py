"""Weight quantization for inference, as a module swap (gpt-fast style): every ``nn.Linear`` of a decoder or
encoder becomes a quantized linear whose forward is one call to one of PyTorch's low-bit kernels, or for int4 and
int8 on x86 CPUs with AVX2, scalenlp's own (lowbit_linear.cpp).

Methods: ``int8`` (weight-only, a scale per output channel), ``int4`` (weight-only, a scale and zero point per
group of ``group_size`` inputs; a decoder's output projection stays int8, ``spec_of``) and ``int8dyn`` (int8
activations too). The token embedding table is int8 with a scale per row (``Int8Embedding``). An export holds
each weight (int8, or int4 two to a byte, even column in the high nibble) and its bfloat16 scales in a layout no
device owns (``quantization.json`` names the method); ``prepare`` builds each device's kernel layout at load.
PyTorch's weight-only kernels compute in bfloat16 (scalenlp's kernels in integers, their activations to 14
bits), and weights are rounded against the stored scales, so the dequantized weight is exactly ``q * scale``.
docs/compression.md describes the methods for users.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.gguf import GGUF_BLOCK, GGUF_INT4, q4_blocks
from scalenlp.models.io import assign_state, cast_state
from scalenlp.native import NativeKernel

METHODS = ("int8", "int4", "int8dyn")
GROUP_SIZES = (32, 64, 128)
QUANTIZATION = "quantization.json"  # the method, beside model_args.json in an export folder
KERNEL_DTYPE = torch.bfloat16
CPU_INT4_ROWS = 16  # PyTorch's CPU int4 kernel takes weights in tiles of this many output rows
LOWBIT_KERNELS = Path(__file__).with_name("lowbit_linear.cpp")
LOWBIT_BLOCK = 32  # inputs per activation scale in scalenlp's CPU int4 and int8 kernels
INT4_NATIVE, INT8_NATIVE = "scalenlp_lowbit.int4_linear", "scalenlp_lowbit.int8_linear"  # their operators


def _register_lowbit_fakes() -> None:
    for op in ("int4_linear", "int8_linear"):
        torch.library.register_fake(f"scalenlp_lowbit::{op}")(
            lambda x, weight, scales: x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32))


# scalenlp's AVX2 int4 and int8 kernels; on CPUs without AVX2, where they cannot be built, or where
# SCALENLP_LOWBIT_KERNELS=0 turns them off, PyTorch's CPU kernels run instead.
lowbit_kernels_available = NativeKernel("scalenlp_lowbit_linear", LOWBIT_KERNELS, "SCALENLP_LOWBIT_KERNELS",
                                        needs=("avx2",), register=_register_lowbit_fakes)


@dataclass(frozen=True)
class Quantization:
    method: str
    group_size: int | None = None  # int4 only

    def check(self) -> Quantization:
        if self.method not in METHODS:
            raise UserError(f"quantization method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "int4" and self.group_size not in GROUP_SIZES:
            raise UserError(f"--group-size {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
        return self

    def describe(self) -> str:
        return f"int4 (group {self.group_size})" if self.method == "int4" else self.method


def quantization_of(method: str | None, group_size: int = 64) -> Quantization | None:
    """The ``--quantize``/``--group-size`` options as a checked ``Quantization`` (None: no quantization)."""
    if method is None:
        return None
    return Quantization(method, group_size if method == "int4" else None).check()


def read_quantization(folder: Path) -> Quantization | None:
    """An export folder's ``quantization.json``, or None for a floating-point export."""
    file = folder / QUANTIZATION
    if not file.is_file():
        return None
    try:
        return Quantization(**json.loads(file.read_text())).check()
    except (json.JSONDecodeError, TypeError, UserError) as e:
        raise UserError(f"{file} is corrupt ({e}); quantize the model again") from None


def quantization_json(spec: Quantization) -> str:
    return json.dumps(asdict(spec), indent=2)


# ---------------------------------------------------------------------------------------------------------
# Rounding: float weights -> the stored tensors (device-independent layout)


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, bf16 scales): symmetric, one scale per output row, rounded against the stored scale."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def int4_grouped(w: torch.Tensor, group_size: int,
                 gram: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (N, K/2), bf16 scales_and_zeros (K/group, N, 2)): asymmetric per group of ``group_size``
    inputs, in the kernels' convention w = (q - 8) * scale + zero with q in 0..15. Each group keeps, of a few
    candidate grids, the one whose rounded weights lie nearest its own (least squared error, scale and zero as
    stored): its min..max range shrunk about the middle by each of ``CLIP_RATIOS`` (clipping a few outliers buys
    a finer step for the rest), and from each, ``REFITS`` rounds of refitting scale and zero by least squares to
    the codes the last grid gave. ``gram`` (K, K), X^T X of calibration inputs X (``scalenlp.compress.awq``), makes
    "nearest" the group's error in the layer's output on them instead, d^T X_g^T X_g d for a rounding error d."""
    w = w.float()
    N, K = w.shape
    groups = w.reshape(N, K // group_size, group_size)
    blocks = None if gram is None else torch.stack([gram[i:i + group_size, i:i + group_size].float()
                                                    for i in range(0, K, group_size)])
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    middle, half = (low + high) / 2, (high - low) / 2
    best = None
    for ratio in CLIP_RATIOS:
        scales = half * ratio * 2 / 15
        grid = rounded(groups, scales, middle - half * ratio + 8 * scales, blocks)
        best = grid if best is None else nearer(best, grid)
        for _ in range(REFITS):
            grid = rounded(groups, *least_squares(groups, grid.q), blocks)
            best = nearer(best, grid)
    scales_and_zeros = torch.stack([best.scales, best.zeros], dim=-1).to(KERNEL_DTYPE).transpose(0, 1).contiguous()
    return pack_int4(best.q.reshape(N, K)), scales_and_zeros


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)
REFITS = 3  # on SmolLM2, three rounds left 7% less squared error than one


class Grid(NamedTuple):
    scales: torch.Tensor  # (N, groups), float32 holding bf16 values
    zeros: torch.Tensor
    q: torch.Tensor  # (N, groups, group_size), 0..15
    error: torch.Tensor  # (N, groups): squared error of the rounded weights, or their output error (``rounded``)


def rounded(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, blocks: torch.Tensor | None) -> Grid:
    """``groups`` rounded to the 16 levels of ``scales`` and ``zeros`` as stored in bf16 (what the kernels use);
    the error is squared, or weighted by ``blocks`` (groups, size, size), each group's inputs' Gram matrix."""
    scales = scales.clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE).float()
    zeros = zeros.to(KERNEL_DTYPE).float()
    q = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
    d = (q - 8) * scales[..., None] + zeros[..., None] - groups
    error = d.square().sum(dim=-1) if blocks is None else torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
    return Grid(scales, zeros, q, error)


def least_squares(groups: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the scale and zero minimizing the squared error of (q - 8) * scale + zero against the weights
    (a straight-line fit; a group whose codes are all equal gets scale 0, which ``rounded`` clamps)."""
    c = q - 8
    n = groups.shape[-1]
    sum_c, sum_cc, sum_w, sum_cw = c.sum(-1), (c * c).sum(-1), groups.sum(-1), (c * groups).sum(-1)
    scales = (n * sum_cw - sum_c * sum_w) / (n * sum_cc - sum_c * sum_c).clamp(min=torch.finfo(torch.float32).tiny)
    return scales, (sum_w - scales * sum_c) / n


def nearer(a: Grid, b: Grid) -> Grid:
    """Group by group, whichever grid rounds with less error."""
    take_b = b.error < a.error
    return Grid(*(torch.where(take_b[..., None] if x.dim() > take_b.dim() else take_b, y, x) for x, y in zip(a, b)))


def int4_from_gguf(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int4_grouped``'s layout (group 32) from a GGUF Q4_0/Q4_1 weight's raw blocks (rows of uint8), keeping
    its 4-bit codes as they are: Q4_1's w = d*q + m is (q - 8)*d + (m + 8d), Q4_0's w = d*(q - 8) has zero 0.
    Only d and m + 8d round, to the kernels' bf16."""
    rows = raw.shape[0]
    d, m, q = q4_blocks(kind, raw)
    d = d.view(rows, -1)
    zeros = torch.zeros_like(d) if m is None else m.view(rows, -1) + 8 * d
    scales_and_zeros = torch.stack([d.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE)], dim=-1)
    return pack_int4(q.reshape(rows, -1)), scales_and_zeros.transpose(0, 1).contiguous()


def dequantize_int4(weight: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The (N, K) weights ``int4_grouped``'s stored tensors stand for, in their scales' dtype."""
    groups, rows, _ = scales_and_zeros.shape
    q = unpack_int4(weight).view(rows, groups, -1).to(scales_and_zeros.dtype)
    scales, zeros = scales_and_zeros.transpose(0, 1).unbind(-1)
    return ((q - 8) * scales[..., None] + zeros[..., None]).view(rows, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K/2) uint8, the even column in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) int32 values 0..15, undoing ``int4_grouped``'s packing."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(1).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------
# The quantized linears. Each is built empty (on the meta device, for loading) and filled by assignment;
# ``prepare`` then builds the kernel's own layout on the weights' device and names the kernel it will run.


class QuantizedLinear(nn.Module):
    kernel = "unprepared"
    # Each stored tensor's (output dim, input dim), for tensor parallelism to slice; None: it has no such dim.
    shard_dims = {"weight": (0, 1), "scales": (0, None), "bias": (0, None)}

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.empty(out_features, device=device) if bias else None)

    def prepare(self) -> str:
        """Make the loaded tensors ready for the kernel; returns the kernel's name."""
        for name, tensor in self.named_buffers(recurse=False):
            # Tensors memory-mapped from safetensors start wherever the file puts them, and PyTorch's CPU int8
            # kernel crashes on a weight that is not 64-byte aligned (from 17 rows of input on); a copy is.
            if tensor is not None and tensor.device.type == "cpu" and tensor.data_ptr() % 64:
                setattr(self, name, tensor.clone())
        return self.prepare_kernel()

    def prepare_kernel(self) -> str:
        raise NotImplementedError

    def lowbit_kernel_takes(self) -> bool:
        """Whether scalenlp's CPU kernels take this layer: on a CPU, whole blocks of their 32 inputs, and built."""
        return (self.weight.device.type == "cpu" and self.in_features % LOWBIT_BLOCK == 0
                and lowbit_kernels_available())

    def empty_like(self, out_features: int) -> QuantizedLinear:
        """An empty layer of this kind and these inputs, with ``out_features`` outputs."""
        return type(self)(self.in_features, out_features, self.bias is not None)

    @classmethod
    def stacked(cls, parts: tuple[QuantizedLinear, ...]) -> QuantizedLinear:
        """One linear whose output is the parts' outputs side by side (inference packing fuses q/k/v and gate/up
        with it): each stored tensor stacks along its output dimension (``shard_dims``), so the products are the
        parts' exactly. Int4 only for parts on scalenlp's kernel, whose weights stay in the stored layout."""
        fused = parts[0].empty_like(sum(p.out_features for p in parts))
        for name, (out_dim, _) in cls.shard_dims.items():
            if getattr(fused, name) is not None:
                setattr(fused, name, torch.cat([getattr(p, name) for p in parts], dim=out_dim))
        fused.prepare()
        return fused


class Int8Linear(QuantizedLinear):
    """int8 weights, one bf16 scale per output channel; products in bf16 (PyTorch's kernel), or on x86 CPUs with
    AVX2 in integers (scalenlp's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__(in_features, out_features, bias, device)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=KERNEL_DTYPE, device=device))

    def prepare_kernel(self) -> str:
        native = self.lowbit_kernel_takes()
        if native:
            self.weight, self.scales = self.weight.contiguous(), self.scales.contiguous()
        self.kernel = INT8_NATIVE if native else "aten._weight_int8pack_mm"
        return self.kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == INT8_NATIVE:
            y = torch.ops.scalenlp_lowbit.int8_linear(x.reshape(-1, self.in_features), self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows_of(x, self.in_features), self.weight, self.scales)
        return add_bias(y.view(*x.shape[:-1], self.out_features).to(x.dtype), self.bias)


class Int4Linear(QuantizedLinear):
    """4-bit weights with a bf16 scale and zero per group of inputs. On x86 CPUs with AVX2, scalenlp's kernel reads
    the stored layout as it is (``block_scales``: the scales and zeros per block of 32 inputs). Elsewhere products
    in bf16 (tinygemm on CUDA, PyTorch's AVX kernel on other CPUs): ``packed`` is that kernel's layout of
    ``weight``; once it is built, memory holds it alone and ``state_dict`` rebuilds the portable layout from it."""

    shard_dims = {"weight": (0, 1), "scales_and_zeros": (1, 0), "bias": (0, None)}

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, device=None):
        super().__init__(in_features, out_features, bias, device)
        self.group_size = group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // group_size, out_features, 2,
                                                             dtype=KERNEL_DTYPE, device=device))
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("block_scales", None, persistent=False)
        self.matmul = self.dequantized_matmul

    def prepare_kernel(self) -> str:
        device = self.weight.device
        if self.group_size % LOWBIT_BLOCK == 0 and self.lowbit_kernel_takes():
            # The weight stays as stored; each block of 32 inputs gets its group's scale and zero.
            self.weight = self.weight.contiguous()  # a tensor-parallel shard is a slice
            self.block_scales = self.scales_and_zeros.transpose(0, 1).repeat_interleave(
                self.group_size // LOWBIT_BLOCK, dim=1).contiguous()
            self.matmul, self.kernel = self.native_matmul, INT4_NATIVE
            return self.kernel
        if device.type == "cpu" and self.out_features % CPU_INT4_ROWS == 0:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(self.weight), 1)
            self.int4_mm, self.kernel = torch.ops.aten._weight_int4pack_mm_for_cpu, "aten._weight_int4pack_mm_for_cpu"
        elif device.type == "cuda" and self.out_features % 8 == 0 and self.in_features % 256 == 0:
            # tinygemm's tiles: 8 output rows, innerKTiles * 16 inputs (innerKTiles 8 as gpt-fast picks).
            self.packed = torch.ops.aten._convert_weight_to_int4pack(self.weight, 8)
            self.int4_mm, self.kernel = torch.ops.aten._weight_int4pack_mm, "aten._weight_int4pack_mm"
        else:
            self.matmul, self.kernel = self.dequantized_matmul, "dequantize-then-matmul"
            return self.kernel
        self.matmul = self.kernel_matmul
        # A zero-stride stand-in keeps the weight's shape, which the KV cache's setup reads.
        self.weight = torch.zeros((), dtype=torch.uint8, device=device).expand(self.weight.shape)
        return self.kernel

    def empty_like(self, out_features: int) -> Int4Linear:
        return type(self)(self.in_features, out_features, self.bias is not None, self.group_size)

    def native_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.scalenlp_lowbit.int4_linear(x.reshape(-1, self.in_features), self.weight, self.block_scales)

    def kernel_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return self.int4_mm(x2d, self.packed, self.group_size, self.scales_and_zeros)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None:
            destination[prefix + "weight"] = self.portable_weight()

    @torch.no_grad()
    def portable_weight(self, rows: int = 256) -> torch.Tensor:
        """``int4_grouped``'s layout rebuilt from the kernel's, exactly: the kernel multiplies rows of the identity
        by the weights dequantized with scale 1 and zero 8, which is each 4-bit value as a bf16 integer."""
        unit = torch.tensor([1.0, 8.0], dtype=KERNEL_DTYPE, device=self.packed.device)
        unit = unit.expand_as(self.scales_and_zeros).contiguous()
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.packed.device)
        values = torch.cat([self.int4_mm(eye[i:i + rows], self.packed, self.group_size, unit)
                            for i in range(0, self.in_features, rows)])
        return pack_int4(values.T)

    def dequantized_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        # The fallback for shapes no kernel tiles (a 2-class head): rebuild the bf16 weight on each call.
        return x2d @ dequantize_int4(self.weight, self.scales_and_zeros).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # scalenlp's kernel takes float32 or bf16 rows as they come; PyTorch's take bf16.
        y = self.matmul(x if self.kernel == INT4_NATIVE else rows_of(x, self.in_features))
        return add_bias(y.view(*x.shape[:-1], self.out_features).to(x.dtype), self.bias)


class Int8DynamicLinear(QuantizedLinear):
    """int8 weights per output channel (float32 scales), activations quantized to int8 per token on each call,
    products in int32: ``torch._int_mm``. One token on CPU goes to fbgemm's dynamic linear instead, 8 times
    faster there; its per-tensor scale is then the token's own (in fbgemm's 7-bit range, which its x86 kernels
    need to avoid overflow). Per token, not per tensor, because a few tokens (the first of a sequence) carry
    activations hundreds of times larger than the rest: one scale for a 512-token window doubled SmolLM2's
    perplexity."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__(in_features, out_features, bias, device)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32, device=device))
        self.packed = None

    def prepare_kernel(self) -> str:
        if self.weight.device.type == "cpu":
            if "fbgemm" not in torch.backends.quantized.supported_engines:
                raise UserError("int8dyn needs PyTorch's fbgemm engine (x86 CPUs), absent here; use int8 or int4")
            import warnings

            with warnings.catch_warnings():
                # Quantized-tensor construction is deprecated in PyTorch, but fbgemm's prepack still takes one
                # and has no replacement on CPU yet.
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(
                    self.weight, self.scales.double(), torch.zeros_like(self.scales, dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(qweight, None if self.bias is None else self.bias.float())
            self.kernel = "torch._int_mm, one token: quantized.linear_dynamic (fbgemm)"
        elif self.weight.device.type == "cuda":
            self.kernel = "torch._int_mm"
        else:
            raise UserError(f"int8dyn has no kernel on {self.weight.device.type}; use int8 or int4")
        return self.kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() == self.in_features:
            return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True).to(x.dtype)
        return add_bias(int_mm_per_token(x.reshape(-1, self.in_features), self.weight, self.scales)
                        .view(*x.shape[:-1], self.out_features).to(x.dtype), self.bias)


class Int8Embedding(nn.Module):
    """A token embedding table in int8, one scale per row (a token's vector); a lookup multiplies the rows back.
    ``tied_to`` a decoder's output projection, it reads that int8 matrix: the two were one table before
    quantization, and the projection's scale per output channel is a scale per token row."""

    def __init__(self, num_embeddings: int, dim: int, device=None):
        super().__init__()
        self.register_buffer("weight", torch.empty(num_embeddings, dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=KERNEL_DTYPE, device=device))
        self.dtype = torch.float32  # of the vectors it returns: build_quantized sets the model's

    @classmethod
    def tied_to(cls, output: QuantizedLinear, dtype: torch.dtype) -> Int8Embedding:
        embedding = cls(*output.weight.shape, device="meta")
        # Not persistent: the state dict holds the table once, as the output projection's.
        embedding.register_buffer("weight", output.weight, persistent=False)
        embedding.register_buffer("scales", output.scales, persistent=False)
        embedding.dtype = dtype
        return embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].to(self.dtype) * self.scales[ids].to(self.dtype).unsqueeze(-1)


def quantize_embedding(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """``state`` with a floating token embedding table as ``Int8Embedding`` stores it: dropped when ``tied`` (the
    output projection, quantized from it, holds it), else rounded to int8 per row. A table already int8 (or
    absent) is left alone, so exports written before embeddings were quantized load the same way as new ones."""
    table = state.get("tok_embeddings.weight")
    if table is None or not table.is_floating_point():
        return state
    state = {k: v for k, v in state.items() if k != "tok_embeddings.weight"}
    if not tied:
        state["tok_embeddings.weight"], state["tok_embeddings.scales"] = int8_per_channel(table.to("cpu"))
    return state


def int_mm_per_token(x2d: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32 products with symmetric per-token activation scales. CUDA's ``torch._int_mm``
    needs more than 16 rows, so a decode batch is padded with zero rows."""
    x_scales = (x2d.abs().amax(dim=1, keepdim=True).float() / 127).clamp(min=torch.finfo(torch.float32).tiny)
    xq = torch.round(x2d.float() / x_scales).to(torch.int8)
    rows = xq.shape[0]
    if rows <= 16 and xq.is_cuda:
        xq = F.pad(xq, (0, 0, 0, 17 - rows))
    return torch.ops.aten._int_mm(xq, weight.T)[:rows].float() * x_scales * scales


def rows_of(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as contiguous bf16 rows, as the weight-only kernels take it (a pooler's input is a strided view)."""
    return x.reshape(-1, width).to(KERNEL_DTYPE).contiguous()


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def empty_linear(spec: Quantization, linear: nn.Linear) -> QuantizedLinear:
    """An unfilled quantized linear of ``linear``'s shape, on the meta device."""
    shape = (linear.in_features, linear.out_features, linear.bias is not None)
    if spec.method == "int4":
        return Int4Linear(*shape, spec.group_size, device="meta")
    return (Int8Linear if spec.method == "int8" else Int8DynamicLinear)(*shape, device="meta")


def quantize_weight(spec: Quantization, w: torch.Tensor, gram: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of one quantized linear weight, under their buffer names (``gram``: ``int4_grouped``'s)."""
    if spec.method == "int4":
        weight, scales_and_zeros = int4_grouped(w, spec.group_size, gram)
        return {"weight": weight, "scales_and_zeros": scales_and_zeros}
    weight, scales = int8_per_channel(w)
    return {"weight": weight, "scales": scales if spec.method == "int8" else scales.float()}


# ---------------------------------------------------------------------------------------------------------
# Whole models: which linears, their stored tensors, the swap


def linears_of(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear}


def check_shapes(spec: Quantization, linears: dict[str, nn.Linear]) -> None:
    """Every linear's input width must split into whole groups (int4) and pack two values to a byte."""
    if spec.method != "int4":
        return
    for name, linear in linears.items():
        if linear.in_features % spec.group_size:
            fits = [g for g in GROUP_SIZES if all(m.in_features % g == 0 for m in linears.values())]
            raise UserError(f"--group-size {spec.group_size} does not divide the input width {linear.in_features} "
                            f"of {name}; use " + (" or ".join(map(str, fits)) if fits else "int8") + " for this model")


def quantize_state(state: dict[str, torch.Tensor], linears: dict[str, nn.Linear], spec: Quantization,
                   tied: bool, blocks: dict[str, tuple[str, torch.Tensor]] | None = None,
                   grams: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A float state dict with each linear's weight replaced by its quantized tensors (CPU, computed in
    float32). ``tied``: the output projection shares the embedding table, which the state holds alone.
    ``blocks`` (a GGUF file's raw Q4_0/Q4_1/Q8_0 weights): int4 with group 32 takes Q4_0/Q4_1 codes as they are.
    ``grams``: calibration inputs' Gram matrices, by linear name, for int4's rounding (``int4_grouped``)."""
    check_shapes(spec, linears)
    blocks, grams = blocks or {}, grams or {}
    out = {k: v for k, v in state.items() if not (tied and k == "output.weight")}
    mapped, requantized = Counter(), Counter()
    for name in linears:
        key = "tok_embeddings.weight" if tied and name == "output" else f"{name}.weight"
        if key not in state:  # e.g. the state dict of a model an Engine packed: its linears keep no parameters
            raise UserError(f"the weights to quantize have no {key}; quantize the model as loaded (not one packed "
                            f"for inference by an Engine), or its checkpoint")
        out.pop(f"{name}.weight", None)
        kind, raw = blocks.get(key, (None, None))
        own = spec_of(spec, name)
        if own.method == "int4" and own.group_size == GGUF_BLOCK and kind in GGUF_INT4:
            tensors = dict(zip(("weight", "scales_and_zeros"), int4_from_gguf(kind, raw)))
            mapped[kind] += 1
        else:
            tensors = quantize_weight(own, state[key].to("cpu"), grams.get(name))
            if kind is not None:
                requantized[kind, own] += 1
        for buffer, tensor in tensors.items():
            out[f"{name}.{buffer}"] = tensor
    if blocks:
        print(gguf_note(spec, mapped, requantized), file=sys.stderr, flush=True)
    return out


def gguf_note(spec: Quantization, mapped: Counter, requantized: Counter) -> str:
    """Which of a GGUF file's quantized weights ``spec`` took as they are, and why the others were rounded again
    (``requantized`` counts them by GGML type and the quantization each got)."""
    parts = [f"{n} linears take the file's {kind} blocks as they are" for kind, n in mapped.items()]
    for (kind, own), n in requantized.items():
        why = ("int8 keeps one scale per output channel, and Q8_0's scale per 32 inputs does not fit it"
               if kind == "Q8_0" and own.method != "int4" else
               f"--group-size {GGUF_BLOCK} would take them as they are" if kind in GGUF_INT4 and own.method == "int4"
               else f"{own.describe()} has no layout of their own")
        parts.append(f"{n} {kind} linears dequantized and rounded to {own.describe()} again ({why})")
    return f"{spec.describe()} from GGUF: " + "; ".join(parts)


def spec_of(spec: Quantization, name: str) -> Quantization:
    """The quantization of the linear ``name``: int4 keeps a decoder's output projection (the vocabulary matrix)
    in int8, as llama.cpp's 4-bit files keep it at 6 or 8 bits: rounding it to 4 bits alone cost SmolLM2 6%
    perplexity where int8 costs 0.1%."""
    return Quantization("int8") if spec.method == "int4" and name == "output" else spec


def swap_linears(model: nn.Module, linears: dict[str, nn.Linear], spec: Quantization) -> None:
    """Replace each named linear by an empty quantized one (a tied output projection is untied by this)."""
    for name, linear in linears.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, empty_linear(spec_of(spec, name), linear))


def prepare_all(model: nn.Module, spec: Quantization) -> str:
    """Build every quantized linear's kernel layout, and say on stderr which kernels run (a fallback shows)."""
    kernels = Counter(m.prepare() for m in model.modules() if isinstance(m, QuantizedLinear))
    line = f"{spec.describe()}: " + ", ".join(f"{kernel} on {n} linears" for kernel, n in kernels.most_common())
    print(line, file=sys.stderr, flush=True)
    return line



def build_quantized(args: ModelArgs | EncoderArgs, state: dict[str, torch.Tensor], spec: Quantization,
                    quantize: bool, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    where: str = "the checkpoint", blocks: dict[str, tuple[str, torch.Tensor]] | None = None,
                    shard: Callable[[nn.Module, dict], dict] | None = None,
                    grams: dict[str, torch.Tensor] | None = None) -> Transformer | Encoder:
    """The model ``args`` describe with quantized linears. ``state`` is a float state dict to quantize now
    (``quantize``, taking ``blocks``, a GGUF file's own, where they fit) or one a quantized export stored; both
    give the same tensors, so quantizing at load and loading a quantized export run identically. ``dtype``
    casts the floating rest (embeddings, norms). ``shard`` (tensor parallelism) swaps the quantized linears
    for this rank's and returns its slice of the quantized state, before any kernel layout is built. ``grams``:
    ``quantize_state``'s, from calibration."""
    with torch.device("meta"):
        model = Encoder(args) if isinstance(args, EncoderArgs) else Transformer(args)
    linears = linears_of(model)
    tied = getattr(args, "tie_embeddings", False)
    if quantize:
        state = quantize_state(state, linears, spec, tied, blocks, grams)
    state = quantize_embedding(state, tied)
    swap_linears(model, linears, spec)
    # A tied table is looked up in the output projection once that has its kernel layout (prepare may copy it).
    model.tok_embeddings = None if tied else Int8Embedding(args.vocab_size, args.dim, device="meta")
    if shard is not None:
        state = shard(model, state)
    # The quantized tensors keep their own dtypes; a bias is cast with the floating rest.
    quantized = {f"{name}.{b}" for name in linears for b, _ in model.get_submodule(name).named_buffers()
                 if b != "bias"} | {"tok_embeddings.weight", "tok_embeddings.scales"}
    rest = cast_state({k: v for k, v in state.items() if k not in quantized}, device, dtype)
    assign_state(model, {**rest, **cast_state({k: v for k, v in state.items() if k in quantized}, device, None)},
                 where)
    if isinstance(args, ModelArgs) and args.position == "rope":  # non-persistent buffers are still on meta
        model.rope_cos, model.rope_sin = rope_tables(args, device=device)
    prepare_all(model, spec)
    floating = next(model.parameters()).dtype  # the norms'
    if tied:
        model.tok_embeddings = Int8Embedding.tied_to(model.output, floating)
    else:
        model.tok_embeddings.dtype = floating
    return model.eval()
