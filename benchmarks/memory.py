"""Per-rank memory of model states under DDP / ZeRO-1 / ZeRO-2 / ZeRO-3, beside the ZeRO paper's
formulas, and activation memory with and without activation checkpointing.

    python benchmarks/memory.py

Model states are measured after a full training step (forward, backward, AdamW step, gradients
kept), at rest, as the bytes of the distinct storages that this rank's parameters, gradients and
optimizer state occupy (DTensor shards counted locally). Formulas for fp32 AdamW (Rajbhandari et
al., 2020, with K = 8): ddp 4Ψ+4Ψ+8Ψ, zero1 4Ψ+4Ψ+8Ψ/N, zero2 4Ψ+4Ψ/N+8Ψ/N, zero3 (4Ψ+4Ψ+8Ψ)/N.
FSDP2's ZeRO-2 reshards parameters after backward, so at rest it holds 4Ψ/N of parameters and
the full 4Ψ only from forward to backward: the "gathered" column shows the parameter bytes held
at the end of forward (measured), which is where the formula's 4Ψ is paid.

Activations are measured with the PyTorch profiler's CPU allocator events: bytes allocated and
still alive at the end of forward (what backward needs), for none / selective / full checkpointing.

The vocabulary-parallel loss (parallel.loss_parallel) is measured at tp=2 on a model with a large
vocabulary, where the (B, T, V) logits dominate: the peak bytes allocated on one rank during
forward + loss + backward, with the logits gathered on every rank and kept sharded on the vocabulary.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.parity import make_config  # noqa: E402

from scalenlp.models.flavors import build_model, model_args  # noqa: E402
from scalenlp.parallel.data_parallel import local_optimizer  # noqa: E402
from scalenlp.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from scalenlp.parallel.parallelize import apply_ac, loss_context, parallelize, shard_optimizer_state  # noqa: E402
from scalenlp.testing.ranks import spawn_ranks  # noqa: E402
from scalenlp.train.loss import cross_entropy  # noqa: E402

MODES = ("ddp", "zero1", "zero2", "zero3")
# Big enough that per-tensor rounding of shards is noise, small enough for 4 processes on 2 cores.
MODEL = dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512, max_seq_len=64)
SEQ, BATCH = 32, 4
# For the loss: (B, T, V) fp32 logits of 16 MiB dwarf the blocks' activations.
VOCAB_HEAVY = MODEL | dict(vocab_size=32768)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def model_states(mode: str, world: int) -> dict:
    cfg = make_config({"data_parallel": mode})
    cfg.training.seq_len, cfg.training.global_batch_size = SEQ, BATCH * world
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = build_mesh(dims)
    torch.manual_seed(0)
    model = build_model(model_args("debug", **MODEL))
    psi = model.num_params()
    part = parallelize(model, dims, mesh, cfg)
    optimizer = shard_optimizer_state(list(part.parameters()), torch.optim.AdamW, dims, mesh, mode, lr=1e-3)
    gathered = {}

    def count_gathered(module, args, output):
        # FSDP swaps in the unsharded (plain) parameters while a unit is gathered.
        gathered["bytes"] = storage_bytes(p for p in module.parameters() if not isinstance(p, DTensor))
    handle = (part.module if hasattr(part, "module") else part).register_forward_hook(count_gathered)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1))
    F.cross_entropy(part(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    handle.remove()
    optimizer.step()
    state = [t for s in local_optimizer(optimizer).state.values() for t in s.values()
             if torch.is_tensor(t) and t.numel() > 1]  # AdamW's scalar step counters are not model states
    return {"psi": psi, "params": storage_bytes(part.parameters()),
            "grads": storage_bytes(p.grad for p in part.parameters() if p.grad is not None),
            "optimizer": storage_bytes(state), "gathered": gathered["bytes"]}


def formula(mode: str, psi: int, n: int) -> dict:
    sharded = {"ddp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "grads"),
               "zero3": ("optimizer", "grads", "params")}[mode]
    base = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    return {k: v / n if k in sharded else v for k, v in base.items()}


def all_model_states(world: int) -> dict:
    return {mode: model_states(mode, world) for mode in MODES}


def peak_bytes(fn) -> int:
    """The highest level the CPU allocator reaches while ``fn()`` runs, above its level at the start.
    The profiler stores the allocator's running total with every allocation it records."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated))
    allocations.sort()
    start = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - start


def loss_peaks(world: int) -> dict:
    """Peak bytes of one tp=``world`` training step's forward + loss + backward, with the logits
    gathered ("off") and vocabulary-parallel ("on"), as the trainer computes them."""
    results = {}
    for vocab_parallel in (False, True):
        cfg = make_config({"tp": world, "loss_parallel": vocab_parallel})
        dims = ParallelDims.from_config(cfg.parallel, world)
        torch.manual_seed(0)
        model = parallelize(build_model(model_args("debug", **VOCAB_HEAVY)), dims, build_mesh(dims), cfg)
        tokens = torch.randint(0, VOCAB_HEAVY["vocab_size"], (BATCH, SEQ + 1))

        def step():
            with loss_context(dims, cfg):
                cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        step()  # warm-up

        def measured_step():  # starts, like a training step, without gradients
            model.zero_grad(set_to_none=True)
            return peak_bytes(step)
        # gloo frees its buffers on its own threads, later when the CPU is busy: the least of a
        # few peaks is what the step itself needs.
        results["on" if vocab_parallel else "off"] = min(measured_step() for _ in range(3))
    return results


def _worker(rank: int, world: int, measure, out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU measurement (gloo) wherever it runs
    results = measure(world)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def spawn(measure, world: int) -> dict:
    """``measure(world)`` on ``world`` processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        spawn_ranks(_worker, world, measure, out)
        return json.loads(Path(out).read_text())


def activation_bytes(mode: str) -> int:
    """Bytes allocated during forward and still alive when it ends (saved for backward + logits)."""
    torch.manual_seed(0)
    model = build_model(model_args("debug", **MODEL))
    apply_ac(model, mode)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    retained = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return retained


def main() -> int:
    torch.set_num_threads(1)
    rows = []
    for world in (2, 4):
        rows += [(world, mode, r) for mode, r in spawn(all_model_states, world).items()]
    psi = rows[0][2]["psi"]
    mib = 2 ** 20
    print(f"model states per rank at rest, fp32 AdamW, Ψ = {psi:,} parameters (MiB, measured / formula)")
    print(f"{'layout':<8}{'N':>3}{'params':>17}{'grads':>17}{'optimizer':>17}{'total':>17}{'gathered':>10}"
          f"{'  within 10%':>13}")
    for world, mode, r in rows:
        f = formula(mode, psi, world)
        # The formula's parameter term is the copy compute uses: ZeRO-2 pays it as the gathered
        # parameters it holds from forward to backward (FSDP2 then reshards them).
        params = r["gathered"] if mode == "zero2" else r["params"]
        measured = {"params": params, "grads": r["grads"], "optimizer": r["optimizer"]}
        ok = all(abs(measured[k] - f[k]) <= 0.1 * f[k] for k in f)
        cells = [f"{r[k] / mib:6.2f} / {f[k] / mib:6.2f}" for k in ("params", "grads", "optimizer")]
        total, total_f = sum(r[k] for k in f), sum(f.values())
        print(f"{mode:<8}{world:>3}{cells[0]:>17}{cells[1]:>17}{cells[2]:>17}"
              f"{f'{total / mib:6.2f} / {total_f / mib:6.2f}':>17}{r['gathered'] / mib:>10.2f}{'yes' if ok else 'NO':>13}")
    print("gathered: parameter bytes held unsharded at the end of forward. FSDP2's ZeRO-2 reshards after backward,\n"
          "so at rest it holds only a 1/N shard; its formula term (4Ψ) is checked against 'gathered', the others'\n"
          "against the at-rest bytes. ZeRO-3's gathered bytes are the root unit (embeddings, output) and the last block.")
    print(f"\nactivation memory, one process, batch {BATCH} x {SEQ} tokens, {MODEL['n_layers']} layers (MiB alive "
          f"at the end of forward)")
    base = None
    for mode in ("none", "selective", "full"):
        b = activation_bytes(mode)
        base = base or b
        print(f"  checkpointing={mode:<10} {b / mib:8.2f}   ({b / base:.0%} of none)")

    tp = 2
    peaks = spawn(loss_peaks, tp)
    logits = BATCH * SEQ * VOCAB_HEAVY["vocab_size"] * 4
    print(f"\nvocabulary-parallel loss, tp={tp}, vocab {VOCAB_HEAVY['vocab_size']:,}, batch {BATCH} x {SEQ} tokens: "
          f"peak MiB per rank during forward + loss + backward (above the weights)")
    print(f"  loss_parallel=false {peaks['off'] / mib:8.2f}   (full fp32 logits: {logits / mib:.2f} MiB on every rank)")
    print(f"  loss_parallel=true  {peaks['on'] / mib:8.2f}   (logits {logits / tp / mib:.2f} MiB per rank; "
          f"saves {(peaks['off'] - peaks['on']) / mib:.2f} MiB, {1 - peaks['on'] / peaks['off']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
