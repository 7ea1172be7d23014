"""The HTTP app of `scalenlp serve` (FastAPI): routing, auth, error shapes, SSE and client disconnects, in
front of a *backend* (``backend.py``, ``encoder.py``, or the Ray backends of ``cluster.py``).

FastAPI is imported inside the functions that build and run the app: `scalenlp --help` imports the serve
command, and so this module.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from scalenlp.auth import authorized
from scalenlp.engine.heap import trim_heap
from scalenlp.serving.encoder import add_encoder_routes
from scalenlp.serving.limits import DEFAULT_MAX_BODY_BYTES
from scalenlp.serving.protocol import (
    ERROR_SCHEMA,
    APIError,
    _chat_request_model,
    _lora_request_models,
    _request_model,
    check_request,
    complete_chat,
    completion_for_chat,
    error_responses,
    stream_chat,
    unless_disconnected,
)

# From this body size up a request may leave the heap holding what it freed: tokenizing the 2,048 texts of a
# refused /v1/embeddings request (3.9 MB) left 160 MB resident in glibc's arenas until malloc_trim gave it back.
LARGE_BODY_BYTES = 1 << 20


class ApiKey:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer KEY``, or gets 401 in OpenAI's shape.
    Plain ASGI rather than Starlette's ``@app.middleware("http")``, whose wrapped ``receive`` raises if anything but
    a disconnect arrives after the body was read: a stream's disconnect listener then collapses and closes the
    stream. Suspected (not reproduced) in two CI runs where a live stream was cancelled while its client read it
    (tests/unit/test_openai_server.py::test_client_disconnect_frees_slot)."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        from fastapi.responses import JSONResponse

        if scope["type"] == "http" and scope["path"] != "/health":
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            if not authorized(header, self.api_key):
                e = APIError(401, "missing or wrong API key; send `Authorization: Bearer KEY`", code="invalid_api_key")
                return await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 in OpenAI's shape, by its Content-Length
    before it is read, or as soon as the chunks received pass the limit (a chunked upload has no
    length). Starlette's own limit (FastAPI's ``max_body_size``) answers the first case in plain text.
    When the last request with a large body in flight ends, the heap's free memory goes back to the system."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.large_in_flight = 0

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
        received, large = 0, False

        async def limited_receive():
            nonlocal received, large
            message = await receive()
            received += len(message.get("body", b""))
            if not large and received >= LARGE_BODY_BYTES:
                large = True
                self.large_in_flight += 1
            if received > self.max_bytes:
                raise HTTPException(413, self.error().message)  # FastAPI passes HTTPExceptions from body reading on
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if large:
                self.large_in_flight -= 1
                if not self.large_in_flight:
                    asyncio.get_running_loop().run_in_executor(None, trim_heap)


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
        """Starlette's own errors (no such route, wrong method, an unreadable body) in OpenAI's shape; a 413 is
        BodyLimit's, for a chunked body found too large while read, and carries its code as the other 413 does."""
        code = "request_too_large" if e.status_code == 413 else None
        return error_response(APIError(e.status_code, str(e.detail), code=code), e.headers)

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

    if api_key is not None:
        app.add_middleware(ApiKey, api_key=api_key)

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

    def adapters() -> dict[str, str]:
        """{name: folder} of the LoRA adapters the backend serves beside its model (none for most backends)."""
        return backend.adapters() if hasattr(backend, "adapters") else {}

    @app.get("/v1/models", responses=error_responses(401))
    async def models():
        base = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "scalenlp"}
        # Adapters as vLLM lists them: their own id, the base model as parent, their folder as root.
        return {"object": "list", "data": [base, *({**base, "id": name, "root": path, "parent": backend.model_name}
                                                   for name, path in adapters().items())]}

    completion_responses = {200: {"description": "a completion, or with `stream` a stream of server-sent events",
                                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                            **error_responses(400, 401, 404, 413, 429, 500, 503)}

    def check_model(req) -> None:
        """A request without ``model`` gets the one model served (as vLLM); where adapters are served beside it,
        which one is the client's to say."""
        served = ", ".join(repr(n) for n in (backend.model_name, *adapters()))
        if req.model is None:
            if adapters():
                raise APIError(400, f"this server serves several models ({served}); name one in the request's "
                               "\"model\" field", param="model")
            req.model = backend.model_name
        if req.model != backend.model_name and req.model not in adapters():
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    async def answer(request: Request, stream: bool, complete, chunks: Callable[[], AsyncIterator[dict]]):
        """The awaited ``complete()``, or an SSE stream of ``chunks()``."""
        if stream:
            chunks = chunks()
            # Wait for the first chunk before answering, so that errors before any output (queue full,
            # prompt too long) get their status code instead of a 200 stream.
            first = await unless_disconnected(request, _first(chunks))
            if not isinstance(first, (dict, type(None))):  # the client left while waiting
                await chunks.aclose()
                return first
            return StreamingResponse(_sse(first, chunks), media_type="text/event-stream")
        return await unless_disconnected(request, complete())

    @app.post("/v1/completions", responses=completion_responses)
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        check_model(req)
        return await answer(request, req.stream, lambda: backend.complete(req), lambda: backend.stream(req))

    @app.post("/v1/chat/completions", responses=completion_responses)
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req)
        # The wait for a template worker too ends when the client leaves: its render then never starts.
        rendered = await unless_disconnected(request, completion_for_chat(req, backend))
        if not isinstance(rendered, tuple):  # the client left (a 499 nobody reads)
            return rendered
        completion, tools = rendered
        return await answer(request, req.stream, lambda: complete_chat(backend, completion, tools),
                            lambda: stream_chat(backend, completion, tools))

    add_encoder_routes(app, backend, check_model)
    add_adapter_routes(app, backend, api_key)

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


def add_adapter_routes(app, backend, api_key: str | None) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes): change what the server serves, so
    only a holder of the API key may (the key middleware answers 401 before these run); a server without a key
    refuses them."""
    from fastapi.responses import PlainTextResponse

    LoadLoraRequest, UnloadLoraRequest = _lora_request_models()
    admin = error_responses(400, 401, 403, 404)

    def allowed() -> None:
        if api_key is None:
            raise APIError(403, "loading and unloading adapters needs an API key; start the server with "
                           "--api-key-file FILE (or SCALENLP_API_KEY) and send it as `Authorization: Bearer KEY`",
                           type="permission_error", code="no_api_key")
        if not hasattr(backend, "load_adapter"):
            raise APIError(400, "this server does not serve LoRA adapters (an encoder, or replicas on Ray); serve a "
                           "decoder in one process with --max-loras N")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=admin)
    async def load_lora_adapter(req: LoadLoraRequest):
        allowed()
        await backend.load_adapter(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=admin)
    async def unload_lora_adapter(req: UnloadLoraRequest):
        allowed()
        await backend.unload_adapter(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


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
