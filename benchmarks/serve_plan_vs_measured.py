"""The serving planner against the engine on this machine: predicted vs measured TTFT, TPOT and throughput.

    python benchmarks/serve_plan_vs_measured.py [--threads 1] [--prompt 64] [--new-tokens 32] [--reps 5]

This machine is measured as ``scalenlp plan --serve --device cpu`` measures it (matmul rate and half dimension
in the serving precision over inference's shapes through the engine's linear layers with their weights in memory,
the rate a decode step streams weights at, the engine's host time per step, layer and sequence, a prefill's
elementwise traffic, the sampler's per logit, fused attention's rate and attention's over a KV cache:
scalenlp.plan.measure), again after each model's runs in each round; in each round for each model (a
random small-llama with SmolLM2's 49k vocabulary, and SmolLM2-135M itself) and batch 1, 4 and 16 the engine
serves that many requests of ``--prompt`` random tokens, ``--new-tokens`` each, greedy, submitted together:
  TTFT  submit -> first token (the batch's prompts prefill together), mean over requests;
  TPOT  (last token - first token) / (new tokens - 1), mean over requests;
  throughput  output tokens / (last token of the batch - submit).
The planner predicts them from scalenlp.plan.serving: prefill_time for the batch's prompts, decode_time at the
batch's mean cached length, and throughput = batch · new / (TTFT + (new - 1) · TPOT). Repetitions are
interleaved across batch sizes; each round's prediction, the mean of those from the figures taken just before and
just after its runs, is compared with that round's measurement, and the median of those errors is reported with
their range and the machine's load. Five rounds by default: on the shared development machine one round's error in
a cell ranged over -33%..+46% while the median of five stayed within 25% (about 5 minutes).
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
    from scalenlp.engine.sampling import SamplingParams

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


def calibrate(base, dtype: torch.dtype, precision: str, when: str):
    """This machine as ``plan --serve --device cpu`` measures it, now."""
    from scalenlp.plan.measure import compute_figures, serving_figures

    device = dataclasses.replace(base, **{**compute_figures(), **serving_figures(dtype)})
    print(f"{when}: load {os.getloadavg()[0]:.1f}, matmul peak {device.peak_flops(precision) / 1e9:.0f} GFLOP/s "
          f"{precision} (half dim {device.gemm_half_dim:.0f}), reads {device.read_bw / 1e9:.1f} GB/s, engine host time "
          f"{device.decode_layer_overhead_s * 1e3:.2f} ms per layer + {device.decode_step_overhead_s * 1e3:.2f} ms per "
          f"step, per sequence {device.decode_layer_sequence_overhead_s * 1e6:.0f} us per layer + "
          f"{device.decode_sequence_overhead_s * 1e6:.0f} us, sampler {device.sample_s_per_logit * 1e9:.1f} ns per "
          f"logit, attention {device.attention_flops / 1e9:.1f} GFLOP/s (prefill) "
          f"{device.decode_attention_flops / 1e9:.1f} (over the cache), prefill's elementwise traffic "
          f"{device.elementwise_traffic:.1f} at {device.hbm_bw / 1e9:.1f} GB/s")
    return device


def predict(shape, device, batch: int, prompt: int, new: int, precision: str) -> tuple[float, float, float]:
    """(TTFT, TPOT, output tokens/s) that scalenlp.plan.serving predicts for one run of serve_once."""
    from scalenlp.plan.serving import decode_time, prefill_time

    ttft = prefill_time(shape, device, batch, prompt, 1, precision)
    tpot = decode_time(shape, device, batch, prompt + new / 2, 1, precision, precision)
    return ttft, tpot, batch * new / (ttft + (new - 1) * tpot)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", default="1,4,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from scalenlp.engine.decoder_engine import Engine
    from scalenlp.engine.dtype import LayerShapes, choose_dtype
    from scalenlp.loader import instantiate, read
    from scalenlp.models.flavors import build_model, model_args
    from scalenlp.models.packaged import packaged_model
    from scalenlp.plan.cost import shape_of
    from scalenlp.plan.measure import measure_cpu

    base = measure_cpu(processes=1)
    pretrained = read(packaged_model("smollm2"))
    choice = choose_dtype(torch.device("cpu"), "auto", LayerShapes.of(pretrained.args))  # as the server would serve it
    print(choice.line(), flush=True)
    dtype = choice.dtype
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    smol = instantiate(pretrained, dtype=dtype)
    small = build_model(model_args("small-llama", vocab_size=smol.args.vocab_size)).to(dtype).eval()
    batches = [int(b) for b in args.batches.split(",")]
    context = args.prompt + args.new_tokens + 1
    models = {name: (shape_of(name, model.args), Engine(model, pretrained.tokenizer, max_batch=max(batches),
                                                         max_queue=1024, max_seq_len=context).start())
              for name, model in (("small-llama", small), ("smollm2-135m", smol))}
    measured = {(name, b): [] for name in models for b in batches}
    predicted = {key: [] for key in measured}
    try:
        # The machine is measured before and after each model's runs in each round (the one after is the next
        # runs' before), and each run is predicted with both figures, averaged: on a shared machine a process's share
        # of the cores, and every rate with it, swings by 2-3x within minutes, so figures taken once beside a run
        # can miss the conditions it ran in.
        before = calibrate(base, dtype, precision, "start")
        for rep in range(args.reps):
            for name, (shape, engine) in models.items():
                # A short request first: the calibration before it evicts the model from the caches and has the
                # allocator hand memory back, which the first request after it would pay (one run here saw its TTFT
                # triple).
                serve_once(engine, 1, args.prompt, 4, shape.vocab)
                runs = [serve_once(engine, b, args.prompt, args.new_tokens, shape.vocab) for b in batches]
                after = calibrate(base, dtype, precision, f"after round {rep + 1}, {name}")
                for b, run in zip(batches, runs):
                    measured[name, b].append(run)
                    pair = [predict(shape, d, b, args.prompt, args.new_tokens, precision) for d in (before, after)]
                    predicted[name, b].append(tuple(statistics.mean(p) for p in zip(*pair)))
                before = after
    finally:
        for _, engine in models.values():
            engine.stop()
    print(f"dtype {precision}, prompt {args.prompt}, {args.new_tokens} new tokens, {args.reps} rounds: medians, and "
          "the median of each round's predicted/measured - 1 with its range over the rounds")
    print(f"{'model':12s} {'batch':>5s}  {'TTFT ms (measured / predicted)':>42s}  {'TPOT ms':>42s}  {'tokens/s':>42s}")
    worst = 0.0
    for (name, b), runs in measured.items():
        cells = []
        for i in range(3):
            m = statistics.median(r[i] for r in runs)
            p = statistics.median(r[i] for r in predicted[name, b])
            errors = [q[i] / r[i] - 1 for q, r in zip(predicted[name, b], runs)]
            error = statistics.median(errors)
            scale = 1 if i == 2 else 1e3
            cells.append(f"{m * scale:7.1f} / {p * scale:7.1f} {error:+5.0%} [{min(errors):+5.0%}, {max(errors):+5.0%}]")
            worst = max(worst, abs(error))
        print(f"{name:12s} {b:5d}  " + "  ".join(cells))
    print(f"largest median error {worst:.0%}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
