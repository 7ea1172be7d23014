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
from scalenlp.engine.decoder_engine import RequestError
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
        # One worker unless a test asks for the short-pass one: these tests count the passes a request waits.
        options = {"short_pass_tokens": 0} | options
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


def record_passes(engine) -> list[tuple[int, int]]:
    """(texts, width: its longest text) of every forward pass from now on, in order."""
    passes, forward = [], engine._forward

    def recorded(kind, batch):
        passes.append((len(batch), max(len(job.ids[i]) for job, i in batch)))
        return forward(kind, batch)

    engine._forward = recorded
    return passes


def test_forward_passes_stay_within_the_token_budget_and_a_small_request_runs_between_them(engine):
    budget = 48
    e = engine(forward_batch=32, pass_tokens=budget, batch_wait_ms=0, max_request_tokens=None)
    texts = [WORDS] * 20 + [WORDS * 10]  # the last is cut at the model's 64 positions: past the budget
    ids = e.encode(texts)
    assert max(map(len, ids)) > budget >= 2 * min(map(len, ids))
    gate = threading.Event()
    slow_forwards(e, gate)
    passes = record_passes(e)
    big = e.submit("embed", ids)
    while e.num_waiting == len(texts):  # the first pass is taken and waits at the gate
        time.sleep(0.01)
    small = e.submit("embed", e.encode(["hi"]))
    order = []
    small.add_done_callback(lambda f: order.append(("small", e.forwards)))
    big.add_done_callback(lambda f: order.append(("big", e.forwards)))
    gate.set()
    assert big.result(timeout=60).shape[0] == len(texts) and small.result(timeout=60).shape[0] == 1
    assert all(n * width <= budget for n, width in passes if n > 1), passes
    assert (1, max(map(len, ids))) in passes  # the text longer than the budget ran, alone
    assert order == [("small", 2), ("big", len(passes))] and len(passes) > 3, (order, passes)


def test_pass_tokens_must_be_positive(classifier, capsys):
    from scalenlp.cli import main

    assert main(["serve", "--checkpoint", str(classifier), "--device", "cpu", "--pass-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --pass-tokens must be at least 1, got 0\n", err


class TokenizerSpy:
    """A tokenizer that counts the texts it is given, otherwise the engine's own."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, 0

    def encode_batch(self, texts, *args, **kwargs):
        self.texts += len(texts)
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_request_surely_over_its_price_is_refused_before_tokenizing(engine, serve):
    e = engine(max_request_tokens=100)
    e.tokenizer, e.words = spy, tag_spy = TokenizerSpy(e.tokenizer), TokenizerSpy(e.words)
    url = serve(e)
    # 10 texts of 14 words: at least 10 x (14 + [CLS] + [SEP]) tokens, over 100 whatever the tokenizer does.
    r = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [WORDS] * 10}, timeout=60)
    assert r.status_code == 400, r.text
    assert "at least" in r.json()["error"]["message"] and "--max-request-tokens" in r.json()["error"]["message"]
    assert spy.texts == 0 and e.requests == 0
    with pytest.raises(RequestError, match="at least"):  # tagging's windows keep every word: no cut at 64
        e.tag_windows([" ".join([WORDS] * 10)], priced=True)
    assert tag_spy.texts == 0
    # One word of many tokens passes the bound: the exact price, after tokenizing, still refuses it.
    dense = ",".join("abcdefghijklmnopqrstuvwxyz")
    r = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [dense] * 4}, timeout=60)
    assert r.status_code == 400 and "at least" not in r.json()["error"]["message"], r.text
    assert spy.texts == 4 and e.requests == 0
    r = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": [WORDS] * 3}, timeout=60)
    assert r.status_code == 200 and spy.texts == 7, r.text


def test_the_heap_is_trimmed_when_the_queue_empties_after_many_tokens(engine, monkeypatch):
    """Forward passes free their activations into glibc's arenas, which kept them (RSS 1.47x after 64-text
    requests): the engine gives them back once idle after TRIM_AFTER_TOKENS, not after every small request."""
    from scalenlp.engine import encoder_engine

    trims = []
    monkeypatch.setattr(encoder_engine, "trim_heap", lambda: trims.append(e.tokens))
    monkeypatch.setattr(encoder_engine, "TRIM_AFTER_TOKENS", 100)
    e = engine(forward_batch=4, batch_wait_ms=0, max_request_tokens=None)
    e.run("embed", ["hi"])
    assert trims == []
    e.run("embed", [WORDS] * 8)  # 8 x 16 tokens, over the threshold with the first request's
    e.run("embed", ["hi"])  # served after the loop's turn that followed the large request
    assert trims == [e.tokens - 3]
