"""Resource monitoring: every rank's CPU and memory in metrics.jsonl, and served in Prometheus' format on
--metrics-port while the job runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scalenlp.config import MonitorConfig, load_config
from scalenlp.parallel.mesh import free_port
from scalenlp.train.monitor import RESOURCES, TRAINING, CpuMeter, MachineCollector, Monitor
from train_helpers import HANG_GUARD_S, TINY, cli_env, read_metrics, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def scrape(port: int) -> dict[str, dict[str, float]]:
    """{metric name: {rank label: value}} from http://127.0.0.1:port/metrics; {} while nothing listens."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {family.name: {s.labels["rank"]: s.value for s in family.samples}
            for family in text_string_to_metric_families(text)}


def test_cpu_meter_is_this_process_cpu_time_over_wall_time():
    """A busy thread counts (as much as the machine's other load lets it run), sleeping does not."""
    meter = CpuMeter()
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.monotonic() < wall0 + 0.5:
        pass
    busy = 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert meter.percent() == pytest.approx(busy, abs=5)
    time.sleep(0.5)
    assert meter.percent() < 5


def test_cpu_meter_reads_short_windows_within_one_core():
    """Metrics records can be a few milliseconds apart (the last one, on a stop): one busy thread over a
    1 ms window must not read as several cores (10 ms clock ticks did, at times 1000%)."""
    meter = CpuMeter()
    readings = []
    for _ in range(300):
        end = time.monotonic() + 0.001
        while time.monotonic() < end:
            pass
        readings.append(meter.percent())
    assert max(readings) <= 100 * os.cpu_count()


def test_collector_serves_live_ranks_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "pid": os.getpid(), "resources": {
        "cpu_percent": 12.5, "rss_bytes": 1e8}, "training": {"step": 3, "loss": 2.5, "tokens_per_sec": 1e3}}))
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "pid": int(dead), "resources": {
        "cpu_percent": 1.0, "rss_bytes": 1.0}, "training": {}}))
    registry = CollectorRegistry()
    registry.register(MachineCollector(tmp_path))
    families = {f.name: {s.labels["rank"]: s.value for s in f.samples}
                for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["scalenlp_train_cpu_percent"] == {"0": 12.5}
    assert families["scalenlp_train_resident_memory_bytes"] == {"0": 1e8}
    assert families["scalenlp_train_loss"] == {"0": 2.5}
    assert families["scalenlp_train_gpu_memory_allocated_bytes"] == {}  # a CPU run has no GPU series


def test_one_process_gathers_its_own_resources():
    monitor = Monitor(MonitorConfig(), torch.device("cpu"), rank=0)
    got = monitor.gather()
    assert set(got) == {"cpu_percent/rank0", "rss_bytes/rank0"}
    assert got["rss_bytes/rank0"] > 0 and 0 <= got["cpu_percent/rank0"] <= 100 * os.cpu_count()
    monitor.close()


def test_metrics_port_flag_sets_the_config_key():
    assert load_config(None, ["monitor.metrics_port=9400"]).monitor.metrics_port == 9400


@pytest.mark.slow  # two training processes
def test_two_ranks_are_served_while_training_and_written_to_metrics_jsonl(tmp_path, corpus):
    port, run = free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "scalenlp", "train", "--nproc", "2", "--run-dir", str(run), "--metrics-port",
           str(port)]
    for s in [*TINY, f"data.path={corpus}", "training.steps=100000", "checkpoint.every=0", "monitor.interval_s=0.2"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        metrics = {}
        # Wait for a sample of both ranks taken after a metrics record (so the training figures are there too).
        while len(metrics.get("scalenlp_train_step", {})) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
            metrics = scrape(port)
    finally:
        proc.send_signal(signal.SIGTERM)  # saves at the next step and exits 0
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, stderr[-3000:]
    for name, _ in [*RESOURCES.values(), *TRAINING.values()]:
        if "gpu" not in name:
            assert set(metrics[name]) == {"0", "1"}, name
    for rank in ("0", "1"):
        assert 2**20 < metrics["scalenlp_train_resident_memory_bytes"][rank] < 2**40
        assert 0 <= metrics["scalenlp_train_cpu_percent"][rank] <= 100 * os.cpu_count()
        assert metrics["scalenlp_train_step"][rank] >= 1 and 0 < metrics["scalenlp_train_loss"][rank] < 20
        assert metrics["scalenlp_train_tokens_per_second"][rank] > 0
    records = read_metrics(run)
    for rank in (0, 1):
        assert all(r[f"rss_bytes/rank{rank}"] > 2**20 for r in records)
        assert all(0 <= r[f"cpu_percent/rank{rank}"] <= 100 * os.cpu_count() for r in records)
    assert scrape(port) == {}  # the server ended with the job
