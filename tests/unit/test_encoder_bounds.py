"""Bounds on the encoder server (issue 32, item 1): a request is priced (characters per text, then tokens) and
refused with a 400 before any work; forward passes are shared round-robin across requests, so a one-text
request is not held behind a large one; a client that leaves takes its queued texts with it; /health goes
through the batcher and fails while it is wedged. (SIGTERM draining: integration/test_encoder_sigterm.py.)"""

import threading
import time

import httpx
import pytest
import torch

from infer_helpers import ServerThread, minilm_classifier
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.serving.app import create_app
from scalenlp.serving.encoder import EncoderBackend

torch.set_num_threads(1)

WORDS = "the quick brown fox jumps over the lazy dog near the river bank today"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return minilm_classifier(tmp_path_factory.mktemp("cls"))


@pytest.fixture
def engine(classifier):
    def start(**options):
        started.append(encoder_from_checkpoint(EncoderEngineConfig(classifier, dtype="float32", device="cpu",
                                                                   **options)))
        return started[-1]

    started = []
    yield start
    for e in started:
        e.stop()


@pytest.fixture
def serve():
    servers = []

    def start(engine, **backend_options):
        servers.append(ServerThread(create_app(EncoderBackend(engine, "cls", **backend_options), api_key=None)))
        return servers[-1].url

    yield start
    for s in servers:
        s.stop()


def slow_forwards(engine, gate: threading.Event | None = None, seconds: float = 0.0):
    """Make each forward pass wait for ``gate`` (when given) and take at least ``seconds``."""
    forward = engine._forward

    def slowed(kind, batch):
        if gate is not None:
            gate.wait()
        time.sleep(seconds)
        return forward(kind, batch)

    engine._forward = slowed


def test_a_request_over_its_price_is_refused_before_any_work(engine, serve):
    e = engine(max_request_tokens=100, max_text_chars=1000)
    url = serve(e)
    r = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [WORDS] * 10}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "input" and "--max-request-tokens" in error["message"], error
    r = httpx.post(url + "/v1/classify", json={"model": "cls", "input": ["a " * 600]}, timeout=60)
    assert r.status_code == 400 and "--max-text-chars" in r.json()["error"]["message"], r.text
    assert e.requests == e.forwards == e.texts == 0  # nothing queued, nothing encoded
    r = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [WORDS] * 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 100, r.text
    # At the defaults, 128 texts of a 256-token encoder (MiniLM's 380-word texts, cut) cost too much for one request.
    assert EncoderEngineConfig("x").max_request_tokens < 128 * 256


def test_a_one_text_request_is_served_within_a_forward_pass_behind_a_large_one(engine):
    e = engine(forward_batch=4, batch_wait_ms=0, max_request_tokens=None)
    gate = threading.Event()
    slow_forwards(e, gate)
    big = e.submit("embed", e.encode([WORDS] * 200))
    while e.num_waiting != 196:  # the first forward took 4 texts and waits at the gate
        time.sleep(0.01)
    small = e.submit("embed", e.encode(["hi"]))
    done_at = []
    small.add_done_callback(lambda f: done_at.append(e.forwards))
    gate.set()
    assert small.result(timeout=60).shape[0] == 1
    assert done_at == [2], f"the one-text request finished in forward pass {done_at} (of {200 // 4 + 1})"
    assert big.result(timeout=60).shape[0] == 200


def test_texts_of_a_request_whose_client_left_are_not_encoded(engine, serve):
    e = engine(forward_batch=2, batch_wait_ms=0, max_request_tokens=None)
    slow_forwards(e, seconds=0.05)  # 100 forward passes: at least 5 s
    url = serve(e)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [WORDS] * 200}, timeout=1)
    left_at = e.texts
    time.sleep(1.5)
    assert 0 < left_at < 200
    assert e.texts - left_at <= 2 * e.forward_batch, f"{e.texts - left_at} texts encoded after the client left"
    assert e.num_waiting == 0
    # and a future cancelled in-process drops its texts as well
    gate = threading.Event()
    slow_forwards(e, gate)
    future = e.submit("embed", e.encode([WORDS] * 50))
    while e.num_waiting != 48:
        time.sleep(0.01)
    future.cancel()
    assert e.num_waiting == 0
    gate.set()
    e.submit("embed", e.encode(["hi"])).result(timeout=60)
    assert e.texts <= left_at + 2 * e.forward_batch + 2 + 1


def test_health_goes_through_the_batcher_and_fails_while_it_is_wedged(engine, serve):
    e = engine(batch_wait_ms=0)
    url = serve(e, health_timeout=1.0)
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok", "detail": "ok"}
    gate = threading.Event()
    slow_forwards(e, gate)  # the batcher thread is alive but makes no progress
    stuck = e.submit("embed", e.encode(["wedged"]))
    r = httpx.get(url + "/health", timeout=30)
    assert e.alive and r.status_code == 503, r.text
    assert r.json()["status"] == "unhealthy" and "no progress" in r.json()["detail"]
    gate.set()
    stuck.result(timeout=60)
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert e.requests == 1  # the probes are not counted as requests
