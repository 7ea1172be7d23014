"""Replicas on Ray Serve: both receive traffic under concurrent load; killing one under load fails
no request (streams resume on another replica with the same text); chat and the request limits answer
as one process does. (Without Ray running: unit/test_ray_replicas.py.)"""

import json
import os
import threading
import time

import httpx
import pytest
import torch

from infer_helpers import EOS, RAY_INIT, ServerThread, make_export
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained
from scalenlp.parallel.mesh import free_port
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import generation_backend
from scalenlp.serving.cluster import LOCAL_RAY_ENV, METRICS_PERIOD_S
from scalenlp.serving.limits import ServeLimits

pytestmark = pytest.mark.slow  # multi-process runs of minutes: `make test-fast` leaves them out

torch.set_num_threads(1)
os.environ.update(LOCAL_RAY_ENV)  # the local Ray instance stays on loopback (read on import)
ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'scalenlp[cluster]'")
PROMPTS = ["the quick brown fox", "hello", "continuous batching lets requests join", "a model that",
           "hello world, this is", "x y z", "the lazy dog", "says little"]


# Plain text between the turns, so that the tokenizer needs no special tokens but the end of text.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
# Above what the other tests send (prompts of a few tokens, up to 1500 new ones, small bodies).
LIMITS = ServeLimits(max_prompt_tokens=64, max_tokens_cap=1600, max_body_bytes=16_384)


def engine_config(export) -> EngineConfig:
    """The engine of each replica of `scalenlp serve --replicas 2`."""
    return EngineConfig(export, dtype="float32", device="cpu", max_batch=4)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from scalenlp.serving import cluster

    export = make_export(tmp_path_factory.mktemp("ray"), max_seq_len=2048)
    (export / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    url, owns_serve = cluster.start(engine_config(export), LIMITS, "m", replicas=2, replica_cpus=0.5, port=free_port(),
                                    ray_init_kwargs=RAY_INIT)
    yield url, export
    cluster.stop(owns_serve)


def expected_texts(export, max_tokens):
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=4, eos_id=find_eos_token_id(tok)).start()
    try:
        return engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        engine.stop()


def post_all(url, bodies):
    results = [None] * len(bodies)

    def post(i):
        results[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=600)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_replicas_share_concurrent_load(cluster):
    url, export = cluster
    bodies = [{"model": "m", "prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
              for p in PROMPTS * 2]
    results = post_all(url, bodies)
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    served_by = {r.json()["system_fingerprint"] for r in results}
    assert len(served_by) == 2, served_by
    expected = expected_texts(export, 48)
    assert [r.json()["choices"][0]["text"] for r in results] == expected * 2


def replica_samples(url) -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value, for the replica-labelled samples of the router's /metrics that
    carry no other label (histogram buckets and per-finish-reason counts left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    return {(s.name, s.labels["replica"]): s.value for family in text_string_to_metric_families(r.text)
            for s in family.samples if set(s.labels) == {"replica"}}


def settled_samples(url) -> dict[tuple[str, str], float]:
    """The replica samples once every live replica has reported and two reports in a row agree: the
    baseline then counts everything earlier tests generated, however late their last report came."""
    previous = None
    while True:
        samples = replica_samples(url)
        if samples == previous and {rep for _, rep in samples} == set(replica_actors()):
            return samples
        previous = samples
        time.sleep(1.5 * METRICS_PERIOD_S)


def test_router_metrics_show_each_replicas_engine(cluster):
    url, _ = cluster
    before = settled_samples(url)
    max_tokens = 16
    bodies = [{"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
              for p in PROMPTS]
    results = post_all(url, bodies)
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    served = [r.json()["system_fingerprint"] for r in results]

    def delta(samples, name, replica):
        return samples.get((name, replica), 0) - before.get((name, replica), 0)

    def settled(samples):
        tokens = sum(delta(samples, "scalenlp_generation_tokens_total", rep) for rep in set(served))
        busy = sum(v for (name, _), v in samples.items() if name in ("scalenlp_requests_running",
                                                                     "scalenlp_requests_waiting"))
        return tokens >= len(bodies) * max_tokens and busy == 0

    # Replicas report every METRICS_PERIOD_S: wait for the reports taken after these requests ended.
    after = replica_samples(url)
    while not settled(after):
        time.sleep(0.5)
        after = replica_samples(url)
    assert {rep for _, rep in after} == set(replica_actors())  # every live replica, and only those
    for rep in set(served):
        n = served.count(rep)
        assert delta(after, "scalenlp_generation_tokens_total", rep) == n * max_tokens
        assert delta(after, "scalenlp_time_to_first_token_seconds_count", rep) == n
        assert delta(after, "scalenlp_inter_token_latency_seconds_count", rep) == n * (max_tokens - 1)
        assert ("scalenlp_requests_running", rep) in after and ("scalenlp_requests_waiting", rep) in after


def replica_actors() -> dict:
    """Replica id -> actor handle (Serve names a replica's actor ...#EngineReplica#<replica id>)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    return {a["name"].rsplit("#", 1)[-1]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in names}


def test_replica_killed_under_load_fails_no_request(cluster):
    url, export = cluster
    max_tokens = 1500  # long enough that every stream is still running when the replica dies
    streams = {i: [] for i in range(len(PROMPTS))}
    some_chunk = threading.Event()
    statuses = {}

    def consume(i):
        body = {"model": "m", "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            statuses[i] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streams[i].append(json.loads(line[6:]))
                    some_chunk.set()
        some_chunk.set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    some_chunk.wait()
    replicas = replica_actors()
    assert len(replicas) == 2
    # The replica of the stream that has come least far (requests may queue behind others): it is
    # surely mid-stream when killed.
    started = [chunks for chunks in list(streams.values()) if chunks]
    least = min(started, key=len)
    ray.kill(replicas[least[0]["system_fingerprint"]], no_restart=True)
    assert least[-1]["choices"][0]["finish_reason"] is None
    for t in threads:
        t.join()
    assert all(s == 200 for s in statuses.values()), statuses
    texts = ["".join(c["choices"][0]["text"] for c in streams[i] if c["choices"]) for i in range(len(PROMPTS))]
    for chunks in streams.values():
        assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert texts == expected_texts(export, max_tokens)
    metrics = httpx.get(url + "/metrics").text
    retries = [line for line in metrics.splitlines() if line.startswith("scalenlp_router_retries_total")]
    assert float(retries[0].split()[-1]) >= 1  # some streams really were resumed elsewhere
    while len(replica_actors()) < 2:  # the controller replaces the dead replica
        time.sleep(1)
    assert httpx.get(url + "/health").status_code == 200


def answer(url: str, path: str, body: dict) -> tuple[int, object]:
    """(status, what must match between servers): an error's body; a completion's choices and usage; a
    stream's text, finish reason and role per choice."""
    if not body.get("stream"):
        r = httpx.post(url + path, json={"model": "m", **body}, timeout=600)
        out = r.json()
        return r.status_code, out if r.status_code != 200 else (out["choices"], out["usage"])
    choices: dict[int, list] = {}
    with httpx.stream("POST", url + path, json={"model": "m", **body}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text, finish, role = choices.setdefault(c["index"], ["", None, None])
                    delta = c["delta"]
                    choices[c["index"]] = [text + delta.get("content", ""), c["finish_reason"] or finish,
                                           role or delta.get("role")]
    return r.status_code, choices


def test_chat_and_request_limits_answer_as_one_process_does(cluster):
    url, export = cluster
    backend = generation_backend(engine_config(export), LIMITS, "m")
    local = ServerThread(create_app(backend, None, LIMITS.max_body_bytes))
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    cases = [
        ("/v1/chat/completions", {"messages": question, "max_tokens": 12, "temperature": 0}),
        ("/v1/chat/completions", {"messages": question, "max_completion_tokens": 20, "temperature": 0,
                                  "ignore_eos": True, "n": 2}),
        ("/v1/chat/completions", {"messages": question, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                  "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),  # the template's 400
        ("/v1/chat/completions", {"messages": question, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                  "top_logprobs": 2, "presence_penalty": -1.5, "frequency_penalty": 0.5,
                                  "logit_bias": {"5": 3}}),
        ("/v1/chat/completions", {"messages": question, "logit_bias": {"1000000": 1}}),  # the replica's vocabulary
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 80}], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": question, "max_tokens": LIMITS.max_tokens_cap + 1}),
        ("/v1/completions", {"prompt": "hello " * 80, "max_tokens": 4}),  # --max-prompt-tokens
        ("/v1/completions", {"prompt": "hello", "max_tokens": LIMITS.max_tokens_cap + 1}),  # --max-tokens-cap
        ("/v1/completions", {"prompt": "x" * LIMITS.max_body_bytes}),  # --max-body-bytes
    ]
    try:
        expected = [answer(local.url, path, body) for path, body in cases]
    finally:
        local.stop()
        backend.engine.stop()
    assert [status for status, _ in expected] == [200, 200, 200, 400, 200, 400, 400, 400, 400, 400, 413]
    assert [answer(url, path, body) for path, body in cases] == expected
