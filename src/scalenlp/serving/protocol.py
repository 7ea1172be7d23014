"""What the HTTP app and the Ray replicas share: OpenAI's request schemas and their checks, the errors in
OpenAI's shape, and the response objects (completions, and chat completions reshaped from them).

pydantic is imported where the schemas are first built, so that `scalenlp --help` (which imports the serve
command and so this module) stays light.
"""

import asyncio
import dataclasses
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

MAX_N = 64
ESCAPED_BYTES = re.compile(r"bytes:((?:\\x[0-9a-f]{2})+)")  # how logprobs write a token that is part of a character
MAX_TEMPERATURE = 2.0  # as the OpenAI API


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _stated_range(default, **bounds):
    """A field whose range the OpenAPI document states (JSON Schema's ``minimum``, ``maximum``...) while
    ``check_request`` still does the checking: its 400s say the range in this server's words, pydantic's would not."""
    from pydantic import Field

    return Field(default, json_schema_extra=bounds)


@functools.cache
def _sampling_request():
    """What completion and chat requests share; the schemas are built on first use so that `scalenlp --help`
    does not import pydantic."""
    from pydantic import BaseModel, ConfigDict

    from scalenlp.engine.sampling import MAX_LOGIT_BIAS, MAX_PENALTY

    class SamplingRequest(BaseModel):
        # Strict: JSON's true is not the token id 1, nor "2" a count (pydantic's lax mode converts both), so the
        # body accepted is the one the OpenAPI document states.
        model_config = ConfigDict(extra="forbid", strict=True)

        model: str | None = None  # optional where one model is served, as vLLM
        temperature: float = _stated_range(1.0, minimum=0, maximum=MAX_TEMPERATURE)
        top_p: float = _stated_range(1.0, exclusiveMinimum=0, maximum=1)
        n: int = _stated_range(1, minimum=1, maximum=MAX_N)
        stream: bool = False
        stream_options: dict[str, Any] | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        presence_penalty: float = _stated_range(0.0, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
        frequency_penalty: float = _stated_range(0.0, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
        # token id (as a string, JSON's keys are) -> a bias added to that token's logit
        logit_bias: dict[str, float] | None = _stated_range(
            None, additionalProperties={"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS})
        user: str | None = None
        # Extensions, as in vLLM:
        top_k: int = 0
        ignore_eos: bool = False

        # ---- structured output (engine/grammar.py) ----
        response_format: dict[str, Any] | None = None
        guided_grammar: str | None = None  # vLLM's extension: a Lark grammar the output must match

    return SamplingRequest


@functools.cache
def _request_model():
    """OpenAI's (legacy) completion request."""
    from scalenlp.engine.sampling import MAX_LOGPROBS

    class CompletionRequest(_sampling_request()):
        prompt: str | list[str] | list[int] | list[list[int]]
        max_tokens: int | None = 16
        logprobs: int | None = _stated_range(None, minimum=0, maximum=MAX_LOGPROBS)
        echo: bool = False
        best_of: int | None = _stated_range(None, minimum=1, maximum=MAX_N)  # n's, the only value served
        suffix: str | None = None

    return CompletionRequest


@functools.cache
def _chat_request_model():
    """OpenAI's chat request; messages are checked by the chat renderer, which names what is wrong."""
    from scalenlp.engine.sampling import MAX_LOGPROBS

    class ChatRequest(_sampling_request()):
        messages: list[Any]
        max_tokens: int | None = None  # the older name of max_completion_tokens
        max_completion_tokens: int | None = None
        logprobs: bool = False
        top_logprobs: int | None = _stated_range(None, minimum=0, maximum=MAX_LOGPROBS)

        # ---- tool calling (serving/tools.py) ----
        tools: list[Any] | None = None
        tool_choice: str | dict[str, Any] | None = None
        parallel_tool_calls: bool | None = None

    return ChatRequest


@functools.cache
def _lora_request_models():
    """The bodies of the admin routes that load and unload LoRA adapters, named as vLLM names them."""
    from pydantic import BaseModel, ConfigDict

    class UnloadLoraRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        lora_name: str

    class LoadLoraRequest(UnloadLoraRequest):
        lora_path: str

    return LoadLoraRequest, UnloadLoraRequest


def sampling_params(req):
    """The sampling settings of a request, from the fields every generation route shares."""
    from scalenlp.engine.sampling import SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                          seed=req.seed, stop=stop, logprobs=req.logprobs, ignore_eos=req.ignore_eos,
                          grammar=request_grammar(req),
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          logit_bias=token_biases(req.logit_bias))


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias's keys as token ids; a key that is not a whole number is a 400 (the engine checks the range)."""
    biases = {}
    for key, value in (logit_bias or {}).items():
        try:
            biases[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids (whole numbers as strings, such as \"50256\"), "
                           f"got {key!r}", param="logit_bias") from None
    return biases


# ---- structured output: response_format and guided_grammar become a grammar the engine decodes under ----

def request_grammar(req) -> str | None:
    """The grammar of a request's output (None: free text); a 400 naming what llguidance cannot decode with."""
    from scalenlp.engine.grammar import GrammarError

    key = None if req.response_format is None else json.dumps(req.response_format, sort_keys=True)
    try:
        return _grammar(key, req.guided_grammar)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None


@functools.lru_cache(maxsize=256)
def _grammar(response_format: str | None, guided_grammar: str | None) -> str | None:
    """``response_grammar`` by the JSON text of response_format: compiling and checking a schema takes milliseconds
    on the event loop (8 ms for a 5-field pydantic model here), and a client sends the same schema again and again,
    and each request asks twice (its checks, then its sampling settings)."""
    from scalenlp.engine.grammar import response_grammar

    return response_grammar(None if response_format is None else json.loads(response_format), guided_grammar)


def check_sampling(params, n: int) -> None:
    """The ranges of a SamplingParams and of n, as 400s naming the field; for every generation route,
    before any work is done, so that no value reaches the engine that it cannot sample with."""
    from scalenlp.engine.sampling import INT64_MAX, InvalidParam

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

async def completion_for_chat(req, backend):
    """The completion request that answers the chat request ``req``; the backend renders the conversation
    (off the event loop: a long one takes time), in this process or on a replica."""
    from scalenlp.engine.sampling import MAX_LOGPROBS

    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs \"logprobs\": true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                       param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "max_tokens and max_completion_tokens are the same setting; send only one",
                       param="max_tokens")
    from scalenlp.serving.tools import ToolError, template_messages, tool_use

    try:
        tools = tool_use(req)
        messages = template_messages(req.messages)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    ids, tool_format = await backend.chat_prompt(messages, tools.tools if tools else None)
    fields = req.model_dump(exclude={"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                     "tool_choice", "parallel_tool_calls"})
    # None: to the end of the context, as OpenAI's chat API (a server's --max-tokens-cap still applies).
    fields["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if tools is not None:
        tools.format = tool_format
        if tools.forced:  # the output is the calls: decoded under their grammar
            if req.response_format is not None or req.guided_grammar is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} makes the output a tool call; send "
                               f"response_format or guided_grammar only with tool_choice \"auto\" or \"none\"",
                               param="tool_choice")
            fields["guided_grammar"] = tool_grammar(tools)
    completion = _request_model()(**fields, prompt=ids)
    check_request(completion)
    return completion, tools


def tool_grammar(tools) -> str:
    """The Lark grammar of the calls a ToolUse forces; a 400 on ``tools`` when a function's parameters hold a JSON
    Schema llguidance cannot decode with."""
    from scalenlp.engine.grammar import GrammarError, lark_grammar

    grammar = tools.grammar()
    try:
        lark_grammar(grammar, "tools", "a function's parameters in tools are not a JSON Schema this server can "
                                       "decode with")
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
    return grammar


async def chat_ids(templates, messages: list, tools: list | None = None) -> list[int]:
    """The prompt ids of a conversation (with ``tools`` for the template, when given), made by the model's template
    workers (``TemplateWorkers``); one they cannot render, or that passes their limits, is a 400 on the request's
    messages."""
    from scalenlp.data.chat import ChatError
    from scalenlp.data.template_workers import WorkersStopped

    try:
        return await templates.chat_ids(messages, tools)
    except ChatError as e:
        raise APIError(400, str(e), param="messages", code=e.code) from None
    except WorkersStopped as e:
        raise APIError(503, str(e), type="server_error") from None


def _on_messages(e: APIError) -> APIError:
    """A prompt error of the completion behind a chat request is an error in the request's messages."""
    if e.param == "prompt":
        e.param = "messages"
    return e


def chat_logprobs(logprobs: dict | None) -> dict | None:
    """A completion choice's logprobs in the chat API's shape: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}, one entry per generated token."""
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        # A part of a character comes as bytes:\xNN... (Engine.token_str): its bytes are the escaped ones.
        escaped = ESCAPED_BYTES.fullmatch(token)
        raw = bytes.fromhex(escaped.group(1).replace("\\x", "")) if escaped else token.encode("utf-8")
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in (top or {}).items()]}
                        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                       logprobs["top_logprobs"])]}


def chat_object(completion: dict, message_key: str, messages: list[dict]) -> dict:
    """A completion object (or chunk) as a chat completion (or chunk) whose choices carry ``messages``."""
    choices = [{"index": c["index"], message_key: m, "logprobs": chat_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"]} for c, m in zip(completion["choices"], messages)]
    return {"id": "chat" + completion["id"], "created": completion["created"], "model": completion["model"],
            "object": "chat.completion" if message_key == "message" else "chat.completion.chunk",
            "choices": choices, "usage": completion["usage"]}


async def complete_chat(backend, req, tools=None) -> dict:
    """The chat completion of ``req``; with ``tools`` (a ToolUse), each choice's text parsed for tool calls."""
    try:
        out = await backend.complete(req)
    except APIError as e:
        raise _on_messages(e) from None
    messages = []
    for c in out["choices"]:
        fields = {"content": c["text"]}
        if tools is not None:
            fields, c["finish_reason"] = tools.reply(c["text"], c["finish_reason"])
        messages.append({"role": "assistant", **fields})
    return chat_object(out, "message", messages)


async def stream_chat(backend, req, tools=None) -> AsyncIterator[dict]:
    """chat.completion.chunk objects: each choice's first delta carries the assistant role, its last the
    finish reason (with an empty delta when no text came with it). With ``tools`` (a ToolUse), text that may be a
    tool call is held back, and the calls come in the choice's last delta: a call is only known once written."""
    started: set[int] = set()
    held = {}  # choice index -> its ToolStream
    try:
        async for chunk in backend.stream(req):
            deltas = []
            for c in chunk["choices"]:
                calls = []
                if tools is not None:
                    stream = held.setdefault(c["index"], tools.stream())
                    c["text"] = stream.feed(c["text"])
                    if c["finish_reason"] is not None:
                        rest, calls, c["finish_reason"] = stream.end(c["finish_reason"])
                        c["text"] += rest
                delta = {"content": c["text"]} if c["text"] or c["index"] not in started else {}
                if c["index"] not in started:
                    started.add(c["index"])
                    delta = {"role": "assistant", **delta}
                if calls:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                deltas.append(delta)
            yield chat_object(chunk, "delta", deltas)
    except APIError as e:
        raise _on_messages(e) from None


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {400: "invalid request", 401: "missing or wrong API key", 403: "the server has no API key to guard this route",
          404: "no such model or route",
          405: "method not allowed", 413: "request body too large", 429: "queue full; retry later",
          500: "generating a choice failed", 503: "the engine stopped"}


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` entries for errors answered in OpenAI's shape."""
    return {s: {"description": ERRORS[s], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


async def unless_disconnected(request, work):
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
