"""The OpenAI-compatible server, through the official `openai` client and raw HTTP."""

import json
import sys
import threading
import time
import traceback

import httpx
import openai
import pytest
import torch

from infer_helpers import ServerThread
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.models.io import load_pretrained
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)
KEY = "sk-test"


@pytest.fixture(scope="module")
def served(tiny_export):
    export = tiny_export
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=2, max_queue=4, eos_id=find_eos_token_id(tok)).start()
    server = ServerThread(create_app(LocalBackend(engine, "tiny"), api_key=KEY))
    yield server, engine
    server.stop()
    engine.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0)


def test_completion_with_openai_client(client):
    out = client.completions.create(model="tiny", prompt="the quick", max_tokens=8, temperature=0, seed=1)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(model="tiny", prompt="the quick", max_tokens=8, temperature=0, seed=1)
    assert again.choices[0].text == out.choices[0].text


def test_n_prompts_seed_and_usage(client):
    out = client.completions.create(model="tiny", prompt=["hello", "the quick brown"], n=2, max_tokens=6,
                                    temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 6
    assert out.choices[0].text != out.choices[1].text  # n choices of one prompt differ
    same = client.completions.create(model="tiny", prompt=["hello", "the quick brown"], n=2, max_tokens=6,
                                     temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in same.choices] == [c.text for c in out.choices]


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", prompt="hello world", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_sse_ends_with_done(served):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    r = httpx.post(served[0].url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    json.loads(events[0][len("data: "):])


def test_stop_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    streamed = list(client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.token_logprobs) for c in streamed) == 5  # one per token, none held back
    text = out.choices[0].text
    assert len(text) > 2
    cut = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0, stop=text[1:3],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(text[1:3])] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 10**6}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "bogus": 1}, 400, "bogus"),
    ({"model": "tiny", "prompt": "hi " * 200}, 400, "prompt"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"prompt": [[True]]}, 400, "prompt"),  # not the token id 1 (and without model: the one served)
    ({"model": "tiny", "prompt": "hi", "n": "2"}, 400, "n"),
    ({"model": "other", "prompt": "hi"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(served, body, status, param):
    r = httpx.post(served[0].url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_malformed_json(served):
    r = httpx.post(served[0].url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", temperature=-1)


def test_auth(served):
    url = served[0].url
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # health stays open for load balancers
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).completions.create(model="tiny", prompt="x")


def test_metrics(served, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    text = httpx.get(served[0].url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("scalenlp_requests_running", "scalenlp_requests_waiting", "scalenlp_generation_tokens_total",
                 "scalenlp_time_to_first_token_seconds_bucket", "scalenlp_inter_token_latency_seconds_bucket"):
        assert name in text
    generated = [line for line in text.splitlines() if line.startswith("scalenlp_generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3


def test_prefix_cache_hit_rate_moves_when_a_prompt_prefix_comes_again(served, client):
    def hit_rate():
        text = httpx.get(served[0].url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return float(next(line for line in text.splitlines()
                          if line.startswith("scalenlp_prefix_cache_hit_rate")).split()[-1])

    prompt = "a shared system prompt, longer than two blocks of the cache " * 2
    client.completions.create(model="tiny", prompt=prompt + "first", max_tokens=2, temperature=0)
    before = hit_rate()
    client.completions.create(model="tiny", prompt=prompt + "second", max_tokens=2, temperature=0)
    assert hit_rate() > before


def test_queue_full_is_429_and_others_still_served(served, client, monkeypatch):
    server, engine = served
    fast = engine._decode

    def slow_decode(*args, **kwargs):  # so that no accepted request finishes while the burst arrives
        time.sleep(0.01)
        return fast(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode", slow_decode)
    long = {"model": "tiny", "prompt": "hi", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    results = []

    def post():
        results.append(httpx.post(server.url + "/v1/completions", json=long, timeout=120,
                                  headers={"Authorization": f"Bearer {KEY}"}).status_code)

    threads = [threading.Thread(target=post) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The 4 queue places are always accepted; the 2 slots only if the engine admits before the burst fills the
    # queue (under load it may not), so 4 to 6 of the 12 succeed and every other one is a 429, never an error.
    assert sorted(set(results)) == [200, 429] and results.count(200) >= 4
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices  # still serving


def test_client_disconnect_frees_slot(served, monkeypatch):
    server, engine = served
    fast = engine._decode
    seen = []  # every request the engine decoded for
    left = threading.Event()  # set once the streaming client has gone
    timed_out = threading.Event()  # set once the second client's timeout has fired

    def held_decode(*args, **kwargs):
        # Once the stream has text out, hold the engine until the client leaves: a loaded machine cannot
        # let the request run to its end first. The second request is held from its first decode until its
        # client's timeout has fired, so that it is running when its client leaves (on a loaded machine it
        # could otherwise be admitted after the timeout). Afterwards each step is slow, so that only a cancel
        # frees the slot before the request's 120 tokens are done.
        seen.extend(r for r in engine._running.values() if r not in seen)
        if not left.is_set() and any(r.sent for r in engine._running.values()):
            left.wait(30)
        if len(seen) == 2 and not timed_out.is_set():
            timed_out.wait(30)
        time.sleep(0.02)
        return fast(*args, **kwargs)

    def freed(request) -> None:
        for _ in range(200):  # the engine notices at its next step; poll instead of sleeping a fixed time
            if engine.num_running == 0:
                break
            time.sleep(0.05)
        assert engine.num_running == 0
        assert request.cancelled and len(request.output_ids) < 120

    cancels = []  # who cancelled, and while handling what: the failure below has never been reproduced outside CI
    cancel = engine.cancel

    def recorded_cancel(request) -> None:
        cancels.append((repr(sys.exc_info()[1]), "".join(traceback.format_stack(limit=14))))
        cancel(request)

    monkeypatch.setattr(engine, "_decode", held_decode)
    monkeypatch.setattr(engine, "cancel", recorded_cancel)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        next(r.iter_lines())
        # What the engine held and who cancelled, should this fail again (three times in CI and once in a local
        # run of the unit tier, always 2 tokens out, 3 characters sent and cancelled; cause unknown).
        assert engine.num_running == 1, (engine.num_waiting, engine.blocks.available, [
            (len(q.output_ids), q.sent, q.finish_reason, q.cancelled) for q in seen], cancels)
    left.set()
    freed(seen[0])
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
    for _ in range(200):  # admitted and decoding, held there until now (2 s: admitted long before, even loaded)
        if len(seen) == 2:
            break
        time.sleep(0.05)
    timed_out.set()
    freed(seen[-1])
    assert len(seen) == 2
