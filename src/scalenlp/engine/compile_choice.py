"""Whether the decoder engine runs its decode step through torch.compile (``--compile on|off|auto``), and why.

A decode step of a small model on a CPU is a few hundred operator calls, whose fixed cost is as large as the
arithmetic: SmolLM2-135M at one thread decoded 1.1-1.2x as fast compiled at batch 1 and 1.3-1.5x at batch 16
(benchmarks/compile_decode.py). A large model's step is its weights streaming from memory, which compiling does not
change, while compiling costs the first start a minute or more (later ones take the compiled step from the cache,
engine/compile_cache.py, in seconds). So ``auto`` measures, per machine and per model shape:
a stack of this model's layers (as many as ``engine.dtype`` streams from memory, never fewer than
``MIN_LAYERS``) decodes a step of 1 and of 16 rows (its weights packed as the engine packs them), eagerly and
compiled, in interleaved rounds; compiling is chosen when the compiled steps take at most 1 / ``MARGIN`` of the
eager ones' time, each mode's fastest round counted. The figure is cached as the dtype's is, so later starts decide without timing.

A quantized model is measured quantized (its layers' random weights quantized the same way, their own kernels): an
int4 SmolLM2 decoded 1.35x as fast compiled at batch 1 on one thread, where its eager step spends a third of its
time around the int4 kernel (casts to and from its bf16 activations, norms, RoPE).

``auto`` stays eager without timing where the compiled step is not supported or not measured: another device than
a CPU or a CUDA GPU, --tp, LoRA adapters, speculative decoding, int8dyn layers. ``SCALENLP_COMPILE=on|off`` decides
``auto`` without timing (the test suite sets it off: its servers would each pay the compile time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scalenlp.compress.quantized import Quantization, lowbit_kernels_available
from scalenlp.engine.dtype import MEMORY_SHARE, LayerShapes, name_of, streamed_copies
from scalenlp.hardware import cached_record, engine_cache_path
from scalenlp.models.memory import device_memory

MARGIN = 1.1  # compiling costs a first start its compile time, every start a trace and the graph's memory: worth a
# real gain, not a tie
MIN_LAYERS = 4
ROWS = (1, 16)  # a decode step of one request, and of a busy server's batch
WARMUP, ROUNDS = 2, 5
STEPS = 4  # timed steps per round and batch size
CONTEXT = 64  # positions each row's queries see: the cache's keys read by the paged attention kernel

# Which compiled step a cached figure is for: records written before the step was built for Inductor's caches
# (engine/compile_cache.py) measured it with freezing, and those before its CPU wrapper was C++ (compiled_step)
# measured a Python one; both are measured again.
STEP = "cpp-wrapper"
# Per mode ("eager", "compiled"), per round: seconds of a step at each of ROWS; and "compile_s", the first
# compiled steps' time.
Timings = dict[str, list[list[float]] | float]


@dataclass(frozen=True)
class CompileChoice:
    on: bool
    reason: str | None  # why ``auto`` chose it, for the start-up line; None: asked for, nothing to say

    def line(self) -> str:
        return f"compile {'on' if self.on else 'off'}: {self.reason}"


def choose_compile(requested: str, device: torch.device, args, dtype: torch.dtype, *, unsupported: str = "",
                   quantize: Quantization | None = None,
                   measure: Callable[..., Timings] | None = None) -> CompileChoice:
    """``requested`` (on, off) as it is, or for ``auto`` whether compiling pays for a model of ``args`` (ModelArgs)
    in ``dtype`` on ``device`` (see the module docstring), its linears quantized by ``quantize`` if given.
    ``unsupported``: what keeps this engine eager (--tp, adapters), said in the line. ``measure`` times the two
    modes (default ``time_decode``); it runs only when this machine's cache has no figure for this model's shape."""
    if requested != "auto":
        return CompileChoice(requested == "on", None)
    forced = os.environ.get("SCALENLP_COMPILE", "")
    if forced in ("on", "off"):
        return CompileChoice(forced == "on", None)
    if unsupported:
        return CompileChoice(False, f"the compiled decode step does not take {unsupported} yet (auto)")
    if device.type not in ("cpu", "cuda"):
        return CompileChoice(False, f"auto measures CPUs and CUDA GPUs, not {device.type}")
    shapes = LayerShapes.of(args)
    layers = max(MIN_LAYERS, streamed_copies(shapes))
    stack_bytes = 2 * layers * sum(i * o for i, o in shapes.products(fused=False)) * dtype.itemsize
    if stack_bytes * MEMORY_SHARE > device_memory(device):
        return CompileChoice(False, f"a stack of {layers} of this model's layers, eager and compiled, is too large "
                                    f"to time on this {device.type} (auto)")
    # The kernels the step would run are part of the record's name: another stack is another step to time.
    kernels = "" if quantize is None else f"{quantize.method}{quantize.group_size or ''}-"
    if device.type == "cpu" and quantize is not None and quantize.method in ("int4", "int8"):
        kernels += "avx2-" if lowbit_kernels_available() else ""  # scalenlp's kernels, not PyTorch's
    elif device.type == "cpu" and quantize is None:
        from scalenlp.engine.packing import native_lookup, panel_kernel

        if dtype == torch.float32 and panel_kernel():
            kernels += "panel-"  # scalenlp's float32 product, not oneDNN's
        elif native_lookup():
            kernels += "packed-cpp-"  # packed weights found in C++, not Python
    path = engine_cache_path("compile", device, f"{name_of(dtype)}-{kernels}{shapes.key()}")
    measure = measure or time_decode
    record, measured = cached_record(path, lambda: _record(measure(args, dtype, layers, device, quantize)), _valid)
    gain, ms = record["speedup"], record["ms"]
    figures = (f"{layers} of this model's layers, {' and '.join(map(str, ROWS))} rows: "
               f"{' and '.join(f'{c:.3g}' for c in ms['compiled'])} against "
               f"{' and '.join(f'{e:.3g}' for e in ms['eager'])} ms a step; compiling them took "
               f"{record['compile_s']:.0f} s; {'measured now, ' if measured else ''}cached in {path}")
    if gain >= MARGIN:
        return CompileChoice(True, f"the decode step measured {gain:.2f}x as fast compiled ({figures}) (auto)")
    return CompileChoice(False, f"the decode step measured {gain:.2f}x as fast compiled, under the {MARGIN}x that "
                                f"pays for compiling ({figures}) (auto)")


def _record(timings: Timings) -> dict:
    """The cache record: each mode's fastest round at each batch size, in milliseconds, how many times as fast the
    compiled steps ran (both batch sizes summed), and the compile time. The fastest, as the MFU peak's best matmul:
    a neighbour's work only ever slows a round, and the figure is cached for good: medians over rounds, measured
    by a server starting beside vLLM's (load 6, two threads), had SmolLM2's compiled batch-1 step at 2.9x eager's
    time, and cached "off" for this machine."""
    ms = {mode: [1e3 * min(r[i] for r in timings[mode]) for i in range(len(ROWS))] for mode in ("eager", "compiled")}
    return {"speedup": sum(ms["eager"]) / sum(ms["compiled"]), "ms": ms, "compile_s": timings["compile_s"],
            "step": STEP}


def _valid(record: dict) -> dict:
    """``record`` when it is one ``_record`` wrote; ValueError otherwise."""
    if (record.get("step") != STEP or not float(record["speedup"]) > 0 or not float(record["compile_s"]) >= 0
            or any(len(record["ms"][mode]) != len(ROWS) for mode in ("eager", "compiled"))):
        raise ValueError(f"not a compile measurement: {record}")
    return record


def time_decode(args, dtype: torch.dtype, layers: int, device: torch.device,
                quantize: Quantization | None = None) -> Timings:
    """Interleaved rounds of decode steps of a ``layers``-layer model of ``args``' widths (random weights, quantized
    by ``quantize`` if given; a small vocabulary: the output projection is the same product either way) at each of
    ROWS, eager and compiled."""
    from scalenlp.compress.quantized import build_quantized
    from scalenlp.engine.decoder_engine import compiled_step
    from scalenlp.engine.packing import pack_for_inference
    from scalenlp.models.decoder import Transformer

    local = tuple(i for i in args.local_layers if i < layers)
    small = dataclasses.replace(args, n_layers=layers, vocab_size=256, local_layers=local,
                                sliding_window=args.sliding_window if local else 0)
    block = 16
    blocks = max(ROWS) * -(-CONTEXT // block) + 1
    steps = {}
    for mode in ("eager", "compiled"):
        model = Transformer(small).to(device, dtype).eval()
        # Quantizing and packing say which kernels run on stderr: lines about this stack, not the served model.
        with contextlib.redirect_stderr(io.StringIO()):
            if quantize is not None:
                model = build_quantized(small, model.state_dict(), quantize, True, device, dtype)
            model.setup_kv_cache(blocks, block, dtype)
            pack_for_inference(model)  # as the engine does, compiled or not
        steps[mode] = compiled_step(model) if mode == "compiled" else model
    inputs = {rows: [t.to(device) for t in _step_inputs(rows, block)] for rows in ROWS}

    def run(mode: str, rows: int, times: int = 1) -> None:
        for _ in range(times):
            steps[mode](*inputs[rows])
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    timings: Timings = {"eager": [], "compiled": []}
    with torch.no_grad():
        start = time.perf_counter()
        for rows in ROWS:
            run("compiled", rows)
        timings["compile_s"] = time.perf_counter() - start
        for r in range(WARMUP + ROUNDS):
            for mode in ("eager", "compiled")[::1 if r % 2 else -1]:
                times = []
                for rows in ROWS:
                    start = time.perf_counter()
                    run(mode, rows, STEPS)
                    times.append((time.perf_counter() - start) / STEPS)
                if r >= WARMUP:
                    timings[mode].append(times)
    return timings


def _step_inputs(rows: int, block: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs for ``rows`` sequences at position CONTEXT - 1, each with blocks of its own (block 0
    is the null block, which the engine's padding writes to)."""
    width = -(-CONTEXT // block)
    table = 1 + torch.arange(rows * width).view(rows, width)
    positions = torch.full((rows, 1), CONTEXT - 1)
    slots = table[:, -1:] * block + (CONTEXT - 1) % block
    return torch.ones(rows, 1, dtype=torch.long), positions, table, slots, torch.zeros(rows, dtype=torch.long)
