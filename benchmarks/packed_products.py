"""What packing the float32 weights buys a decode step (engine/packing.py), two ways:

  python benchmarks/packed_products.py products [--threads 1,2] [--rows 1,4,16,64]
  python benchmarks/packed_products.py engine [--threads 2] [--compile] [--rounds 3]

``products``: the products of one SmolLM2-135M decode step as the step reads its weights: 30 blocks' fused q/k/v,
output, fused gate/up and down projections, each block its own weights (540 MB in all, so each is streamed from
memory, not reused from the cache), then the 576 -> 49,152 output projection; timed plain (``F.linear``), packed for
oneDNN for 1 row and for 32 rows, in scalenlp's panels (panel_linear.cpp, what the engine runs where it builds),
and, when this Python has vLLM's CPU build, through vLLM's own oneDNN product
(``create_onednn_mm`` with its 32-row hint), the way vLLM serves float32. Best of 4 interleaved rounds, ms a step.

``engine``: the packaged SmolLM2 through ``Engine`` with ``pack_weights`` off (plain products), with the output
projection alone packed (the engine before every linear was), and on (every linear); decode tokens/s as
compile_decode.py measures them, rounds interleaved, ratios to the first.

Data: none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS = 30
BLOCK_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): q/k/v, output, gate/up, down
HEAD = (49152, 576)


def product_variants(weights: list[torch.Tensor]) -> dict[str, list]:
    from scalenlp.models.onednn import pack, packed_linear

    def packed(rows):
        return [(lambda p: lambda x: packed_linear(x, p, None))(pack(w, rows)) for w in weights]

    variants = {"plain": [(lambda w: lambda x: F.linear(x, w))(w) for w in weights],
                "packed for 1 row": packed(1), "packed for 32 rows": packed(32)}
    from scalenlp.engine.packing import PanelLinear, panel_kernel

    if panel_kernel():
        variants["panels"] = []
        for w in weights:
            linear = torch.nn.utils.skip_init(torch.nn.Linear, w.shape[1], w.shape[0], bias=False)
            linear.weight.data = w
            variants["panels"].append(PanelLinear(linear))
    try:
        import vllm._custom_ops as ops  # only in vLLM's own venv
    except ImportError:
        return variants
    handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    variants["vLLM onednn_mm"] = [(lambda h: lambda x: ops.onednn_mm(h, x, None))(h) for h in handles]
    return variants


def products(args) -> None:
    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in BLOCK_SHAPES] + [torch.randn(*HEAD)]
    variants = product_variants(weights)
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {}
        for rnd in range(5):
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
                for name, fns in variants.items():
                    start = time.perf_counter()
                    for w, f in zip(weights, fns):
                        f(inputs[w.shape[1]])
                    if rnd:  # the first round warms up
                        times.setdefault((rows, name), []).append(time.perf_counter() - start)
        for rows in args.rows:
            plain = min(times[rows, "plain"])
            print(f"{threads} thread(s), {rows:3d} rows: " + "; ".join(
                f"{name} {min(times[rows, name]) * 1e3:.1f} ms ({min(times[rows, name]) / plain:.2f}x)"
                for name in variants), flush=True)


def engine(args) -> None:
    from compile_decode import decode_rate, prompts_of
    from scalenlp.engine.decoder_engine import Engine
    from scalenlp.engine.packing import PackedLinear
    from scalenlp.loader import instantiate, read
    from scalenlp.models.packaged import packaged_model

    torch.set_num_threads(args.threads[0])
    pre = read(packaged_model("smollm2"))

    def build(kind):
        model = instantiate(pre, device=torch.device("cpu"), dtype=torch.float32)
        if kind == "output packed":
            model.output = PackedLinear(model.output)
        return Engine(model, pre.tokenizer, max_batch=16, max_seq_len=2048, max_queue=1024,
                      kv_cache_tokens=16 * 2048, pack_weights=kind == "all packed", compile=args.compile).start()

    kinds = ("plain", "output packed", "all packed")
    engines = {kind: build(kind) for kind in kinds}
    print(f"{'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} thread(s), load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for batch, context in ((1, 8), (16, 8), (16, 1000), (1, 1000)):
        prompts, rates = prompts_of(pre, batch, context), {kind: [] for kind in kinds}
        for kind in kinds:
            decode_rate(engines[kind], prompts)  # warm: the shared prefix cached, the shapes seen
        for rnd in range(args.rounds):
            for kind in kinds if rnd % 2 else kinds[::-1]:
                rates[kind].append(decode_rate(engines[kind], prompts))
        print(f"batch {batch}, {context}-token context, decode tokens/s (ratio to plain, median of rounds): " + "; ".join(
            f"{kind} {statistics.median(rates[kind]):.1f} "
            f"({statistics.median(x / y for x, y in zip(rates[kind], rates['plain'])):.2f}x)" for kind in kinds)
            + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    for e in engines.values():
        e.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("products", "engine"))
    parser.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rows", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--compile", action="store_true", help="engine: the compiled decode step")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with torch.no_grad():
        (products if args.what == "products" else engine)(args)


if __name__ == "__main__":
    main()
