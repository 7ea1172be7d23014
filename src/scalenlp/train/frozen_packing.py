"""Whether a LoRA run holds its frozen base packed for oneDNN (``lora.pack_frozen = auto``, the default), measured.

Packed copies of W and W^T (models/adapters.py ``pack_frozen``) let oneDNN skip reordering the weight at every
product, but hold the base twice: SmolLM2's peak resident memory grew 1.37x. Whether they are faster depends on the
CPU: on SmolLM2's block shapes at 128 rows, one thread, they ran 1.07-1.19x faster on one machine and 0.88-0.94x
as fast on another (an AMD EPYC without AVX-512), where the whole step ran 0.93-0.95x as fast packed. So ``auto``
times the products a step would run (each frozen shape's forward and input-gradient product, weighted by how many
linears have it) plain and packed, in interleaved rounds, and packs when packed takes at most 1 / ``MARGIN`` of the
plain time. The figure is cached per processor, torch version, thread count, shapes and rows, as the served
dtype's is, so later runs on the machine decide without timing. ``SCALENLP_PACK_FROZEN=on|off`` decides ``auto``
without timing (the test suite sets it, as it sets SCALENLP_COMPILE).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scalenlp.hardware import cached_record, engine_cache_path, time_rounds
from scalenlp.models.adapters import packed_pair
from scalenlp.models.onednn import packed_linear

MARGIN = 1.05  # packing costs a second copy of the base: worth a real gain, not a tie
ROUNDS = 5
MAX_ROWS = 512  # a product's time per row is about flat from a few hundred rows: a larger step is timed at this
CANDIDATES = ("plain", "packed")
# Per candidate, per round: seconds of each shape's pass (in the order of the shapes given).
Timings = dict[str, list[list[float]]]


@dataclass(frozen=True)
class PackingChoice:
    on: bool
    reason: str  # for the log line


def choose_packing(shapes: Counter[tuple[int, int]], rows: int,
                   measure: Callable[[list[tuple[int, int]], int], Timings] | None = None) -> PackingChoice:
    """Whether packing the frozen linears of ``shapes`` ((in, out) -> how many) pays for products of ``rows`` rows
    on this machine (see the module docstring); ``measure`` times them (default ``time_products``), only when the
    cache has no figure for them."""
    forced = os.environ.get("SCALENLP_PACK_FROZEN", "")
    if forced in ("on", "off"):
        return PackingChoice(forced == "on", f"SCALENLP_PACK_FROZEN={forced}")
    order = sorted(shapes)
    rows = min(rows, MAX_ROWS)
    key = f"{rows}rows-" + "-".join(f"{i}x{o}x{shapes[i, o]}" for i, o in order)
    path = engine_cache_path("pack-frozen", torch.device("cpu"), key)
    record, measured = cached_record(path, lambda: _record((measure or time_products)(order, rows),
                                                           [shapes[s] for s in order]), _valid)
    gain, ms = record["speedup"], record["ms"]
    figures = (f"the frozen products of a step, {rows} rows: {ms['packed']:.1f} ms packed against {ms['plain']:.1f} "
               f"ms plain; {'measured now, ' if measured else ''}cached in {path}")
    if gain >= MARGIN:
        return PackingChoice(True, f"measured {gain:.2f}x as fast packed ({figures})")
    return PackingChoice(False, f"measured {gain:.2f}x as fast packed, under the {MARGIN}x that pays for a second "
                                f"copy of the base ({figures})")


def _record(timings: Timings, counts: list[int]) -> dict:
    """The cache record: each candidate's milliseconds for a step's products (each shape's median over rounds
    times how many linears have it) and how many times as fast packed ran."""
    ms = {name: 1e3 * sum(n * statistics.median(r[i] for r in rounds) for i, n in enumerate(counts))
          for name, rounds in timings.items()}
    return {"speedup": ms["plain"] / ms["packed"], "ms": ms}


def _valid(record: dict) -> dict:
    """``record`` when it is one ``_record`` wrote; ValueError otherwise."""
    if not float(record["speedup"]) > 0 or not all(float(record["ms"][name]) > 0 for name in CANDIDATES):
        raise ValueError(f"not a packing measurement: {record}")
    return record


def time_products(shapes: list[tuple[int, int]], rows: int) -> Timings:
    """Interleaved rounds of each shape's forward product and input gradient (dy W, as autograd computes it for a
    frozen weight), plain and packed, with this process's threads."""
    passes: dict[str, list[Callable[[], None]]] = {name: [] for name in CANDIDATES}
    with torch.no_grad():
        for k, n in shapes:
            w, x, dy = torch.randn(n, k), torch.randn(rows, k), torch.randn(rows, n)
            packed, packed_t = packed_pair(w, rows)
            passes["plain"].append(lambda w=w, x=x, dy=dy: (F.linear(x, w), dy.mm(w)))
            passes["packed"].append(lambda p=packed, pt=packed_t, x=x, dy=dy: (packed_linear(x, p, None),
                                                                              packed_linear(dy, pt, None)))
        return time_rounds(passes, ROUNDS)
