"""`scalenlp plan`: does a model fit on these devices, with which layout, and how fast will it train?

Without --layout, searches every layout whose degrees divide the device count and prints the fastest
that fit, each with its memory breakdown and the `scalenlp train` line that runs it; with --layout,
predicts that one. The cost model and its calibration are described in scalenlp.plan.cost.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from scalenlp.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="flavor name (debug, small, llama-8b, ...) or hidden=H,layers=L,heads=A,kv_heads=K,"
                             "ffn=F,vocab=V[,family=llama|gpt2][,dropout=P]")
    parser.add_argument("--seq", type=int, required=True, help="tokens per training sequence")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
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
                             "zero=0-3|ddp|zero1-3,recompute=none|selective|full[,schedule=gpipe|1f1b|"
                             "interleaved_1f1b][,v=..][,sp=true]")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to list")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


_ZERO_WORDS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def parse_layout(text: str, devices: int, global_batch: int):
    """``key=value,...`` -> Layout; unnamed data-parallel degrees take what the others leave."""
    from scalenlp.plan.cost import Layout

    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--layout {item!r}: expected key=value")
        values[key.strip()] = value.strip()
    known = {"dp_shard", "dp_replicate", "tp", "pp", "microbatch", "zero", "recompute", "schedule", "v", "sp"}
    unknown = set(values) - known
    if unknown:
        raise UserError(f"--layout: unknown key(s) {', '.join(sorted(unknown))}; keys are {', '.join(sorted(known))}")

    def integer(key: str, default: int | None) -> int | None:
        if key not in values:
            return default
        try:
            return int(values[key])
        except ValueError:
            raise UserError(f"--layout {key}={values[key]!r}: expected an integer") from None

    zero_text = values.get("zero", "0").lower()
    zero = _ZERO_WORDS.get(zero_text)
    if zero is None:
        zero = integer("zero", 0)
    tp, pp = integer("tp", 1), integer("pp", 1)
    replicate, shard = integer("dp_replicate", None), integer("dp_shard", None)
    if min(tp, pp) < 1 or min(x for x in (replicate, shard, 1) if x is not None) < 1:
        raise UserError("--layout: degrees must be at least 1")
    rest = devices // (tp * pp)
    if replicate is None and shard is None:
        replicate, shard = (1, rest) if zero else (rest, 1)
    elif replicate is None:
        replicate = rest // shard if rest % shard == 0 else 1
    elif shard is None:
        shard = rest // replicate if zero and rest % replicate == 0 else 1
    dp = replicate * shard
    microbatch = integer("microbatch", 1 if pp > 1 else max(1, global_batch // dp))
    sp = values.get("sp", "false").lower()
    if sp not in ("true", "false", "1", "0"):
        raise UserError(f"--layout sp={values['sp']!r}: expected true or false")
    v = integer("v", 1)
    schedule = values.get("schedule", "interleaved_1f1b" if v > 1 else "1f1b")
    return Layout(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, microbatch=microbatch, zero=zero,
                  recompute=values.get("recompute", "none"), schedule=schedule, stages_per_rank=v,
                  sequence_parallel=sp in ("true", "1"))


def train_command(shape, work, layout, devices: int, gpus_per_node: int) -> str:
    """The `scalenlp train` line that runs this layout."""
    from scalenlp.plan.cost import ZERO_NAMES

    if devices > gpus_per_node:
        # FIRST_NODE: the address of one of the machines, which hosts the rendezvous (see README, "Several machines")
        launch = ["--nproc", str(gpus_per_node), "--nnodes", str(devices // gpus_per_node),
                  "--rdzv-endpoint", "FIRST_NODE:29400"]
    else:
        launch = ["--nproc", str(devices)]
    settings = {
        "parallel.dp_replicate": layout.dp_replicate, "parallel.dp_shard": layout.dp_shard,
        "parallel.tp": layout.tp, "parallel.pp": layout.pp,
        "parallel.data_parallel": ZERO_NAMES[layout.zero],
        "parallel.sequence_parallel": str(layout.sequence_parallel).lower(),
    }
    if layout.pp > 1:  # the schedule splits each rank's batch into pp_microbatches itself
        settings["parallel.pp_schedule"] = layout.schedule
        settings["parallel.pp_microbatches"] = work.global_batch // (layout.dp * layout.microbatch)
        settings["parallel.pp_stages_per_rank"] = layout.stages_per_rank
    settings["training.activation_checkpointing"] = layout.recompute
    settings["training.global_batch_size"] = work.global_batch
    if layout.pp == 1:
        settings["training.micro_batch_size"] = layout.microbatch
    settings["training.seq_len"] = work.seq
    settings["training.mixed_precision"] = work.precision
    if shape.flavor:
        settings = {"model.flavor": shape.flavor, **settings}
    words = ["scalenlp", "train", *launch]
    for key, value in settings.items():
        words += ["--set", f"{key}={value}"]
    return shlex.join(words)


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
        f"    {p.train_command}" if p.train_command else "    (custom shape: add it to scalenlp.models.flavors "
                                                        "to train it with `scalenlp train`)",
    ]


@dataclass
class Plan:
    """What `scalenlp plan` answers: the layouts that fit, fastest first (or the one asked for)."""

    header: dict  # the question: model, parameters, device, devices, seq, batch, precision, states
    device: Any  # the DeviceSpec priced (measured, with --device cpu)
    layouts: list  # Predictions, each with its `scalenlp train` line where the model is a flavor
    feasible: int = 0  # layouts that fit (a search lists the first ``top``)
    rejected: Counter = field(default_factory=Counter)  # why the others did not
    smallest_device_count: int | None = None  # when nothing fits: the fewest devices on which something does

    def to_dict(self) -> dict:
        return {**self.header, "layouts": [p.to_dict() for p in self.layouts], "feasible": self.feasible,
                "rejected": dict(self.rejected), "smallest_device_count_that_fits": self.smallest_device_count}


def plan(model: str, seq: int, global_batch: int, devices: int, device: str = "h100-sxm", *,
         layout: str | None = None, gpus_per_node: int | None = None, device_spec: str = "",
         precision: str | None = None, states: str = "fp32", top: int = 10) -> Plan:
    """Which layouts of ``model`` fit ``devices`` accelerators, and how fast each trains (see add_arguments
    for the meaning of each option). With ``layout`` ("tp=2,pp=4,..."), that one layout's prediction; a
    layout that cannot work or does not fit is a UserError naming why."""
    from scalenlp.hardware import get_device, parse_overrides
    from scalenlp.plan.cost import Workload, check_layout, fits, model_shape, predict
    from scalenlp.plan.search import MAX_DEVICES, search, smallest_device_count

    for name, value in (("seq", seq), ("global_batch", global_batch), ("devices", devices), ("top", top)):
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if devices > MAX_DEVICES:
        raise UserError(f"--devices {devices:,} is more than the {MAX_DEVICES:,} devices plan searches; "
                        "plan a part of the cluster (a layout's cost per device does not depend on the rest)")
    overrides = parse_overrides(device_spec)
    if device == "cpu":
        from scalenlp.plan.measure import measure_cpu  # runs training steps: only when asked for

        gpus_per_node = gpus_per_node or devices
        spec = measure_cpu(processes=gpus_per_node, overrides=overrides)
    else:
        gpus_per_node = gpus_per_node or 8
        spec = get_device(device, overrides)
    if devices > gpus_per_node and devices % gpus_per_node:
        raise UserError(f"--devices {devices} is not a whole number of nodes of {gpus_per_node}; "
                        "use a multiple of --gpus-per-node")
    precision = precision or ("fp32" if device == "cpu" else "bf16")
    shape = model_shape(model, seq)
    work = Workload(seq=seq, global_batch=global_batch, precision=precision, states=states)
    header = dict(model=model, parameters=shape.total_params, device=spec.name, devices=devices,
                  gpus_per_node=gpus_per_node, seq=seq, global_batch=global_batch, precision=precision,
                  states=states)

    def with_command(p):
        p.train_command = train_command(shape, work, p.layout, devices, gpus_per_node) if shape.flavor else None
        return p

    if layout:
        chosen = parse_layout(layout, devices, global_batch)
        problems = check_layout(shape, work, chosen, devices, gpus_per_node)
        if problems:
            raise UserError(f"layout {chosen.describe()} cannot work: {'; '.join(m for _, m in problems)}")
        p = predict(shape, work, chosen, spec, gpus_per_node)
        if not fits(p, spec):
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in p.memory.items())
            raise UserError(f"layout {chosen.describe()} does not fit: it needs {_gib(p.memory_per_device_bytes)} GiB "
                            f"per device ({parts}) and a {spec.name} has {_gib(spec.memory_bytes)} GiB; "
                            "raise zero, recompute, tp or pp, or lower the microbatch")
        return Plan(header, spec, [with_command(p)], feasible=1)
    result = search(shape, work, spec, devices, gpus_per_node)
    smallest = None if result.ranked else smallest_device_count(shape, work, spec, devices, gpus_per_node)
    return Plan(header, spec, [with_command(p) for p in result.ranked[:top]], len(result.ranked), result.rejected,
                smallest)


def run(args: argparse.Namespace) -> int:
    from scalenlp.plan.search import MAX_DEVICES

    result = plan(args.model, args.seq, args.global_batch, args.devices, args.device, layout=args.layout,
                  gpus_per_node=args.gpus_per_node, device_spec=args.device_spec, precision=args.precision,
                  states=args.states, top=args.top)
    title = f"{args.model} ({result.header['parameters'] / 1e6:,.1f}M parameters) on {args.devices} x {result.device.name}"
    if args.layout:
        if args.json:
            print(json.dumps({**result.header, **result.layouts[0].to_dict()}, indent=2))
        else:
            print(title)
            print("\n".join(_describe(result.layouts[0], result.device, None)))
        return 0
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
