"""Layout search: every combination of degrees that divides the device count, each checked, priced and ranked.

Pruning that loses nothing: sequence parallelism is on with TP wherever tp divides the sequence (it
replaces each all-reduce by an all-gather and a reduce-scatter of the same volume and only saves memory
and memory traffic), and recomputation is tried
none -> selective -> full, keeping the first that fits (each step only saves memory and costs time).
Offloading a ZeRO-2/3 layout's shards to host memory is the last resort, as DeepSpeed's and FSDP's users
take it: tried (with the same recomputation order) only where no recomputation fits on the device alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from scalenlp.hardware import DeviceSpec
from scalenlp.layout import INTERLEAVED, Layout, ModelSizes, problems
from scalenlp.plan.cost import ModelShape, Prediction, Workload, fits, predict

RECOMPUTE_ORDER = ("none", "selective", "full")
MAX_MICROBATCH = 1 << 12  # sequences; the largest power-of-two micro-batch searched below the whole batch
MAX_DEVICES = 1 << 17  # the largest cluster planned for; the search enumerates the divisors of the count
MAX_STAGES_PER_RANK = 8


@dataclass
class SearchResult:
    ranked: list[Prediction]
    rejected: Counter = field(default_factory=Counter)  # kind of problem -> how many layouts it ruled out
    evaluated: int = 0


def check_layout(shape: ModelShape, work: Workload, layout: Layout, devices: int,
                 gpus_per_node: int) -> list[tuple[str, str]]:
    """(kind, what is wrong) for each reason this layout cannot run, memory aside; empty when it can: the one
    layout check the trainer and the sharded server make (scalenlp.layout), and one rule of the
    planner's own, which runs but is never worth recommending: tensor parallelism across nodes."""
    found = problems(layout, ModelSizes(heads=shape.heads, kv_heads=shape.kv_heads, ffn=shape.ffn, layers=shape.layers),
                     devices, work.seq, work.global_batch)
    if layout.tp > gpus_per_node or gpus_per_node % layout.tp:
        found.append(("tp would span nodes", f"tp={layout.tp} would span nodes of {gpus_per_node} devices "
                                             "(TP all-reduces every layer and needs the node's own links)"))
    return found


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_parallel_splits(dp: int, tp: int, gpus_per_node: int) -> list[tuple[int, int, int]]:
    """(zero, dp_replicate, dp_shard): DDP, each ZeRO stage fully sharded, and HSDP sharded within a node."""
    splits = [(0, dp, 1)]
    if dp == 1:
        return splits
    in_node = max((d for d in divisors(dp) if d * tp <= gpus_per_node and 1 < d < dp), default=None)
    for zero in (1, 2, 3):
        splits.append((zero, 1, dp))
        if in_node:
            splits.append((zero, dp // in_node, in_node))
    return splits


def _microbatches(per_replica: int) -> list[int]:
    """The powers of two up to MAX_MICROBATCH that divide the per-replica batch, then the batch itself. Found by
    doubling (a batch can be 2**63, far too many numbers to try each), and capped, since each size is another
    round of predictions: a batch of 2**62 would otherwise search 60 sizes where one of 256 searches 9."""
    sizes = [1]
    while per_replica % (sizes[-1] * 2) == 0 and sizes[-1] < MAX_MICROBATCH:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == per_replica else [*sizes, per_replica]


def _schedules(pp: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    # One stage per rank makes interleaved_1f1b a plain 1F1B; zero_bubble fills the bubble either way.
    interleaved = [(schedule, v) for schedule in INTERLEAVED for v in range(1, MAX_STAGES_PER_RANK + 1)
                   if pp * v <= layers and (v > 1 or schedule == "zero_bubble")]
    return [("gpipe", 1), ("1f1b", 1), *interleaved]


def candidates(shape: ModelShape, work: Workload, devices: int, gpus_per_node: int, fixed: dict | None = None):
    """Yield groups of layouts that differ only in recomputation (cheapest first)."""
    fixed = fixed or {}

    def allowed(name, values):
        return [fixed[name]] if name in fixed else values

    for tp in allowed("tp", divisors(devices)):
        for pp in allowed("pp", divisors(devices // tp) if devices % tp == 0 else [1]):
            dp = max(1, devices // (tp * pp))
            for zero, replicate, shard in _data_parallel_splits(dp, tp, gpus_per_node):
                if ("zero" in fixed and zero != fixed["zero"]) or ("dp_shard" in fixed and shard != fixed["dp_shard"]):
                    continue
                per_replica = max(1, work.global_batch // dp)
                for micro in allowed("microbatch", _microbatches(per_replica)):
                    for schedule, v in _schedules(pp, shape.layers):
                        if "schedule" in fixed and schedule != fixed["schedule"]:
                            continue
                        if "stages_per_rank" in fixed and v != fixed["stages_per_rank"]:
                            continue
                        sp = fixed.get("sequence_parallel", tp > 1 and work.seq % tp == 0)
                        yield [Layout(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, microbatch=micro,
                                      zero=zero, recompute=r, schedule=schedule, stages_per_rank=v,
                                      sequence_parallel=sp)
                               for r in allowed("recompute", RECOMPUTE_ORDER)]


def search(shape: ModelShape, work: Workload, device: DeviceSpec, devices: int, gpus_per_node: int,
           fixed: dict | None = None) -> SearchResult:
    result = SearchResult(ranked=[])
    oom = f"out of memory (more than the {device.memory_bytes / 2**30:.1f} GiB of a device)"
    host_oom = (f"out of host memory, offloaded (more than {device.host_memory_bytes / 2**30:.0f} GiB per device)"
                if device.host_memory_bytes is not None else "")
    offload = fixed.get("offload") if fixed else None
    for group in candidates(shape, work, devices, gpus_per_node, fixed):
        problems = check_layout(shape, work, group[0], devices, gpus_per_node)
        if problems:
            result.rejected[problems[0][0]] += len(group)
            continue
        tries = [] if offload else [group]
        if offload is not False and can_offload(group[0], device):
            tries.append([replace(layout, offload=True) for layout in group])
        for layout in (layout for tried in tries for layout in tried):
            prediction = predict(shape, work, layout, device, gpus_per_node)
            result.evaluated += 1
            if fits(prediction, device):
                result.ranked.append(prediction)
                break
            result.rejected[oom if prediction.memory_per_device_bytes > device.memory_bytes else host_oom] += 1
    result.ranked.sort(key=lambda p: (-p.tokens_per_sec, p.memory_per_device_bytes))
    return result


def can_offload(layout: Layout, device: DeviceSpec) -> bool:
    """FSDP's shards can move to host memory: ZeRO-2/3 over more than one rank, on a device with a host link."""
    return layout.zero >= 2 and layout.dp > 1 and device.host_link_bw is not None


def smallest_device_count(shape: ModelShape, work: Workload, device: DeviceSpec, devices: int, gpus_per_node: int,
                          limit: int = MAX_DEVICES) -> int | None:
    """The fewest devices above ``devices`` on which some layout fits (whole nodes beyond one node): doubling
    until one fits, then bisecting between the last count that did not and the first that did."""
    def fits_on(n: int) -> bool:
        return bool(search(shape, work, device, n, gpus_per_node).ranked)

    def whole(n: int) -> int:
        return n if n <= gpus_per_node else gpus_per_node * -(-n // gpus_per_node)

    low, high = devices, None
    while low < limit:
        n = whole(low * 2)
        if fits_on(n):
            high = n
            break
        low = n
    if high is None:
        return None
    step = gpus_per_node if low >= gpus_per_node else 1
    while high - low > step:
        mid = whole((low + high) // 2)
        if mid in (low, high):
            break
        if fits_on(mid):
            high = mid
        else:
            low = mid
    return high
