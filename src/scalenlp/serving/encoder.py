"""The encoder routes of `scalenlp serve`: ``POST /v1/embeddings`` (OpenAI's embeddings API),
``POST /v1/classify`` (label and probabilities per text), ``POST /v1/tag`` (entities per text: type, text,
character offsets, score) and ``POST /v1/qa`` (the answer to each question in its context: text, character
offsets, score), on the same app, auth and error shapes as generation.

A backend that serves an encoder has ``embeddings``, ``classify`` and ``tag``; ``EncoderBackend`` runs them on an
``EncoderEngine`` in this process, the Ray backend forwards them to replicas. The routes answer a
decoder's backend, which has neither, with a 400 that says which routes it serves, and an encoder's
backend answers the generation routes the same way.
"""

# No `from __future__ import annotations` here: FastAPI reads the request types from the route functions'
# annotations, which must then be the classes, not their names.
import asyncio
import base64
import functools
from typing import Any, Literal

from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.serving.protocol import APIError, error_responses

ENCODER_ONLY = "this model is an encoder: use /v1/embeddings or /v1/classify, or /v1/tag for a tagger"
DECODER_ONLY = "this model is a decoder (it generates text): use /v1/completions or /v1/chat/completions"


@functools.cache
def request_models():
    """(EmbeddingRequest, ClassifyRequest, TagRequest, QARequest), built on first use so that `scalenlp --help` does not import pydantic."""
    from pydantic import BaseModel, ConfigDict

    class EmbeddingRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)  # as generation: JSON true is no token id

        model: str | None = None  # optional: the one model served
        input: str | list[str] | list[int] | list[list[int]]
        encoding_format: Literal["float", "base64"] = "float"
        dimensions: int | None = None
        user: str | None = None

    class ClassifyRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        model: str | None = None  # optional: the one model served
        input: str | list[str]
        user: str | None = None

    class TagRequest(ClassifyRequest):
        pass

    class QARequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        model: str | None = None  # optional: the one model served
        question: str | list[str]
        context: str | list[str]  # one per question, or one for them all
        allow_empty: bool = False  # SQuAD v2.0: answer "" when "no answer" scores above every span
        user: str | None = None

    return EmbeddingRequest, ClassifyRequest, TagRequest, QARequest


CLASSIFY_RESPONSE = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["index", "label", "probabilities"], "properties": {
        "index": {"type": "integer"}, "label": {"type": "string"},
        "probabilities": {"type": "object", "additionalProperties": {"type": "number"}}}}},
    "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}


def inputs_of(value: str | list) -> list[str | list[int]]:
    """The request's inputs, each a text or token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def usage_of(rows: list[list[int]]) -> dict:
    tokens = sum(map(len, rows))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


class EncoderOnly:
    """The generation routes, answered for an encoder."""

    def complete(self, req):
        raise APIError(400, ENCODER_ONLY)

    stream = complete

    async def chat_prompt(self, messages, tools=None):
        raise APIError(400, ENCODER_ONLY, param="messages")


class EncoderBackend(EncoderOnly):
    """Requests go to an ``EncoderEngine`` in this process; its counters are the /metrics."""

    def __init__(self, engine, model_name: str, health_timeout: float = 10.0):
        from prometheus_client import CollectorRegistry

        self.engine = engine
        self.health_timeout = health_timeout
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCounters(engine))

    async def _run(self, kind: str, inputs: list[str | list[int]], encode=None):
        """(rows of the engine's output, the token ids they came from: ``encode``'s, the engine's ``encode`` by
        default, each called with ``priced=True``). The request is priced (characters per text, a lower bound on
        its tokens from its words, then its tokens) before it is queued; cancelling this coroutine (the client
        left) drops its texts."""
        from scalenlp.engine.decoder_engine import EngineDead, QueueFull, RequestError

        try:
            # Tokenizing thousands of texts takes a while, and the tokenizer lets go of the GIL meanwhile.
            encoded = await asyncio.to_thread(encode or self.engine.encode, inputs, priced=True)
            # Question answering's windows come with their segments (and the windows, to read answers from).
            ids, types = (encoded[0], encoded[1]) if isinstance(encoded, tuple) else (encoded, None)
            self.engine.price(ids)
            future = self.engine.submit(kind, ids, types=types)
        except RequestError as e:
            raise APIError(400, str(e), param="input") from None
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error") from None
        try:
            return await asyncio.wrap_future(future), encoded
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error") from None

    async def embeddings(self, req) -> dict:
        dim = self.engine.args.dim
        if req.dimensions is not None and req.dimensions != dim:
            raise APIError(400, f"dimensions={req.dimensions} is not supported: this model's embeddings have {dim} "
                                f"dimensions; omit the field or send {dim}", param="dimensions")
        rows, ids = await self._run("embed", inputs_of(req.input))
        data = [{"object": "embedding", "index": i, "embedding": vector(row, req.encoding_format)}
                for i, row in enumerate(rows)]
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage_of(ids)}

    async def classify(self, req) -> dict:
        labels = self.engine.labels
        rows, ids = await self._run("classify", inputs_of(req.input))
        data = [{"index": i, "label": labels[int(row.argmax())],
                 "probabilities": dict(zip(labels, row.tolist()))} for i, row in enumerate(rows)]
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage_of(ids)}

    async def tag(self, req) -> dict:
        texts = inputs_of(req.input)
        rows, ids = await self._run("tag", texts, self.engine.tag_windows)
        entities = await asyncio.to_thread(self.engine.entities, texts, rows)
        data = [{"index": i, "entities": found} for i, found in enumerate(entities)]
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage_of(ids)}

    async def qa(self, req) -> dict:
        questions = [req.question] if isinstance(req.question, str) else list(req.question)
        contexts = [req.context] if isinstance(req.context, str) else list(req.context)
        if len(contexts) == 1:
            contexts *= len(questions)

        def windows(_, priced):
            found = self.engine.qa_windows(questions, contexts, priced)
            flat = [w for ws in found for w in ws]
            return [w.ids for w in flat], [w.type_ids for w in flat], found

        rows, (ids, _, found) = await self._run("qa", [], windows)
        answers = await asyncio.to_thread(self.engine.answers, contexts, found, rows, req.allow_empty)
        data = [{"index": i, "answer": a.text, "start": a.start, "end": a.end, "score": a.score}
                for i, a in enumerate(answers)]
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage_of(ids)}

    async def health(self) -> tuple[bool, str]:
        """Send a one-token text through the batcher, as a request would go; healthy if it comes back within
        ``health_timeout``, or if the batcher is busy and still running forward passes. Dead or wedged:
        unhealthy."""
        from scalenlp.engine.decoder_engine import EngineDead

        engine = self.engine
        if not engine.alive:
            return False, f"encoder stopped: {engine.error!r}"
        forwards_before = engine.forwards
        try:
            probe = engine.submit("embed", [engine.prefix + [engine.args.pad_token_id] + engine.suffix],
                                  bypass_queue_limit=True)
        except EngineDead as e:
            return False, str(e)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(probe)), self.health_timeout)
            return True, "ok"
        except TimeoutError:
            if engine.forwards > forwards_before + 1:
                return True, "ok (busy)"
            return False, f"the encoder made no progress in {self.health_timeout:g}s"
        except EngineDead as e:
            return False, str(e)
        finally:
            probe.cancel()

    def metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class EngineCounters:
    """A Prometheus collector reading the engine's own counters at scrape time."""

    COUNTERS = {"requests": "requests queued", "forwards": "forward passes run", "texts": "texts encoded",
                "tokens": "real tokens encoded", "padded_tokens": "token positions computed, padding included",
                "truncated": "texts cut to the model's length"}

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"scalenlp_encoder_{name}", doc, value=getattr(self.engine, name))
        yield GaugeMetricFamily("scalenlp_encoder_texts_waiting", "texts queued for a forward pass",
                                value=self.engine.num_waiting)


def vector(row, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode()
    return row.tolist()


def add_encoder_routes(app, backend, check_model) -> None:
    """/v1/embeddings, /v1/classify, /v1/tag and /v1/qa on the server's app; ``check_model`` answers a wrong model name."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from scalenlp.serving.protocol import unless_disconnected

    EmbeddingRequest, ClassifyRequest, TagRequest, QARequest = request_models()

    async def served(req, request, route: str) -> Any:
        """The backend's answer as JSON; if the client leaves first, its texts leave the queue."""
        check_model(req)
        method = getattr(backend, route, None)
        if method is None:
            raise APIError(400, DECODER_ONLY, param="model")
        answer = await unless_disconnected(request, method(req))
        return JSONResponse(answer) if isinstance(answer, dict) else answer

    # JSONResponse serialises with json.dumps; FastAPI's default encoder walks every float, slow for vectors.
    responses = error_responses(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/embeddings", responses=responses)
    async def embeddings(req: EmbeddingRequest, request: Request):
        return await served(req, request, "embeddings")

    @app.post("/v1/classify", responses={200: {"description": "a label and the probability of every label, per text",
                                               "content": {"application/json": {"schema": CLASSIFY_RESPONSE}}},
                                         **responses})
    async def classify(req: ClassifyRequest, request: Request):
        return await served(req, request, "classify")

    @app.post("/v1/tag", responses=responses)
    async def tag(req: TagRequest, request: Request):
        return await served(req, request, "tag")

    @app.post("/v1/qa", responses=responses)
    async def qa(req: QARequest, request: Request):
        return await served(req, request, "qa")


def build_encoder_backend(config: EncoderEngineConfig, model_name: str) -> EncoderBackend:
    """The encoder ``config`` names, behind the encoder routes: one-process serving and each replica build it here."""
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint  # torch: not for `scalenlp --help`

    engine = encoder_from_checkpoint(config)
    announce(engine)
    return EncoderBackend(engine, model_name)
