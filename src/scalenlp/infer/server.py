"""`scalenlp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine.

Two layers: ``create_app`` speaks HTTP (routing, auth, error shapes, SSE, client disconnects) to a
*backend*, which turns a validated ``CompletionRequest`` into a response or a stream of chunks.
``LocalBackend`` drives an engine in this process (itself possibly tensor-parallel); the Ray
backend in ``cluster.py`` forwards to replicas. A backend has ``complete``, ``stream``,
``health``, ``metrics`` and ``model_name``, and ``chat_prompt`` where it serves chat completions; an
encoder's backend (``encoder_api.py``) serves embeddings and classification instead.
"""


import argparse
import asyncio
import dataclasses
import functools
import hmac
import json
import os
import sys
import time
import uuid
from typing import Any, AsyncIterator, Callable

from scalenlp.errors import UserError
from scalenlp.infer.generate import add_engine_arguments

MAX_N = 64
MAX_TEMPERATURE = 2.0  # as the OpenAI API
DEFAULT_MAX_BODY_BYTES = 4 << 20  # four 128k-token prompts as JSON token ids (up to 7 bytes each) fit
API_KEY_ENV = "SCALENLP_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health; other users see it in "
                             f"`ps`, so prefer --api-key-file or the {API_KEY_ENV} environment variable")
    parser.add_argument("--api-key-file", default=None, help="read the API key from the first line of this file")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"larger request bodies get 413 before they are read (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longer prompts get 400 (default: the context length less one)")
    parser.add_argument("--max-tokens-cap", type=int, default=None,
                        help="most tokens one choice may generate; a larger max_tokens gets 400, and a request "
                             "without max_tokens stops there (default: the end of the context)")
    parser.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint folder's name)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="serve N engine replicas behind a load-balancing router on Ray Serve")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="with --replicas: autoscale between --replicas and this many on queue length")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--replica-cpus", type=float, default=1.0,
                        help="with --replicas: CPUs Ray reserves for each replica (also its torch threads)")
    from scalenlp.infer.encoder_api import add_encoder_arguments  # it imports this module

    add_encoder_arguments(parser)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@functools.cache
def _sampling_request():
    """What completion and chat requests share; the schemas are built on first use so that `scalenlp --help`
    does not import pydantic."""
    from pydantic import BaseModel, ConfigDict

    class SamplingRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        model: str
        temperature: float = 1.0
        top_p: float = 1.0
        n: int = 1
        stream: bool = False
        stream_options: dict[str, Any] | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logit_bias: dict[str, float] | None = None
        user: str | None = None
        # Extensions, as in vLLM:
        top_k: int = 0
        ignore_eos: bool = False

    return SamplingRequest


@functools.cache
def _request_model():
    """OpenAI's (legacy) completion request."""

    class CompletionRequest(_sampling_request()):
        prompt: str | list[str] | list[int] | list[list[int]]
        max_tokens: int | None = 16
        logprobs: int | None = None
        echo: bool = False
        best_of: int | None = None
        suffix: str | None = None

    return CompletionRequest


@functools.cache
def _chat_request_model():
    """OpenAI's chat request; messages are checked by the chat renderer, which names what is wrong."""

    class ChatRequest(_sampling_request()):
        messages: list[Any]
        max_tokens: int | None = None  # the older name of max_completion_tokens
        max_completion_tokens: int | None = None
        logprobs: bool = False
        top_logprobs: int | None = None

    return ChatRequest


def sampling_params(req):
    """The sampling settings of a request, from the fields every generation route shares."""
    from scalenlp.infer.sampling import SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                          seed=req.seed, stop=stop, logprobs=req.logprobs, ignore_eos=req.ignore_eos)


def check_sampling(params, n: int) -> None:
    """The ranges of a SamplingParams and of n, as 400s naming the field; for every generation route,
    before any work is done, so that no value reaches the engine that it cannot sample with."""
    from scalenlp.infer.sampling import INT64_MAX, InvalidParam

    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {n}", param="n")
    try:
        params.check()
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.param) from None
    if params.temperature > MAX_TEMPERATURE:
        raise APIError(400, f"temperature must be between 0 and {MAX_TEMPERATURE}, got {params.temperature}",
                       param="temperature")
    if params.seed is not None and params.seed + n - 1 > INT64_MAX:
        raise APIError(400, f"choice i samples with seed + i, so seed + n - 1 must be at most {INT64_MAX}; "
                       f"got seed {params.seed} with n {n}", param="seed")


def choice_params(params, index: int):
    """Choice ``index`` of a request: n choices from one seed must differ from each other, and still reproduce."""
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + index)


def check_request(req) -> None:
    """What pydantic's types do not say: ranges, and the parts of the API this server does not implement."""
    check_sampling(sampling_params(req), req.n)
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if req.presence_penalty or req.frequency_penalty:
        raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
    if isinstance(req.prompt, list) and not req.prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")


def prompts_of(req) -> list[str | list[int]]:
    """The request's prompts, each text or token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


class LocalBackend:
    """Requests go to an engine in this process; events come back from its thread to the event loop."""

    def __init__(self, engine, model_name: str, health_timeout: float = 10.0, max_prompt_tokens: int | None = None,
                 max_tokens_cap: int | None = None):
        """max_prompt_tokens: longest prompt accepted (default: the context less one). max_tokens_cap:
        most tokens a choice may generate (default: to the end of the context)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = engine
        self.model_name = model_name
        self.health_timeout = health_timeout
        self.max_prompt_tokens = min(max_prompt_tokens or engine.max_seq_len, engine.max_seq_len - 1)
        self.max_tokens_cap = max_tokens_cap
        self.registry = CollectorRegistry()
        Gauge("scalenlp_requests_running", "requests holding a KV-cache slot", registry=self.registry
              ).set_function(lambda: engine.num_running)
        Gauge("scalenlp_requests_waiting", "requests queued for a slot", registry=self.registry
              ).set_function(lambda: engine.num_waiting)
        self.prompt_tokens = Counter("scalenlp_prompt_tokens", "prompt tokens processed", registry=self.registry)
        self.generated_tokens = Counter("scalenlp_generation_tokens", "tokens generated", registry=self.registry)
        self.finished = Counter("scalenlp_requests_finished", "finished requests", ["finish_reason"],
                                registry=self.registry)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("scalenlp_time_to_first_token_seconds", "arrival to first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("scalenlp_inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=buckets, registry=self.registry)
        self.e2e = Histogram("scalenlp_e2e_request_latency_seconds", "arrival to last token",
                             buckets=buckets, registry=self.registry)

    def chat_prompt(self, messages: list) -> list[int]:
        """The prompt ids of a conversation, by the checkpoint's chat template (ChatError when it cannot)."""
        from scalenlp.data.chat import encode_chat

        return encode_chat(self.engine.tokenizer, messages, self.engine.tokenizer_config)

    def _limited(self, params, n_choices: int, max_tokens_sent: bool):
        """The request's settings under this server's limits; the limits no retry can meet are 400s.
        A max_tokens over the cap is one only when the client sent it, not when it is the API's default."""
        if n_choices > self.engine.max_queue:
            raise APIError(400, f"the request asks for {n_choices} choices (prompts times n), more than this "
                           f"server ever queues ({self.engine.max_queue}); send fewer", param="n")
        cap = self.max_tokens_cap
        if cap is None:
            return params
        if max_tokens_sent and params.max_tokens is not None and params.max_tokens > cap:
            raise APIError(400, f"max_tokens must be at most {cap} on this server, got {params.max_tokens}",
                           param="max_tokens")
        return dataclasses.replace(params, max_tokens=min(params.max_tokens or cap, cap))

    def _check_prompt_length(self, ids: list[int]) -> None:
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, and this server accepts at most "
                           f"{self.max_prompt_tokens}; shorten it", param="prompt")

    def _tokenize(self, prompts: list) -> list[list[int]]:
        """Token ids of every prompt; runs in a worker thread, as a long text takes seconds."""
        from scalenlp.infer.engine import RequestError

        try:
            ids = [self.engine.encode(p) for p in prompts]
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        for x in ids:
            self._check_prompt_length(x)
        return ids

    async def _events(self, req) -> AsyncIterator[tuple[int, Any, int]]:
        """Submit every choice of the request; yield (choice index, Delta, prompt length) as they come.
        Leaving early (client gone, cancelled) cancels the engine requests, freeing their slots."""
        from scalenlp.infer.engine import EngineDead, QueueFull, RequestError

        prompts = prompts_of(req)
        params = self._limited(sampling_params(req), len(prompts) * req.n, "max_tokens" in req.model_fields_set)
        texts = [p for p in prompts if isinstance(p, str)]
        for p in prompts:
            if not isinstance(p, str):
                self._check_prompt_length(p)  # before tokenizing the others
        encoded = iter(await asyncio.to_thread(self._tokenize, texts) if texts else [])
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        items, callbacks, lengths = [], [], []
        for p_index, prompt in enumerate(prompts):
            ids = next(encoded) if isinstance(prompt, str) else prompt
            for j in range(req.n):
                index = p_index * req.n + j
                items.append((ids, choice_params(params, j)))
                callbacks.append(lambda d, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, d)))
                lengths.append(len(ids))
        try:
            requests = self.engine.submit_many(items, callbacks)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error") from None
        start = time.perf_counter()
        last = [None] * len(requests)
        open_count = len(requests)
        try:
            while open_count:
                i, delta = await queue.get()
                if delta.finish_reason == "abort":
                    raise APIError(503, f"the engine stopped while serving this request: {self.engine.error!r}",
                                   type="server_error")
                if delta.finish_reason == "error":
                    raise APIError(500, f"generating this choice failed: {delta.error}", type="server_error")
                n_tokens = len(delta.token_ids)
                self.generated_tokens.inc(n_tokens)
                if n_tokens:
                    if last[i] is None:
                        self.ttft.observe(delta.time - requests[i].arrival)
                        self.prompt_tokens.inc(lengths[i])
                    else:
                        self.itl.observe(delta.time - last[i])
                    last[i] = delta.time
                if delta.finish_reason is not None:
                    open_count -= 1
                    self.finished.labels(delta.finish_reason).inc()
                    self.e2e.observe(time.perf_counter() - start)
                yield i, delta, lengths[i]
        finally:
            for r in requests:
                if r.finish_reason is None:
                    self.engine.cancel(r)

    async def complete(self, req) -> dict:
        n_choices = len(prompts_of(req)) * req.n
        choices = [{"index": i, "text": "", "logprobs": _empty_logprobs() if req.logprobs is not None else None,
                    "finish_reason": None} for i in range(n_choices)]
        prompt_tokens = completion_tokens = 0
        counted = set()
        async for i, delta, prompt_len in self._events(req):
            c = choices[i]
            _append_logprobs(c["logprobs"], c["text"], delta)
            c["text"] += delta.text
            completion_tokens += len(delta.token_ids)
            if i // req.n not in counted:
                counted.add(i // req.n)
                prompt_tokens += prompt_len
            if delta.finish_reason is not None:
                c["finish_reason"] = delta.finish_reason
        return completion_object(self.model_name, choices, usage(prompt_tokens, completion_tokens))

    async def stream(self, req) -> AsyncIterator[dict]:
        """Completion chunks; a last chunk with only usage when stream_options.include_usage is set."""
        cid, created = new_id(), int(time.time())
        prompt_tokens = completion_tokens = 0
        counted = set()
        async for i, delta, prompt_len in self._events(req):
            completion_tokens += len(delta.token_ids)
            if i // req.n not in counted:
                counted.add(i // req.n)
                prompt_tokens += prompt_len
            if not delta.text and delta.finish_reason is None and req.logprobs is None:
                continue  # text held back (an unfinished character or a possible stop string)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _empty_logprobs()
                _append_logprobs(logprobs, "", delta)
            yield completion_object(self.model_name, [{"index": i, "text": delta.text, "logprobs": logprobs,
                                                       "finish_reason": delta.finish_reason}], None, cid, created)
        if (req.stream_options or {}).get("include_usage"):
            yield completion_object(self.model_name, [], usage(prompt_tokens, completion_tokens), cid, created)

    async def health(self) -> tuple[bool, str]:
        """Send a one-token request through the engine; healthy if it finishes, or if the engine is
        busy and still stepping (then the probe leaves the queue). Dead or no progress: unhealthy."""
        from scalenlp.infer.engine import EngineDead
        from scalenlp.infer.sampling import SamplingParams

        engine = self.engine
        if not engine.alive:
            return False, f"engine stopped: {engine.error!r}"
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        steps_before = engine.steps
        try:
            probe = engine.submit([engine.eos_id or 0], SamplingParams(max_tokens=1, temperature=0),
                                  lambda d: loop.call_soon_threadsafe(done.set), bypass_queue_limit=True)
        except EngineDead as e:
            return False, str(e)
        deadline = time.monotonic() + self.health_timeout
        try:
            while time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(done.wait(), 0.05)
                    return probe.finish_reason != "abort", "ok" if probe.finish_reason != "abort" else "engine stopped"
                except asyncio.TimeoutError:
                    if engine.steps > steps_before + 1:
                        return True, "ok (busy)"
            return False, f"engine made no progress in {self.health_timeout:.0f}s"
        finally:
            engine.cancel(probe)

    def metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _empty_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _append_logprobs(logprobs: dict | None, text_so_far: str, delta) -> None:
    if logprobs is None or delta.logprobs is None:
        return
    for k, token_id in enumerate(delta.token_ids):
        logprobs["tokens"].append(str(token_id))
        logprobs["token_logprobs"].append(delta.logprobs[k])
        logprobs["top_logprobs"].append(delta.top_logprobs[k] if delta.top_logprobs else None)
        logprobs["text_offset"].append(len(text_so_far))


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(model: str, choices: list[dict], usage_: dict | None, cid: str | None = None,
                      created: int | None = None) -> dict:
    return {"id": cid or new_id(), "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


# ---- chat completions: a conversation is rendered by the model's chat template into a prompt of token ids,
# completed as any prompt is, and the completion objects are reshaped into chat objects. ----

def completion_for_chat(req, backend):
    """The completion request that answers the chat request ``req``. Runs in a worker thread: rendering and
    tokenizing a long conversation takes time the event loop does not have."""
    from scalenlp.data.chat import ChatError

    if req.logprobs or req.top_logprobs is not None:
        raise APIError(400, "logprobs are not supported for chat completions", param="logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "max_tokens and max_completion_tokens are the same setting; send only one",
                       param="max_tokens")
    chat_prompt = getattr(backend, "chat_prompt", None)
    if chat_prompt is None:
        raise APIError(501, "chat completions are not served with --replicas yet; use /v1/completions",
                       type="server_error")
    try:
        ids = chat_prompt(req.messages)
    except ChatError as e:
        raise APIError(400, str(e), param="messages") from None
    fields = req.model_dump(exclude={"messages", "max_completion_tokens", "logprobs", "top_logprobs"})
    # None: to the end of the context, as OpenAI's chat API (a server's --max-tokens-cap still applies).
    fields["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    completion = _request_model()(**fields, prompt=ids)
    check_request(completion)
    return completion


def _on_messages(e: APIError) -> APIError:
    """A prompt error of the completion behind a chat request is an error in the request's messages."""
    if e.param == "prompt":
        e.param = "messages"
    return e


def chat_object(completion: dict, message_key: str, messages: list[dict]) -> dict:
    """A completion object (or chunk) as a chat completion (or chunk) whose choices carry ``messages``."""
    choices = [{"index": c["index"], message_key: m, "logprobs": None, "finish_reason": c["finish_reason"]}
               for c, m in zip(completion["choices"], messages)]
    return {"id": "chat" + completion["id"], "created": completion["created"], "model": completion["model"],
            "object": "chat.completion" if message_key == "message" else "chat.completion.chunk",
            "choices": choices, "usage": completion["usage"]}


async def complete_chat(backend, req) -> dict:
    try:
        out = await backend.complete(req)
    except APIError as e:
        raise _on_messages(e) from None
    return chat_object(out, "message", [{"role": "assistant", "content": c["text"]} for c in out["choices"]])


async def stream_chat(backend, req) -> AsyncIterator[dict]:
    """chat.completion.chunk objects: each choice's first delta carries the assistant role, its last the
    finish reason (with an empty delta when no text came with it)."""
    started: set[int] = set()
    try:
        async for chunk in backend.stream(req):
            deltas = []
            for c in chunk["choices"]:
                delta = {"content": c["text"]} if c["text"] or c["index"] not in started else {}
                if c["index"] not in started:
                    started.add(c["index"])
                    delta = {"role": "assistant", **delta}
                deltas.append(delta)
            yield chat_object(chunk, "delta", deltas)
    except APIError as e:
        raise _on_messages(e) from None


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "no such model or route",
          405: "method not allowed", 413: "request body too large", 429: "queue full; retry later",
          500: "generating a choice failed", 501: "not served in this configuration", 503: "the engine stopped"}


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` entries for errors answered in OpenAI's shape."""
    return {s: {"description": ERRORS[s], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 in OpenAI's shape, by its Content-Length
    before it is read, or as soon as the chunks received pass the limit (a chunked upload has no
    length). Starlette's own limit (FastAPI's ``max_body_size``) answers the first case in plain text."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def error(self) -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({self.max_bytes} bytes); "
                        "send a shorter prompt", code="request_too_large")

    async def __call__(self, scope, receive, send):
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")  # the HTTP server has checked it is a number
        if length and int(length) > self.max_bytes:
            e = self.error()
            return await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.error().message)  # FastAPI passes HTTPExceptions from body reading on
            return message

        await self.app(scope, limited_receive, send)


def _authorized(header: str, api_key: str) -> bool:
    """``Authorization: Bearer KEY``; the scheme is case-insensitive (RFC 7235), the key compared in constant time."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def create_app(backend, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    CompletionRequest = _request_model()
    ChatRequest = _chat_request_model()
    app = FastAPI(title="scalenlp", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        """Starlette's own errors (no such route, wrong method, an unreadable body) in OpenAI's shape."""
        return error_response(APIError(e.status_code, str(e.detail)), e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        kind = first.get("type", "")
        if kind == "json_invalid":
            message, loc = "the request body is not valid JSON", []  # its location is a character offset
        elif kind == "extra_forbidden":
            message = f"unrecognized request argument supplied: {'.'.join(loc)}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(APIError(400, message, param=loc[0] if loc else None))

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            if not _authorized(request.headers.get("authorization", ""), api_key):
                return error_response(APIError(401, "missing or wrong API key; send `Authorization: Bearer KEY`",
                                               code="invalid_api_key"))
        return await call_next(request)

    health_schema = {"type": "object", "required": ["status", "detail"],
                     "properties": {"status": {"enum": ["ok", "unhealthy"]}, "detail": {"type": "string"}}}

    @app.get("/health", responses={200: {"description": "the engine answers",
                                         "content": {"application/json": {"schema": health_schema}}},
                                   503: {"description": "the engine stopped or makes no progress",
                                         "content": {"application/json": {"schema": health_schema}}}})
    async def health():
        ok, reason = await backend.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "detail": reason}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401),
             description="Prometheus text exposition format")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(backend.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(401))
    async def models():
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": 0,
                                            "owned_by": "scalenlp"}]}

    completion_responses = {200: {"description": "a completion, or with `stream` a stream of server-sent events",
                                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                            **error_responses(400, 401, 404, 413, 429, 500, 503)}

    def check_model(req) -> None:
        if req.model != backend.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {backend.model_name!r}",
                           param="model", code="model_not_found")

    async def answer(request: Request, stream: bool, complete, chunks: Callable[[], AsyncIterator[dict]]):
        """The awaited ``complete()``, or an SSE stream of ``chunks()``."""
        if stream:
            chunks = chunks()
            # Wait for the first chunk before answering, so that errors before any output (queue full,
            # prompt too long) get their status code instead of a 200 stream.
            first = await _unless_disconnected(request, _first(chunks))
            if not isinstance(first, (dict, type(None))):  # the client left while waiting
                await chunks.aclose()
                return first
            return StreamingResponse(_sse(first, chunks), media_type="text/event-stream")
        return await _unless_disconnected(request, complete())

    @app.post("/v1/completions", responses=completion_responses)
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        check_model(req)
        return await answer(request, req.stream, lambda: backend.complete(req), lambda: backend.stream(req))

    @app.post("/v1/chat/completions", responses={**completion_responses, **error_responses(501)})
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        completion = await asyncio.to_thread(completion_for_chat, req, backend)
        return await answer(request, req.stream, lambda: complete_chat(backend, completion),
                            lambda: stream_chat(backend, completion))

    from scalenlp.infer.encoder_api import add_encoder_routes  # it imports this module

    add_encoder_routes(app, backend, check_model)

    def openapi() -> dict:
        """FastAPI's document, less its 422 (validation errors are 400s here), with the error schema and
        the API key as a bearer scheme on every route but /health."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schemas["Error"] = ERROR_SCHEMA
            if api_key is not None:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in doc["paths"].items():
                for op in operations.values():
                    op["responses"].pop("422", None)
                    if api_key is not None and path != "/health":
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _first(chunks: AsyncIterator[dict]) -> dict | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _sse(first: dict | None, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events; when the client goes away the server cancels this generator, and closing
    ``chunks`` cancels the engine requests behind it."""
    try:
        if first is not None:
            yield f"data: {json.dumps(first)}\n\n"
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


async def _unless_disconnected(request, work):
    """Run ``work``; if the client disconnects first, cancel it (freeing its slots) and give up."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():  # the client left: a cancelled task is done only once its cleanup has run
        await asyncio.wait({task})
    if task.cancelled():
        from fastapi.responses import Response

        return Response(status_code=499)
    return task.result()


def check_options(args) -> None:
    """The serving options' ranges, checked before the model is loaded."""
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    for option in ("max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens_cap"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')} must be at least 1, got {value}")


def api_key_of(args) -> str | None:
    """--api-key, else the first line of --api-key-file, else $SCALENLP_API_KEY; the last two keep
    the key out of the process list."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UserError("--api-key and --api-key-file both give the API key; keep one")
    if args.api_key_file is not None:
        try:
            lines = open(args.api_key_file, encoding="utf-8").read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the API key from --api-key-file {args.api_key_file}: {e}") from None
        if not lines or not lines[0].strip():
            raise UserError(f"--api-key-file {args.api_key_file} is empty; put the key on its first line")
        return lines[0].strip()
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None


def run(args) -> int:
    check_options(args)
    args.api_key = api_key_of(args)
    if args.replicas:
        from scalenlp.infer.cluster import serve_replicas

        return serve_replicas(args)
    import uvicorn

    from scalenlp.infer.encoder_api import build_encoder_backend
    from scalenlp.infer.encoder_engine import is_encoder
    from scalenlp.infer.generate import build_engine

    model_name = args.model_name or default_model_name(args.checkpoint)
    if is_encoder(args.checkpoint):
        backend = build_encoder_backend(args, model_name)
    else:
        backend = LocalBackend(build_engine(args, max_queue=args.max_queue), model_name,
                               max_prompt_tokens=args.max_prompt_tokens, max_tokens_cap=args.max_tokens_cap)
    engine = backend.engine
    server = uvicorn.Server(uvicorn.Config(create_app(backend, args.api_key, args.max_body_bytes), host=args.host,
                                           port=args.port, log_level="warning"))
    if isinstance(backend, LocalBackend):  # the generation engine tells when its loop dies
        engine.on_death = lambda error: setattr(server, "should_exit", True)
        if not engine.alive:  # it died before it could be told
            server.should_exit = True
    try:
        server.run()
    finally:
        engine.stop()
    if getattr(engine, "error", None) is not None:
        # Not a user error: exit 1, which a supervisor (systemd, Kubernetes) answers with a restart.
        print(f"fatal: the engine stopped ({engine.error!r}); exiting so that a supervisor restarts the server",
              file=sys.stderr)
        return 1
    return 0


def default_model_name(checkpoint: str) -> str:
    from pathlib import Path

    path = Path(checkpoint).resolve()
    return path.parent.name if path.name == "export" else path.name
