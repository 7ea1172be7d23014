"""What would make a layout fit: the changes a user would try, each priced by the cost model.

Each change keeps the device count and the global batch: shard the model states further (a higher ZeRO
stage, with the data-parallel ranks sharded), recompute more, a smaller microbatch, more tensor or pipeline
parallelism (taken from data parallelism), the shards offloaded to host memory (ZeRO-2/3, a device with
a host link). Single changes first; where none fits, pairs of them. Only changes that check_layout
accepts and whose memory fits are named, fastest first.
"""

from __future__ import annotations

import dataclasses
from itertools import combinations

from scalenlp.hardware import DeviceSpec
from scalenlp.layout import Layout
from scalenlp.plan.cost import ModelShape, Prediction, Workload, predict
from scalenlp.plan.search import RECOMPUTE_ORDER, check_layout


def _changes(layout: Layout, device: DeviceSpec) -> list[tuple[str, dict]]:
    """(what to write in --layout, the Layout fields it sets) for each single change worth trying."""
    out = []
    if not layout.offload and device.host_link_bw is not None:  # check_layout asks for ZeRO-2/3 over ranks
        out.append(("offload=true", dict(offload=True)))
    for zero in range(max(layout.zero, 0) + 1, 4):  # a higher ZeRO stage shards over every data-parallel rank
        out.append((f"zero={zero}", dict(zero=zero, dp_shard=layout.dp, dp_replicate=1)
                    if layout.dp_shard == 1 else dict(zero=zero)))
    for recompute in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(layout.recompute) + 1:] if layout.recompute in \
            RECOMPUTE_ORDER else ():
        out.append((f"recompute={recompute}", dict(recompute=recompute)))
    micro = layout.microbatch // 2
    while micro >= 1:
        out.append((f"microbatch={micro}", dict(microbatch=micro)))
        micro //= 2
    for name in ("tp", "pp"):
        for factor in (2, 4, 8):
            # The extra degree comes out of data parallelism: dp_replicate first, then dp_shard.
            if layout.dp_replicate % factor == 0:
                dp = dict(dp_replicate=layout.dp_replicate // factor)
            elif layout.dp_shard % factor == 0:
                dp = dict(dp_shard=layout.dp_shard // factor)
            else:
                continue
            out.append((f"{name}={getattr(layout, name) * factor}", {name: getattr(layout, name) * factor, **dp}))
    return out


def _apply(layout: Layout, fields: dict, work: Workload) -> Layout:
    new = dataclasses.replace(layout, **fields)
    if new.dp_shard == 1 and new.zero and new.dp_replicate > 1:  # ZeRO needs ranks to shard over
        new = dataclasses.replace(new, dp_shard=new.dp_replicate, dp_replicate=1)
    if new.tp > 1 and work.seq % new.tp == 0 and "tp" in fields:
        new = dataclasses.replace(new, sequence_parallel=True)
    if new.microbatch * new.dp > work.global_batch:  # fewer data-parallel ranks may take more sequences each
        new = dataclasses.replace(new, microbatch=max(1, work.global_batch // new.dp))
    return new


def what_fits(shape: ModelShape, work: Workload, layout: Layout, device: DeviceSpec, devices: int,
              gpus_per_node: int, limit: int = 5) -> list[tuple[str, Prediction]]:
    """Up to ``limit`` (change, its prediction) that make ``layout`` fit, fastest first: single changes, or
    where none fits, pairs."""
    changes = _changes(layout, device)
    for size in (1, 2):
        found: dict[Layout, tuple[str, Prediction]] = {}
        for combo in combinations(changes, size):
            names = [name.split("=")[0] for name, _ in combo]
            if len(set(names)) < size:  # two values of one knob
                continue
            fields = {k: v for _, f in combo for k, v in f.items()}
            candidate = _apply(layout, fields, work)
            if candidate in found or check_layout(shape, work, candidate, devices, gpus_per_node):
                continue
            p = predict(shape, work, candidate, device, gpus_per_node)
            if p.fits:
                found[candidate] = (",".join(name for name, _ in combo), p)
        if found:
            return sorted(found.values(), key=lambda c: -c[1].tokens_per_sec)[:limit]
    return []
