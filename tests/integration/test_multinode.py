"""Several machines, simulated: each "node" is a network namespace (scalenlp.testing.hosts), and
`scalenlp train` runs on each as a user would run it on two machines, meeting through c10d rendezvous."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scalenlp.testing.hosts import RDZV_PORT, Host, start_train, unavailable, virtual_hosts
from train_helpers import HANG_GUARD_S, TINY, cli_env, last_step, read_metrics, train_here


def need_hosts() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"no test hosts: {reason}")


@pytest.fixture
def two_hosts():
    need_hosts()
    with virtual_hosts(2) as hosts:
        yield hosts


def start_node(host: Host, hosts: list[Host], run_dir: Path, sets: list[str], *extra: str) -> subprocess.Popen:
    args = ["--run-dir", str(run_dir), "--nproc", "2", *extra] + [a for s in sets for a in ("--set", s)]
    return start_train(host, hosts[0], args, cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outputs = [p.communicate(timeout=HANG_GUARD_S)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs


def test_hosts_are_separate_machines_and_vanish_afterwards():
    need_hosts()
    server = "import socket; s = socket.create_server(('{}', 5000)); c, peer = s.accept(); print(peer[0])"
    with pytest.raises(RuntimeError, match="inside"):
        with virtual_hosts(2) as (a, b):
            listener = subprocess.Popen(a.command([sys.executable, "-c", server.format(a.address)]),
                                        stdout=subprocess.PIPE, text=True)
            before = b.traffic()
            client = ("import socket, time\nfor _ in range(100):\n"
                      "  try: socket.create_connection(('{}', 5000)); break\n"
                      "  except ConnectionRefusedError: time.sleep(0.1)")
            subprocess.run(b.command([sys.executable, "-c", client.format(a.address)]), check=True)
            assert listener.communicate(timeout=HANG_GUARD_S)[0].strip() == b.address  # the peer is host b
            assert b.traffic()["tx_packets"] > before["tx_packets"]  # and it went out through b's veth
            own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
            assert f" {a.address}/" not in own  # the addresses exist in the namespaces only
            sleeper = subprocess.Popen(a.command(["sleep", "600"]))
            raise RuntimeError("a test failing inside")
    assert sleeper.wait(timeout=HANG_GUARD_S) == -9  # cleanup ended what ran on the host
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.namespace not in names and b.namespace not in names


STEPS = 3


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    """The metrics of STEPS steps in one process: what every layout on any number of machines must reproduce."""
    run = tmp_path_factory.mktemp("one-process") / "run"
    train_here(run, *TINY, f"data.path={corpus}", f"training.steps={STEPS}")  # in this process: no interpreter to start
    return read_metrics(run)


@pytest.mark.slow  # two nodes x 2 processes
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_two_nodes_train_like_one_process(tmp_path, corpus, two_hosts, one_process, layout):
    steps = STEPS
    sets = [*TINY, f"data.path={corpus}", f"training.steps={steps}", f"parallel.data_parallel={layout}"]
    before = [h.traffic() for h in two_hosts]
    finish([start_node(h, two_hosts, tmp_path / "two-nodes", sets, "--nnodes", "2") for h in two_hosts])

    one, two = one_process, read_metrics(tmp_path / "two-nodes")
    assert [r["step"] for r in two] == list(range(1, steps + 1))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # The training traffic crossed the veth pairs: every step, each node needs at least the half of the
    # gradient sums (DDP) or of the weights (ZeRO-3) that the other node's processes hold.
    weight_bytes = (tmp_path / "two-nodes" / "export" / "model.safetensors").stat().st_size
    for h, b in zip(two_hosts, before):
        assert h.traffic()["rx_bytes"] - b["rx_bytes"] >= steps * weight_bytes / 2


@pytest.mark.slow  # two nodes x 2 processes, one of them lost mid-run, then one process as the reference
def test_losing_a_node_continues_from_the_checkpoint_with_nothing_lost(tmp_path, corpus, two_hosts):
    steps, every = 30, 5
    sets = [*TINY, f"data.path={corpus}", f"training.steps={steps}", f"checkpoint.every={every}",
            "checkpoint.keep=10"]  # no checkpoint.resume: a restarted attempt resumes by itself
    run = tmp_path / "elastic"
    # The survivor's rendezvous waits 5 s, not torchrun's 30, for the lost machine to come back.
    survivor, lost = [start_node(h, two_hosts, run, sets, "--nnodes", "1:2", "--max-restarts", "1",
                                 "--rdzv-last-call", "5") for h in two_hosts]
    while last_step(run) < every + 2:  # a checkpoint is written, and steps after it
        assert survivor.poll() is None, survivor.communicate()[0][-4000:]
        time.sleep(0.05)
    two_hosts[1].kill()  # the machine is gone: its agent and its workers, without a word
    killed_at = last_step(run)
    out = finish([survivor])[0]
    lost.wait(timeout=HANG_GUARD_S)
    assert "on 2 x cpu" in out  # the second attempt ran on the remaining node's 2 processes

    train_here(tmp_path / "reference", *sets)  # one process, this one
    reference = {r["step"]: r for r in read_metrics(tmp_path / "reference")}
    records = read_metrics(run)
    resumed = next(i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"])
    first_again = records[resumed]["step"]
    assert killed_at - first_again < every  # only the steps after the newest checkpoint ran twice
    last = {r["step"]: r for r in records}  # the record of each step that counted
    assert sorted(last) == list(range(1, steps + 1))  # no step lost
    for step, r in last.items():
        assert r["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5)
    ours = load_file(run / "export" / "model.safetensors")
    theirs = load_file(tmp_path / "reference" / "export" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    # Two processes sum the gradients in another order than one does, and Adam scales a near-zero gradient's
    # rounding up to a visible update (one of 11,264 weights 2.8e-6 apart after 30 steps, on an AVX-512 Xeon);
    # a step lost or taken twice moves nearly every weight by about its learning rate (3e-3 at the peak, 100 times
    # this bound).
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=3e-5)


def test_the_endpoint_machine_hosts_the_rendezvous(two_hosts):
    # torchrun's own guess compares host names, which every namespace shares; the address decides here.
    a, b = two_hosts
    probe = f"from scalenlp.cli.train import _is_own_address as own; print(own('{a.address}:{RDZV_PORT}'))"
    answers = [subprocess.run(h.command([sys.executable, "-c", probe]), capture_output=True, text=True,
                              env=cli_env(), check=True).stdout.strip() for h in (a, b)]
    assert answers == ["True", "False"]
