"""`scalenlp plan`: does a model fit on these devices, with which layout, and how fast will it train?

Without --layout, searches every layout whose degrees divide the device count and prints the fastest
that fit, each with its memory breakdown and the `scalenlp train` line that runs it; with --layout,
predicts that one. The cost model and its calibration are described in scalenlp.plan.cost.
"""

from __future__ import annotations

import argparse
import json
import sys

from scalenlp.errors import UserError
from scalenlp.layout import RECOMPUTE, SCHEDULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="flavor name (debug, small, llama-8b, ...), or the model.* keys scalenlp train takes: "
                             "flavor=F,layers=L,... over a flavor, or hidden=H,layers=L,heads=A,vocab_size=V"
                             "[,kv_heads=K][,ffn=F][,family=llama|gpt2][,dropout=P] alone")
    parser.add_argument("--seq", type=int, default=None, help="tokens per training sequence (training plans)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (training plans)")
    parser.add_argument("--devices", type=int, required=True, help="number of accelerators (or CPU processes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="devices per node (default 8; with --device cpu, all processes share this machine)")
    parser.add_argument("--device", default="h100-sxm",
                        help="h100-sxm | a100-80gb | h200 | cpu (cpu measures this machine: matmul rate, "
                             "memory bandwidth, gloo all-reduce)")
    parser.add_argument("--device-spec", default="",
                        help="override device fields, e.g. memory_gb=40,nic_bw=12.5e9,gemm_efficiency=0.6")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="training precision (default bf16 on GPUs, fp32 on cpu)")
    parser.add_argument("--states", choices=("fp32", "mixed"), default="fp32",
                        help="how weights, gradients and Adam state are kept: fp32 (4+4+8 bytes per parameter, as "
                             "scalenlp train keeps them, bf16 only in matmuls) or mixed (2+2+12, Megatron/DeepSpeed)")
    parser.add_argument("--layout", default=None,
                        help="predict one layout: dp_shard=..,dp_replicate=..,tp=..,pp=..,microbatch=..,"
                             f"zero=0-3|ddp|zero1-3,recompute={'|'.join(RECOMPUTE)}[,schedule={'|'.join(SCHEDULES)}]"
                             "[,v=..][,sp=true][,offload=true: shards and optimizer state in host memory]")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to list")
    serve = parser.add_argument_group("serving (--serve): tensor-parallel degree and replicas for inference")
    serve.add_argument("--serve", action="store_true", help="plan serving instead of training")
    serve.add_argument("--context", type=int, default=None, help="tokens per sequence: prompt + output")
    serve.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens (default: half the context)")
    serve.add_argument("--concurrency", type=int, default=None, help="sequences served at once, over all replicas")
    serve.add_argument("--rate", type=float, default=None, help="requests per second to carry")
    serve.add_argument("--ttft-ms", type=float, default=None, help="time-to-first-token target")
    serve.add_argument("--tpot-ms", type=float, default=None, help="time-per-output-token target")
    serve.add_argument("--quantize", choices=("int8", "int4"), default=None,
                       help="weight width (default: the precision's)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _si(x: float) -> str:
    """1.23G, 456M, 7.8k: a count or a rate at a readable scale."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f}"


def _describe(p, device, rank: int | None) -> list[str]:
    m = p.memory
    head = f"#{rank} " if rank is not None else ""
    return [
        f"{head}{p.layout.describe()}",
        f"    {p.tokens_per_sec:,.0f} tokens/s | step {p.step_time_s:.4g} s | {_si(p.tflops_per_device * 1e12)}FLOP/s "
        f"per device | MFU {p.mfu:.1%} | bubble {p.bubble_fraction:.1%}",
        f"    memory per device {_gib(p.memory_per_device_bytes)} of {_gib(device.memory_bytes)} GiB: params "
        f"{_gib(m['params'])}, grads {_gib(m['grads'])}, optimizer {_gib(m['optimizer'])}, activations "
        f"{_gib(m['activations'])}, buffers {_gib(m['buffers'])}, runtime {_gib(m['runtime'])}",
        *([f"    host memory per device {_gib(p.host_memory_per_device_bytes)} of {_gib(device.host_memory_bytes)} "
           "GiB (offloaded weights, gradients and optimizer state)"] if p.layout.offload else []),
        f"    {p.train_command}",
    ]


def _serving_device(device: str, device_spec: str, gpus_per_node: int | None, devices: int, precision: str | None,
                    shape):
    """(DeviceSpec, devices per node, precision) for serving ``shape`` (a ModelShape); on a CPU, this machine
    measured in the precision its engine serves that model in (engine/dtype.py: the faster one here)."""
    from scalenlp.hardware import get_device, parse_overrides

    overrides = parse_overrides(device_spec)
    if device != "cpu":
        return get_device(device, overrides), gpus_per_node or 8, precision or "bf16"
    import dataclasses

    import torch

    from scalenlp.engine.dtype import LayerShapes, choose_dtype
    from scalenlp.plan.measure import measure_cpu, serving_figures  # times this machine: only when asked for

    if precision is None:
        layer = LayerShapes(shape.hidden, shape.hidden, shape.kv_dim, shape.ffn, gated=shape.swiglu, layers=shape.layers)
        precision = "bf16" if choose_dtype(torch.device("cpu"), "auto", layer).dtype == torch.bfloat16 else "fp32"
    measured = measure_cpu(processes=1)
    spec = dataclasses.replace(measured, **serving_figures(torch.bfloat16 if precision == "bf16" else torch.float32))
    return dataclasses.replace(spec, **overrides), gpus_per_node or devices, precision


def run_serve(args: argparse.Namespace) -> int:
    """`scalenlp plan --serve`: the layouts that serve the model within the targets, fewest devices first."""
    from scalenlp.plan.cost import model_shape
    from scalenlp.plan.serving import plan_serving

    if args.context is None or args.context < 2:
        raise UserError("--serve needs --context N (prompt + output tokens per sequence, at least 2)")
    if args.concurrency is None and args.rate is None:
        raise UserError("--serve needs --concurrency K, or --rate R with --ttft-ms and/or --tpot-ms")
    if args.concurrency is not None and args.concurrency < 1 or args.rate is not None and args.rate <= 0:
        raise UserError("--concurrency must be at least 1 and --rate positive")
    prompt = args.prompt_tokens or args.context // 2
    if not 1 <= prompt < args.context:
        raise UserError(f"--prompt-tokens {prompt} must be at least 1 and below --context {args.context}")
    try:
        shape = model_shape(args.model, args.context)
    except UserError as e:
        raise UserError(str(e).replace("--seq", "--context")) from None
    device, per_node, precision = _serving_device(args.device, args.device_spec, args.gpus_per_node, args.devices,
                                                  args.precision, shape)
    layouts = plan_serving(shape, device, args.devices, per_node, args.context, prompt, concurrency=args.concurrency,
                           rate=args.rate, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, precision=precision,
                           quantize=args.quantize)[:args.top]
    if args.json:
        print(json.dumps(dict(model=args.model, parameters=shape.total_params, device=device.name,
                              devices=args.devices, context=args.context, prompt_tokens=prompt,
                              quantize=args.quantize or precision, layouts=[s.to_dict() for s in layouts]), indent=2))
        return 0 if layouts else 1
    print(f"serving {args.model} ({shape.total_params / 1e6:,.1f}M parameters, {args.quantize or precision}) on up to {args.devices} "
          f"x {device.name}, context {args.context} ({prompt} prompt): {len(layouts)} layouts")
    for rank, s in enumerate(layouts, 1):
        print(f"#{rank} tp={s.tp} replicas={s.replicas} ({s.devices} devices), batch {s.batch} per replica "
              f"(at most {s.max_batch})")
        print(f"    TTFT {s.ttft_s * 1e3:,.1f} ms | TPOT {s.tpot_s * 1e3:,.2f} ms | {s.tokens_per_sec:,.0f} output tokens/s")
        print(f"    per device: weights {_gib(s.weights_per_device)} GiB, KV cache {_gib(s.kv_per_sequence)} GiB per "
              f"sequence, {_gib(s.kv_per_device)} GiB for the batch")
    if not layouts:
        print("no layout meets the targets on these devices; loosen --ttft-ms/--tpot-ms, lower --rate, or add "
              "--devices", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from scalenlp.plan.planner import plan
    from scalenlp.plan.search import MAX_DEVICES

    if args.serve:
        return run_serve(args)
    if args.seq is None or args.global_batch is None:
        raise UserError("plan needs --seq and --global-batch (or --serve with --context to plan serving)")

    result = plan(args.model, args.seq, args.global_batch, args.devices, args.device, layout=args.layout,
                  gpus_per_node=args.gpus_per_node, device_spec=args.device_spec, precision=args.precision,
                  states=args.states, top=args.top)
    title = f"{args.model} ({result.header['parameters'] / 1e6:,.1f}M parameters) on {args.devices} x {result.device.name}"
    if args.layout:
        p = result.layouts[0]
        if args.json:
            print(json.dumps(result.layout_dict(), indent=2))
        else:
            print(title)
            print("\n".join(_describe(p, result.device, None)))
            if not p.fits:
                if p.memory_per_device_bytes > result.device.memory_bytes:
                    print(f"does not fit: {_gib(p.memory_per_device_bytes)} GiB per device, a {result.device.name} "
                          f"has {_gib(result.device.memory_bytes)} GiB")
                else:
                    print(f"does not fit: {_gib(p.host_memory_per_device_bytes)} GiB of host memory per device, a "
                          f"{result.device.name}'s host has {_gib(result.device.host_memory_bytes)} GiB")
                for change, q in result.would_fit:
                    print(f"  fits with {change}: {_gib(q.memory_per_device_bytes)} GiB, {q.tokens_per_sec:,.0f} "
                          f"tokens/s ({q.layout.describe()})")
                if not result.would_fit:
                    print("  no change of one or two degrees fits; run without --layout to search every layout")
        return 0 if p.fits else 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.layouts else 1
    h = result.header
    print(f"{title}, seq {h['seq']}, global batch {h['global_batch']}, {h['precision']}: "
          f"{result.feasible} layouts fit, {sum(result.rejected.values())} rejected")
    for reason, count in result.rejected.most_common():
        print(f"  rejected {count}: {reason}")
    for rank, p in enumerate(result.layouts, 1):
        print()
        print("\n".join(_describe(p, result.device, rank)))
    if not result.layouts:
        smallest = result.smallest_device_count
        if smallest:
            print(f"\nnothing fits on {args.devices} devices; the smallest device count that fits is {smallest} "
                  f"(scalenlp plan ... --devices {smallest})", file=sys.stderr)
        else:
            print(f"\nnothing fits on {args.devices} devices, nor on any count up to {MAX_DEVICES:,}", file=sys.stderr)
        return 1
    return 0
