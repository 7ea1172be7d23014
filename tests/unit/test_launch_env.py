"""Schedulers' environments read as torchrun's (scalenlp.launch_env): Slurm's compressed host lists, a Slurm step
of one task per node as launch flags, one task per rank (Open MPI, MPICH, srun) as RANK / WORLD_SIZE / ...;
`scalenlp deploy slurm`'s script; and an allocation that does not fit the layout, in one error line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from scalenlp.cli import main
from scalenlp.errors import UserError
from scalenlp.launch_env import PORT_BASE, expand_hostlist, rank_env, slurm_nodes
from scalenlp.parallel import mesh
from train_helpers import TINY

HOSTLISTS = {
    "vm": ["vm"],
    "node[01-03,7]": ["node01", "node02", "node03", "node7"],
    "login,gpu[09-11]": ["login", "gpu09", "gpu10", "gpu11"],
    "rack[1-2]-n[8-9]": ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"],
    "a[1],b[002-003]": ["a1", "b002", "b003"],
}


@pytest.mark.parametrize("spec", HOSTLISTS)
def test_hostlists_expand_as_slurm_expands_them(spec, tmp_path):
    assert expand_hostlist(spec) == HOSTLISTS[spec]
    if shutil.which("scontrol"):  # Slurm's own reading, where it is installed, agrees
        conf = tmp_path / "slurm.conf"  # scontrol reads one before anything else
        conf.write_text("ClusterName=c\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=localhost\n")
        assert subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True, check=True,
                              env={**os.environ, "SLURM_CONF": str(conf)}).stdout.split() == HOSTLISTS[spec]


@pytest.mark.parametrize("spec", ["node[1-", "node]1[", "node[3-1]", "node[a-b]", "node[1,,2]", "", ","])
def test_malformed_hostlists_are_refused(spec):
    with pytest.raises(UserError, match="host list"):
        expand_hostlist(spec)


def slurm_step(**extra: str) -> dict[str, str]:
    """A task's environment in a job step on gpu07 and gpu08 (one task per node), as srun sets it."""
    return {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", **extra}


def test_slurm_task_per_node_is_torchrun_on_the_first_node():
    job = slurm_nodes(slurm_step(SLURM_GPUS_PER_TASK="a100:4"))
    assert (job.nnodes, job.nproc, job.endpoint, job.job_id) == (2, 4, f"gpu07:{PORT_BASE + 4321}", "4321")
    assert slurm_nodes(slurm_step(MASTER_PORT="7000")).endpoint == "gpu07:7000"
    assert slurm_nodes(slurm_step(SLURM_GPUS_ON_NODE="2")).nproc == 2  # --gres=gpu:2, the node's one task
    assert slurm_nodes(slurm_step()).nproc is None  # no GPUs: --nproc says
    assert rank_env(slurm_step()) is None
    batch_shell = {k: v for k, v in slurm_step().items() if not k.startswith("SLURM_STEP")}
    assert slurm_nodes(batch_shell) is None and rank_env(batch_shell) is None  # not under srun: a plain run
    assert slurm_nodes(slurm_step(WORLD_SIZE="8")) is None  # a torchrun worker inside the job


def test_one_task_per_rank_from_each_launcher():
    srun = slurm_step(SLURM_NTASKS="6", SLURM_STEP_NUM_TASKS="6", SLURM_STEP_TASKS_PER_NODE="4,2",
                      SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_GPUS_PER_TASK="1")
    assert slurm_nodes(srun) is None
    assert rank_env(srun) == ("Slurm", {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(PORT_BASE + 4321)})
    openmpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "572784641"}
    assert rank_env(openmpi) == ("Open MPI", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(PORT_BASE + 572784641 % 10000)})
    mpich = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert rank_env(mpich) == ("MPICH", {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"})
    assert rank_env({**openmpi, "WORLD_SIZE": "2"}) is None  # torchrun's own variables win


@pytest.mark.parametrize("env, message", [
    ({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, "-genv MASTER_ADDR HOST"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "out of range"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='x' is not a whole number"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, "MPI_LOCALNRANKS is not set"),
    (slurm_step(SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_GPUS_PER_TASK="2"),
     "a task is one training process on one GPU"),
    (slurm_step(SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x)"), "not a list such as 2(x3),1"),
])
def test_launcher_variables_that_cannot_work_are_one_line(env, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        rank_env(env)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("gpus, flags, expected", [
    # 2 nodes x 3 GPUs per task = 6 ranks, which a global batch of 4 cannot be split over.
    ("3", [], "Slurm job 4321 runs 2 node(s) x 3 process(es) (one per GPU of its task): "),
    ("2", ["--nproc", "4"], "--nproc 4, but the Slurm job gives each node's task 2 GPU(s)"),
])
def test_allocation_that_does_not_fit_the_layout_is_one_line(monkeypatch, capsys, tmp_path, gpus, flags, expected):
    for name, value in slurm_step(SLURM_GPUS_PER_TASK=gpus).items():
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--run-dir", str(tmp_path / "run"), *flags, *[a for s in TINY for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_mpirun_ranks_say_a_layout_does_not_fit_once(monkeypatch, capsys, tmp_path, rank):
    """Every rank checks the layout before joining the others; only rank 0 says what is wrong."""
    for name, value in {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sets = [*TINY, "parallel.tp=3"]
    assert main(["train", "--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert err == ("" if rank else "error: 2 processes started by Open MPI: parallel.dp_replicate*tp*pp = 1*3*1 = 3 "
                   "does not divide the world size 2; choose degrees whose product divides the number of processes\n")
    assert not (tmp_path / "run").exists()
    assert main(["train", "--nproc", "2", *[a for s in TINY for a in ("--set", s)]]) == 2
    assert "started this process as rank" in capsys.readouterr().err


def test_deploy_slurm_writes_a_script_of_one_task_per_node(tmp_path, capsys):
    out = tmp_path / "job out"
    assert main(["deploy", "slurm", "--train", "configs/debug.toml", "--out", str(out), "--nodes", "4",
                 "--gpus-per-node", "8", "--time", "2-00:00:00", "--partition", "gpu", "--grace-period", "120",
                 "--run-dir", "/shared/runs/llm", "--set", "training.global_batch_size=32"]) == 0
    script = (out / "train.sbatch").read_text()
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--job-name=debug", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-task=8",
                          "--time=2-00:00:00", "--partition=gpu", f"--output='{out}/debug-%j.log'",
                          "--open-mode=append", "--requeue", "--signal=TERM@120"]
    assert script.splitlines()[-1] == (f"srun --kill-on-bad-exit=1 scalenlp train --config '{out}/train.toml' "
                                       f"--run-dir /shared/runs/llm --max-restarts 3")
    config = (out / "train.toml").read_text()
    assert "resume = true" in config and "global_batch_size = 32" in config
    assert f"sbatch {out}/train.sbatch" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "3", "--gpus-per-node", "1"], "not divisible by the 3 data-parallel ranks"),  # debug.toml's batch over 3 ranks
    (["--time", "two days"], "--time 'two days' is not what sbatch takes"),
    (["--partition", "gpu;reboot"], "--partition 'gpu;reboot' is not what sbatch takes"),
    (["--gpus-per-node", "2", "--nproc-per-node", "4"], "each process takes one GPU"),
    (["--nodes", "0"], "--nodes must be at least 1"),
])
def test_deploy_slurm_mistakes_are_one_line_and_write_nothing(tmp_path, capsys, args, message):
    assert main(["deploy", "slurm", "--train", "configs/debug.toml", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("system_range", [True, False], ids=["linux range", "no range"])
def test_free_ports_are_distinct_bindable_and_outside_the_system_range(monkeypatch, system_range):
    """Ports for servers come from below the range the system hands to outgoing sockets (one of Ray's took a
    port chosen inside it before Serve's proxy bound it); with no such range the system picks."""
    if not system_range:
        monkeypatch.setattr(mesh, "_ephemeral_start", lambda: 0)
    top = mesh._ephemeral_start()
    ports = mesh.free_ports(6)
    assert len(set(ports)) == 6
    if top:
        assert all(mesh._RESERVED_BELOW <= p < top for p in ports), (ports, top)
    for p in ports:
        with socket.create_server(("127.0.0.1", p)):
            pass
