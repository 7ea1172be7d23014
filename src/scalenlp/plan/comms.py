"""Collectives on a cluster's links, and how much of data parallelism's traffic hides behind compute.

A group inside one node talks over NVLink; a group across nodes runs NCCL's ring over one NIC per GPU, the
steps that cross a node at the network's latency. DDP, ZeRO-1/2/3 and HSDP move their per-step bytes over
those links, and FSDP's per-unit gathers hide behind the previous unit's compute only. docs/planner.md,
"Communication", gives the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalenlp.hardware import DeviceSpec


@dataclass(frozen=True)
class Group:
    """A communicator: its size, the bus bandwidth a ring over it reaches, and its mean latency per ring step."""
    size: int
    bw: float
    latency: float
    nodes: int = 1


def group(stride: int, size: int, gpus_per_node: int, device: DeviceSpec) -> Group:
    """The ring of ``size`` ranks spaced ``stride`` apart in the rank order (innermost dimension first)."""
    if size <= 1:
        return Group(1, math.inf, 0.0)
    if stride * size <= gpus_per_node:
        return Group(size, device.intra_node_bw, device.latency_s)
    per_node = max(1, gpus_per_node // stride)  # this group's ranks on one node, each with its own NIC
    nodes = -(-size // per_node)
    bw = min(device.intra_node_bw, per_node * device.nic_bw)
    network = device.latency_s if device.nic_latency_s is None else device.nic_latency_s
    crossings = nodes - 1  # of the ring's size − 1 steps, those that cross a node boundary
    latency = ((size - 1 - crossings) * device.latency_s + crossings * network) / (size - 1)
    return Group(size, bw, latency, nodes)


def ring_time(kind: str, nbytes: float, n: int, bw: float, latency: float, slowdown: float = 1.0) -> float:
    """A ring collective's time, times ``slowdown`` where the library is measured slower than the ring
    (DeviceSpec.all_gather_factor, reduce_scatter_factor)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    hops = (n - 1) * (2 if kind == "all_reduce" else 1)
    return slowdown * hops * (nbytes / n / bw + latency)


def collective(kind: str, nbytes: float, g: Group, slowdown: float = 1.0) -> float:
    """A ring collective's time over ``g``: (n − 1) steps (twice for an all-reduce), each moving 1/n of the
    bytes and paying one step's latency; ``slowdown`` where the library is measured slower than the ring."""
    return ring_time(kind, nbytes, g.size, g.bw, g.latency, slowdown)


def forward_exposed(gathers: list[float], compute: list[float], overlaps: bool) -> float:
    """Time the forward waits on its gathers: unit i's gather (prefetched while unit i − 1 computes) hides
    behind that compute only; the first waits whole. Without overlap (gloo on a CPU's cores) all of it."""
    if not overlaps:
        return sum(gathers)
    if not gathers:
        return 0.0
    return gathers[0] + sum(max(0.0, g - c) for g, c in zip(gathers[1:], compute[:-1]))


def backward_exposed(gathers: list[float], reductions: list[float], compute: list[float], overlaps: bool) -> float:
    """Time the backward waits on its traffic, units in backward order: while unit k computes, the link carries
    unit k + 1's gather and unit k − 1's reduction; the first gather and the last reduction wait whole."""
    if not overlaps:
        return sum(gathers) + sum(reductions)
    n = len(compute)
    if n == 0:
        return 0.0
    exposed = gathers[0] + reductions[-1]
    for k in range(n):
        traffic = (gathers[k + 1] if k + 1 < n else 0.0) + (reductions[k - 1] if k > 0 else 0.0)
        exposed += max(0.0, traffic - compute[k])
    return exposed
