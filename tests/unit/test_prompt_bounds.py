"""Requests priced before work on the generation routes (issue 32, item 6, and the server's LOW items of item 7):
a prompt, or a conversation, over --max-prompt-chars is refused before it is tokenized or rendered; a client that
sends half a request has its connection closed; the OpenAPI document states the sampling fields' ranges. (A burst
of huge prompts against a server process, its RSS and a small request beside it:
integration/test_prompt_burst.py.)"""

import asyncio
import socket

import httpx
import pytest
import torch

from infer_helpers import ServerThread
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.models.io import load_pretrained
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend
from scalenlp.serving.limits import CHARS_PER_PROMPT_TOKEN, ServeLimits
from scalenlp.serving.protocol import APIError, _request_model

torch.set_num_threads(1)
MAX_CHARS = 200


@pytest.fixture(scope="module")
def engine(tiny_export):
    tok = load_tokenizer(tiny_export)
    engine = Engine(load_pretrained(tiny_export), tok, max_batch=2, max_queue=16, eos_id=find_eos_token_id(tok))
    yield engine.start()
    engine.stop()


class Templates:
    """Template workers that render every conversation as two tokens, and count the conversations."""

    def __init__(self):
        self.rendered = 0

    async def chat_ids(self, messages: list, tools: list | None = None) -> list[int]:
        self.rendered += 1
        return [1, 2]


@pytest.fixture(scope="module")
def templates():
    return Templates()


@pytest.fixture(scope="module")
def served(engine, templates):
    """A server whose prompts may hold MAX_CHARS characters."""
    server = ServerThread(create_app(LocalBackend(engine, "tiny", max_prompt_chars=MAX_CHARS, templates=templates)))
    yield server
    server.stop()


@pytest.fixture
def encoded(engine, monkeypatch):
    """The texts the engine tokenizes, in order."""
    seen, encode = [], engine.encode
    monkeypatch.setattr(engine, "encode", lambda text: seen.append(text) or encode(text))
    return seen


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=None)


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_long_prompt_is_refused_before_tokenizing(served, encoded):
    r = post(served.url, "/v1/completions", {"model": "tiny", "prompt": "a" * (MAX_CHARS + 1)})
    assert_400(r, "prompt", f"{MAX_CHARS + 1}", "--max-prompt-chars")
    # One long prompt among several: none of them is tokenized.
    r = post(served.url, "/v1/completions", {"model": "tiny", "prompt": ["hi there", "b" * (MAX_CHARS + 1)]})
    assert_400(r, "prompt", "--max-prompt-chars")
    assert encoded == []
    at_cap = ("the " * MAX_CHARS)[:MAX_CHARS]
    ok = post(served.url, "/v1/completions", {"model": "tiny", "prompt": at_cap, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert encoded == [at_cap]


def test_prompts_stop_being_tokenized_at_the_first_too_long(served, engine, encoded):
    long = "x " * (MAX_CHARS // 2 - 1)  # within the characters, past the 127 tokens of the tiny model's context
    assert len(engine.encode(long)) > engine.max_seq_len
    encoded.clear()
    r = post(served.url, "/v1/completions", {"model": "tiny", "prompt": [long, "hi", "there"]})
    assert_400(r, "prompt", "tokens")
    assert encoded == [long]


def test_long_conversation_is_refused_before_rendering(served, encoded, templates):
    rendered = templates.rendered
    # Every string counts, keys too, as the template may write any of them: 170 characters of text, 36 of keys and
    # roles.
    messages = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 50, "name": "n" * 20}]
    r = post(served.url, "/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert_400(r, "messages", "206", "--max-prompt-chars")
    assert templates.rendered == rendered and encoded == []
    messages[1]["name"] = "n"
    ok = post(served.url, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert templates.rendered == rendered + 1


def test_default_cap_follows_the_longest_prompt(engine, encoded):
    backend = LocalBackend(engine, "tiny", max_prompt_tokens=50)
    assert backend.max_prompt_chars == 50 * CHARS_PER_PROMPT_TOKEN
    req = _request_model()(model="tiny", prompt="z" * (50 * CHARS_PER_PROMPT_TOKEN + 1))
    with pytest.raises(APIError, match="--max-prompt-chars") as caught:
        asyncio.run(backend.complete(req))
    assert caught.value.status == 400 and encoded == []


class Idle:
    """A backend with nothing to do but a /health that takes ``seconds`` (for the connection tests)."""

    model_name = "idle"

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds

    async def health(self):
        await asyncio.sleep(self.seconds)
        return True, "ok"


@pytest.fixture
def deadline_server():
    """A server whose clients have 0.5 s to send each request, on `scalenlp serve`'s connections."""
    server = ServerThread(create_app(Idle(seconds=1.0)), ServeLimits(read_timeout=0.5, keep_alive_timeout=5))
    yield server
    server.stop()


def closed_by_server(port: int, sent: bytes) -> bytes:
    """Send ``sent`` on a new connection, then nothing; what the server answers before closing it. A socket
    timeout (the server kept the connection) fails the test."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(sent)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
        return received


@pytest.mark.parametrize("sent", [
    b"",  # a connection that never sends a byte
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",  # half the headers
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\": ",  # half the body
])
def test_half_sent_requests_are_closed(deadline_server, sent):
    assert closed_by_server(deadline_server.port, sent) == b""
    assert httpx.get(deadline_server.url + "/health").status_code == 200  # and the server goes on


def test_requests_slower_to_answer_than_to_read_are_not_cut(deadline_server):
    """The deadline is for reading a request, not answering it: /health here takes twice as long; a keep-alive
    connection takes its next request after the deadline has passed for the first."""
    with httpx.Client() as client:
        for _ in range(2):
            r = client.get(deadline_server.url + "/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"


def test_openapi_states_the_sampling_ranges_and_the_checks_keep_their_words(served):
    schemas = httpx.get(served.url + "/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatRequest"]["properties"]
    for fields in (completion, chat):
        assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, 64)
        assert (fields["temperature"]["minimum"], fields["temperature"]["maximum"]) == (0, 2)
        assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
    assert (completion["best_of"]["minimum"], completion["best_of"]["maximum"]) == (1, 64)
    for field, value, message in [("n", 65, "n must be between 1 and 64, got 65"),
                                  ("temperature", 2.5, "temperature must be between 0 and 2.0, got 2.5"),
                                  ("top_p", 0, "top_p must be in (0, 1], got 0")]:
        r = post(served.url, "/v1/completions", {"model": "tiny", "prompt": "hi", field: value})
        assert_400(r, field, message)
