"""The training metrics exporter (`scalenlp train --metrics-port`) against a hostile machine (issue 32, item 5): it
listens on loopback unless told otherwise, takes a bearer key, keeps its files in a private folder that another
user cannot pre-create for it, never writes through a planted link, and serves only this run's live ranks, skipping
whatever else the folder holds (never an error page)."""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from scalenlp.cli import main
from scalenlp.config import MonitorConfig
from scalenlp.errors import UserError
from scalenlp.parallel.mesh import free_port
from scalenlp.train.monitor import TOKEN_ENV, Monitor, snapshot_folder

CPU = torch.device("cpu")


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A temporary directory of this test in place of /tmp, and the environment of a one-process run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "XDG_RUNTIME_DIR", TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def start(port: int, **options) -> Monitor:
    # A sampling interval of an hour: the test writes the samples itself, none comes from the thread meanwhile.
    return Monitor(MonitorConfig(metrics_port=port, interval_s=3600, **options), CPU, rank=0)


def scrape(port: int, key: str | None = None) -> dict[str, set[str]]:
    """{metric name: rank labels} of http://127.0.0.1:port/metrics; HTTPError on any status but 200."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    text = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers))
    return {family.name: {s.labels["rank"] for s in family.samples}
            for family in text_string_to_metric_families(text.read().decode())}


def test_listens_on_loopback_unless_metrics_host_says_otherwise(tmp):
    port = free_port()
    monitor = start(port)
    try:
        assert monitor.server.server_address[0] == "127.0.0.1"
    finally:
        monitor.close()
    monitor = start(port, metrics_host="0.0.0.0")
    try:
        assert monitor.server.server_address[0] == "0.0.0.0"
    finally:
        monitor.close()


def test_metrics_host_flag_reaches_the_config(capsys):
    """--metrics-host is monitor.metrics_host: an empty address (which would listen everywhere) is refused."""
    assert main(["train", "--metrics-port", "9400", "--metrics-host", " "]) == 2
    assert "monitor.metrics_host is empty" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["environment", "file"])
def test_a_key_is_required_once_given(tmp, monkeypatch, source):
    port, options = free_port(), {}
    if source == "environment":
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
    else:
        (tmp / "key").write_text("s3cret\n")
        options["metrics_token_file"] = str(tmp / "key")
    monitor = start(port, **options)
    try:
        monitor.write_sample()
        for wrong in (None, "guess", "s3cret-and-more"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                scrape(port, wrong)
            assert refused.value.code == 401
        assert scrape(port, "s3cret")["scalenlp_train_cpu_percent"] == {"0"}
    finally:
        monitor.close()


def test_an_unreadable_key_file_is_one_error_line(tmp):
    with pytest.raises(UserError, match="monitor.metrics_token_file"):
        start(free_port(), metrics_token_file=str(tmp / "missing"))


@pytest.mark.parametrize("planted", ["open to others", "another user's", "a link", "a file"])
def test_a_folder_planted_in_tmp_is_refused(tmp, monkeypatch, planted):
    port = free_port()
    if planted == "another user's":  # the folder is this test's, but the trainer runs as someone else
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    folder = snapshot_folder(port)
    if planted == "a link":  # to a private folder of the planter's, which would then receive the files
        (tmp / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp / "elsewhere")
    elif planted == "a file":
        folder.write_text("")
    else:
        folder.mkdir(mode=0o700)
        if planted == "open to others":
            folder.chmod(0o777)
    with pytest.raises(UserError, match="not a private folder"):
        start(port)


@pytest.mark.parametrize("mode", [0o700, 0o755])
def test_the_sessions_private_runtime_folder_is_used_before_tmp(tmp, monkeypatch, mode):
    """Nobody else can plant a name in a private XDG_RUNTIME_DIR, so a run is never locked out there; one that is
    open to others is passed over for /tmp."""
    runtime = tmp / "run-user"
    runtime.mkdir(mode=mode)
    runtime.chmod(mode)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert snapshot_folder(9).parent == (runtime if mode == 0o700 else tmp)


def test_the_folder_is_created_private(tmp):
    monitor = start(free_port())
    try:
        assert monitor.folder.stat().st_mode & 0o777 == 0o700
        monitor.write_sample()
        assert monitor.path.stat().st_mode & 0o777 == 0o600
    finally:
        monitor.close()


def test_a_planted_link_is_not_written_through(tmp):
    port = free_port()
    folder = snapshot_folder(port)
    folder.mkdir(mode=0o700)
    victim = tmp / "victim"
    victim.write_text("precious")
    (folder / "rank0.json.tmp").symlink_to(victim)  # where the write makes its temporary file
    monitor = start(port)
    try:
        monitor.write_sample()
        assert victim.read_text() == "precious"
        assert json.loads((folder / "rank0.json").read_text())["rank"] == 0
    finally:
        monitor.close()
    assert victim.read_text() == "precious"


def test_only_live_ranks_of_this_run_are_served_and_junk_is_skipped(tmp, monkeypatch):
    """Files the run did not write sit beside rank 0's: none is served as a rank, none turns a scrape into a 500."""
    monkeypatch.setenv("WORLD_SIZE", "8")  # ranks 1-7 could be this run's, on another machine
    port = free_port()
    monitor = start(port)
    monitor.write_sample()

    def snapshot(rank, **changes):
        return {"rank": rank, "pid": os.getpid(), "launcher": os.getppid(),
                "resources": {"cpu_percent": 1.0, "rss_bytes": 1e6}, "training": {"step": 1}, **changes}

    planted = {
        "rank7.json": snapshot(7, launcher=os.getppid() + 1),  # another run's (another launcher)
        "rank9.json": snapshot(9),  # beyond the world size
        "rank5.json": snapshot(4),  # a rank under another rank's name
        "rank1.json": [],
        "rank2.json": {"rank": 2, "pid": "x"},
        "rank3.json": snapshot(3, pid=True),
        "rank6.json": snapshot(6, resources=[], training={"step": 10**400}),  # beyond a float: no series
    }
    for name, value in planted.items():
        (monitor.folder / name).write_text(json.dumps(value))
    (monitor.folder / "rank4.json").write_bytes(b"\xff\xfe not UTF-8")
    (tmp / "outside.json").write_text(json.dumps(snapshot(2)))
    (monitor.folder / "rank2.json").unlink()
    (monitor.folder / "rank2.json").symlink_to(tmp / "outside.json")  # a link in place of a file
    os.mkfifo(monitor.folder / "rank8.json")  # opening it to read would block the scrape
    try:
        metrics = scrape(port)
    finally:
        monitor.close()
    assert metrics["scalenlp_train_cpu_percent"] == {"0"}
    assert metrics["scalenlp_train_resident_memory_bytes"] == {"0"}
    assert metrics["scalenlp_train_step"] == set()  # rank 0 has no metrics record yet; rank 6's step is dropped
