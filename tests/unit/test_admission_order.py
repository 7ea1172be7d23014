"""Which waiting request the decoder engine admits next (Engine._next_waiting): the cheapest first, a request
passed over ``max_overtaken`` times before any cheaper one, and a cancelled one never, in the engine and through
the HTTP server. The engine's loop is held between steps, so every order here is decided by the scheduler alone,
not by timing."""

import threading

import httpx
import pytest
import torch

from infer_helpers import ServerThread, wait
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.flavors import build_model, model_args
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tok(tiny_export):
    return load_tokenizer(tiny_export)


def held_engine(tok, monkeypatch, **kw):
    """A started one-slot engine whose loop runs a step only for each release of the returned semaphore."""
    torch.manual_seed(0)
    engine = Engine(build_model(model_args("debug", vocab_size=tok.get_vocab_size())), tok, eos_id=None,
                    max_batch=1, block_size=4, **kw)
    gate, step = threading.Semaphore(0), engine.step
    monkeypatch.setattr(engine, "step", lambda: (gate.acquire(), step()))
    return engine.start(), gate


def run_all(engine, gate, max_tokens: list[int], cancel: tuple[int, ...] = ()):
    """Submit a request per entry of ``max_tokens`` (greedy, PROMPT) at once, cancel those at the indices in
    ``cancel`` before any step, then let the loop run until the others end. Returns the requests and their tokens."""
    outs = [[] for _ in max_tokens]
    done = [threading.Event() for _ in max_tokens]

    def collect(i):
        return lambda d: (outs[i].extend(d.token_ids), d.finish_reason and done[i].set())

    requests = engine.submit_many([(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                                   for n in max_tokens], [collect(i) for i in range(len(max_tokens))])
    for i in cancel:
        engine.cancel(requests[i])
    assert engine.num_waiting == len(max_tokens) - len(cancel)  # a cancelled request leaves the queue at once
    gate.release(10_000)  # enough steps for them all; the loop sleeps once nothing is left
    for i, event in enumerate(done):
        if i not in cancel:
            wait(engine, event)
    return requests, outs


def admitted(requests) -> list[int]:
    """Indices of ``requests`` in the order the engine admitted them (Request.slot is the admission number)."""
    return sorted((i for i, r in enumerate(requests) if r.slot >= 0), key=lambda i: requests[i].slot)


def test_the_cheapest_waiting_request_goes_first_with_the_same_greedy_text(tok, monkeypatch):
    """Four requests queued together for one slot: admitted by max_tokens (arrival order among equals), where
    first come first served would take them as they came; each request's tokens are those it has alone."""
    engine, gate = held_engine(tok, monkeypatch, max_overtaken=8)
    try:
        requests, outs = run_all(engine, gate, [12, 12, 2, 5])
        assert admitted(requests) == [2, 3, 0, 1]
        alone = [run_all(engine, gate, [n])[1][0] for n in (12, 2, 5)]
    finally:
        engine.stop()
    assert outs == [alone[0], alone[0], alone[1], alone[2]]


def test_a_request_passed_over_max_overtaken_times_goes_before_cheaper_ones(tok, monkeypatch):
    """With max_overtaken 1, the two long requests are due once the 2-token one has passed them: they go next,
    in arrival order, before the 5-token request that arrived after them."""
    engine, gate = held_engine(tok, monkeypatch, max_overtaken=1)
    try:
        requests, _ = run_all(engine, gate, [12, 12, 2, 5])
    finally:
        engine.stop()
    assert admitted(requests) == [2, 0, 1, 3]


def test_a_cancelled_waiting_request_is_never_prefilled(tok, monkeypatch):
    """Cancelled while queued, a request is out of the queue before the next step and no forward ever
    computes it, though it was the cheapest; the requests beside it finish as usual."""
    engine, gate = held_engine(tok, monkeypatch)
    computed = []
    forward = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda requests, *a: (computed.extend(requests), forward(requests, *a))[1])
    try:
        requests, outs = run_all(engine, gate, [3, 2, 4], cancel=(1,))
    finally:
        engine.stop()
    assert requests[1].slot == -1 and not requests[1].output_ids and outs[1] == []
    assert not any(r is requests[1] for r in computed)
    assert admitted(requests) == [0, 2] and [len(o) for o in outs] == [3, 0, 4]


def test_a_queued_request_whose_http_client_left_is_never_admitted(tok, tiny_export, monkeypatch):
    """Through the server: while the engine is held, one client's completion waits for the slot, and a second
    client gives up on its own and disconnects; the second request leaves the queue without being admitted,
    and once the engine runs, the first is served."""
    engine, gate = held_engine(tok, monkeypatch)
    cancelled, cancel = threading.Event(), engine.cancel
    monkeypatch.setattr(engine, "cancel", lambda r: (cancel(r), cancelled.set()))
    server = ServerThread(create_app(LocalBackend(engine, "tiny")))
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    first: list = []
    try:
        waiting = threading.Thread(target=lambda: first.append(httpx.post(server.url + "/v1/completions",
                                                                          json=body, timeout=None)))
        waiting.start()
        while engine.num_waiting < 1:  # queued (the engine runs no step until released)
            waiting.join(0.05)
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while its request is queued
            httpx.post(server.url + "/v1/completions", json={**body, "prompt": "the quick brown"},
                       timeout=httpx.Timeout(30, read=1))
        # A bound for a server that never notices, not a measure: the disconnect arrives within milliseconds.
        assert cancelled.wait(60), "the server did not cancel the request of the client that left"
        assert engine.num_waiting == 1  # out of the queue at once
        gate.release(10_000)
        waiting.join()
    finally:
        gate.release(10_000)
        server.stop()
        engine.stop()
    assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 3
    assert engine._admitted == 1  # only the first request was ever admitted
