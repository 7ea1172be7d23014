"""A parallel layout, and the one check of whether a model can run it, shared by the trainer
(``parallel.*`` config keys), the sharded server (``--tp``) and the planner (``--layout``).

Pure Python (no torch), so that config validation and the planner import it without cost. The rules are
what runs (tp divides the heads, key/value heads and MLP width but not the vocabulary; what each pipeline
schedule needs of its microbatches), checked against one process in tests/unit/test_layout.py and listed
in docs/training.md, "Parallel layouts".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalenlp.errors import ConfigError, UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
INTERLEAVED = ("interleaved_1f1b", "zero_bubble")  # the schedules that take pp_stages_per_rank > 1
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")  # indexed by ZeRO stage (Layout.zero)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSizes:
    """What a layout splits: heads, key/value heads and MLP width over tp, layers over pp."""
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    encoder: bool = False  # encoders pool over the whole sequence: no pipeline, no sequence parallelism

    @classmethod
    def of(cls, args, encoder: bool = False) -> ModelSizes:
        """From a decoder's ModelArgs or (``encoder``) an EncoderArgs, whose attention has no separate kv heads."""
        return cls(heads=args.n_heads, kv_heads=getattr(args, "n_kv_heads", args.n_heads), ffn=args.ffn_dim,
                   layers=args.n_layers, encoder=encoder)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    microbatch: int = 1  # sequences per forward/backward on one rank
    zero: int = 0  # 0 = DDP, 1-3 = ZeRO stage over dp_shard (DATA_PARALLEL names them)
    recompute: str = "none"  # one of RECOMPUTE
    schedule: str = "1f1b"  # one of SCHEDULES (pp > 1)
    stages_per_rank: int = 1  # v of the interleaved schedules
    sequence_parallel: bool = False
    offload: bool = False  # FSDP's shards and the optimizer's state in host memory (parallel.offload)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def microbatches(self, global_batch: int) -> int:
        """Microbatches each rank runs per step."""
        return global_batch // (self.dp * self.microbatch)

    def describe(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}",
                 f"pp={self.pp}", f"microbatch={self.microbatch}", f"zero={self.zero}",
                 f"recompute={self.recompute}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}" + (f",v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        if self.sequence_parallel:
            parts.append("sp=true")
        if self.offload:
            parts.append("offload=true")
        return " ".join(parts)

    @classmethod
    def from_config(cls, cfg, world_size: int) -> Layout:
        """The layout a Config runs on ``world_size`` processes: dp_shard=-1 resolved, the batch keys turned
        into sequences per microbatch. A config no layout describes (degrees that do not multiply to the world
        size, a batch that does not split) is a ConfigError; whether the model can run it is ``check``'s."""
        p, t = cfg.parallel, cfg.training
        dp_shard = resolve_dp_shard(p, world_size)
        degrees = cls(dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, pp=p.pp)
        if degrees.devices != world_size:
            raise ConfigError(degrees_problem(degrees, world_size))
        g, dp = t.global_batch_size, degrees.dp
        if g % dp:
            raise ConfigError(f"training.global_batch_size={g} is not divisible by the {dp} data-parallel ranks; "
                              f"use a multiple of {dp}")
        local = g // dp
        if p.pp > 1:  # the pipeline schedule splits the local batch into parallel.pp_microbatches itself
            count = p.pp_microbatches or p.pp
            if local % count:
                raise ConfigError(f"parallel.pp_microbatches={count} does not divide the per-rank batch {local} "
                                  f"(global_batch_size / data-parallel degree); choose a divisor of {local}")
            micro = local // count
        else:
            micro = t.micro_batch_size or local
            if local % micro:
                raise ConfigError(f"training.micro_batch_size={micro} does not divide the {local} sequences each "
                                  f"rank gets per step (global_batch_size / data-parallel ranks)")
        return cls(dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, pp=p.pp, microbatch=micro,
                   zero=DATA_PARALLEL.index(p.data_parallel), recompute=t.activation_checkpointing,
                   schedule=p.pp_schedule, stages_per_rank=p.pp_stages_per_rank,
                   sequence_parallel=p.sequence_parallel, offload=p.offload)

    def to_config(self, global_batch: int) -> dict[str, str]:
        """The reverse of ``from_config``: ``section.key`` -> value as ``--set`` takes it (the workload's keys,
        global batch and sequence length, are the caller's)."""
        settings = {
            "parallel.dp_replicate": self.dp_replicate, "parallel.dp_shard": self.dp_shard,
            "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.data_parallel": DATA_PARALLEL[self.zero],
            "parallel.sequence_parallel": self.sequence_parallel,
        }
        if self.offload:  # rare: left out of the usual command
            settings["parallel.offload"] = True
        if self.pp > 1:  # the schedule splits each rank's batch into pp_microbatches itself
            settings["parallel.pp_schedule"] = self.schedule
            settings["parallel.pp_microbatches"] = self.microbatches(global_batch)
            settings["parallel.pp_stages_per_rank"] = self.stages_per_rank
        else:
            settings["training.micro_batch_size"] = self.microbatch
        settings["training.activation_checkpointing"] = self.recompute
        return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}


def resolve_dp_shard(p, world_size: int) -> int:
    """parallel.dp_shard, with -1 taking whatever the other degrees (a ParallelConfig's) leave of the world."""
    if p.dp_shard != -1:
        return p.dp_shard
    fixed = p.dp_replicate * p.tp * p.pp
    if world_size % fixed:
        raise ConfigError(f"parallel.dp_replicate*tp*pp = {p.dp_replicate}*{p.tp}*{p.pp} = {fixed} does not divide "
                          f"the world size {world_size}; choose degrees whose product divides the number of processes")
    return world_size // fixed


def degrees_problem(degrees, devices: int) -> str | None:
    """Why ``degrees`` (anything with dp_replicate, dp_shard, tp and pp) cannot fill ``devices``, or None."""
    product = degrees.dp_replicate * degrees.dp_shard * degrees.tp * degrees.pp
    if product == devices:
        return None
    return (f"dp_replicate*dp_shard*tp*pp = {degrees.dp_replicate}*{degrees.dp_shard}*{degrees.tp}*{degrees.pp} = "
            f"{product} but there are {devices} devices (processes); make the product equal their number")


def choice_problems(schedule: str, recompute: str) -> list[str]:
    """Names outside the lists: config validation asks this before any model or world size is known."""
    problems = []
    if schedule not in SCHEDULES:
        problems.append(f"pipeline schedule {schedule!r} is not one of {' | '.join(SCHEDULES)}")
    if recompute not in RECOMPUTE:
        problems.append(f"activation recomputation {recompute!r} is not one of {' | '.join(RECOMPUTE)}")
    return problems


def problems(layout: Layout, model: ModelSizes, devices: int, seq: int | None = None,
             global_batch: int | None = None) -> list[tuple[str, str]]:
    """(kind, what is wrong and how to fix it) for each reason ``model`` cannot run ``layout`` on ``devices``;
    empty when it can. ``seq`` and ``global_batch`` are the training workload (None when serving)."""
    lay, found = layout, []

    def bad(kind: str, message: str) -> None:
        found.append((kind, message))

    if min(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.microbatch, lay.stages_per_rank) < 1:
        return [("bad value", "every degree, the microbatch and the stages per rank must be at least 1")]
    if problem := degrees_problem(lay, devices):
        bad("degrees do not multiply to the device count", problem)
    if lay.zero not in range(len(DATA_PARALLEL)):
        bad("bad value", f"ZeRO stage {lay.zero} is not one of 0 (ddp), 1, 2, 3")
    for problem in choice_problems(lay.schedule, lay.recompute):
        bad("bad value", problem)
    if lay.offload and (lay.zero < 2 or lay.dp == 1):
        bad("bad value", "offload moves FSDP's shards to host memory, so it needs zero2 or zero3 data parallelism "
                         "over more than one rank; turn offload off, or shard with zero2|zero3 over dp > 1 ranks")
    for what, size in (("attention heads", model.heads), ("key/value heads", model.kv_heads),
                       ("MLP width (ffn)", model.ffn)):
        if size % lay.tp:
            bad("tp does not divide the model", f"tp={lay.tp} does not divide the model's {size} {what}; "
                                                f"choose a tp that divides {size}")
    if model.encoder and (lay.pp > 1 or lay.sequence_parallel and lay.tp > 1):
        bad("encoders are not pipelined", "encoders are not pipelined and have no sequence parallelism (their "
                                          "pooling reads the whole sequence); use pp=1 without sequence parallelism")
    if lay.sequence_parallel and lay.tp > 1 and seq is not None and seq % lay.tp:
        bad("tp does not divide the sequence", f"sequence parallelism splits the sequence over the tp ranks: "
                                               f"tp={lay.tp} does not divide the sequence length {seq}")
    if lay.stages_per_rank > 1 and lay.schedule not in INTERLEAVED:
        bad("bad value", f"{lay.stages_per_rank} pipeline stages per rank (v) need an interleaved schedule: "
                         f"{' or '.join(INTERLEAVED)}")
    stages = lay.pp * lay.stages_per_rank
    if lay.pp > 1 and stages > model.layers:
        bad("more pipeline stages than layers",
            f"pp={lay.pp} x {lay.stages_per_rank} stages per rank = {stages} pipeline stages but the model has only "
            f"{model.layers} layers; use at most {model.layers} stages")
    if global_batch is None:
        return found
    if global_batch % (lay.dp * lay.microbatch):
        bad("global batch does not split", f"global batch {global_batch} is not divisible by data-parallel degree "
                                           f"x microbatch = {lay.dp} x {lay.microbatch}")
    elif lay.pp > 1:
        m = lay.microbatches(global_batch)
        rounds = max(1, m // lay.pp)
        if lay.schedule == "1f1b" and m < lay.pp:
            bad("too few microbatches for the pipeline", f"the 1f1b schedule needs at least one microbatch per "
                                                         f"stage: {m} microbatches per step cannot fill {lay.pp} "
                                                         f"pipeline stages")
        elif lay.schedule in INTERLEAVED and m % rounds:
            bad("microbatches do not fill the rounds", f"the {lay.schedule} schedule splits the {m} microbatches per "
                                                       f"step into m // pp = {rounds} rounds, which must divide "
                                                       f"them; use a multiple of pp={lay.pp}")
    return found


def check(layout: Layout, model: ModelSizes, devices: int, seq: int | None = None, global_batch: int | None = None,
          error: type[UserError] = UserError) -> None:
    """Raise ``error`` naming every reason ``problems`` finds, in one line."""
    found = problems(layout, model, devices, seq, global_batch)
    if found:
        raise error("; ".join(message for _, message in found))


def largest_shard(size: int, tp: int) -> int:
    """Rows of ``size`` on the rank holding most of them when split over ``tp`` ranks (the vocabulary)."""
    return math.ceil(size / tp)
