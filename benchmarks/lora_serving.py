"""Serving throughput of many LoRA adapters in one continuous batch against the base model alone.

  python benchmarks/lora_serving.py [--rounds 2] [--requests 16] [--max-tokens 32] [--rank 16] [--device cpu]

SmolLM2-135M-Instruct (the `models` extra's GGUF) with 4 random rank-16 adapters on every block linear (q/k/v/o,
gate/up/down), written to adapter folders and served with `--lora` as `scalenlp serve` does
(engine_from_checkpoint). Three engines on the same weights, each given the same 16 concurrent requests (one
prompt of the corpus each, max_tokens generated, end of text ignored):
  base    the engine without adapter slots: the base model's own speed;
  lora    the engine with the 4 adapters, the 16 requests spread over them (4 each), all in one batch;
  mixed   the same engine, half the requests on the base model and half on the adapters.
Output tokens per second of each, in interleaved rounds (base, lora, mixed, base, ...); the figure is lora / base
within each round, the median over rounds (the goal: at least 0.8), since on a shared machine the load moves more
between rounds than within one. The same ratio is given per second of this process's CPU time (the engine's
thread and the clients'): where other work shares the cores, the wall time counts the time it waited for them, the
CPU time what it computed. Decode steps on a CPU run the kernel of models/lora_decode.cpp; SCALENLP_LORA_KERNEL=0
measures the products in PyTorch instead (engine/lora.py). Data: none (the prompts are made up here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Story {i}: a lighthouse keeper finds a message in a bottle."


def write_adapters(checkpoint: str, folder: Path, n: int, rank: int) -> list[str]:
    """``n`` random rank-``rank`` adapters on every block linear, as --lora NAME=PATH flags."""
    import torch

    from scalenlp.loader import load
    from scalenlp.models.adapter_io import write_adapter
    from scalenlp.models.adapters import LoraSpec, adapter_weights, add_adapters, match_targets

    model, _ = load(checkpoint, dtype=torch.float32)
    spec = LoraSpec(rank=rank, alpha=2 * rank)
    add_adapters(model, spec, match_targets(model, "all-linear"))
    flags = []
    for k in range(n):
        torch.manual_seed(k)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B" in name:  # a fresh B is zero; the product must cost what a trained one does
                    p.normal_(0, 0.01)
        write_adapter(folder / f"a{k}", spec, adapter_weights(model), None)
        flags.append(f"a{k}={folder / f'a{k}'}")
    return flags


def run_round(engine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> tuple[float, float]:
    """Output tokens per second, of wall time and of this process's CPU time, of all ``prompts`` submitted at
    once, prompt i with adapter ``adapters[i]``."""
    from scalenlp.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    done = threading.Semaphore(0)
    counts = [0] * len(prompts)

    def on_event(i):
        def event(d):
            counts[i] += len(d.token_ids)
            if d.finish_reason is not None:
                done.release()
        return event

    start, cpu = time.perf_counter(), time.process_time()
    for i, (p, a) in enumerate(zip(prompts, adapters)):  # one submit per request, as a server's clients do
        engine.submit(p, params, on_event(i), bypass_queue_limit=True, adapter=a)
    for _ in prompts:
        done.acquire()
    return sum(counts) / (time.perf_counter() - start), sum(counts) / (time.process_time() - cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    import torch

    from scalenlp.engine.config import EngineConfig
    from scalenlp.engine.llm import engine_from_checkpoint
    from scalenlp.models.packaged import packaged_model

    checkpoint = str(packaged_model("smollm2"))
    with tempfile.TemporaryDirectory() as tmp:
        flags = write_adapters(checkpoint, Path(tmp), args.adapters, args.rank)
        # A short context: SmolLM2's 8,192 positions would make each engine's KV cache 6 GiB at 16 slots.
        common = dict(max_batch=args.requests, device=args.device, dtype=args.dtype, max_seq_len=128)
        engines = {"base": engine_from_checkpoint(EngineConfig(checkpoint, **common))}
        engines["lora"] = engine_from_checkpoint(EngineConfig(checkpoint, lora=flags, **common))
        names = [f.partition("=")[0] for f in flags]
        prompts = [engines["base"].encode(PROMPT.format(i=i)) for i in range(args.requests)]
        plans = {"base": [None] * args.requests, "lora": [names[i % len(names)] for i in range(args.requests)],
                 "mixed": [None if i % 2 else names[i // 2 % len(names)] for i in range(args.requests)]}
        run_round(engines["base"], prompts[:2], plans["base"][:2], 4)  # warm-up of both engines
        run_round(engines["lora"], prompts[:2], plans["lora"][:2], 4)
        rates: dict[str, list[float]] = {k: [] for k in plans}
        cpu_rates: dict[str, list[float]] = {k: [] for k in plans}
        for r in range(args.rounds):
            for kind in plans:
                engine = engines["base" if kind == "base" else "lora"]
                wall, cpu = run_round(engine, prompts, plans[kind], args.max_tokens)
                rates[kind].append(wall)
                cpu_rates[kind].append(cpu)
                print(f"round {r}: {kind:5s} {wall:8.1f} tokens/s, {cpu:8.1f} per CPU second", file=sys.stderr,
                      flush=True)
        for engine in engines.values():
            engine.stop()
    device = engines["base"].device
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {k: statistics.median(x / b for x, b in zip(v, rates["base"])) for k, v in rates.items()}
    cpu_ratio = {k: statistics.median(x / b for x, b in zip(v, cpu_rates["base"])) for k, v in cpu_rates.items()}
    print(f"SmolLM2-135M on {device} ({torch.get_num_threads()} threads), {args.requests} concurrent requests x "
          f"{args.max_tokens} tokens, {args.adapters} random rank-{args.rank} adapters on every block linear; "
          f"median of {args.rounds} interleaved rounds (ratio: to the same round's base):")
    print(f"  base model alone (no adapter slots)          {median['base']:8.1f} tokens/s")
    print(f"  {args.adapters} adapters in one batch                   {median['lora']:8.1f} tokens/s  "
          f"{ratio['lora']:.2f}x base ({cpu_ratio['lora']:.2f}x per CPU second)")
    print(f"  half base, half adapters in one batch        {median['mixed']:8.1f} tokens/s  "
          f"{ratio['mixed']:.2f}x base ({cpu_ratio['mixed']:.2f}x per CPU second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
