"""The server stays up and answers 4xx for any request (issue 12): out-of-range sampling settings,
oversized bodies and prompts, text that is not Unicode, clients that leave; the engine survives one
request's failure, and a server whose engine dies exits non-zero."""

import json
import queue
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from infer_helpers import ServerThread, make_export

from scalenlp.cli import main
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.errors import UserError
from scalenlp.engine import llm as llm_module
from scalenlp.serving.backend import LocalBackend
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.serving.limits import API_KEY_ENV, api_key_of
from scalenlp.serving.app import create_app
from scalenlp.models.io import load_pretrained
from scalenlp.parallel.mesh import free_port

torch.set_num_threads(1)
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 4
MAX_BODY = 2 << 20
MAX_TOKENS_CAP = 4  # keeps the fuzzer's generations short


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("hard"))


@pytest.fixture(scope="module")
def served(export):
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=2, max_queue=MAX_QUEUE,
                    eos_id=find_eos_token_id(tok)).start()
    backend = LocalBackend(engine, "tiny", max_tokens_cap=MAX_TOKENS_CAP)
    server = ServerThread(create_app(backend, api_key=KEY, max_body_bytes=MAX_BODY))
    yield server, engine
    server.stop()
    engine.stop()


def post(server, body, headers=AUTH, **kw) -> httpx.Response:
    """POST a body given as JSON text (so that NaN and lone surrogates can be sent), chunks, or an object."""
    content = body if isinstance(body, (str, bytes)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(server.url + "/v1/completions", content=content, timeout=None,
                      headers={"Content-Type": "application/json", **headers}, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", [
    ('{"model": "tiny", "prompt": "hi", "seed": 9223372036854775808}', "seed"),
    ('{"model": "tiny", "prompt": "hi", "seed": -9223372036854775809}', "seed"),
    ('{"model": "tiny", "prompt": "hi", "seed": 9223372036854775807, "n": 2}', "seed"),
    ('{"model": "tiny", "prompt": "hi", "top_k": 9223372036854775808}', "top_k"),
    ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', "top_p"),
    ('{"model": "tiny", "prompt": "\\ud800"}', "prompt"),  # a lone surrogate cannot be tokenized
    ('{"model": "tiny", "prompt": ["ok", "a\\udfffb"]}', "prompt"),
    ('{"model": "tiny", "prompt": "hi", "n": 5}', "n"),  # more choices than the queue ever holds: not a 429
    ('{"model": "tiny", "prompt": ["a", "b", "c"], "n": 2}', "n"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 5}', "max_tokens"),  # over the server's cap
])
def test_bad_values_are_400_and_the_engine_lives_on(served, body, param):
    server, engine = served
    assert_error(post(server, body), 400, param)
    assert engine.alive
    assert httpx.get(server.url + "/health").status_code == 200
    ok = post(server, {"model": "tiny", "prompt": "hi", "seed": 2**63 - 1, "top_k": 2**63 - 1, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_no_max_tokens_stops_at_the_cap(served):
    out = post(served[0], {"model": "tiny", "prompt": "hi", "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == MAX_TOKENS_CAP


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


def test_a_failing_request_fails_alone(export, caplog):
    """A value no check foresaw (here planted after submission), and a callback that raises (a client
    gone): each ends its own request with "error"; the request sharing the batch finishes normally."""
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=3).start()
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
def test_server_exits_nonzero_when_the_engine_dies(export, monkeypatch, capsys):
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
        ["serve", "--checkpoint", str(export), "--port", str(port), "--dtype", "float32", "--device", "cpu"])),
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


def test_body_limit_is_413_before_reading(served):
    server, engine = served
    big = json.dumps({"model": "tiny", "prompt": "x" * (5 * MAX_BODY)})
    assert_error(post(server, big), 413)

    def chunks():  # no Content-Length: the limit applies as the body arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + 65536].encode()

    assert_error(post(server, chunks()), 413)
    assert httpx.get(server.url + "/health").status_code == 200


class _WatchedTokenizer:
    """The engine's tokenizer, with a flag raised while ``encode_batch`` runs."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.inside = threading.Event()

    def encode_batch(self, *args, **kwargs):
        self.inside.set()
        try:
            return self._tokenizer.encode_batch(*args, **kwargs)
        finally:
            self.inside.clear()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_health_answers_while_a_long_prompt_is_tokenized(served, monkeypatch):
    """Tokenizing a long prompt takes a second or more; it must not hold up the event loop (it runs in a
    worker thread) nor the GIL (the Rust tokenizer lets go of it). Health is polled throughout, and several
    polls must be sent and answered while the tokenizer is inside that one call: a tokenizer that held the
    event loop or the GIL would let at most one through. Counted, not timed, so a loaded machine cannot
    fail it (a time ratio here once did)."""
    server, engine = served
    watched = _WatchedTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", watched)
    words = "the quick brown fox jumps over the lazy dog "
    body = json.dumps({"model": "tiny", "prompt": words * (MAX_BODY // len(words) - 10)})
    result = {}
    heavy = threading.Thread(target=lambda: result.update(response=post(server, body)))
    heavy.start()
    answered_inside = 0
    with httpx.Client() as client:
        while heavy.is_alive():
            sent_inside = watched.inside.is_set()
            assert client.get(server.url + "/health", timeout=None).status_code == 200
            answered_inside += sent_inside and watched.inside.is_set()
    heavy.join()
    assert_error(result["response"], 400, "prompt")  # longer than the context
    assert answered_inside >= 5, answered_inside


def test_client_disconnect_logs_no_traceback(served, monkeypatch, capfd):
    server, engine = served
    fast = engine._decode

    def slow_decode(*args, **kwargs):  # so that the request is still running when its client leaves
        time.sleep(0.2)
        return fast(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode", slow_decode)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": MAX_TOKENS_CAP, "temperature": 0, "ignore_eos": True}
    capfd.readouterr()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    while engine.num_running or engine.num_waiting:
        time.sleep(0.05)
    # uvicorn logs an application's exception when the next request arrives at the latest
    assert httpx.get(server.url + "/health").status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


@pytest.mark.parametrize("method,path,content,status", [
    ("POST", "/v1/completions", b"\xff\xfe{", 400),  # not UTF-8: FastAPI's own 400
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("GET", "/v1/nothing", b"", 404),
    ("PUT", "/v1/completions", b"", 405),
])
def test_framework_errors_in_openai_shape(served, method, path, content, status):
    r = httpx.request(method, served[0].url + path, content=content,
                      headers={"Content-Type": "application/json", **AUTH})
    assert_error(r, status)


@pytest.mark.parametrize("header,status", [
    (f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 200),
    ("Bearer wrong", 401), (f"Basic {KEY}", 401), (KEY, 401), ("", 401),
])
def test_bearer_scheme_is_case_insensitive(served, header, status):
    r = httpx.get(served[0].url + "/v1/models", headers={"Authorization": header})
    assert r.status_code == status


def test_openapi_documents_the_responses(served):
    doc = httpx.get(served[0].url + "/openapi.json", headers=AUTH).json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(completions) and "422" not in completions
    assert completions["429"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "text/event-stream" in completions["200"]["content"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_schemathesis_finds_nothing(served):
    """Every check schemathesis has, on examples generated from the server's own OpenAPI document.
    A schema-valid request may still be a 400 (a prompt longer than the context, more choices than
    the queue holds: limits JSON Schema cannot state), so positive-data acceptance allows 400 too."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict({"checks": {"positive_data_acceptance": {
        "expected-statuses": ["2xx", "400", "401", "404", "413", "429"]}}})
    schema = schemathesis.openapi.from_url(served[0].url + "/openapi.json", config=config, headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "GET /health", "GET /metrics"}
    for operation in operations:
        # An operation with no parameters and no body has nothing to make invalid.
        for mode in GenerationMode if len(operation.body) or len(operation.query) else [GenerationMode.POSITIVE]:
            @settings(max_examples=30, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def check(case):
                case.call_and_validate(headers=AUTH)

            check()
    assert served[1].alive


def test_api_key_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_of(None, None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key_of(None, None) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key_of(None, str(key_file)) == "from-file"
    assert api_key_of("from-argv", None) == "from-argv"
    key_file.write_text("\n")
    for bad in ((None, str(key_file)), (None, str(tmp_path / "missing")), ("a", str(key_file))):
        with pytest.raises(UserError):
            api_key_of(*bad)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "hi", "--seed", str(2**63)], "--seed"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "hi", "--top-k", str(2**63)], "--top-k"),
    (["generate", "--prompt", "\udcff"], "not valid Unicode"),  # how Python hands over a byte that is not UTF-8
    (["generate", "--prompt", "hi", "--max-seq-len", "-5"], "--max-seq-len"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes"),
])
def test_cli_bad_values_are_one_error_line(export, capsys, argv, message):
    assert main(argv + ["--checkpoint", str(export), "--dtype", "float32", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_generate_invalid_utf8_argv_is_one_error_line(export):
    """The real thing: bytes that are not UTF-8 on the command line of a new process."""
    r = subprocess.run([sys.executable, "-m", "scalenlp.cli", "generate", "--checkpoint", str(export),
                        "--prompt", b"caf\xe9"], capture_output=True)
    assert r.returncode == 2 and r.stderr.startswith(b"error: --prompt is not valid Unicode"), r.stderr
    assert r.stderr.count(b"\n") == 1


def test_a_replica_with_a_dead_engine_fails_its_health_check():
    """Ray Serve calls check_health on each replica and replaces one that raises."""
    from types import SimpleNamespace

    from scalenlp.serving.cluster import EngineReplica

    EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=True)))
    with pytest.raises(RuntimeError, match="engine stopped"):
        EngineReplica.check_health(SimpleNamespace(engine=SimpleNamespace(alive=False, error=ValueError("device lost"))))
