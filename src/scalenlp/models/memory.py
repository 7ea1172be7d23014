"""The memory a model's arguments ask for, priced before anything is allocated: its weights (and a decoder's RoPE
tables) when it is built, its KV cache when an engine sets one up. Arguments that ask for more than the device has
are refused in one line (naming the size and what to change) instead of being allocated until the process dies.

Counts come from building the model with one layer on the meta device (nothing allocated), so they follow the
model classes exactly; the device's memory is its total (a GPU's, or this machine's RAM within its cgroup's limit),
since what ever exceeds the total cannot fit whatever else is freed.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.encoder import Encoder, EncoderArgs

GiB = 2**30
# Sequences of max_seq_len that the default KV cache holds: the slots the cache had before it was paged, so that
# the default memory did not grow with paging.
DEFAULT_CACHED_SEQUENCES = 8
# cgroup v2's and v1's memory limit of this process's group ("max" or a huge number when unlimited).
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def device_memory(device: str | torch.device) -> int:
    """Bytes of memory ``device`` has in all: a CUDA device's, else this machine's RAM (within a cgroup limit),
    which an Apple GPU (mps) shares."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for file in CGROUP_LIMITS:
        try:
            ram = min(ram, int(file.read_text()))
        except (OSError, ValueError):  # absent, or "max"
            continue
    return ram


def parameter_count(args: ModelArgs | EncoderArgs) -> int:
    """The parameters of the model ``args`` describe (checked arguments), counted on a one-layer copy built on the
    meta device: the embeddings and heads once, the layer ``n_layers`` times."""
    if isinstance(args, EncoderArgs):
        one, build = replace(args, n_layers=1), Encoder
    else:  # a one-layer copy has no window layers to name
        one, build = replace(args, n_layers=1, sliding_window=0, local_layers=()), Transformer
    with torch.device("meta"):
        model = build(one)
    layer = sum(p.numel() for p in model.layers["0"].parameters())
    return sum(p.numel() for p in model.parameters()) + (args.n_layers - 1) * layer


def rope_bytes(args: ModelArgs | EncoderArgs) -> int:
    """A decoder's RoPE tables (cos and sin in float32, the local layers' beside the global ones)."""
    if isinstance(args, EncoderArgs) or args.position != "rope":
        return 0
    return 2 * 4 * args.max_seq_len * args.head_dim * (2 if args.rope_local_theta else 1)


def check_fits(args: ModelArgs | EncoderArgs, device: str | torch.device, itemsize: float, where: str) -> None:
    """UserError unless the weights (``itemsize`` bytes each) and RoPE tables of the model fit in ``device``'s
    memory; ``where`` names the file they were read from."""
    count = parameter_count(args)
    weights, tables, have = count * itemsize, rope_bytes(args), device_memory(device)
    if weights > have:
        raise UserError(f"{where}: its arguments describe {count:,} parameters ({weights / GiB:,.1f} GiB at "
                        f"{itemsize:g} bytes each), more than the {have / GiB:,.1f} GiB of {torch.device(device)} "
                        f"memory: n_layers={args.n_layers}, dim={args.dim}, ffn_dim={args.ffn_dim}, "
                        f"vocab_size={args.vocab_size}; the file is damaged, or the model needs a larger machine")
    if weights + tables > have:
        raise UserError(f"{where}: max_seq_len={args.max_seq_len:,} needs {tables / GiB:,.1f} GiB of RoPE tables "
                        f"beside {weights / GiB:,.1f} GiB of weights, more than the {have / GiB:,.1f} GiB of "
                        f"{torch.device(device)} memory; the file's context length is wrong")


def kv_cache_bytes(args: ModelArgs, positions: int, itemsize: int) -> int:
    """A KV cache of ``positions`` over every layer (keys and values)."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * itemsize * positions


def kv_cache_blocks(tokens: int, block_size: int) -> int:
    """Blocks of a paged KV cache that holds ``tokens`` positions: enough for them, and the null block that
    padding writes to (engine.kv_blocks)."""
    return -(-tokens // block_size) + 1


def check_kv_cache(args: ModelArgs, tokens: int, block_size: int, dtype: torch.dtype, device: str | torch.device,
                   weights: int) -> None:
    """UserError, before the cache is allocated, unless a paged KV cache holding ``tokens`` positions (over all
    sequences) fits in ``device``'s memory beside ``weights`` bytes of model. The message gives the most
    positions that would fit."""
    positions = kv_cache_blocks(tokens, block_size) * block_size
    need = kv_cache_bytes(args, positions, dtype.itemsize)
    left = device_memory(device) - weights
    if need <= left:
        return
    fit = (max(0, left) // kv_cache_bytes(args, block_size, dtype.itemsize) - 1) * block_size
    raise UserError(f"a KV cache of {tokens:,} positions needs {need / GiB:,.1f} GiB, more than the "
                    f"{max(0, left) / GiB:,.1f} GiB of {torch.device(device)} memory left beside the weights; "
                    f"pass --kv-cache-tokens {max(0, fit):,} or less (it defaults to {DEFAULT_CACHED_SEQUENCES} x --max-seq-len)")


def bytes_per(dtype: torch.dtype | None, state: dict[str, torch.Tensor]) -> int:
    """Bytes per weight once built: ``dtype``'s, else the checkpoint's widest floating tensor's."""
    if dtype is not None:
        return dtype.itemsize
    return max((t.element_size() for t in state.values() if t.is_floating_point()), default=1)

