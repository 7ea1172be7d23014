"""Decode attention over the paged KV cache on CPUs: scalenlp's kernel (paged_attention.cpp), float32 or bfloat16
pools with float32 arithmetic, built on first use like cpu_attention's.

The decoder's generic paged path gathers each row's blocks into one tensor and runs SDPA over it; at decode
(one query per row) that gather copies everything the step reads, and measured 2-3x slower per layer than SDPA
over a dense cache (SmolLM2's heads, batch 1 and 16). The kernel reads keys and values in place through the
block table. It serves decode steps on CPU in float32 and bfloat16 (``usable``); prefill, other dtypes, GPUs and
machines where it does not build keep the generic path. In bfloat16 the generic path was the slower by far: at 16
sequences over a shared 1,000-token prefix, SmolLM2's whole decode step took 5.9x its short-prompt time. ``SCALENLP_PAGED_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scalenlp.native import NativeKernel

SOURCE = Path(__file__).with_name("paged_attention.cpp")


def _register_fake() -> None:
    # Shapes without computing, for torch.compile's tracing: what makes the op a graph node.
    @torch.library.register_fake("scalenlp_paged::decode_attention")
    def _(q, k, v, block_table, lengths, scale, softcap, window, block_size):
        return q.new_empty(q.shape)


KERNEL = NativeKernel("scalenlp_paged_attention", SOURCE, "SCALENLP_PAGED_ATTENTION", register=_register_fake)


@torch.compiler.assume_constant_result  # torch.compile calls it while tracing, never traces into it
def available() -> bool:
    """Whether the kernel is loaded (built or loaded from the cached build on the first call); False where it
    cannot be built or is turned off."""
    return KERNEL()


def usable(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Where the kernel applies: one query per row against a pool of its dtype, float32 or bfloat16, on a CPU,
    plain tensors."""
    return (q.device.type == "cpu" and q.shape[2] == 1 and q.dtype in (torch.float32, torch.bfloat16)
            and pool.dtype == q.dtype and type(q) is torch.Tensor and available())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                     lengths: torch.Tensor, block_size: int, scale: float, softcap: float, window: int) -> torch.Tensor:
    """q: (B, H, 1, D); k, v: the pool, (slots, H_kv, D), slot = block * block_size + offset; block_table (B, N);
    lengths (B,), the keys each query sees; window: the last that many of them only (0: all); softcap: scores
    capped as Gemma 2 does (0: not). Returns (B, H, 1, D)."""
    out = torch.ops.scalenlp_paged.decode_attention(q[:, :, 0], k, v, block_table, lengths, scale, softcap, window,
                                                    block_size)
    return out.unsqueeze(2)
