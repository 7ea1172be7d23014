"""The serving planner against the engine on this machine: predicted vs measured TTFT, TPOT and throughput.

    python benchmarks/serve_plan_vs_measured.py [--threads 1] [--prompt 64] [--new-tokens 32] [--reps 3]

This machine is measured as ``scalenlp plan --serve --device cpu`` measures it (matmul rate and half dimension
in the serving precision over inference's shapes, memory read bandwidth, a decode step's host time, fused
attention's rate: scalenlp.plan.measure), again before each round,
and in each round for each model (a
random small-llama with SmolLM2's 49k vocabulary, and SmolLM2-135M itself) and batch 1, 4 and 16 the engine
serves that many requests of ``--prompt`` random tokens, ``--new-tokens`` each, greedy, submitted together:
  TTFT  submit -> first token (the batch's prompts prefill together), mean over requests;
  TPOT  (last token - first token) / (new tokens - 1), mean over requests;
  throughput  output tokens / (last token of the batch - submit).
The planner predicts them from scalenlp.plan.serving: prefill_time for the batch's prompts, decode_time at the
batch's mean cached length, and throughput = batch · new / (TTFT + (new - 1) · TPOT). Repetitions are
interleaved across batch sizes; the median is reported, with the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import threading
import time

import torch


def serve_once(engine, batch: int, prompt: int, new: int, vocab: int) -> tuple[float, float, float]:
    from scalenlp.infer.sampling import SamplingParams

    first, last, done = [None] * batch, [None] * batch, [threading.Event() for _ in range(batch)]

    def on_event(i, d):
        first[i] = first[i] or d.time
        last[i] = d.time
        if d.finish_reason:
            done[i].set()

    prompts = [torch.randint(0, vocab, (prompt,)).tolist() for _ in range(batch)]
    start = time.perf_counter()
    engine.submit_many([(p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)) for p in prompts],
                       [lambda d, i=i: on_event(i, d) for i in range(batch)])
    for event in done:
        event.wait()
    ttft = statistics.mean(f - start for f in first)
    tpot = statistics.mean((b - a) / (new - 1) for a, b in zip(first, last))
    return ttft, tpot, batch * new / (max(last) - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", default="1,4,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from scalenlp.infer.engine import Engine, pick_dtype
    from scalenlp.models.flavors import build_model, model_args
    from scalenlp.models.loader import load
    from scalenlp.models.packaged import packaged_model
    from scalenlp.plan.cost import shape_of
    from scalenlp.plan.measure import compute_figures, measure_cpu, serving_figures
    from scalenlp.plan.serving import decode_time, prefill_time

    base = measure_cpu(processes=1)
    dtype = pick_dtype(torch.device("cpu"))
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    smol, pretrained = load(packaged_model("smollm2"), dtype=dtype)
    small = build_model(model_args("small-llama", vocab_size=smol.args.vocab_size)).to(dtype).eval()
    batches = [int(b) for b in args.batches.split(",")]
    context = args.prompt + args.new_tokens + 1
    models = {name: (shape_of(name, model.args), Engine(model, pretrained.tokenizer, max_batch=max(batches),
                                                         max_queue=1024, max_seq_len=context).start())
              for name, model in (("small-llama", small), ("smollm2-135m", smol))}
    measured = {(name, b): [] for name in models for b in batches}
    predicted = {key: [] for key in measured}
    try:
        for shape, engine in models.values():
            serve_once(engine, 1, args.prompt, 4, shape.vocab)  # warm-up
        for rep in range(args.reps):
            # The machine is measured again before each round, so that each prediction uses figures taken beside
            # the runs it predicts (on a shared machine the rates drift by 2x over minutes).
            device = dataclasses.replace(base, **{**compute_figures(), **serving_figures(dtype)})
            print(f"round {rep + 1}: matmul peak {device.peak_flops_bf16 / 1e9:.1f} GFLOP/s bf16 (half dim "
                  f"{device.gemm_half_dim:.0f}), reads {device.read_bw / 1e9:.1f} GB/s, decode host time "
                  f"{device.decode_layer_overhead_s * 1e3:.2f} ms per layer + {device.decode_step_overhead_s * 1e3:.2f}"
                  f" ms, attention {device.attention_flops / 1e9:.1f} GFLOP/s")
            for name, (shape, engine) in models.items():
                for b in batches:
                    measured[name, b].append(serve_once(engine, b, args.prompt, args.new_tokens, shape.vocab))
                    ttft = prefill_time(shape, device, b, args.prompt, 1, precision)
                    tpot = decode_time(shape, device, b, args.prompt + args.new_tokens / 2, 1, precision, precision)
                    predicted[name, b].append((ttft, tpot, b * args.new_tokens / (ttft + (args.new_tokens - 1) * tpot)))
    finally:
        for _, engine in models.values():
            engine.stop()
    print(f"dtype {precision}, prompt {args.prompt}, {args.new_tokens} new tokens, {args.reps} rounds (medians)")
    print(f"{'model':12s} {'batch':>5s}  {'TTFT ms':>17s}  {'TPOT ms':>17s}  {'tokens/s':>17s}   (measured / predicted)")
    worst = 0.0
    for (name, b), runs in measured.items():
        cells = []
        for i in range(3):
            m = statistics.median(r[i] for r in runs)
            p = statistics.median(r[i] for r in predicted[name, b])
            scale = 1 if i == 2 else 1e3
            cells.append(f"{m * scale:7.1f} / {p * scale:7.1f}")
            worst = max(worst, abs(p / m - 1))
        print(f"{name:12s} {b:5d}  " + "  ".join(cells))
    print(f"largest error {worst:.0%}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
