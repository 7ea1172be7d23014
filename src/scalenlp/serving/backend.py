"""``LocalBackend``: completion requests served by an engine in this process (itself possibly
tensor-parallel). A backend turns a checked ``CompletionRequest`` into a response or a stream of chunks, and
has ``complete``, ``stream``, ``health``, ``metrics`` and ``model_name``, and ``chat_prompt`` where it serves
chat completions; the Ray backend in ``cluster.py`` forwards to replicas instead, and an encoder's backend
(``encoder.py``) serves embeddings and classification.
"""

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from scalenlp.engine.config import EngineConfig
from scalenlp.serving.limits import CHARS_PER_PROMPT_TOKEN, ServeLimits, text_chars
from scalenlp.serving.protocol import (
    APIError,
    chat_ids,
    choice_params,
    completion_object,
    new_id,
    prompts_of,
    sampling_params,
    usage,
)


class LocalBackend:
    """Requests go to an engine in this process; events come back from its thread to the event loop."""

    def __init__(self, engine, model_name: str, health_timeout: float = 10.0, max_prompt_tokens: int | None = None,
                 max_tokens_cap: int | None = None, max_prompt_chars: int | None = None, templates=None):
        """max_prompt_tokens: longest prompt accepted (default: the context less one). max_tokens_cap:
        most tokens a choice may generate (default: to the end of the context). max_prompt_chars: longest
        prompt, or conversation, taken to the tokenizer or the chat template (default: CHARS_PER_PROMPT_TOKEN
        per token of the longest prompt). templates: the ``TemplateWorkers`` that make chat prompts (default:
        their defaults, started by the first chat request)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = engine
        self.model_name = model_name
        self.health_timeout = health_timeout
        self.max_prompt_tokens = min(max_prompt_tokens or engine.max_seq_len, engine.max_seq_len - 1)
        self.max_tokens_cap = max_tokens_cap
        self.max_prompt_chars = max_prompt_chars or CHARS_PER_PROMPT_TOKEN * self.max_prompt_tokens
        self.templates = templates
        self._templates_starting = asyncio.Lock()
        self.registry = CollectorRegistry()
        Gauge("scalenlp_requests_running", "requests holding KV-cache blocks", registry=self.registry
              ).set_function(lambda: engine.num_running)
        Gauge("scalenlp_requests_waiting", "requests queued for KV-cache blocks", registry=self.registry
              ).set_function(lambda: engine.num_waiting)
        Gauge("scalenlp_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens",
              registry=self.registry).set_function(lambda: engine.blocks.hit_rate)
        Gauge("scalenlp_spec_decode_acceptance_rate", "draft tokens accepted / draft tokens verified (speculative "
              "decoding)", registry=self.registry).set_function(lambda: engine.acceptance_rate)
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

    def adapters(self) -> dict[str, str]:
        """{name: folder} of the LoRA adapters served beside the model."""
        slots = self.engine.adapters
        if slots is None:
            return {}
        with slots.lock:
            return dict(slots.paths)

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter in folder ``path`` as model ``name``; what cannot be served is a 400."""
        from scalenlp.errors import UserError

        if self.engine.adapters is None:
            raise APIError(400, "this server was started without adapter slots; start it with --max-loras N (and "
                           "--max-lora-rank R) to load adapters at run time", param="lora_name")
        if name == self.model_name:
            raise APIError(400, f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        try:  # reading the folder takes a while: off the event loop
            await asyncio.to_thread(self.engine.adapters.load, name, path)
        except UserError as e:
            raise APIError(400, str(e)) from None

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests for it get 404, those in flight finish on it."""
        from scalenlp.engine.lora import UnknownAdapter

        try:
            self.engine.unload_adapter(name)
        except UnknownAdapter as e:
            raise APIError(404, str(e), param="lora_name", code="model_not_found") from None

    async def chat_prompt(self, messages: list, tools: list | None = None) -> tuple[list[int], str | None]:
        """The prompt ids of a conversation, by the checkpoint's chat template, in a template worker process (a
        400 when it cannot, or passes a limit); the event loop waits for it holding no thread. With ``tools``, the
        template renders them too, and the tool-call format it teaches comes back with the ids (serving/tools.py)."""
        self._check_prompt_chars(text_chars([messages, tools]), "messages", "the messages hold")
        tool_format = None
        if tools is not None:
            from scalenlp.data.chat import ChatError, chat_template
            from scalenlp.serving.tools import ToolError
            from scalenlp.serving.tools import tool_format as format_of

            try:
                tool_format = format_of(chat_template(self.engine.tokenizer_config))
            except (ChatError, ToolError) as e:
                raise APIError(400, str(e), param=getattr(e, "param", "messages")) from None
        async with self._templates_starting:
            if self.templates is None:
                from scalenlp.data.template_workers import TemplateWorkers
                from scalenlp.errors import UserError

                try:
                    self.templates = await asyncio.to_thread(TemplateWorkers, self.engine.tokenizer,
                                                             self.engine.tokenizer_config)
                except UserError as e:  # the model's tokenizer is refused: not the request's fault
                    raise APIError(500, str(e), type="server_error") from None
        return await chat_ids(self.templates, messages, tools), tool_format

    def close(self) -> None:
        """Stop the template workers; the engine is its owner's to stop."""
        if self.templates is not None:
            self.templates.close()

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

    def _check_prompt_chars(self, chars: int, param: str = "prompt", what: str = "the prompt holds") -> None:
        """Before any tokenizing or rendering: a text's cost grows with its characters, and one that cannot fit
        need not be tokenized to be refused."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{what} {chars:,} characters, and this server takes at most "
                           f"{self.max_prompt_chars:,} (--max-prompt-chars); shorten it", param=param)

    def _check_prompt_length(self, ids: list[int]) -> None:
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, and this server accepts at most "
                           f"{self.max_prompt_tokens}; shorten it", param="prompt")

    def _tokenize(self, prompts: list) -> list[list[int]]:
        """Token ids of every prompt; runs in a worker thread, as a long text takes seconds."""
        from scalenlp.engine.decoder_engine import RequestError

        ids = []
        for p in prompts:
            try:
                ids.append(self.engine.encode(p))
            except RequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            self._check_prompt_length(ids[-1])  # before tokenizing the next
        return ids

    async def _events(self, req) -> AsyncIterator[tuple[int, Any, int]]:
        """Submit every choice of the request; yield (choice index, Delta, prompt length) as they come.
        Leaving early (client gone, cancelled) cancels the engine requests, freeing their slots."""
        from scalenlp.engine.decoder_engine import EngineDead, QueueFull, RequestError
        from scalenlp.engine.lora import UnknownAdapter

        prompts = prompts_of(req)
        params = self._limited(sampling_params(req), len(prompts) * req.n, "max_tokens" in req.model_fields_set)
        texts = [p for p in prompts if isinstance(p, str)]
        for p in prompts:  # the sizes of them all before tokenizing any
            if isinstance(p, str):
                self._check_prompt_chars(len(p))
            else:
                self._check_prompt_length(p)
        encoded = iter(await asyncio.to_thread(self._tokenize, texts) if texts else [])
        if params.grammar is not None:
            await asyncio.to_thread(self.engine.grammars)  # the first one reads the vocabulary: a second
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
            requests = self.engine.submit_many(items, callbacks,
                                               adapter=None if req.model == self.model_name else req.model)
        except UnknownAdapter as e:  # unloaded since the app checked the name
            raise APIError(404, str(e), param="model", code="model_not_found") from None
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
        return completion_object(req.model, choices, usage(prompt_tokens, completion_tokens))

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
            yield completion_object(req.model, [{"index": i, "text": delta.text, "logprobs": logprobs,
                                                 "finish_reason": delta.finish_reason}], None, cid, created)
        if (req.stream_options or {}).get("include_usage"):
            yield completion_object(req.model, [], usage(prompt_tokens, completion_tokens), cid, created)

    async def health(self) -> tuple[bool, str]:
        """Send a one-token request through the engine; healthy if it finishes, or if the engine is
        busy and still stepping (then the probe leaves the queue). Dead or no progress: unhealthy."""
        from scalenlp.engine.decoder_engine import EngineDead
        from scalenlp.engine.sampling import SamplingParams

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
                except TimeoutError:
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
    for k, token in enumerate(delta.tokens):
        logprobs["tokens"].append(token)
        logprobs["token_logprobs"].append(delta.logprobs[k])
        logprobs["top_logprobs"].append(delta.top_logprobs[k] if delta.top_logprobs else None)
        logprobs["text_offset"].append(len(text_so_far))


def generation_backend(config: EngineConfig, limits: ServeLimits, model_name: str) -> LocalBackend:
    """The engine ``config`` names, behind a server's request limits: one-process serving, and each
    replica of --replicas, build it here."""
    from scalenlp.data.template_workers import TemplateWorkers
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.llm import engine_from_checkpoint  # torch: not for `scalenlp --help`

    engine = engine_from_checkpoint(config)
    try:  # before serving: the first worker tries the model's tokenizer on a test text
        templates = TemplateWorkers(engine.tokenizer, engine.tokenizer_config, timeout=limits.template_timeout,
                                    max_bytes=limits.template_max_bytes, workers=limits.template_workers)
    except BaseException:
        engine.stop()
        raise
    announce(engine)
    return LocalBackend(engine, model_name, max_prompt_tokens=limits.max_prompt_tokens,
                        max_tokens_cap=limits.max_tokens_cap, max_prompt_chars=limits.max_prompt_chars,
                        templates=templates)
