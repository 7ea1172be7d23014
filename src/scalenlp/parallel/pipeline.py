"""Pipeline parallelism: split the decoder into stages by layer and run a torch.distributed.pipelining schedule.

Stage s holds a contiguous run of layers (the first stage also the embeddings, the last the final norm, the
output projection and the loss), balanced by training FLOPs per token; with pp_stages_per_rank = v > 1, rank r
holds stages r, r + pp, r + 2pp, .... Each stage is a pruned copy of the full model, so parameter names and
checkpoints are the same in every layout. Tied input/output embeddings are two copies, on the first and last
stage, whose gradients are summed after each step as in Megatron-LM (the norm counts them once: ``second_copies``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from scalenlp.config import Config
from scalenlp.models.adapters import is_nf4
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.parallel.parallelize import loss_context, parallelize

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}


def layer_costs(model: nn.Module, seq_len: int) -> tuple[list[float], float]:
    """Per-layer training cost in units of matmul parameters (FLOPs / 6 per token), and the output
    projection's cost, which the last stage carries in addition to its layers."""
    dim = model.args.dim
    costs = [sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)) + 2 * dim * seq_len
             for block in model.layers.values()]
    return costs, float(model.output.weight.numel())


def split_layers(costs: list[float], head_cost: float, num_stages: int) -> list[list[int]]:
    """Contiguous, non-empty runs of layer indices, one per stage, minimising the costliest stage
    (exact dynamic programme; the last stage also pays ``head_cost``)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-stage cost that puts layers [0, i) on stages [0, s).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                stage = prefix[i] - prefix[j] + (head_cost if s == num_stages else 0.0)
                value = max(best[s - 1][j], stage)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]


def stage_module(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` keeping only ``layer_ids`` (and the embeddings / head if first / last)."""
    keep = {str(i) for i in layer_ids}
    # An NF4 weight (QLoRA's frozen base) is shared, not copied: torchao copies one by quantizing its dequantized
    # values again, which changes them, and each lives in one block, so in one stage, of a model dropped after.
    part = copy.deepcopy(model, memo={id(p): p for p in model.parameters() if is_nf4(p)})
    for key in [k for k in part.layers if k not in keep]:
        del part.layers[key]
    if not first:
        part.tok_embeddings = None
        part.pos_embeddings = None
        part.drop = nn.Identity()  # dropout after the embeddings belongs to the first stage only
    if not last:
        part.norm = None
        part.output = None
    return part


def tied_copy_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's first-stage and last-stage ranks with the same dp / tp coordinates
    (the holders of a tied embedding's two copies); None on a rank of neither. For pp = 2 that is
    the pp group itself; otherwise every rank creates every pair's group, in the same order."""
    pp_mesh = mesh["pp"]
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0)
    pairs = [list(pair) for pair in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist())]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _shard_layout(weight: torch.Tensor) -> tuple:
    """Where a weight's local shard sits in the full matrix: mesh, placements, coordinate, shape."""
    if not isinstance(weight, DTensor):
        return None, None, None, None, tuple(weight.shape)
    mesh = weight.device_mesh
    return mesh.mesh_dim_names, tuple(mesh.shape), repr(weight.placements), mesh.get_coordinate(), \
        tuple(weight.to_local().shape)


def check_tied_copies_line_up(weight: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The embedding (vocabulary-parallel under TP: Shard(0)) and the output projection (column-parallel
    over the vocabulary: Shard(0) too), both sharded alike by data parallelism, must hold the same
    rows on the two ranks of ``group``, or summing their local gradients would mix rows."""
    layouts = [None, None]
    dist.all_gather_object(layouts, _shard_layout(weight), group=group)
    if layouts[0] != layouts[1]:
        raise RuntimeError(f"the copies of the tied embedding are sharded differently on the first and the last "
                           f"pipeline stage: {layouts[0]} vs {layouts[1]}")


class PipelineRunner:
    """One optimizer step's worth of forward + backward through the pipeline schedule."""

    def __init__(self, schedule, pp_mesh: DeviceMesh, parts: list[nn.Module], has_first: bool, has_last: bool,
                 device: torch.device, loss_context: Callable[[], contextlib.AbstractContextManager],
                 tied_group: dist.ProcessGroup | None = None):
        self.schedule, self.pp_mesh, self.parts, self.device = schedule, pp_mesh, parts, device
        self.has_first, self.has_last = has_first, has_last
        self.loss_context = loss_context
        self.tied_group = tied_group  # set on the two holders of a tied embedding's copies
        if tied_group is not None:
            check_tied_copies_line_up(self.tied_copy(), tied_group)

    def tied_copy(self) -> nn.Parameter:
        """This rank's copy of the tied embedding. Looked up on each use: FSDP swaps the module's
        parameter between its sharded and gathered forms, and the sharded one holds the gradient."""
        return self.parts[0].tok_embeddings.weight if self.has_first else self.parts[-1].output.weight

    def second_copies(self) -> list[nn.Parameter]:
        """Parameters to clip but leave out of the gradient norm, because the same gradient is counted
        on another rank: the last stage's copy of a tied embedding (the first stage's counts)."""
        return [self.tied_copy()] if self.tied_group is not None and not self.has_first else []

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, input_pos: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Forward + backward of the local batch as the configured microbatches; gradients are left
        in the stage parameters (averaged over microbatches, reduced over data-parallel ranks, and
        summed over a tied embedding's two copies). ``input_pos``: (B, T) positions (data.reset_positions),
        else 0..T-1. Returns the mean loss on every pp rank."""
        loss = self._run(self.schedule.step, inputs, targets, input_pos)
        if self.tied_group is not None:
            self._sum_tied_grads()
        return loss

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        # One process accumulates the embedding's and the output projection's gradients into the one
        # tied weight; here each copy has its half, so both take the sum. The local shards line up
        # (check_tied_copies_line_up), so summing local tensors sums the same rows once both gradients
        # are laid out like their weights: under TP the lookup's backward leaves the embedding's
        # gradient replicated, the output projection's comes back sharded. Under no_grad a DTensor's
        # to_local() is its own storage, so the sum lands in the gradient.
        weight = self.tied_copy()
        grad = weight.grad
        if grad is None:  # a frozen embedding (LoRA): nothing to sum
            return
        if isinstance(grad, DTensor):
            if grad.placements != weight.placements:
                grad = weight.grad = grad.redistribute(placements=weight.placements)
            grad = grad.to_local()
        dist.all_reduce(grad, group=self.tied_group)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, targets: torch.Tensor, input_pos: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Forward only; the mean loss on every pp rank."""
        return self._run(self.schedule.eval, inputs, targets, input_pos)

    def _run(self, run, inputs: torch.Tensor, targets: torch.Tensor, input_pos: torch.Tensor | None
             ) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        # Stages check received tensors against the layout inferred at the first step, strides
        # included, so sliced batches (tokens[:, :-1]) are made contiguous.
        kwargs = {"target": targets.contiguous(), "losses": losses} if self.has_last else {}
        if input_pos is not None:
            # Every stage rotates its queries and keys by the positions, and only the first sees the tokens they
            # come from: the schedule splits keyword arguments into microbatches and hands them to all stages.
            kwargs["input_pos"] = input_pos.contiguous()
        # The schedule runs the last stage's loss and its backward inside step(), so the whole step
        # runs in the loss context (vocabulary-parallel cross-entropy under TP).
        with self.loss_context():
            if self.has_first:
                run(inputs.contiguous(), **kwargs)
            else:
                run(**kwargs)
        loss = torch.stack(losses).mean().detach().float() if self.has_last else torch.zeros((), device=self.device)
        # The last stage lives on the last pp rank (stage s is on rank s mod pp).
        dist.broadcast(loss, group=self.pp_mesh.get_group(), group_src=self.pp_mesh.size() - 1)
        return loss


def build_pipeline(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, cfg: Config,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> tuple[PipelineRunner, list[nn.Module]]:
    """Split ``model`` into this rank's stages, parallelize each (TP/AC/compile/DP), and wrap them in
    the configured schedule. ``loss_fn(logits, targets)`` must be a mean over its microbatch; with
    tp > 1 and parallel.loss_parallel its logits are vocabulary-sharded (see ``loss_context``).
    Returns the runner and the model parts (for the optimizer, gradient clipping and checkpoints)."""
    p = cfg.parallel
    pp_mesh = mesh["pp"]
    pp_rank, v = pp_mesh.get_local_rank(), p.pp_stages_per_rank
    num_stages = dims.pp * v
    costs, head_cost = layer_costs(model, cfg.training.seq_len)
    layers = split_layers(costs, head_cost, num_stages)
    device = next(model.parameters()).device
    stages, parts = [], []
    for stage_id in range(pp_rank, num_stages, dims.pp):
        first, last = stage_id == 0, stage_id == num_stages - 1
        part = parallelize(stage_module(model, layers[stage_id], first, last), dims, mesh, cfg)
        parts.append(part)
        stages.append(PipelineStage(part, stage_id, num_stages, device, group=pp_mesh.get_group()))
    microbatches = p.pp_microbatches or dims.pp
    schedule_class = SCHEDULES[p.pp_schedule]
    if schedule_class in (ScheduleGPipe, Schedule1F1B):
        schedule = schedule_class(stages[0], microbatches, loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages, microbatches, loss_fn=loss_fn)
    # Every rank creates the tied copies' groups, holders or not; stage 0 sits on pp rank 0 and the
    # last stage on pp rank pp - 1 under every schedule, interleaved included.
    tied_group = tied_copy_group(mesh) if model.args.tie_embeddings else None
    has_first, has_last = pp_rank == 0, pp_rank == dims.pp - 1
    runner = PipelineRunner(schedule, pp_mesh, parts, has_first=has_first, has_last=has_last, device=device,
                            loss_context=functools.partial(loss_context, dims, cfg),
                            tied_group=tied_group if has_first or has_last else None)
    return runner, parts
