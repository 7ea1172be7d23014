"""Resource monitoring of a running job: `scalenlp train --nproc 2 --metrics-port` serves every rank's CPU, memory and
training figures in Prometheus' format while it runs, and writes them to metrics.jsonl."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scalenlp.parallel.mesh import free_port
from scalenlp.train.monitor import RESOURCES, TRAINING
from train_helpers import HANG_GUARD_S, TINY, cli_env, read_metrics


def scrape(port: int) -> dict[str, dict[str, float]]:
    """{metric name: {rank label: value}} from http://127.0.0.1:port/metrics; {} while nothing listens."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {family.name: {s.labels["rank"]: s.value for s in family.samples}
            for family in text_string_to_metric_families(text)}


@pytest.mark.slow  # two training processes: 30-80 s here
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
