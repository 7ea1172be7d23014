"""A restarted attempt of a torchrun job resumes by itself, from the newest checkpoint that is whole.

torchrun restarts every worker of a job when one fails (``--max-restarts``) and when the set of nodes
changes (elastic ``--nnodes MIN:MAX``). A restarted worker is a new process with the same command line,
so it must tell a continuation of this launch from a user starting the same command again: the first
refuses nothing and resumes, the second keeps the rule that a run folder with checkpoints needs
``checkpoint.resume=true``.

Who continues: every attempt records in ``<run_dir>/launch.json`` the torchrun agents of its workers,
each as host, the agent's process id (a worker's parent) and torchrun's run id. An attempt continues
the launch when one of its agents is listed there. A relaunch starts new agents, so it is never mistaken
for a restart; a node that joins an elastic job is, because its peers' agents are listed. torchrun's own
TORCHELASTIC_RESTART_COUNT cannot decide it alone: it stays 0 when a node joins, and it is 1 after a
first attempt that stopped on a user error and never trained (whose checkpoints, if any, are an older
run's). The record is written only once every check has passed, so that attempt leaves none.

A Slurm job requeued (its node failed, or `scontrol requeue`) runs its script again with new agents; it
continues too: the record names the job (cluster and id, which a requeue keeps), and a requeued attempt
(SLURM_RESTART_COUNT above 0) of the job named there resumes as a restart does. A first attempt never
matches, so a cluster that reuses job ids after a reinstall is not mistaken for a requeue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import torch.distributed as dist

from scalenlp.config import Config
from scalenlp.errors import UserError
from scalenlp.files import write_file
from scalenlp.launch_env import slurm_requeued
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.train.checkpoint import Checkpointer, read_train_state

LAUNCH_FILE = "launch.json"


def _agent() -> str | None:
    """This worker's torchrun agent, or None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{socket.gethostname()}/{os.getppid()}/{run_id}" if run_id else None


def _agents() -> list[str]:
    """The agents of every worker of this attempt (one all-gather of a short string per rank)."""
    mine = _agent()
    if not dist.is_initialized():
        return [mine] if mine else []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({a for a in every if a})


def _slurm_job() -> str | None:
    """This worker's Slurm job as cluster/id, or None outside Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{os.environ.get('SLURM_CLUSTER_NAME', '')}/{job}" if job else None


def continues_launch(run_dir: Path) -> tuple[bool, list[str]]:
    """(whether this attempt is a restart of the launch that last trained in ``run_dir``, or a requeue of its
    Slurm job; this attempt's agents). Every rank gets the same answer: all read the same record after the
    same all-gather, and every task of a job sees the same SLURM_RESTART_COUNT."""
    agents = _agents()
    try:
        record = json.loads((Path(run_dir) / LAUNCH_FILE).read_text())
        recorded = set(record["agents"])
    except (OSError, ValueError, KeyError, TypeError):  # no record, or one from before: a new launch
        record, recorded = {}, set()
    requeued = slurm_requeued(os.environ) and record.get("slurm_job") == _slurm_job()
    return bool(recorded & set(agents)) or requeued and _slurm_job() is not None, agents


def record_launch(run_dir: Path, agents: list[str], restarted: bool) -> None:
    """Rank 0, once the attempt's checks have passed: list its agents and its Slurm job for the attempts after
    it. A restart keeps the agents listed before (a node lost now may be the one that rejoins later)."""
    job = _slurm_job()
    if not agents and job is None:
        return
    path = Path(run_dir) / LAUNCH_FILE
    if restarted:
        agents = sorted(set(agents) | set(json.loads(path.read_text())["agents"]))
    write_file(path, json.dumps({"agents": agents, "slurm_job": job}, indent=1))


def set_aside_damaged(checkpointer: Checkpointer, log) -> tuple[Path, dict] | None:
    """Rank 0 of a restart: newer checkpoints that are not whole (a rank died while one was written, a disk
    lost a file) are renamed to ``step-N.damaged``, so that the restart resumes from the newest good one
    and pruning never counts a damaged one as kept. They stay on disk for whoever wants to look.

    A user's ``checkpoint.resume=true`` of a damaged checkpoint stays an error (read_train_state's): they
    asked for that state, and silently training on from an older one would lose steps they may not be
    able to spare. A restart is unattended; the previous good checkpoint is exactly what it is for.

    Returns the newest whole checkpoint with its verified train state (None if there is none), so that
    resuming from it does not hash every file of a big checkpoint a second time."""
    for _, path in reversed(checkpointer.complete()):
        try:
            return path, read_train_state(path)
        except UserError as e:
            aside = path.with_name(path.name + ".damaged")
            os.replace(path, aside)
            reason = str(e).split("; delete ")[0]  # read_train_state's advice is for a user, not for a restart
            log(f"warning: {reason}; the restart sets it aside as {aside.name} and resumes from the checkpoint "
                f"before it")
    return None


def keep_micro_batch(cfg: Config, saved: dict, dims: ParallelDims, log) -> Config:
    """On fewer data-parallel ranks than the checkpoint was saved with (a node lost), the global batch stays
    the same; with training.micro_batch_size=0 each rank would then run a larger micro-batch, which may not
    fit in memory. Keep the saved per-rank micro-batch instead and accumulate more of them."""
    t = cfg.training
    saved_dp = 1
    for name, size in saved.get("layout", []):
        if name.startswith("dp_"):
            saved_dp *= size
    local = t.global_batch_size // dims.dp
    if t.micro_batch_size or saved_dp <= dims.dp or local % (t.global_batch_size // saved_dp):
        return cfg
    micro = t.global_batch_size // saved_dp
    log(f"data-parallel ranks {saved_dp} -> {dims.dp}: the global batch stays {t.global_batch_size} sequences, as "
        f"{local // micro} micro-batches of {micro} per rank (training.micro_batch_size={micro})")
    return dataclasses.replace(cfg, training=dataclasses.replace(t, micro_batch_size=micro))
