"""What torch.compile buys the decode step: the packaged SmolLM2-135M through ``Engine`` (paged KV cache, the paged
attention kernel), eager and compiled engines side by side in one process, interleaved rounds:

  python benchmarks/compile_decode.py [--dtype float32|auto] [--rounds 3] [--batches 1,16] [--contexts 8,1000]

(--rounds 0: the compile time alone.)

For each batch size and context length, a round runs ``batch`` requests at once, each a prompt of that many tokens
(a shared prefix and a short tail of its own, so that after the first round the prefix cache computes only the
tails) then 32 greedy tokens, on one engine then the other (the order alternating); the figure is decode tokens/s:
tokens emitted after every request has its first token, over the time from then to the last one. The compiled
engine compiles its decode step when it is built: the script prints how long that took, the time of each engine's
first run at each shape, and how many graphs Dynamo compiled in all (a batch size or a block-table width that cost
a recompile shows there).

The compiled step's artifacts are cached between starts (engine/compile_cache.py: a file in
``$XDG_CACHE_HOME/scalenlp``, and Inductor's own folder, ``TORCHINDUCTOR_CACHE_DIR``): run once with both folders
fresh for the cold compile time, then again for the warm one (the start-up line says where the step came from).

Data: none (the prompt is the text of ``benchmarks/serve.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from paged_cache import timed
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.dtype import LayerShapes, choose_dtype
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, read
from scalenlp.models.packaged import packaged_model

OUTPUT_TOKENS = 32


def prompts_of(pre, batch: int, context: int) -> list[list[int]]:
    text = open(os.path.join(os.path.dirname(__file__), "serve.py")).read()
    shared = pre.tokenizer.encode(text * 4).ids[:max(0, context - 8)]
    return [(shared + pre.tokenizer.encode(f" Story {i} begins with a").ids)[-context:] for i in range(batch)]


def decode_rate(engine: Engine, prompts: list[list[int]]) -> float:
    runs = timed(engine, prompts, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True))
    since = max(t[0] for _, t in runs)
    later = [x for _, t in runs for x in t if x > since]
    return len(later) / (max(later) - since)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="8,1000")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pre = read(packaged_model("smollm2"))
    dtype = choose_dtype(torch.device("cpu"), args.dtype, LayerShapes.of(pre.args)).dtype
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    engines = {}
    for compiled in (False, True):
        model = instantiate(pre, device=torch.device("cpu"), dtype=dtype)
        engines[compiled] = Engine(model, pre.tokenizer, max_batch=max(batches), max_seq_len=2048, max_queue=1024,
                                   kv_cache_tokens=max(batches) * 2048, compile=compiled).start()
    print(f"SmolLM2-135M, {str(dtype).removeprefix('torch.')}, 1 thread, inductor cache "
          f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}", flush=True)
    print(f"compiled engine built (its decode step compiled at start-up) in {engines[True].compile_seconds:.1f} s: "
          f"{engines[True].compile_line}; load {os.getloadavg()[0]:.1f}", flush=True)
    # First use of each shape: a compiled engine that compiled again here would show new graphs.
    for batch in batches:
        for context in contexts:
            prompts = prompts_of(pre, batch, context)
            for compiled in (False, True):
                before, start = graphs(), time.perf_counter()
                timed(engines[compiled], prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                print(f"first run, batch {batch}, context {context}, {'compiled' if compiled else 'eager'}: "
                      f"{time.perf_counter() - start:.1f} s, {graphs() - before} new graphs", flush=True)
    rates = {key: [] for key in ((b, c, compiled) for b in batches for c in contexts for compiled in (False, True))}
    for r in range(args.rounds):
        for batch in batches:
            for context in contexts:
                prompts = prompts_of(pre, batch, context)
                for compiled in (False, True)[::1 if r % 2 else -1]:
                    rates[batch, context, compiled].append(decode_rate(engines[compiled], prompts))
    for batch in batches if args.rounds else ():  # --rounds 0: the compile time alone (a warm Inductor cache's)
        for context in contexts:
            eager, comp = rates[batch, context, False], rates[batch, context, True]
            ratios = [c / e for c, e in zip(comp, eager)]
            print(f"batch {batch:2d}, context {context:4d}: eager {statistics.median(eager):6.1f} tokens/s, compiled "
                  f"{statistics.median(comp):6.1f}; compiled/eager per round {' '.join(f'{x:.2f}' for x in ratios)}, "
                  f"median {statistics.median(ratios):.2f}", flush=True)
    print(f"graphs compiled in all: {graphs()}; load {os.getloadavg()[0]:.1f}", flush=True)
    for engine in engines.values():
        engine.stop()


if __name__ == "__main__":
    main()
