"""Where a decode step's time goes outside the model: the packaged SmolLM2-135M through ``Engine`` in this process,
as `scalenlp serve` builds it (float32, the decode step compiled unless --compile off, torch's own thread count),
C requests of ~32-token prompts decoding --tokens greedy tokens each, --rounds times:

  python benchmarks/step_overhead.py [--concurrency 16] [--tokens 64] [--rounds 3] [--compile on|off] [--ops 15]
                                    [--quantize int4 --group-size 32]

(--quantize: the GGUF file's weights quantized as `scalenlp serve --quantize` does, int4 at group 32 taking its
Q4_1 codes as they are; compiled or not as --compile says, as for float32.)

Each step of the engine loop is timed, and inside it the parts: the model's forward (the compiled step or the eager
model), building its inputs (token, position, block-table and slot tensors), sampling, and emitting (detokenizing,
stop checks, the event callback). Only steps that decode and prefill nothing are counted (after every request has
its first token). Prints, per part, milliseconds per step (median over those steps) and its share of the step;
with --ops N, the last round runs under torch.profiler (in the engine's thread, where the steps run) and the N
operators with the most time of their own follow (Inductor's fused kernels are not recorded one by one: their time
is the compiled graph's own).

The callback here only counts tokens: a server's (a thread-safe hand-off to its event loop) and the HTTP stream
cost more, on another thread; benchmarks/serve_vs_peers.py measures those from outside.

Data: none (the prompts are cut from the text of ``benchmarks/serve.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from scalenlp.compress.quantized import quantization_of
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, read
from scalenlp.models.packaged import packaged_model

PARTS = ("forward", "inputs", "sample", "emit")


class Timer:
    """Seconds spent in each part during the current step, and the finished steps' records."""

    def __init__(self):
        self.current = dict.fromkeys(PARTS, 0.0)
        self.steps: list[dict] = []

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - start


def instrument(engine: Engine, timer: Timer, profiler: dict) -> None:
    """Wrap the engine's step and its parts (instance attributes shadow the class's methods). profiler["want"]:
    a torch.profiler starts at the next step, in the engine's thread, and stops once no request is left
    (profiler["done"] is set then)."""
    forward_of = {}

    def timed_model(model):
        def run(*args, **kwargs):
            with timer.part("forward"):
                return model(*args, **kwargs)
        return run

    run, sample, emit, step = engine._run, engine._sample, engine._emit, engine.step

    def timed_run(model, *args, **kwargs):
        # _run's own time less the forward inside it is input building.
        wrapped = forward_of.setdefault(id(model), timed_model(model))
        start, before = time.perf_counter(), timer.current["forward"]
        try:
            return run(wrapped, *args, **kwargs)
        finally:
            timer.current["inputs"] += time.perf_counter() - start - (timer.current["forward"] - before)

    def timed_sample(*args, **kwargs):
        with timer.part("sample"):
            return sample(*args, **kwargs)

    def timed_emit(*args, **kwargs):
        with timer.part("emit"):
            return emit(*args, **kwargs)

    def timed_step():
        if profiler["want"] and profiler.get("profile") is None:
            profiler["profile"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler["profile"].start()
        decoding = sum(r.computed == r.length - 1 for r in engine._running.values())
        prefilling = any(r.computed < r.length - 1 for r in engine._running.values()) or engine._waiting
        timer.current = dict.fromkeys(PARTS, 0.0)
        start = time.perf_counter()
        step()
        if decoding and not prefilling and profiler.get("profile") is None:  # the profiler's own cost left out
            timer.steps.append({**timer.current, "step": time.perf_counter() - start, "rows": decoding})
        if profiler.get("profile") is not None and not profiler["done"].is_set() and not (
                engine._running or engine._waiting):
            profiler["profile"].stop()
            profiler["done"].set()

    engine._run, engine._sample, engine._emit, engine.step = timed_run, timed_sample, timed_emit, timed_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", choices=("on", "off"), default="on")
    parser.add_argument("--ops", type=int, default=0, help="profile the last round: the N costliest operators")
    parser.add_argument("--quantize", choices=("int4", "int8"), help="quantized weights")
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args()
    if min(args.concurrency, args.tokens, args.rounds) < 1:
        parser.error("--concurrency, --tokens and --rounds must be 1 or more")
    pre = read(packaged_model("smollm2"))
    model = instantiate(pre, device=torch.device("cpu"), dtype=torch.float32,
                        quantize=quantization_of(args.quantize, args.group_size))
    built = time.perf_counter()
    engine = Engine(model, pre.tokenizer, max_batch=max(64, args.concurrency), max_seq_len=2048,
                    compile=args.compile == "on").start()
    print(f"SmolLM2-135M, {args.quantize or 'float32'}, {torch.get_num_threads()} threads, compile {args.compile} "
          f"(engine built in {time.perf_counter() - built:.0f} s)", flush=True)
    words = pre.tokenizer.encode(Path(__file__).with_name("serve.py").read_text()).ids
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    timer = Timer()
    engine.generate([words[:32]], SamplingParams(max_tokens=4, temperature=0))  # warm-up, not timed
    profiler = {"want": False, "done": threading.Event()}
    instrument(engine, timer, profiler)
    for rnd in range(args.rounds):
        profiler["want"] = bool(args.ops) and rnd == args.rounds - 1
        prompts = [words[(rnd * args.concurrency + i) * 40:][:32] for i in range(args.concurrency)]
        done, lock = threading.Event(), threading.Lock()
        left = [args.concurrency]

        def on_event(delta):
            if delta.finish_reason is not None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        start = time.perf_counter()
        engine.submit_many([(p, params) for p in prompts], [on_event] * len(prompts), bypass_queue_limit=True)
        done.wait()
        if profiler["want"]:
            profiler["done"].wait()
        print(f"round {rnd + 1}: {args.concurrency * args.tokens / (time.perf_counter() - start):.1f} output "
              f"tokens/s", flush=True)
    engine.stop()
    steps = [s for s in timer.steps if s["rows"] == args.concurrency]
    if not steps:
        raise SystemExit("error: no step decoded every request at once; raise --tokens")
    total = statistics.median(s["step"] for s in steps)
    print(f"{len(steps)} decode steps of {args.concurrency} rows: {1e3 * total:.1f} ms a step (median)")
    for name in (*PARTS, "other"):
        values = [s["step"] - sum(s[p] for p in PARTS) if name == "other" else s[name] for s in steps]
        ms = 1e3 * statistics.median(values)
        print(f"  {name:8s} {ms:7.2f} ms  {ms / 1e3 / total:6.1%}")
    if args.ops:
        print(profiler["profile"].key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
