"""Loss and gradient-norm parity of every parallel layout against one process.

    python benchmarks/parity.py [--steps 10] [--layouts ddp2,tp2,...]

Each layout trains the same model (the debug flavor with 4 layers, float32) on the same global
batches from the same initial weights, through scalenlp.parallel (parallelize / build_pipeline /
shard_optimizer_state / skip_gradient_sync / loss_context / clip_grad_norm_) with AdamW and the
trainer's loss (lm_loss: the model's chunked loss, or under TP the vocabulary-parallel cross_entropy
unless the layout sets loss_parallel=False, as "tp2 full logits" does); the table shows the largest relative difference of the per-step loss
and gradient norm from the single-process run.
Layouts of one world size share one launch of processes (gloo, one thread each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from scalenlp.config import Config
from scalenlp.models.flavors import build_model, model_args
from scalenlp.parallel.data_parallel import skip_gradient_sync
from scalenlp.parallel.mesh import ParallelDims, build_mesh, dp_rank
from scalenlp.parallel.parallelize import (
    check_layout,
    clip_grad_norm_,
    dp_mesh,
    loss_context,
    parallelize,
    shard_optimizer_state,
)
from scalenlp.parallel.pipeline import build_pipeline
from scalenlp.testing.ranks import spawn_ranks
from scalenlp.train.loss import cross_entropy, lm_loss

# name -> (world size, overrides: [parallel] keys, or "section.key" for other sections)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "ddp2": (2, dict(data_parallel="ddp")),
    "zero1x2": (2, dict(data_parallel="zero1")),
    "zero2x2": (2, dict(data_parallel="zero2")),
    "zero3x2": (2, dict(data_parallel="zero3")),
    "tp2": (2, dict(tp=2)),
    "tp2 full logits": (2, dict(tp=2, loss_parallel=False)),
    "tp2+sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2 gpipe": (2, dict(pp=2, pp_schedule="gpipe", pp_microbatches=4)),
    "pp2 1f1b": (2, dict(pp=2, pp_schedule="1f1b", pp_microbatches=4)),
    "pp2 interleaved": (2, dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_microbatches=4)),
    "pp2 zero bubble": (2, dict(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=2, pp_microbatches=4)),
    "zero3x2+ac full": (2, {"data_parallel": "zero3", "training.activation_checkpointing": "full"}),
    "tp2+sp+ac sel.": (2, {"tp": 2, "sequence_parallel": True, "training.activation_checkpointing": "selective"}),
    "pp2 1f1b+ac full": (2, {"pp": 2, "pp_microbatches": 4, "training.activation_checkpointing": "full"}),
    "zero3x4": (4, dict(data_parallel="zero3")),
    "hsdp2x2": (4, dict(data_parallel="zero3", dp_replicate=2)),
    "dp2xtp2": (4, dict(data_parallel="zero3", tp=2)),
    "dp2xpp2": (4, dict(data_parallel="ddp", pp=2, pp_microbatches=2)),
    "tp2xpp2": (4, dict(tp=2, pp=2, pp_microbatches=4)),
    "tp2+sp xpp2": (4, dict(tp=2, sequence_parallel=True, pp=2, pp_microbatches=4)),
    "ddp2xtp2": (4, dict(data_parallel="ddp", tp=2)),
    "zero1 dp2xtp2": (4, dict(data_parallel="zero1", tp=2)),
    "zero1 dp2xpp2": (4, dict(data_parallel="zero1", pp=2, pp_microbatches=2)),
    "dp2xtp2xpp2": (8, dict(data_parallel="zero3", tp=2, pp=2, pp_microbatches=2)),
    "hsdp2x2xtp2": (8, dict(data_parallel="zero3", dp_replicate=2, tp=2)),
}



@dataclass(frozen=True)
class Shape:
    """Model and batch of a run: the parity default is tiny; benchmarks/scaling.py uses a larger one."""
    model: tuple = (("vocab_size", 256), ("n_layers", 4), ("max_seq_len", 16))  # overrides of the debug flavor
    seq: int = 16
    global_batch: int = 8
    micro_batch: int = 2  # per rank, for gradient accumulation when pp == 1


PARITY = Shape()


def make_config(parallel: dict, shape: Shape = PARITY) -> Config:
    cfg = Config()
    cfg.training.seq_len, cfg.training.global_batch_size = shape.seq, shape.global_batch
    for key, value in parallel.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(cfg, section or "parallel"), name, value)
    return cfg


def batches(steps: int, shape: Shape, vocab: int, seed: int = 0) -> torch.Tensor:
    """(steps, global batch, seq + 1) token sequences that count up by a per-row stride: learnable,
    so the loss falls and the comparison covers a moving optimisation, not noise."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (steps, shape.global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (steps, shape.global_batch, 1), generator=g)
    return (start + stride * torch.arange(shape.seq + 1)) % vocab


def train(parallel: dict, world: int, steps: int, shape: Shape = PARITY) -> dict[str, list[float]]:
    """Train ``steps`` steps under the layout on this process's share; per-step losses, gradient
    norms and wall-clock seconds."""
    cfg = make_config(parallel, shape)
    margs = model_args("debug", **dict(shape.model))
    dims = ParallelDims.from_config(cfg.parallel, world)
    check_layout(margs, dims, cfg)
    mesh = build_mesh(dims)
    torch.manual_seed(cfg.training.seed)
    model = build_model(margs)
    pp_mesh = mesh["pp"] if mesh is not None else None
    if dims.pp > 1:
        runner, parts = build_pipeline(model, dims, mesh, cfg, cross_entropy)
    else:
        parts = [parallelize(model, dims, mesh, cfg)]
    # At 3e-3 ten steps move the loss from the Llama recipe's unit-scale embeddings (at 1e-3 they barely do).
    optimizers = [shard_optimizer_state([q for q in part.parameters()], torch.optim.AdamW, dims, mesh,
                                        cfg.parallel.data_parallel,
                                        lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)) for part in parts]
    local = shape.global_batch // dims.dp
    rank_in_dp = dp_rank(mesh)
    data = batches(steps, shape, margs.vocab_size)[:, rank_in_dp * local:(rank_in_dp + 1) * local]
    dp_group = dp_mesh(mesh, flat=True).get_group() if mesh is not None and dims.dp > 1 else None
    losses, norms, seconds = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets = data[step, :, :-1], data[step, :, 1:]
        if dims.pp > 1:
            loss = runner.step(inputs, targets)
        else:
            n_micro = local // shape.micro_batch
            loss = torch.zeros(())
            for i in range(n_micro):
                sl = slice(i * shape.micro_batch, (i + 1) * shape.micro_batch)
                sync = i == n_micro - 1
                with contextlib.nullcontext() if sync else skip_gradient_sync(parts), loss_context(dims, cfg):
                    micro_loss = lm_loss(parts[0], inputs[sl], targets[sl], dims) / targets[sl].numel() / n_micro
                    micro_loss.backward()
                loss += micro_loss.detach()
        norm = clip_grad_norm_([q for part in parts for q in part.parameters()], 1.0, pp_mesh,
                               counted_elsewhere=runner.second_copies() if dims.pp > 1 else [])
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dims.dp
        losses.append(loss.item())
        norms.append(norm.item())
        seconds.append(time.perf_counter() - start)
    return {"loss": losses, "grad_norm": norms, "step_s": seconds}


def _worker(rank: int, world: int, layouts: dict[str, dict], steps: int, shape: Shape, out: str) -> None:
    # A CPU harness (gloo, one thread per process) wherever it runs: several ranks cannot share one GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = {name: train(parallel, world, steps, shape) for name, parallel in layouts.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run_layouts(names: list[str], steps: int, shape: Shape = PARITY,
                layouts: dict[str, tuple[int, dict]] = LAYOUTS) -> dict[str, dict[str, list[float]]]:
    """Results per layout name (a key of ``layouts``); one process launch per world size."""
    results = {}
    for world in sorted({layouts[n][0] for n in names}):
        group = {n: layouts[n][1] for n in names if layouts[n][0] == world}
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            spawn_ranks(_worker, world, group, steps, shape, out)
            results |= json.loads(Path(out).read_text())
    return results


def reference(steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    return train({}, 1, steps)


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    ref = reference(args.steps)
    results = run_layouts(names, args.steps)
    print(f"single process: losses {ref['loss'][0]:.5f} -> {ref['loss'][-1]:.5f} over {args.steps} steps")
    print(f"{'layout':<18}{'procs':>6}{'max rel diff loss':>20}{'max rel diff grad norm':>25}{'  within 1e-4':>14}")
    ok = True
    for name in names:
        dl = relative_diff(results[name]["loss"], ref["loss"])
        dg = relative_diff(results[name]["grad_norm"], ref["grad_norm"])
        ok &= dl < 1e-4 and dg < 1e-4
        print(f"{name:<18}{LAYOUTS[name][0]:>6}{dl:>20.2e}{dg:>25.2e}{'yes' if dl < 1e-4 and dg < 1e-4 else 'NO':>14}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
