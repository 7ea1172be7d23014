"""Causal attention for training on CPUs: scalenlp's own float32 kernel (cpu_attention.cpp), built on first use.

PyTorch's CPU flash attention runs each block of scores through memory between two GEMMs; with small head sizes
that round trip, not the arithmetic, sets its pace. The kernel here keeps each tile of scores in registers from
the scores to the output and the gradients. It is used where it measured faster than SDPA (``HEAD_SIZES``;
benchmarks/RESULTS.md) by the decoder's training and scoring forward (``usable``); everywhere else, and wherever
the build fails (no C++ compiler or ninja), attention is PyTorch's SDPA. The build is cached per machine by
``torch.utils.cpp_extension`` (-march=native, so keyed by this CPU's model too). ``SCALENLP_CPU_ATTENTION=0``
turns the kernel off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scalenlp.native import NativeKernel

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
HEAD_SIZES = (16, 32)  # measured faster than SDPA; at 64 and 128 it was not, on this CPU
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@torch.compiler.assume_constant_result  # torch.compile calls it while tracing, never traces into it
def available() -> bool:
    """Whether the kernel is loaded (built or loaded from the cached build on the first call); False, with one log
    line, where it cannot be built or is turned off."""
    return KERNEL()


def _bshd_like(t: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, S, D) tensor laid out as (B, S, H, D), as the kernel returns its outputs."""
    B, H, S, D = t.shape
    return t.new_empty(B, S, H, D).transpose(1, 2)


def _register_autograd() -> None:
    # Shapes without computing (torch.compile's tracing) and the backward: what makes the op a graph node.
    @torch.library.register_fake("scalenlp_cpu::causal_attention")
    def _(q, k, v):
        return _bshd_like(q), q.new_empty(q.shape[:3])

    @torch.library.register_fake("scalenlp_cpu::causal_attention_backward")
    def _(dout, q, k, v, out, lse):
        return _bshd_like(q), _bshd_like(k), _bshd_like(v)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        return torch.ops.scalenlp_cpu.causal_attention_backward(dout, q, k, v, out, lse)

    torch.library.register_autograd("scalenlp_cpu::causal_attention", backward, setup_context=setup_context)


KERNEL = NativeKernel("scalenlp_cpu_attention", SOURCE, "SCALENLP_CPU_ATTENTION", register=_register_autograd)


def usable(q: torch.Tensor, k: torch.Tensor, dropout: float) -> bool:
    """Where the kernel applies: plain tensors (not DTensors) on a CPU, float32 or a 16-bit float (computed in
    float32), a head size it has, no dropout, query and key lengths equal (training and scoring without a cache)."""
    return (q.device.type == "cpu" and q.dtype in FLOATS and k.dtype == q.dtype and dropout == 0.0
            and q.shape[-1] in HEAD_SIZES and q.shape[-2] == k.shape[-2] and type(q) is torch.Tensor
            and type(k) is torch.Tensor and available())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v for q (B, H, S, D), k and v (B, H_kv, S, D), H_kv dividing H;
    the result is (B, H, S, D) laid out as (B, S, H, D), in q's dtype. 16-bit inputs are computed in float32
    (PyTorch's CPU kernels accumulate them in float32 too), their gradients rounded back by autograd."""
    dtype = q.dtype
    q, k, v = (t.float() if t.stride(-1) == 1 else t.float().contiguous() for t in (q, k, v))
    return torch.ops.scalenlp_cpu.causal_attention(q, k, v)[0].to(dtype)
