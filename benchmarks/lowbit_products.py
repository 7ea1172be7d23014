"""scalenlp's int4 and int8 CPU kernels (compress/lowbit_linear.cpp) against PyTorch's, on the products of one
SmolLM2-135M decode step as the step reads its weights:

  python benchmarks/lowbit_products.py [--threads 1,2] [--rows 1,4,16,64] [--rounds 5]

The 30 blocks' fused q/k/v, output, fused gate/up and down projections in int4 (group 32, as the packaged GGUF
file's blocks), each block its own weights (so each is streamed from memory, not reused from the cache), then the
576 -> 49,152 output projection in int8, as int4 keeps it. Timed on scalenlp's kernels and on PyTorch's
(``_weight_int4pack_mm_for_cpu``; for the output projection ``_weight_int8pack_mm`` and the 4-bit halves the engine
runs it as there, engine/packing.py). Best of --rounds interleaved rounds, ms a step.

Data: none.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from packed_products import BLOCK_SHAPES, HEAD, LAYERS


def quantized_layer(out_features: int, in_features: int, method: str, native: bool) -> nn.Module:
    from scalenlp.compress import quantized
    from scalenlp.compress.quantized import Quantization, empty_linear, quantize_weight

    quantized.lowbit_kernels_available.built = native  # the kernels' choice, made once per process (built by main)
    spec = Quantization(method, 32 if method == "int4" else None)
    linear = nn.Linear(in_features, out_features, bias=False)
    module = empty_linear(spec, linear)
    module.load_state_dict(quantize_weight(spec, linear.weight.detach()), assign=True)
    module.prepare()
    return module


def step(native: bool) -> tuple[list[nn.Module], nn.Module]:
    blocks = [quantized_layer(o, i, "int4", native) for _ in range(LAYERS) for o, i in BLOCK_SHAPES]
    return blocks, quantized_layer(*HEAD, "int8", native)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rows", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from scalenlp.compress.quantized import lowbit_kernels_available
    from scalenlp.engine.packing import PackedInt8Linear

    torch.manual_seed(0)
    if not lowbit_kernels_available():
        raise SystemExit("scalenlp's low-bit kernels did not build here (they need an x86 CPU with AVX2)")
    ours, theirs = step(True), step(False)
    variants = {"scalenlp": ours, "pytorch": theirs, "pytorch, halves": (theirs[0], PackedInt8Linear(theirs[1]))}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            x = {width: torch.randn(rows, width) for width in {i for _, i in BLOCK_SHAPES}}
            best = {name: {"blocks": float("inf"), "output": float("inf")} for name in variants}
            with torch.no_grad():
                for _ in range(args.rounds):
                    for name, (blocks, head) in variants.items():
                        start = time.perf_counter()
                        for layer in blocks:
                            layer(x[layer.in_features])
                        middle = time.perf_counter()
                        head(x[HEAD[1]])
                        end = time.perf_counter()
                        best[name]["blocks"] = min(best[name]["blocks"], 1e3 * (middle - start))
                        best[name]["output"] = min(best[name]["output"], 1e3 * (end - middle))
            mine = best["scalenlp"]
            print(f"{threads} thread(s), {rows} row(s): scalenlp int4 blocks {mine['blocks']:.1f} ms, int8 output "
                  f"{mine['output']:.2f} ms; " + "; ".join(
                      f"{name} {b['blocks']:.1f} ms ({mine['blocks'] / b['blocks']:.2f}x), {b['output']:.2f} ms "
                      f"({mine['output'] / b['output']:.2f}x)" for name, b in best.items() if name != "scalenlp"),
                  flush=True)


if __name__ == "__main__":
    main()
