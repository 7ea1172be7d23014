"""Test harness: stand-in machines made of Linux network namespaces, for multi-node tests and benchmarks.

Each host is a namespace with its loopback up and one interface, ``eth0``, whose veth peer sits on a
bridge inside a further "switch" namespace; every address lives in a namespace, so the machine's own
network is never touched. A process started with ``host.command([...])`` sees only that host's
interfaces, so whatever it sends to another host crosses the veth pair (``host.traffic()`` counts it).

Needs root and iproute2; ``unavailable()`` says why not, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "scalenlp-"
INTERFACE = "eth0"
SUBNET = "10.77.0"  # private; the same in every group, which cannot see each other
RDZV_PORT = 29400
_groups = itertools.count()


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    interface: str = INTERFACE

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host (the environment passes through)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def traffic(self) -> dict[str, int]:
        """Bytes and packets this host's interface has sent and received so far."""
        out = _ip("-n", self.namespace, "-s", "-j", "link", "show", self.interface)
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}

    def pids(self) -> list[int]:
        """Every process running on this host."""
        return [int(p) for p in _ip("netns", "pids", self.namespace).split()]

    def kill(self) -> None:
        """The host loses power: SIGKILL to every process on it."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_train(host: Host, rendezvous: Host, args: list[str], env: dict, **popen) -> subprocess.Popen:
    """`scalenlp train ARGS` on ``host``, as one machine of a job meeting at ``rendezvous``: the command is the
    same on every host but for --local-addr, which the shared host name cannot stand in for here."""
    cmd = [sys.executable, "-m", "scalenlp", "train", "--rdzv-endpoint", f"{rendezvous.address}:{RDZV_PORT}",
           "--local-addr", host.address, *args]
    # gloo picks its interface from the host name, which resolves to loopback inside a namespace.
    return subprocess.Popen(host.command(cmd), env=dict(env, GLOO_SOCKET_IFNAME=host.interface), **popen)


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None when they can (tries one namespace)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", probe)
    return None


def _remove(namespace: str) -> None:
    """Ends the processes on it, then deletes it (its veth ends go with it)."""
    with contextlib.suppress(RuntimeError):
        Host(namespace, "").kill()
        _ip("netns", "del", namespace)


def _sweep_orphans() -> None:
    """Namespaces left by a harness process that died before its cleanup (the pid is in the name)."""
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0]
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) >= 3 and parts[1].isdigit() and not _alive(int(parts[1])):
            _remove(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def virtual_hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one switch, addresses SUBNET.1 .. SUBNET.n/24; removed on exit, whatever happened."""
    _sweep_orphans()
    group = f"{PREFIX}{os.getpid()}-{next(_groups)}"
    switch = f"{group}-sw"
    hosts = [Host(f"{group}-h{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
    made: list[str] = []
    try:
        for ns in [switch] + [h.namespace for h in hosts]:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, h in enumerate(hosts):
            port = f"p{i}"
            _ip("link", "add", h.interface, "netns", h.namespace, "type", "veth", "peer", "name", port,
                "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface)
            _ip("-n", h.namespace, "link", "set", h.interface, "up")
        yield hosts
    finally:
        for ns in reversed(made):
            _remove(ns)
