"""Where a scheduler started `scalenlp train`: Slurm's and MPI launchers' environments, read as torchrun's.

The one place that knows their variables. Jobs come in two shapes:

- one task per node (``srun --ntasks-per-node=1``, what `scalenlp deploy slurm` writes): each task runs
  torchrun's launcher for its node's processes, and the nodes meet at the first node of the allocation
  (c10d rendezvous), so torchrun's restarts stay. ``slurm_nodes`` says how.
- one task per training process (``mpirun -np N``, ``srun --ntasks-per-node=G``): each task is a rank, and
  ``rank_env`` gives the variables torchrun would have set for it (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the process group is gloo / NCCL as under torchrun.

Under torchrun (WORLD_SIZE already set) neither applies: torchrun's own variables win.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from scalenlp.errors import UserError

DEFAULT_PORT = 29500  # torch's MASTER_PORT default, when the scheduler gives no job id to derive one from
# A job's port is derived from its id, so that two jobs sharing a node do not meet on the same port.
PORT_BASE, PORT_SPAN = 20000, 10000
MPI_RANKS = {  # launcher: (rank, world size, local rank, ranks on this host)
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
_GROUP = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list as its hosts, in order: ``node[01-03,7],login`` -> node01, node02, node03,
    node7, login. Each bracket is a comma list of numbers and ranges (zero padding kept); several brackets in
    one name (``rack[1-2]-n[1-2]``) multiply out as Slurm does."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise UserError(f"host list {spec!r}: brackets do not pair; expected names like node[01-03,7]")
        if ch == "," and depth == 0:
            if spec[start:i]:
                hosts += _expand_name(spec[start:i], spec)
            start = i + 1
    if depth or not hosts:
        raise UserError(f"host list {spec!r}: brackets do not pair or no host is named; expected names like "
                        f"node[01-03,7]")
    return hosts


def _expand_name(name: str, spec: str) -> list[str]:
    group = _GROUP.search(name)
    if group is None:
        return [name]
    numbers = []
    for part in group.group(1).split(","):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (high or low).isdigit() and int(low) <= int(high or low)):
            raise UserError(f"host list {spec!r}: {part!r} is not a number or a rising range such as 01-03")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    head, tail = name[:group.start()], name[group.end():]
    return [head + n + rest for n in numbers for rest in _expand_name(tail, spec)]


def slurm_hosts(nodelist: str) -> list[str]:
    """The allocation's hosts: Slurm's own `scontrol show hostnames` where it is installed, else our reading."""
    if shutil.which("scontrol"):
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_hostlist(nodelist)


def job_port(env: dict[str, str], job_id: str | None) -> int:
    """MASTER_PORT where the user set it, else one derived from the job id (the same on every task of the job)."""
    if env.get("MASTER_PORT"):
        return _whole(env, "MASTER_PORT", 1, 65535)
    return PORT_BASE + int(job_id) % PORT_SPAN if job_id and job_id.isdigit() else DEFAULT_PORT


def _whole(env: dict[str, str], name: str, low: int = 0, high: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        raise UserError(f"{name} is not set, though the launcher set others of its variables; check how the job "
                        f"was started")
    if not value.isdigit() or int(value) < low or high is not None and int(value) > high:
        raise UserError(f"{name}={value!r} is not a whole number from {low}{f' to {high}' if high else ''}; "
                        f"check how the job was started")
    return int(value)


def in_slurm_step(env: dict[str, str]) -> bool:
    """Inside a Slurm job step (srun), not merely inside an allocation's shell; torchrun's variables win."""
    return "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env and "WORLD_SIZE" not in env


def slurm_requeued(env: dict[str, str]) -> bool:
    """A second or later attempt of a Slurm job (requeued after a node failure, a preemption or `scontrol
    requeue`): the job runs its script again from the top."""
    return env.get("SLURM_RESTART_COUNT", "0") != "0"


def _slurm_tasks(env: dict[str, str]) -> tuple[int, int]:
    """(tasks, nodes) of this job step."""
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    nodes = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
    return _whole(env, tasks, 1), _whole(env, nodes, 1)


def gpus_per_task(env: dict[str, str]) -> int | None:
    """SLURM_GPUS_PER_TASK (``2``, or typed ``a100:2``), None where the job asked for none per task."""
    value = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]
    if not value:
        return None
    if not value.isdigit():
        raise UserError(f"SLURM_GPUS_PER_TASK={env['SLURM_GPUS_PER_TASK']!r} is not a GPU count; submit with "
                        f"--gpus-per-task=N")
    return int(value)


@dataclass(frozen=True)
class SlurmNodes:
    """A Slurm step of one task per node, as torchrun's launch flags."""
    nnodes: int
    nproc: int | None  # processes per node: the task's GPUs, None where the allocation does not say
    endpoint: str  # HOST:PORT, the allocation's first node
    job_id: str


def slurm_nodes(env: dict[str, str]) -> SlurmNodes | None:
    """The launch of this Slurm step when it runs one task per node; None outside Slurm or with more tasks."""
    if not in_slurm_step(env):
        return None
    tasks, nodes = _slurm_tasks(env)
    if tasks != nodes:
        return None
    gpus = gpus_per_task(env)
    if gpus is None and env.get("SLURM_GPUS_ON_NODE", "0").isdigit() and int(env.get("SLURM_GPUS_ON_NODE", "0")):
        gpus = int(env["SLURM_GPUS_ON_NODE"])  # --gres=gpu:N: the node's one task holds all its GPUs
    job = env["SLURM_JOB_ID"]
    return SlurmNodes(nodes, gpus, f"{slurm_hosts(_nodelist(env))[0]}:{job_port(env, job)}", job)


def rank_env(env: dict[str, str]) -> tuple[str, dict[str, str]] | None:
    """(the launcher, torchrun's variables for this task) when the launcher started one task per training
    process (mpirun, or a Slurm step of several tasks per node); None otherwise."""
    if "WORLD_SIZE" in env:
        return None
    for launcher, names in MPI_RANKS.items():
        if names[0] in env:
            rank, world, local, local_world = (_whole(env, name) for name in names)
            job = env.get("OMPI_MCA_ess_base_jobid") if launcher == "Open MPI" else None
            if env.get("MASTER_ADDR"):
                addr = env["MASTER_ADDR"]
            elif local_world == world:  # every rank on this host
                addr = "127.0.0.1"
            else:
                raise UserError(f"{launcher} started ranks on several hosts: give rank 0's host as MASTER_ADDR "
                                f"(mpirun -x MASTER_ADDR=HOST with Open MPI, -genv MASTER_ADDR HOST with MPICH)")
            return launcher, _torchrun_env(rank, world, local, local_world, addr, job_port(env, job))
    if not in_slurm_step(env) or slurm_nodes(env) is not None:
        return None
    gpus = gpus_per_task(env)
    if gpus is not None and gpus != 1:
        raise UserError(f"srun started several tasks per node with {gpus} GPUs each, but a task is one training "
                        f"process on one GPU: submit with --gpus-per-task=1, or one task per node "
                        f"(--ntasks-per-node=1) whose processes share its GPUs")
    addr = env.get("MASTER_ADDR") or slurm_hosts(_nodelist(env))[0]
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
    node = _whole(env, "SLURM_NODEID")
    if node >= len(per_node):
        raise UserError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE names {len(per_node)} node(s); start "
                        f"training with srun")
    return "Slurm", _torchrun_env(_whole(env, "SLURM_PROCID"), _slurm_tasks(env)[0], _whole(env, "SLURM_LOCALID"),
                                  per_node[node], addr, job_port(env, env["SLURM_JOB_ID"]))


def _nodelist(env: dict[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return env[name]
    raise UserError("inside a Slurm step but SLURM_JOB_NODELIST is not set; start training with srun")


def _tasks_per_node(counts: str) -> list[int]:
    """Slurm's tasks-per-node list, whose repeats are compressed: ``2(x3),1`` -> [2, 2, 2, 1]."""
    per_node = []
    for part in filter(None, counts.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise UserError(f"SLURM_TASKS_PER_NODE={counts!r} is not a list such as 2(x3),1; start training "
                            f"with srun")
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    return per_node


def _torchrun_env(rank: int, world: int, local: int, local_world: int, addr: str, port: int) -> dict[str, str]:
    if not (0 <= rank < world and 0 <= local < local_world):
        raise UserError(f"rank {rank} of {world} (local {local} of {local_world}) from the launcher's variables is "
                        f"out of range; check how the job was started")
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
