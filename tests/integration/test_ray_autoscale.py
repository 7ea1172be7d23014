"""Replicas autoscale on queue length: one replica under sustained load grows to the upper bound,
and no request fails while it does."""

import os
import threading
import time

import httpx
import pytest
import torch

from infer_helpers import RAY_INIT, make_export
from scalenlp.engine.config import EngineConfig
from scalenlp.parallel.mesh import free_port
from scalenlp.serving.cluster import LOCAL_RAY_ENV
from scalenlp.serving.limits import ServeLimits

pytestmark = pytest.mark.slow  # multi-process runs of minutes: `make test-fast` leaves them out

torch.set_num_threads(1)
os.environ.update(LOCAL_RAY_ENV)  # the local Ray instance stays on loopback (read on import)
ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'scalenlp[cluster]'")

HANG_GUARD_S = 600  # hang guard only: Serve adds the replica in seconds (upscale_delay_s 2 below)


def replica_count() -> int:
    return sum("EngineReplica" in a["name"] for a in ray.util.list_named_actors(all_namespaces=True))


def test_load_above_the_target_adds_replicas_up_to_the_bound(tmp_path, monkeypatch):
    from scalenlp.serving import cluster

    real_options = cluster.replica_options

    def quick_to_scale(*args, **kwargs):
        """scalenlp's options (bounds and target), with Serve's waits shortened: it averages load over 30 s and
        waits 30 s more before adding a replica by default, which alone took most of this test's 150 s."""
        options = real_options(*args, **kwargs)
        options["autoscaling_config"].update(look_back_period_s=2, upscale_delay_s=2)
        return options

    monkeypatch.setattr(cluster, "replica_options", quick_to_scale)
    export = make_export(tmp_path, max_seq_len=2048)
    config = EngineConfig(export, dtype="float32", device="cpu", max_batch=2)
    url, owns_serve = cluster.start(config, ServeLimits(), "m", replicas=1, max_replicas=2, replica_cpus=0.5,
                                    port=free_port(), ray_init_kwargs=RAY_INIT)
    try:
        assert replica_count() == 1
        stop, failures, done = threading.Event(), [], []

        def client():  # keeps one request in flight until told to stop: 6 clients, target 2 per replica
            while not stop.is_set():
                body = {"model": "m", "prompt": "hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
                r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_GUARD_S)
                (done if r.status_code == 200 else failures).append(r.status_code)

        clients = [threading.Thread(target=client) for _ in range(6)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while replica_count() < 2 and time.monotonic() < deadline:
            time.sleep(1)
        grew = replica_count()
        time.sleep(5)  # requests keep flowing across the new replica's arrival; a third would have come by now
        stop.set()
        for t in clients:
            t.join()
        assert grew == 2 and replica_count() == 2  # and never past the upper bound
        assert not failures and len(done) >= 6
    finally:
        cluster.stop(owns_serve)
