"""Which layout, if any, a LoRA run holds its frozen base in (``lora.pack_frozen = auto``, the default), measured.

The layouts (models/frozen.py) give a frozen weight's forward product and input gradient operands the CPU's BLAS may
read faster than ``F.linear``'s, at the cost of a second copy of the weight: oneDNN-packed copies of W and W^T, a
row-major copy of W^T beside W, or an MKL-packed copy of W beside it. Which is faster depends on the CPU and the
shape: on SmolLM2's block shapes at 128 rows, one thread, the oneDNN-packed products ran 1.07-1.19x faster than
plain on one machine and 0.88-0.94x as fast on an AMD EPYC without AVX-512 (where the whole step ran 0.93-0.95x as
fast packed); on an AVX-512 Xeon the transposed copy ran the block shapes' products 1.07-1.10x faster and the output
projection's 0.80x as fast. So ``auto`` times the products a step would run, plain and in each layout, in
interleaved rounds: each frozen shape's forward and input-gradient product, over enough copies of its weight that
they come from memory as in a step. Each shape takes its fastest layout where that is at least ``MARGIN`` as fast as
plain, as long as the copies fit in a budget of memory (``memory_budget``: a share of what the machine has
available, split among its processes): past it, the shapes that save the least time per byte stay plain. The figures
are cached per processor, torch version, thread count, dtype, shapes and rows, as the served dtype's are, so later runs on
the machine decide without timing. ``SCALENLP_PACK_FROZEN=off|onednn|transposed|mkl|cast`` decides ``auto`` without
timing, one layout for every shape (the test suite sets it, as it sets SCALENLP_COMPILE).

Under mixed precision the products run in autocast's dtype, and "plain" is what autocast does: the weight cast anew
each step. The layouts then hold a copy cast once ("cast", and oneDNN's and the transposed copy of it), which
saves that cast and costs less memory than a float32 copy; they are timed and chosen the same way, apart.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scalenlp.hardware import available_memory, cached_record, engine_cache_path, time_rounds
from scalenlp.models.frozen import LAYOUTS, available_layouts, frozen_operands, frozen_product, run_layouts

MARGIN = 1.05  # a layout costs a second copy of the base: worth a real gain, not a tie
ROUNDS = 5
MAX_ROWS = 512  # a product's time per row is about flat from a few hundred rows: a larger step is timed at this
SPAN_BYTES = 64 * 2**20  # more than a core's share of the last-level cache
# Of the memory available once the base is loaded: the copies leave the rest to the step's activations, the
# optimizer and everything else on the machine. A layout is about one more float32 copy of each weight it holds.
MEMORY_SHARE = 0.5
# Per candidate ("plain" or a layout), per round: seconds of each shape's pass (in the order of the shapes given).
Timings = dict[str, list[list[float]]]


@dataclass(frozen=True)
class PackingChoice:
    layouts: dict[tuple[int, int], str]  # the layout of each (in, out) shape that gets one; the others stay plain
    reason: str  # for the log line


def choose_packing(shapes: Counter[tuple[int, int]], rows: int, layouts: tuple[str, ...] | None = None,
                   measure: Callable[[list[tuple[int, int]], int, list[int]], Timings] | None = None,
                   budget: int | None = None, dtype: torch.dtype = torch.float32) -> PackingChoice:
    """Which of ``layouts``, if any, pays for holding each shape's frozen linears in it, for ``shapes`` ((in, out)
    -> how many) and products of ``rows`` rows in ``dtype`` on this machine (see the module docstring): the
    fastest, where it is at least ``MARGIN`` as fast as plain and the copies fit in ``budget`` bytes (None: no
    bound; ``layouts`` default: all that hold products in ``dtype``); ``measure`` times them (default
    ``time_products``), only when the cache has no figure for them."""
    if layouts is None:
        layouts = run_layouts(dtype)
    forced = os.environ.get("SCALENLP_PACK_FROZEN", "")
    if forced in ("off", *layouts):
        return PackingChoice({} if forced == "off" else dict.fromkeys(shapes, forced), f"SCALENLP_PACK_FROZEN={forced}")
    if forced in LAYOUTS:  # one this run cannot take (models/frozen.py's refusal)
        return PackingChoice({}, f"SCALENLP_PACK_FROZEN={forced} is not among this run's layouts: {', '.join(layouts)}")
    order = sorted(shapes)
    rows = min(rows, MAX_ROWS)
    in_dtype = "" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')}-"
    key = f"{rows}rows-{in_dtype}" + "-".join(f"{i}x{o}x{shapes[i, o]}" for i, o in order)
    path = engine_cache_path("pack-frozen", torch.device("cpu"), key)
    counts = [shapes[s] for s in order]
    measure = measure or functools.partial(time_products, dtype=dtype)
    record, measured = cached_record(path, lambda: _record(measure(order, rows, counts), counts),
                                     functools.partial(_valid, dtype=dtype))
    ms = record["ms"]
    timed = [name for name in layouts if name in ms]
    best = {shape: min(timed, key=lambda name: ms[name][i], default="plain") for i, shape in enumerate(order)}
    gain = {shape: ms["plain"][i] / ms[best[shape]][i] for i, shape in enumerate(order)}
    chosen = {shape: best[shape] for shape in order if gain[shape] >= MARGIN}
    over = set()
    if budget is not None:  # the copies that save the most time per byte first, while they fit
        copy = {shape: copy_bytes(shape, shapes[shape], chosen[shape], dtype) for shape in chosen}
        saved = {shape: ms["plain"][i] - ms[best[shape]][i] for i, shape in enumerate(order)}
        held_bytes = 0
        for shape in sorted(chosen, key=lambda s: saved[s] / copy[s], reverse=True):
            if held_bytes + copy[shape] > budget:
                over.add(shape)
            else:
                held_bytes += copy[shape]
        chosen = {shape: name for shape, name in chosen.items() if shape not in over}
    notes = []
    for k, n in order:
        figure = f"{best[k, n]} {gain[k, n]:.2f}x"
        if (k, n) in chosen:
            notes.append(f"{k}x{n} {figure}")
        elif (k, n) in over:
            notes.append(f"{k}x{n} plain ({figure}; its copy would pass the memory budget, {budget / 2**20:,.0f} MiB)")
        else:
            notes.append(f"{k}x{n} plain" + (f" ({figure})" if timed else ""))
    plain, held = sum(ms["plain"]), sum(ms[chosen.get(shape, "plain")][i] for i, shape in enumerate(order))
    figures = (f"the frozen products of a step, {rows} rows: {held:.1f} ms against {plain:.1f} ms plain; "
               f"{', '.join(notes)}; {'measured now, ' if measured else ''}cached in {path}")
    if chosen:
        return PackingChoice(chosen, f"measured {plain / held:.2f}x as fast ({figures})")
    if over:
        return PackingChoice({}, f"no layout's copy fits the memory budget ({figures})")
    return PackingChoice({}, f"no layout of {', '.join(layouts)} at least {MARGIN}x as fast as plain, which pays for "
                             f"a second copy of the base ({figures})")


def copy_bytes(shape: tuple[int, int], count: int, layout: str, dtype: torch.dtype) -> int:
    """The memory ``count`` linears of ``shape`` hold in ``layout`` beside (or, oneDNN's float32, in place of) their
    float32 weights: one more weight's worth in float32; in a lower dtype, one copy cast ("cast") or two."""
    copies = 1 if dtype == torch.float32 or layout == "cast" else 2
    return copies * dtype.itemsize * shape[0] * shape[1] * count


def memory_budget(processes: int) -> int | None:
    """Bytes of layout copies each of this machine's ``processes`` may hold: ``MEMORY_SHARE`` of the memory
    available now, split among them (None where the system does not say)."""
    available = available_memory()
    return None if available is None else int(MEMORY_SHARE * available) // max(1, processes)


def _record(timings: Timings, counts: list[int]) -> dict:
    """The cache record: each candidate's milliseconds for a step's products of each shape (the median over
    rounds times how many linears have it)."""
    return {"ms": {name: [1e3 * n * statistics.median(r[i] for r in rounds) for i, n in enumerate(counts)]
                   for name, rounds in timings.items()}}


def _valid(record: dict, dtype: torch.dtype) -> dict:
    """``record`` when it is one ``_record`` wrote, timing every layout this PyTorch has for ``dtype`` (one written
    before a layout was added is measured again); ValueError otherwise."""
    ms = record["ms"]
    if "plain" not in ms or not all(name in ("plain", *LAYOUTS) and len(t) == len(ms["plain"])
                                    and all(float(v) > 0 for v in t) for name, t in ms.items()):
        raise ValueError(f"not a packing measurement: {record}")
    if missing := [name for name in available_layouts(dtype) if name not in ms]:
        raise ValueError(f"a packing measurement without {', '.join(missing)}")
    return record


def time_products(shapes: list[tuple[int, int]], rows: int, counts: list[int],
                  dtype: torch.dtype = torch.float32) -> Timings:
    """Interleaved rounds of each shape's forward product and input gradient (dy W, as autograd computes it for a
    frozen weight) in ``dtype``, plain (below float32, on the weight cast first, as autocast casts it each step) and
    in each layout this PyTorch has for ``dtype``, with this process's threads; a shape's pass runs
    them over copies of its weight, as many as the step has linears of the shape (``counts``) up to ``SPAN_BYTES``
    of them (a step reads every weight once each way, from memory, not from a cache that one weight timed over and
    over would sit in), and is counted per copy. One shape's copies at a time, so the timing holds little more than
    that."""
    layouts = available_layouts(dtype)
    timings: Timings = {name: [[] for _ in range(ROUNDS)] for name in ("plain", *layouts)}
    with torch.no_grad():
        for (k, n), count in zip(shapes, counts):
            x, dy = torch.randn(rows, k, dtype=dtype), torch.randn(rows, n, dtype=dtype)
            weights = [torch.randn(n, k) for _ in range(max(1, min(count, SPAN_BYTES // (4 * n * k))))]
            passes = {"plain": [lambda: [(F.linear(x, c), dy.mm(c)) for c in (w.to(dtype) for w in weights)]]}
            for name in layouts:
                held = [frozen_operands(w, name, rows, dtype) for w in weights]
                passes[name] = [lambda held=held: [(frozen_product(x, f), frozen_product(dy, b)) for f, b in held]]
            for name, rounds in time_rounds(passes, ROUNDS).items():
                for r, (seconds,) in enumerate(rounds):
                    timings[name][r].append(seconds / len(weights))
    return timings
