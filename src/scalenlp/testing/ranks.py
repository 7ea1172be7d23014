"""Run a function on several fresh processes joined by one process group: the tests' and benchmarks' harness."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalenlp.parallel.mesh import free_port


def spawn_ranks(fn: Callable, world: int, *args, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned processes, one thread each; raises if any rank fails."""
    mp.spawn(_rank_main, args=(world, free_port(), backend, fn, args), nprocs=world)


def _rank_main(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Every rank leaves its last collective before any tears down its pairs (and rank 0 the store).
        dist.barrier()
    finally:
        gc.collect()  # modules and meshes that hold groups go while the interpreter is whole
        dist.destroy_process_group()
    # A rank that finished leaves without interpreter finalization: in about one CI run of 100, a rank ended
    # its test and then aborted in it ("terminate called without an active exception"), a C++ thread of
    # gloo or the store meeting a half torn-down interpreter (the cause pytorch#179291 describes). Nothing
    # of a finished rank is lost this way: its results are written and its streams are flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
