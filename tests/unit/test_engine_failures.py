"""When the engine fails: one request's failure ends that request alone, a dead or stuck engine shows in /health
(503) and in the answer to a request, and `scalenlp serve` whose engine dies exits non-zero for its supervisor."""

import queue
import threading
import time

import httpx
import pytest
import torch

from infer_helpers import ServerThread
from scalenlp.cli import main
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.engine import llm as llm_module
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained
from scalenlp.parallel.mesh import free_port
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)


def _collect(engine, prompt_ids, params, on_event=None):
    """Submit one request; returns its queue of deltas."""
    events = queue.Queue()

    def put(d):
        events.put(d)
        if on_event is not None:
            on_event(d)

    engine.submit(prompt_ids, params, put)
    return events


def _drain(events) -> list:
    """Deltas up to the last. The wait is bounded only so that an engine that dies without telling
    every request (as it did when a callback raised) fails the test instead of hanging it."""
    deltas = [events.get(timeout=120)]
    while deltas[-1].finish_reason is None:
        deltas.append(events.get(timeout=120))
    return deltas


def test_a_failing_request_fails_alone(tiny_export, caplog):
    """A value no check foresaw (here planted after submission), and a callback that raises (a client
    gone): each ends its own request with "error"; the request sharing the batch finishes normally."""
    tok = load_tokenizer(tiny_export)
    engine = Engine(load_pretrained(tiny_export), tok, max_batch=3).start()
    try:
        ids = tok.encode("the quick").ids
        slow = SamplingParams(max_tokens=40, temperature=1.0, top_k=5, seed=3, ignore_eos=True)
        bad = SamplingParams(max_tokens=40, temperature=1.0, top_k=5, seed=4, ignore_eos=True)

        def break_params(d):  # on the first token: a top_k that int64 cannot hold
            bad.top_k = 2**64

        def raise_on_event(d):
            raise RuntimeError("client gone")

        good_events = _collect(engine, ids, slow)
        bad_events = _collect(engine, ids, bad, break_params)
        gone_events = _collect(engine, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                               raise_on_event)
        good = _drain(good_events)
        assert _drain(bad_events)[-1].finish_reason == "error"
        assert gone_events.get(timeout=120).finish_reason is None  # it received its first token, and raised
        assert (len(good), good[-1].finish_reason) == (40, "length")
        assert engine.alive and engine.num_running == 0
        assert "request failed in the engine" in caplog.text
    finally:
        engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine dies on purpose
def test_server_exits_nonzero_when_the_engine_dies(tiny_export, monkeypatch, capsys):
    """A fault no request causes (the device fails in the forward): the engine loop ends, and so does
    the server, with exit code 1, so that its supervisor restarts it."""
    real = llm_module.engine_from_checkpoint

    def broken_engine(config):
        engine = real(config)
        engine.model.forward = None  # the next step fails
        return engine

    monkeypatch.setattr(llm_module, "engine_from_checkpoint", broken_engine)  # where `scalenlp serve` looks it up
    port = free_port()
    result = []
    thread = threading.Thread(target=lambda: result.append(main(
        ["serve", "--checkpoint", str(tiny_export), "--port", str(port), "--dtype", "float32", "--device", "cpu"])),
        daemon=True)
    thread.start()
    while thread.is_alive():
        try:  # the health probe is the step that fails
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=None)
            break
        except httpx.ConnectError:  # not listening yet
            thread.join(0.1)
        except httpx.HTTPError:  # the connection closed as the server exited
            break
    thread.join(120)  # a bound only so that a server that stays up fails this test instead of hanging it
    assert result == [1]
    assert "fatal: the engine stopped" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine dies on purpose
def test_health_503_when_engine_dead(tiny_export):
    export = tiny_export
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=1).start()
    server = ServerThread(create_app(LocalBackend(engine, "tiny", health_timeout=2)))
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        engine.model.forward = None  # the next step fails: the engine thread dies with an error
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()
        engine.stop()


def test_health_503_when_engine_stuck(tiny_export, monkeypatch):
    export = tiny_export
    engine = Engine(load_pretrained(export), load_tokenizer(export), max_batch=1).start()
    server = ServerThread(create_app(LocalBackend(engine, "tiny", health_timeout=1)))
    release = threading.Event()
    real = engine._decode

    def stuck(*args, **kwargs):  # a decode step that never returns until released (a hung device)
        release.wait()
        return real(*args, **kwargs)

    try:
        monkeypatch.setattr(engine, "_decode", stuck)
        t = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions",
                                                       json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                                                       timeout=None))
        t.start()
        while engine.num_running == 0:
            time.sleep(0.02)
        health = httpx.get(server.url + "/health", timeout=None)
        assert health.status_code == 503 and "no progress" in health.json()["detail"]
        release.set()
        t.join()
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        release.set()
        server.stop()
        engine.stop()
