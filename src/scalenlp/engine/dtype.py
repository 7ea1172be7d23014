"""The weight dtype a model is served in: the one asked for, or with ``auto`` the one this machine runs this
model's layers fastest in, and why.

- CUDA: bf16 where the GPU computes in it, else fp16. Either runs on the tensor cores and streams half of
  float32's bytes, so nothing is timed.
- CPU: float32 or bf16, whichever runs a layer of this model's widths faster here, measured. oneDNN reporting
  bf16 support is no guide: it reports it on AVX-512 CPUs without native bf16 instructions, where each product
  converts in software; on such a 2-core Xeon SmolLM2 served 16 streams at 36 tokens/s in bf16 against 81 in
  float32 (issue 30).
- Any other device: float32.

The measurement runs a layer's linear products as the engine calls them (packed, with q/k/v and gate/up fused,
where the engine packs them: float32 always, in scalenlp's panels where its kernel builds; bf16 for oneDNN, where
oneDNN computes in it) for one request of
``PREFILL_ROWS`` prompt tokens and as many output tokens: a prefill of that many rows, then that many one-row decode steps (an
encoder's request is its prefill alone). The products are most of a step's time at serving's lengths, and the
rest of the step runs in the same dtype. A decode step streams every layer's weights from memory, which one
layer timed again and again does not (SmolLM2's fits in a 32 MiB L3 cache): a round's one-row pass runs through
copies of the layer, as many as the model has layers, up to four times the last-level cache in float32.

Rounds alternate the two dtypes, in alternating order, and the figure is the median over rounds of float32's
time over bf16's: a neighbour's burst slows both halves of a round alike. In each round a dtype runs its request
once untimed right before the timed run, so that the timing pays neither a first call's one-time costs nor what
the other dtype's half left behind (its weights in the caches, the cores' clocks set for its instructions): a
server runs one dtype over and over. (A start once reported MiniLM's bf16 at 17.39x float32's speed, 1.53 against
26.9 ms for a 32-token prefill, float32's figure that of a cold-looking call.) bf16 is chosen when that is at least
``BF16_MARGIN``, since it costs precision. The figure is cached per processor, torch version, thread count and
layer widths, as training's MFU peak is (train/peak.py), so every start on this machine picks the same dtype
without timing again.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import skip_init

from scalenlp.engine.packing import can_pack, packed, panel_kernel
from scalenlp.hardware import cached_record, engine_cache_path, time_rounds
from scalenlp.models.memory import device_memory

CPU_CANDIDATES = ("float32", "bfloat16")
# bf16 is served only when it runs the request at least this many times as fast as float32: it rounds every weight
# and activation to 8 significant bits, worth a real gain and not a tie that noise decides (SmolLM2 at one thread
# here measured 1.16x one way and 1.08x the other in five runs under load).
BF16_MARGIN = 1.1
PREFILL_ROWS = 32  # prompt tokens of the timed request: time per prompt token is about flat from here up


def layout() -> str:
    """How the candidates' products are laid out, kept in the record: one measured under another layout is measured
    again (plain float32 before the engine packed it ran its decode step 1.2-1.4x slower than oneDNN's packed
    weights; those ran their products 1.11-1.32x slower than scalenlp's panels)."""
    return "float32 panels" if panel_kernel() else "float32 packed"


ROUNDS = 5
# Timed only when one float32 layer takes at most this share of memory, so a model of a few layers still fits.
MEMORY_SHARE = 4
FILL = 0.01  # every weight and input: a normal float in both dtypes, whose sums stay far from overflow

# Per candidate dtype name, per round: (seconds of a one-row pass, seconds of a PREFILL_ROWS-row pass).
Timings = dict[str, list[tuple[float, float]]]


@dataclass(frozen=True)
class LayerShapes:
    """The widths of one layer's linear products on one process."""

    dim: int
    q_width: int  # query heads times head size, which the attention's output projection reads
    kv_width: int
    ffn: int
    gated: bool  # a gate and an up projection (SwiGLU, GeGLU)
    layers: int
    decodes: bool = True  # a decoder's request is a prefill then one-row steps; an encoder's a prefill alone
    packs: bool = True  # the engine packs bf16 weights for oneDNN (a decoder on one process)

    @classmethod
    def of(cls, args, tp: int = 1) -> LayerShapes:
        """A decoder's (ModelArgs) or an encoder's (EncoderArgs) layer, on one of ``tp`` tensor-parallel ranks."""
        from scalenlp.models.encoder import EncoderArgs

        if isinstance(args, EncoderArgs):
            return cls(args.dim, args.dim, args.dim, args.ffn_dim, gated=False, layers=args.n_layers, decodes=False,
                       packs=False)
        return cls(args.dim, args.n_heads * args.head_dim // tp, args.n_kv_heads * args.head_dim // tp,
                   args.ffn_dim // tp, gated=args.activation != "gelu", layers=args.n_layers, packs=tp == 1)

    def products(self, fused: bool) -> list[tuple[int, int]]:
        """(inputs, outputs) of each product, in the order a layer runs them."""
        attention, up = [self.q_width, self.kv_width, self.kv_width], [self.ffn] * (1 + self.gated)
        if fused:
            attention, up = [sum(attention)], [sum(up)]
        return [*((self.dim, n) for n in attention), (self.q_width, self.dim), *((self.dim, n) for n in up),
                (self.ffn, self.dim)]

    def key(self) -> str:
        kind = ("decoder" if self.packs else "decoder-unpacked") if self.decodes else "encoder"
        return (f"{kind}-{self.layers}x{self.dim}-{self.q_width}-{self.kv_width}-{self.ffn}"
                f"{'-gated' if self.gated else ''}")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str | None  # why ``auto`` chose this dtype, for the start-up line; None: it was asked for, so nothing to say

    def line(self) -> str:
        return f"dtype {name_of(self.dtype)}: {self.reason}"


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_dtype(device: torch.device, requested: str, shapes: LayerShapes,
                 measure: Callable[[LayerShapes], Timings] | None = None) -> DtypeChoice:
    """``requested`` (float32, bfloat16, float16) as it is, or for ``auto`` the dtype this device serves a layer of
    ``shapes`` fastest in (see the module docstring). ``measure`` times the CPU candidates (default
    ``time_layer``); it runs only when this machine's cache has no figure for these widths."""
    if requested != "auto":
        return DtypeChoice(getattr(torch, requested), None)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "this GPU computes in bf16 (auto)")
        return DtypeChoice(torch.float16, "this GPU has no bf16 arithmetic; fp16 runs on its tensor cores (auto)")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto measures CPUs and knows CUDA's dtypes, not {device.type}'s")
    if sum(i * o for i, o in shapes.products(fused=False)) * 4 * MEMORY_SHARE > device_memory(device):
        # Such a model does not fit this machine (the loader, next, refuses it in one line): timing it would
        # allocate its layer first, terabytes for a model file's absurd widths.
        return DtypeChoice(torch.float32, None)
    threads = torch.get_num_threads()
    path = engine_cache_path("dtype", device, shapes.key())
    record, measured = cached_record(path, lambda: _record((measure or time_layer)(shapes)), _valid)
    return _explained(record, shapes, threads, f"{'measured now, ' if measured else ''}cached in {path}")


def _explained(record: dict, shapes: LayerShapes, threads: int, where: str) -> DtypeChoice:
    """The dtype a measurement ``record`` picks, and the start-up line's why."""
    gain, ms = record["bfloat16_speedup"], record["ms"]
    if gain >= BF16_MARGIN:
        chosen, other, verdict = "bfloat16", "float32", f"measured {gain:.2f}x as fast as float32"
    elif gain > 1:
        chosen, other = "float32", "bfloat16"
        verdict = f"bfloat16 measured only {gain:.2f}x as fast, under the {BF16_MARGIN}x its coarser rounding must earn,"
    else:
        chosen, other, verdict = "float32", "bfloat16", f"measured {1 / gain:.2f}x as fast as bfloat16"
    figures = (f"{ms[chosen][0]:.3g} against {ms[other][0]:.3g} ms a decode step, " if shapes.decodes else "")
    figures += f"{ms[chosen][1]:.3g} against {ms[other][1]:.3g} ms a {PREFILL_ROWS}-token prefill"
    return DtypeChoice(getattr(torch, chosen),
                       f"{verdict} on this CPU at this model's widths (one layer's products, {threads} "
                       f"thread{'s' if threads > 1 else ''}: {figures}; {where})")


def _record(timings: Timings) -> dict:
    """The cache record of one measurement: how many times as fast bf16 ran the request as float32 (the median
    over rounds of float32's time over bf16's), and each candidate's median milliseconds per one-row pass and per
    prefill. An encoder's one-row passes are not run (0 s), so its request is its prefill."""
    request = {name: [prefill + PREFILL_ROWS * one for one, prefill in rounds] for name, rounds in timings.items()}
    gain = statistics.median(a / b for a, b in zip(request["float32"], request["bfloat16"]))
    ms = {name: [1e3 * statistics.median(r[i] for r in rounds) for i in (0, 1)] for name, rounds in timings.items()}
    return {"bfloat16_speedup": gain, "ms": ms, "layout": layout()}


def _valid(record: dict) -> dict:
    """``record`` when it is one ``_record`` wrote; ValueError otherwise."""
    ms = record["ms"]
    if (record.get("layout") != layout() or not float(record["bfloat16_speedup"]) > 0
            or any(len(ms[name]) != 2 or not all(float(x) >= 0 for x in ms[name]) for name in CPU_CANDIDATES)):
        raise ValueError(f"not a dtype measurement: {record}")
    return record


def time_layer(shapes: LayerShapes) -> Timings:
    """Interleaved rounds of a layer's products in each CPU candidate dtype, with this process's threads (see the
    module docstring)."""
    copies = streamed_copies(shapes)
    with torch.no_grad():
        passes = {}
        for name in CPU_CANDIDATES:
            stack, one, many = _layers(shapes, getattr(torch, name), copies)
            decode = [functools.partial(_run, stack, one)] if shapes.decodes else []  # one row through the copies
            passes[name] = [*decode, functools.partial(_run, stack[:1], many)]
        timed = time_rounds(passes, ROUNDS)
    return {name: [(r[0] / copies, r[1]) if shapes.decodes else (0.0, r[0]) for r in rounds]
            for name, rounds in timed.items()}


def streamed_copies(shapes: LayerShapes) -> int:
    """Copies of the layer a round's one-row pass runs through: the model's layers, up to four times the
    last-level cache in float32 weights (bf16's then twice it), so that they stream from memory as a decode step's
    do. One for an encoder, whose products read each weight for many rows."""
    if not shapes.decodes:
        return 1
    layer_bytes = 4 * sum(n_in * n_out for n_in, n_out in shapes.products(fused=False))
    return max(1, min(shapes.layers, -(-4 * _last_level_cache_bytes() // layer_bytes)))


def _last_level_cache_bytes() -> int:
    """The largest CPU cache Linux lists; 32 MiB (a server core complex's L3) where it lists none."""
    sizes = []
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            pass
    return max(sizes, default=32 * 2**20)


def _layers(shapes: LayerShapes, dtype: torch.dtype, copies: int):
    """(``copies`` layers, each a list of its products; a one-row input and a prefill's input of each width they
    read) in ``dtype``. Every value is one constant: values do not change a product's speed, and drawing random
    ones for SmolLM2's ten copies took 0.85 s, longer than the timing (no RNG is touched either)."""
    packs = shapes.packs and can_pack(skip_init(nn.Linear, 1, 1, bias=False, dtype=dtype))  # as the engine packs
    widths = shapes.products(fused=packs)
    stack = []
    for _ in range(copies):
        linears = [skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype) for n_in, n_out in widths]
        for linear in linears:
            linear.weight.fill_(FILL)
        stack.append([packed(linear) for linear in linears] if packs else linears)
    one = {n_in: torch.full((1, n_in), FILL, dtype=dtype) for n_in, _ in widths}
    many = {n_in: torch.full((PREFILL_ROWS, n_in), FILL, dtype=dtype) for n_in, _ in widths}
    return stack, one, many


def _run(layers: list[list[nn.Module]], inputs: dict[int, torch.Tensor]) -> None:
    """Each of ``layers``' products, in order, on the input of its width."""
    for products in layers:
        for product in products:
            product(inputs[product.in_features])


def announce(engine) -> None:
    """Print an engine's start-up line (which dtype ``auto`` chose, and why), if it has one: said by a command once
    its own checks have passed, so that a refusal stays one error line."""
    if engine.startup_line:
        print(engine.startup_line, file=sys.stderr, flush=True)
