"""The decoder engine's KV cache, measured through ``Engine`` on the packaged SmolLM2-135M (float32):

  python benchmarks/paged_cache.py [decode|prefix|capacity ...]

  decode    decode tokens/s at batch 1 and 16 (8-token prompts, 64 tokens each): tokens emitted after every
            request has its first token, over the time from then to the last one (KV memory: batch x 2,048)
  prefix    16 requests at once (KV memory 16 x 2,048) sharing a 300-token prompt prefix (each with its own 10-token tail), 64 tokens
            each through ``Engine.generate``: median and max time to first token, and the total time
  capacity  sequences running at once within the KV memory of 8 sequences of 2,048 positions, for 200 requests of
            the prefix workload submitted together (the peak of ``Engine.num_running`` over the first steps)

The same script runs against an older tree (PYTHONPATH=old/src) to compare: an engine without the paged cache
takes no ``kv_cache_tokens``, and holds ``max_batch`` full-length rows.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import threading
import time

import torch

from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, read
from scalenlp.models.packaged import packaged_model

MAX_SEQ_LEN = 2048
OLD_SLOTS = 8  # the static cache's default rows


def engine_on(pre, max_batch: int, rows: int) -> Engine:
    """An engine with the KV memory of ``rows`` sequences of MAX_SEQ_LEN, and room for ``max_batch`` running: a
    paged one holds that many positions, an old one that many static rows (and so runs at most ``rows``)."""
    model = instantiate(pre, device=torch.device("cpu"), dtype=torch.float32)
    if "kv_cache_tokens" in inspect.signature(Engine).parameters:
        return Engine(model, pre.tokenizer, max_batch=max_batch, kv_cache_tokens=rows * MAX_SEQ_LEN,
                      max_seq_len=MAX_SEQ_LEN, max_queue=1024).start()
    return Engine(model, pre.tokenizer, max_batch=rows, max_seq_len=MAX_SEQ_LEN, max_queue=1024).start()


def timed(engine: Engine, prompts: list[list[int]], params: SamplingParams,
          tokens: list[list[int]] | None = None) -> list[tuple[float, list[float]]]:
    """Submit every prompt at once; per request its submit time and the time of each token (and its token ids
    appended to ``tokens[i]``, when given)."""
    times = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def collector(i):
        def on_event(d):
            times[i].extend([d.time] * len(d.token_ids))
            if tokens is not None:
                tokens[i].extend(d.token_ids)
            if d.finish_reason:
                done[i].set()
        return on_event

    start = time.perf_counter()
    engine.submit_many([(p, params) for p in prompts], [collector(i) for i in range(len(prompts))],
                       bypass_queue_limit=True)
    for event in done:
        event.wait()
    return [(start, t) for t in times]


def decode(pre) -> None:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for batch in (1, 16):
        engine = engine_on(pre, batch, batch)
        prompts = [pre.tokenizer.encode(f"Story number {i} begins with").ids for i in range(batch)]
        timed(engine, prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
        runs = timed(engine, prompts, params)
        engine.stop()
        since = max(t[0] for _, t in runs)
        later = [x for _, t in runs for x in t if x > since]
        print(f"decode batch {batch:2d}: {len(later) / (max(later) - since):6.1f} tokens/s", flush=True)


def prefix_prompts(pre, n: int) -> list[list[int]]:
    text = open(__file__.replace("paged_cache.py", "serve.py")).read()  # any fixed text of a few thousand tokens
    shared = pre.tokenizer.encode(text).ids[:300]
    return [shared + pre.tokenizer.encode(f" Question {i}: what does this code do, in short?").ids[:10]
            for i in range(n)]


def prefix(pre) -> None:
    engine = engine_on(pre, 16, 16)
    prompts = prefix_prompts(pre, 16)
    runs = timed(engine, prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    engine.stop()
    ttft = [t[0] - start for start, t in runs]
    total = max(t[-1] for _, t in runs) - runs[0][0]
    print(f"shared 300-token prefix, 16 requests: TTFT median {statistics.median(ttft):.2f} s, max {max(ttft):.2f} s; "
          f"all done in {total:.1f} s ({16 * 64 / total:.1f} tokens/s)", flush=True)


def capacity(pre) -> None:
    engine = engine_on(pre, 256, OLD_SLOTS)
    prompts = prefix_prompts(pre, 200)
    peak = 0
    engine.submit_many([(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)) for p in prompts],
                       [lambda d: None] * len(prompts), bypass_queue_limit=True)
    steps = engine.steps
    while engine.steps < steps + 40:
        peak = max(peak, engine.num_running)
        time.sleep(0.01)
    engine.stop()
    print(f"sequences running at once in {OLD_SLOTS} x {MAX_SEQ_LEN} positions of KV memory: {peak}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    pre = read(packaged_model("smollm2"))
    for name in sys.argv[1:] or ("decode", "prefix", "capacity"):
        {"decode": decode, "prefix": prefix, "capacity": capacity}[name](pre)
