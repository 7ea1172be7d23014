"""Tensor-parallel inference: one model sharded over N processes, rank 0 runs the engine and HTTP.

Every rank holds 1/N of each block (Megatron layout from ``scalenlp.parallel.tensor_parallel``,
without sequence parallelism; a quantized model on the same plan through ``shard_quantized``)
and its own KV-cache shard (n_kv_heads / N heads). Rank 0's engine
calls ``ShardedModel`` exactly like a local model; each call first broadcasts the step's inputs,
so that the other ranks, waiting in ``follow``, run the same forward and join its collectives.
Sampling happens on rank 0 alone: after the output projection every rank holds the full logits.

A forward that raises on one rank leaves the others blocked in a collective for IDLE_TIMEOUT, and gloo
has no abort, so a failure ends processes rather than being recovered from; rank 0 is the parent of the
others, so it alone decides: a failing follower sends it one line on a pipe and exits; rank 0, watching
its children (``Followers``), ends its engine with that line, as a failure of its own does: the requests
in flight are answered (503 from a server), the followers killed, and the process exits 1.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

from scalenlp import faults
from scalenlp.errors import UserError
from scalenlp.layout import Layout, ModelSizes, check
from scalenlp.parallel.mesh import free_port

FORWARD, SETUP_CACHE, STOP = 0, 1, 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADER = 6
# Followers wait for rank 0's next step for as long as the server is idle.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def init_process_group(rank: int, world_size: int, port: int) -> torch.device:
    """gloo on CPU, NCCL with one GPU per rank."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    return device


def check_tp(args, tp: int) -> None:
    """Before any process starts: the one layout check (scalenlp.layout) for ``tp`` ranks of
    tensor parallelism alone over this model (its ModelArgs)."""
    check(Layout(tp=tp), ModelSizes.of(args), devices=tp)


def check_quantized_tp(args, spec, tp: int) -> None:
    """int4 under ``tp`` ranks: each rank's share of a row-parallel linear's inputs (attention wo, MLP w2) must
    split into whole groups."""
    if spec is None or spec.method != "int4":
        return
    for name, width in (("attention output", args.n_heads * args.head_dim), ("MLP output", args.ffn_dim)):
        if width // tp % spec.group_size:
            raise UserError(f"--tp {tp} leaves each rank {width // tp} of the {width} inputs of the {name} "
                            f"projection, which --group-size {spec.group_size} does not divide; use a smaller group "
                            f"size, fewer ranks, or int8")


def load_sharded(pre, device: torch.device, dtype: torch.dtype, quantize=None):
    """Every rank builds the model from the checkpoint it read (a ``Pretrained``) and keeps its shard of each weight.
    ``quantize`` (a ``Quantization``), or a quantized checkpoint: see ``shard_quantized``."""
    from torch.distributed.device_mesh import init_device_mesh

    from scalenlp.loader import instantiate
    from scalenlp.parallel.tensor_parallel import apply_tp

    if quantize is not None or pre.quantization is not None:
        shard = functools.partial(shard_quantized, quantize or pre.quantization, dist.get_rank(), dist.get_world_size())
        return instantiate(pre, device=device, dtype=dtype, quantize=quantize, shard=shard).eval()
    model = instantiate(pre, device=device, dtype=dtype)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    apply_tp(model, mesh, sequence_parallel=False)
    return model.eval()


def shard_quantized(spec, rank: int, world: int, model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's slice of a quantized decoder (``compress.quantized.build_quantized``'s ``shard``): the tensors
    are quantized whole, as on one process, then sliced on the same plan as the float model (column-parallel:
    output rows with their scales; row-parallel: inputs, each output's scale kept whole, the partial sums added
    by one all-reduce), so every rank multiplies by exactly the single-process weights. Plain tensors and hooks,
    not DTensors: the quantized linears compute through kernels DTensor has no rules for. Embeddings and the
    output projection stay whole on every rank: the vocabulary need not split evenly, and the output is then
    one matmul on each rank with no gather."""
    from scalenlp.compress.quantized import empty_linear
    from scalenlp.parallel.tensor_parallel import block_plan

    state = dict(state)
    for i, block in model.layers.items():
        for name, style in block_plan(False, block.feed_forward.w3 is not None).items():
            full = f"layers.{i}.{name}"
            linear = model.get_submodule(full)
            row = isinstance(style, RowwiseParallel)
            shape = [linear.in_features // world, linear.out_features] if row else \
                [linear.in_features, linear.out_features // world]
            for buffer, dims in linear.shard_dims.items():
                key = f"{full}.{buffer}"
                dim = dims[row]
                if key in state and dim is not None:
                    state[key] = state[key].chunk(world, dim)[rank].contiguous()  # the kernels take whole rows
                elif key in state and buffer == "bias" and rank:
                    state[key] = torch.zeros_like(state[key])  # a row-parallel bias is added once, to the sum
            local = empty_linear(spec, nn.Linear(*shape, bias=linear.bias is not None, device="meta"))
            if row:
                local.register_forward_hook(_sum_over_ranks)
            parent, _, child = full.rpartition(".")
            setattr(model.get_submodule(parent), child, local)
    return state


def _sum_over_ranks(module, args, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


class Followers:
    """Ranks 1..N-1 as rank 0 sees them: their processes, what ended one, and a watcher that acts on it from
    the moment they start. A dead rank leaves the others blocked in a collective forever, so the watcher
    kills the rest (rank 0's collective with them then fails instead of waiting) and calls ``on_failure``:
    the engine's ``fail``, which answers every request in flight and ends the server with exit 1, so that
    whatever supervises it (a Ray Serve controller, systemd, Kubernetes) restarts it. Before an engine
    is attached (loading), nothing is in flight: it prints the failure and exits 1."""

    def __init__(self, processes, reports: multiprocessing.connection.Connection):
        self.processes = list(processes)
        self.reports = reports  # (rank, error) from a follower whose forward raised, sent just before it exits
        self.closing = threading.Event()
        self.on_failure: Callable[[BaseException], None] | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self.closing.is_set():
            return
        failure = self.failure()
        self.kill()
        if self.on_failure is None:
            print(f"error: {failure}; stopping", file=sys.stderr, flush=True)
            os._exit(1)
        self.on_failure(RuntimeError(failure))

    def failure(self) -> str | None:
        """What ended a follower, once one has: its report (sent before it exits), or else its exit code."""
        with self._lock:  # the engine thread (its collective raised) and the watcher may both ask
            if self._failure is None and self.reports.poll():
                try:
                    rank, error = self.reports.recv()
                    self._failure = f"tensor-parallel rank {rank} failed: {error}"
                except EOFError:  # every follower that held the pipe ended without a report: see the exit codes
                    pass
            if self._failure is None:
                ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=0)
                for rank, p in enumerate(self.processes, 1):
                    if p.sentinel in ended:
                        p.join()  # its sentinel is ready: it has exited, and join reads the exit code
                        self._failure = f"tensor-parallel rank {rank} died (exit code {p.exitcode})"
                        break
            return self._failure

    def kill(self) -> None:
        for p in self.processes:
            p.kill()
            p.join()


class ShardedModel:
    """Rank 0's handle on the sharded model: same calls as a Transformer, broadcast to every rank.
    ``close`` (called by ``Engine.stop``) releases the followers."""

    def __init__(self, model, followers: Followers):
        self.model = model
        self.args = model.args
        self.device = next(model.parameters()).device
        self.followers = followers
        self.failed = False  # a forward raised: the followers wait in a collective rank 0 left, or are gone
        self.fault = faults.planned(0)
        self.forwards = 0

    def parameters(self):
        return self.model.parameters()

    def _broadcast_header(self, *values: int) -> None:
        header = torch.tensor(list(values) + [0] * (HEADER - len(values)), dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)

    def setup_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or next(self.model.parameters()).dtype
        self._broadcast_header(SETUP_CACHE, num_blocks, block_size, DTYPES.index(dtype))
        self.model.setup_kv_cache(num_blocks, block_size, dtype)

    def __call__(self, tokens, input_pos, block_table=None, slot_mapping=None, logits_at=None):
        B, T = tokens.shape
        try:
            # The block table's width, or -1 for a forward without the cache (no block table, no slot mapping).
            self._broadcast_header(FORWARD, B, T, -1 if block_table is None else block_table.shape[1],
                                   logits_at is not None)
            for t in (tokens, input_pos, block_table, slot_mapping, logits_at):
                if t is not None:
                    dist.broadcast(t.contiguous(), src=0)
            faults.inject(self.fault, self.forwards, None)
            logits = self.model(tokens, input_pos, block_table, slot_mapping, logits_at=logits_at)
        except Exception as e:
            self.failed = True
            # A follower that failed first closes its connections, and so fails rank 0's collective:
            # its own error, not this one, is the cause.
            if (failure := self.followers.failure()) is not None:
                raise RuntimeError(failure) from e
            raise RuntimeError(f"tensor-parallel rank 0 failed: {e!r}") from e
        self.forwards += 1
        return logits

    def close(self) -> None:
        self.followers.closing.set()
        if self.failed:
            self.followers.kill()
        else:
            self._broadcast_header(STOP)
            for p in self.followers.processes:
                p.join()
        dist.destroy_process_group()


@torch.inference_mode()
def follow(model, fault: tuple[str, int] | None) -> None:
    """Ranks > 0: run whatever rank 0 runs, until it says stop. ``fault``: see ``faults.planned``."""
    device = next(model.parameters()).device
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    forwards = 0
    while True:
        dist.broadcast(header, src=0)
        cmd, *rest = header.tolist()
        if cmd == STOP:
            return
        if cmd == SETUP_CACHE:
            num_blocks, block_size, dtype_index = rest[:3]
            model.setup_kv_cache(num_blocks, block_size, DTYPES[dtype_index])
            continue
        B, T, width, has_logits_at = rest[:4]
        tokens = torch.empty(B, T, dtype=torch.long, device=device)
        input_pos = torch.empty(B, T, dtype=torch.long, device=device)
        block_table = torch.empty(B, width, dtype=torch.long, device=device) if width >= 0 else None
        slot_mapping = torch.empty(B, T, dtype=torch.long, device=device) if width >= 0 else None
        logits_at = torch.empty(B, dtype=torch.long, device=device) if has_logits_at else None
        for t in (tokens, input_pos, block_table, slot_mapping, logits_at):
            if t is not None:
                dist.broadcast(t, src=0)
        faults.inject(fault, forwards, None)
        model(tokens, input_pos, block_table, slot_mapping, logits_at=logits_at)
        forwards += 1


def _follower_main(rank: int, world_size: int, port: int, checkpoint: str, dtype: torch.dtype, quantize,
                   reports: multiprocessing.connection.Connection) -> None:
    from scalenlp.loader import read

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = init_process_group(rank, world_size, port)
    model = load_sharded(read(checkpoint), device, dtype, quantize)
    try:
        follow(model, faults.planned(rank))
    except Exception as e:  # noqa: BLE001 - told to rank 0, which prints it: one line, not a child's traceback
        reports.send((rank, repr(e)))
        # Not destroy_process_group: it may wait on ranks that wait in a collective for this one.
        os._exit(1)
    dist.destroy_process_group()


def start_sharded(pre, tp: int, dtype: torch.dtype, quantize=None) -> ShardedModel:
    """Spawn ranks 1..tp-1, each reading the checkpoint ``pre`` was read from, become rank 0 with ``pre``
    (a ``Pretrained``), and return the handle the engine drives, every rank's weights in ``dtype``. ``quantize``: a
    ``Quantization`` applied at load."""
    check_tp(pre.args, tp)
    check_quantized_tp(pre.args, quantize or pre.quantization, tp)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    # A pipe, not a Queue: its semaphores would be reported leaked when rank 0 ends with os._exit.
    reports, report = ctx.Pipe(duplex=False)
    followers = [ctx.Process(target=_follower_main,
                             args=(r, tp, port, str(pre.path), dtype, quantize, report), daemon=True)
                 for r in range(1, tp)]
    for p in followers:
        p.start()
    watched = Followers(followers, reports)  # a rank failing while it loads would leave this one waiting for it
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    device = init_process_group(0, tp, port)
    return ShardedModel(load_sharded(pre, device, dtype, quantize), watched)
