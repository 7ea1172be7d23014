"""Test harness: a real one-node Slurm cluster (Debian's slurm-wlm: munged, slurmctld, slurmd) in a folder.

``cluster(folder, cpus)`` writes a slurm.conf there, starts the three daemons in the foreground as children of
this process and stops them, and whatever they left running, on exit; commands given ``Cluster.env`` (SLURM_CONF) talk to this cluster only.
The node is ``localhost``, so the name a job's tasks meet at resolves on any machine. Needs root (slurmd
starts tasks as their user) and the packages; ``unavailable()`` says why not, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scalenlp.parallel.mesh import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
MUNGE_KEY = Path("/etc/munge/munge.key")  # the package makes one on installation
NODE = "localhost"
# Seconds a job credential lives (slurm.conf AuthInfo cred_expire): long enough to launch a step on a loaded
# machine, short enough that a requeued job, held that long, starts again within a test.
CRED_EXPIRE_S = 15
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd starts the tasks)"
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing or not MUNGE_KEY.is_file():
        return (f"needs Debian's slurm-wlm and munge packages (missing: {', '.join(missing) or MUNGE_KEY}): "
                f"apt-get install slurm-wlm")
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]  # this process's environment with SLURM_CONF: for sbatch, squeue, and the jobs

    def sbatch(self, script: Path, env: dict[str, str] | None = None) -> str:
        """Submit ``script`` with ``env`` (default: self.env) as the job's environment; the job id."""
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              env={**(env or self.env), "SLURM_CONF": self.env["SLURM_CONF"]}, check=True)
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state as slurmctld has it (PENDING, RUNNING, COMPLETED, ...)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True,
                             env=self.env, check=True).stdout
        return next(field.split("=", 1)[1] for field in out.split() if field.startswith("JobState="))

    def wait(self, job: str, poll_s: float = 1.0) -> str:
        """Wait until the job has ended; its final state."""
        while (state := self.state(job)) not in DONE:
            time.sleep(poll_s)
        return state


@contextlib.contextmanager
def cluster(folder: Path, cpus: int = 2) -> Iterator[Cluster]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state").mkdir(exist_ok=True)
    # The daemons' Unix sockets (munge's, and slurmd's per job step in its spool) go in a short folder of their
    # own: a socket path holds at most 108 bytes, and under a pytest-xdist worker's tmp_path slurmstepd's was 109
    # (the job was requeued, held, and never ran).
    sockets = Path(tempfile.mkdtemp(prefix="slurm-"))
    (sockets / "spool").mkdir()
    munge = sockets / "munge.sock"
    conf = folder / "slurm.conf"
    controller_port, node_port = free_ports(2)
    settings = {
        "ClusterName": "scalenlp-test", "SlurmctldHost": f"{NODE}(127.0.0.1)", "SlurmUser": "root",
        "SlurmdUser": "root", "SlurmctldPort": controller_port, "SlurmdPort": node_port,
        # A requeued job waits cred_expire seconds (120 by default) before it may start again: slurmd refuses to
        # launch a job whose earlier run's credentials it has revoked until they expire ("Job credential revoked").
        "AuthType": "auth/munge", "AuthInfo": f"socket={munge},cred_expire={CRED_EXPIRE_S}", "CryptoType": "crypto/munge",
        "StateSaveLocation": folder / "state", "SlurmdSpoolDir": sockets / "spool",
        "SlurmctldPidFile": folder / "slurmctld.pid", "SlurmdPidFile": folder / "slurmd.pid",
        "SlurmctldLogFile": folder / "slurmctld.log", "SlurmdLogFile": folder / "slurmd.log",
        # No cgroups: the tasks are plain processes, tracked by their parent ids.
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none", "JobAcctGatherType": "jobacct_gather/none",
        "MpiDefault": "none", "ReturnToService": 2, "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
        # A requeued job becomes eligible once its hold (CRED_EXPIRE_S) ends, an event no scheduling pass follows:
        # it started at the main loop's next periodic pass, every 60 s by default (measured: 39 s after the
        # requeue, where the hold is 15). One job on one node: a pass every second costs nothing.
        "SchedulerParameters": "sched_interval=1",
        "AccountingStorageType": "accounting_storage/none", "JobCompType": "jobcomp/none",
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines += [f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
              f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP"]
    conf.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    log = open(folder / "daemons.log", "w")
    daemons = [subprocess.Popen([_daemon("munged"), "-F", "--force", f"--socket={munge}", f"--key-file={MUNGE_KEY}",
                                 f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
                                 f"--seed-file={folder / 'munge.seed'}"], stdout=log, stderr=log)]
    try:
        while not munge.exists():
            if daemons[0].poll() is not None:
                raise RuntimeError(f"munged ended: {(folder / 'munged.log').read_text()[-2000:]}")
            time.sleep(0.1)
        daemons.append(subprocess.Popen([_daemon("slurmctld"), "-D", "-i", "-f", str(conf)], stdout=log, stderr=log,
                                        env=env))
        daemons.append(subprocess.Popen([_daemon("slurmd"), "-D", "-N", NODE, "-f", str(conf)], stdout=log,
                                        stderr=log, env=env))
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                           env=env).stdout:
            ended = [d.args[0] for d in daemons if d.poll() is not None]
            if ended:
                raise RuntimeError(f"{', '.join(ended)} ended: {(folder / 'daemons.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield Cluster(folder, env)
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        _kill_left_over(conf)
        log.close()
        shutil.rmtree(sockets, ignore_errors=True)


def _kill_left_over(conf: Path) -> None:
    """SIGKILL what this cluster started and slurmd left behind: a job's slurmstepd stays on, retrying to report
    to the stopped daemons, and so may its tasks. They are known by this cluster's SLURM_CONF in their environment."""
    mark = f"SLURM_CONF={conf}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # ended meanwhile, or not ours to read
            pass
