"""ParallelDims -> one DeviceMesh with named dimensions; every process group comes from it.

Mesh order, outermost first: pp, dp_replicate, dp_shard, tp. TP is innermost so that its ranks are
neighbours (same node: TP all-reduces every layer and needs the fastest links); PP is outermost
because it sends the least traffic (one activation per microbatch at stage boundaries).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scalenlp.config import ConfigError, ParallelConfig
from scalenlp.layout import degrees_problem, resolve_dp_shard

# Ports a process gets for an outgoing connection or a bind to port 0 (Linux's default range). A port chosen in
# this range and released can be handed to such a socket before our server binds it: a CI run saw Ray Serve's
# proxy fail to bind a port that one of Ray's own sockets had taken meanwhile. So ports are chosen below it, and
# above Ray's worker ports (10002-19999), where only an explicit bind takes them.
_RESERVED_BELOW = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: no fixed range to stay out of
        return 0


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1, for process groups and servers to listen on: outside the range the
    system hands out by itself where it has one. Every socket stays bound until all are chosen: ports picked one
    at a time can repeat once the first socket closes (a CI run saw Ray refuse two components on one port)."""
    top = _ephemeral_start()
    candidates = random.sample(range(_RESERVED_BELOW, top), top - _RESERVED_BELOW) if top > _RESERVED_BELOW else []
    sockets = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == n:
                break
        while len(sockets) < n:  # no range to choose from, or all of it taken: the system picks
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard=-1 and check that the degrees multiply to the world size."""
        dims = cls(p.dp_replicate, resolve_dp_shard(p, world_size), p.tp, p.pp, world_size)
        if problem := degrees_problem(dims, world_size):
            raise ConfigError(problem)
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    def names_and_sizes(self) -> list[tuple[str, int]]:
        return [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: int, group_of_one: bool = False) -> tuple[int, int]:
    """Join the process group that torchrun describes in the environment; (rank, world_size).

    A single process (no WORLD_SIZE) runs without a process group, unless ``group_of_one`` asks for one
    (FSDP's mixed precision, training.param_dtype, needs a mesh even of one). The timeout bounds every
    collective, so a rank that died makes the others fail instead of hanging forever.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        if not group_of_one:
            return 0, 1
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device_type() == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type() == "cuda" else "gloo"
        if device_type() == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """Wait for every rank; nothing to wait for in a single process."""
    if dist.is_initialized():
        dist.barrier()


def build_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The one mesh of this run with every dimension named, including those of size 1, so that code
    can always ask for mesh["tp"] or mesh["dp_replicate", "dp_shard"]. None without a process group."""
    if not dist.is_initialized():
        return None
    names, sizes = zip(*dims.names_and_sizes())
    return init_device_mesh(device_type(), sizes, mesh_dim_names=names)


def dp_rank(mesh: DeviceMesh | None) -> int:
    """This rank's index among data-parallel ranks (replicate-major), which picks its slice of the batch."""
    if mesh is None:
        return 0
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
