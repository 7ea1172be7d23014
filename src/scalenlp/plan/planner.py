"""The planner's Python answer: which layouts of a model fit a cluster and how fast each trains, each with the
`scalenlp train` line that runs it (`scalenlp.plan(...)`; `scalenlp plan` prints the same)."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from scalenlp.config import INT_MAX
from scalenlp.errors import UserError
from scalenlp.layout import DATA_PARALLEL, Layout

_ZERO_WORDS = {name: stage for stage, name in enumerate(DATA_PARALLEL)}


def parse_layout(text: str, devices: int, global_batch: int):
    """``key=value,...`` -> Layout; unnamed data-parallel degrees take what the others leave."""
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--layout {item!r}: expected key=value")
        values[key.strip()] = value.strip()
    known = {"dp_shard", "dp_replicate", "tp", "pp", "microbatch", "zero", "recompute", "schedule", "v", "sp",
             "offload"}
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

    def flag(key: str) -> bool:
        value = values.get(key, "false").lower()
        if value not in ("true", "false", "1", "0"):
            raise UserError(f"--layout {key}={values[key]!r}: expected true or false")
        return value in ("true", "1")

    v = integer("v", 1)
    schedule = values.get("schedule", "interleaved_1f1b" if v > 1 else "1f1b")
    return Layout(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, microbatch=microbatch, zero=zero,
                  recompute=values.get("recompute", "none"), schedule=schedule, stages_per_rank=v,
                  sequence_parallel=flag("sp"), offload=flag("offload"))


def train_command(shape, work, layout, devices: int, gpus_per_node: int) -> str:
    """The `scalenlp train` line that runs this layout on this model: the model's shape as model.* keys, the
    layout as Layout.to_config gives it, and the workload."""
    from scalenlp.models.flavors import parse_shape, shape_keys

    if devices > gpus_per_node:
        # FIRST_NODE: the address of one of the machines, which hosts the rendezvous (see README, "Several machines")
        launch = ["--nproc", str(gpus_per_node), "--nnodes", str(devices // gpus_per_node),
                  "--rdzv-endpoint", "FIRST_NODE:29400"]
    else:
        launch = ["--nproc", str(devices)]
    settings = {f"model.{key}": value for key, value in shape_keys(parse_shape(shape.name)).items()}
    settings.update(layout.to_config(work.global_batch))
    settings["training.global_batch_size"] = work.global_batch
    settings["training.seq_len"] = work.seq
    settings["training.mixed_precision"] = work.precision
    words = ["scalenlp", "train", *launch]
    for key, value in settings.items():
        words += ["--set", f"{key}={value}"]
    return shlex.join(words)


@dataclass
class Plan:
    """What `scalenlp plan` answers: the layouts that fit, fastest first (or the one asked for)."""

    header: dict  # the question: model, parameters, device, devices, seq, batch, precision, states
    device: Any  # the DeviceSpec priced (measured, with --device cpu)
    layouts: list  # Predictions, each with its `scalenlp train` line
    feasible: int = 0  # layouts that fit (a search lists the first ``top``)
    rejected: Counter = field(default_factory=Counter)  # why the others did not
    smallest_device_count: int | None = None  # when nothing fits: the fewest devices on which something does
    # A --layout that does not fit: (the change to its --layout, that layout's prediction) that would, fastest first.
    would_fit: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**self.header, "layouts": [p.to_dict() for p in self.layouts], "feasible": self.feasible,
                "rejected": dict(self.rejected), "smallest_device_count_that_fits": self.smallest_device_count}

    def layout_dict(self) -> dict:
        """The one --layout's answer: the question, its prediction and, when it does not fit, what would."""
        return {**self.header, **self.layouts[0].to_dict(),
                "would_fit": [dict(change=change, layout=p.layout.describe(),
                                   memory_per_device_bytes=p.memory_per_device_bytes, tokens_per_sec=p.tokens_per_sec)
                              for change, p in self.would_fit]}


def plan(model: str, seq: int, global_batch: int, devices: int, device: str = "h100-sxm", *,
         layout: str | None = None, gpus_per_node: int | None = None, device_spec: str = "",
         precision: str | None = None, states: str = "fp32", top: int = 10) -> Plan:
    """Which layouts of ``model`` fit ``devices`` accelerators, and how fast each trains (see add_arguments
    for the meaning of each option). With ``layout`` ("tp=2,pp=4,..."), that one layout's prediction; a
    layout that cannot work is a UserError naming why, one that does not fit is predicted all the same
    (``fits`` False) with the changes that would make it fit (``would_fit``)."""
    from scalenlp.hardware import get_device, parse_overrides
    from scalenlp.plan.cost import Workload, model_shape, predict
    from scalenlp.plan.remedy import what_fits
    from scalenlp.plan.search import MAX_DEVICES, check_layout, search, smallest_device_count

    for name, value in (("seq", seq), ("global_batch", global_batch), ("devices", devices), ("top", top)):
        if not 1 <= value <= INT_MAX:  # the config keys of the printed command take 64-bit integers
            raise UserError(f"--{name.replace('_', '-')} must be between 1 and {INT_MAX}, got {value}")
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
        p.train_command = train_command(shape, work, p.layout, devices, gpus_per_node)
        return p

    if layout:
        chosen = parse_layout(layout, devices, global_batch)
        problems = check_layout(shape, work, chosen, devices, gpus_per_node)
        if problems:
            raise UserError(f"layout {chosen.describe()} cannot work: {'; '.join(m for _, m in problems)}")
        p = predict(shape, work, chosen, spec, gpus_per_node)
        remedies = [] if p.fits else what_fits(shape, work, chosen, spec, devices, gpus_per_node)
        return Plan(header, spec, [with_command(p)], feasible=int(p.fits), would_fit=remedies)
    result = search(shape, work, spec, devices, gpus_per_node)
    smallest = None if result.ranked else smallest_device_count(shape, work, spec, devices, gpus_per_node)
    return Plan(header, spec, [with_command(p) for p in result.ranked[:top]], len(result.ranked), result.rejected,
                smallest)
