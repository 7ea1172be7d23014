"""Replicas behind a load-balancing router, on Ray Serve (`scalenlp serve --replicas N`).

    client ──HTTP──► Ray Serve proxy ──► Router (the same FastAPI app as one-process serving,
                                         with RayBackend) ──handle──► EngineReplica × N
                                                                      (each may be --tp sharded)

- Routing: the router calls the replicas through a Ray Serve deployment handle, whose
  power-of-two-choices router sends each request to the less loaded of two sampled replicas,
  load being the replica's ongoing requests (running + queued). ``max_ongoing_requests`` is kept
  near a replica's slot count, so excess requests wait at the router, where any replica that
  frees a slot can take them, instead of queueing behind a busy one.
- Failure: a replica that dies is replaced by the Serve controller; the requests it held fail
  at the router with RayActorError and are sent again to another replica. A request gets a seed
  at the router when it has none, so a retry regenerates the same text; a stream that breaks
  midway resumes after the characters the client already has.
- Metrics: each replica sends its engine metrics to the router every ``METRICS_PERIOD_S`` (Serve
  gives the router no way to call a replica of its choosing, so they push); the router's
  ``/metrics`` shows them next to its own, labelled by replica.
- Autoscaling: with ``--max-replicas``, the replica count moves between the bounds to keep about
  ``max_batch`` ongoing requests per replica.
- Joining a cluster (``--ray-address``): the cluster is not ours; stopping takes our application
  down and leaves the cluster, and a Serve instance that ran there before us, running.
Ray is an optional extra (``pip install scalenlp[cluster]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator

import torch

from scalenlp.engine.config import EncoderEngineConfig, EngineConfig
from scalenlp.errors import UserError
from scalenlp.loader import checkpoint_kind
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend, generation_backend
from scalenlp.serving.encoder import EncoderBackend, EncoderOnly, build_encoder_backend, request_models
from scalenlp.serving.limits import ServeLimits
from scalenlp.serving.protocol import APIError, _request_model, check_request

RETRIES = 5
APP_NAME = "scalenlp"
ROUTER_NAME = "Router"  # the ingress deployment
METRICS_PERIOD_S = 1.0
METRICS_STALE_S = 5 * METRICS_PERIOD_S  # a replica silent this long is gone (dead, or scaled down)
# Ray turns 127.0.0.1 into the machine's outward address, and binds its control plane there, unless
# told it forms no multi-machine cluster (the switch is named for macOS/Windows, and honoured on Linux
# too). The Ray instance `scalenlp serve` starts for itself serves one machine, so it stays on loopback.
# Ray reads it when first imported.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _import_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("--replicas needs Ray Serve, which is not installed; add it with "
                        "`pip install 'scalenlp[cluster]'` (or serve on one process without --replicas)") from None
    return ray, serve


class EngineReplica:
    """One engine (loaded from the checkpoint) serving completion requests handed over by the router."""

    def __init__(self, config: EngineConfig | EncoderEngineConfig, limits: ServeLimits, model_name: str,
                 threads: int = 1):
        torch.set_num_threads(threads)
        self.backend = self.local_backend(config, limits, model_name)
        self.engine = self.backend.engine
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id  # answered as system_fingerprint
        threading.Thread(target=self._report_metrics, name="scalenlp-metrics", daemon=True).start()

    @staticmethod
    def local_backend(config: EngineConfig, limits: ServeLimits, model_name: str) -> LocalBackend:
        return generation_backend(config, limits, model_name)

    def _report_metrics(self) -> None:
        from ray import serve

        router = serve.get_deployment_handle(ROUTER_NAME, app_name=APP_NAME)
        while True:
            try:
                router.report_metrics.remote(self.replica_id, list(self.backend.registry.collect())).result()
            except Exception:  # noqa: BLE001 - the router is starting or being replaced; the next report reaches it
                pass
            time.sleep(METRICS_PERIOD_S)

    def _request(self, body: dict):
        req = _request_model()(**body)
        check_request(req)
        return req

    async def complete(self, body: dict) -> dict:
        try:
            out = await self.backend.complete(self._request(body))
        except APIError as e:
            return {"__error__": [e.status, e.body()]}
        out["system_fingerprint"] = self.replica_id
        return out

    async def chat_prompt(self, messages: list, tools: list | None = None) -> dict:
        """The conversation rendered by the checkpoint's chat template, which the router does not load."""
        try:
            ids, tool_format = await self.backend.chat_prompt(messages, tools)
            return {"ids": ids, "tool_format": tool_format}
        except APIError as e:
            return {"__error__": [e.status, e.body()]}

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        try:
            async for chunk in self.backend.stream(self._request(body)):
                chunk["system_fingerprint"] = self.replica_id
                yield chunk
        except APIError as e:
            yield {"__error__": [e.status, e.body()]}

    async def health(self) -> tuple[bool, str]:
        return await self.backend.health()

    def check_health(self) -> None:
        """Called by Serve every few seconds: a replica whose engine loop died is replaced, as a
        one-process server exits for its supervisor to restart it."""
        if not self.engine.alive:
            raise RuntimeError(f"the engine stopped: {self.engine.error!r}")


def _raise_if_error(out: dict) -> None:
    if "__error__" in out:
        status, body = out["__error__"]
        err = body["error"]
        raise APIError(status, err["message"], err["type"], err["param"], err["code"])


class ReplicaMetrics:
    """A Prometheus collector of the engine metrics that the live replicas last reported.

    Each replica's series keep their own ``replica`` label rather than being summed: a sum over the
    live replicas would drop when one dies, which Prometheus reads as a counter reset, while a
    labelled series just ends. Totals are one query away: ``sum without (replica) (...)``."""

    def __init__(self):
        self.reports: dict[str, tuple[float, list]] = {}  # replica id -> (when, metric families)

    def report(self, replica_id: str, families: list) -> None:
        self.reports[replica_id] = (time.monotonic(), families)

    def collect(self):
        from prometheus_client.metrics_core import Metric

        now = time.monotonic()
        merged: dict[str, Metric] = {}
        for replica_id, (when, families) in sorted(self.reports.items()):
            if now - when > METRICS_STALE_S:
                self.reports.pop(replica_id, None)
                continue
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "replica": replica_id}, sample.value,
                                    sample.timestamp, sample.exemplar)
        return list(merged.values())


class RayBackend:
    """The server's backend when the engines are Ray Serve replicas: forwards, and retries on replica death."""

    def __init__(self, handle, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.handle = handle
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.requests = Counter("scalenlp_router_requests", "requests answered by the router", ["status"],
                                registry=self.registry)
        self.retries = Counter("scalenlp_router_retries", "requests sent again after a replica failed",
                               registry=self.registry)
        self.latency = Histogram("scalenlp_router_e2e_request_latency_seconds", "arrival to response",
                                 registry=self.registry)
        self.replica_metrics = ReplicaMetrics()
        self.registry.register(self.replica_metrics)

    def _body(self, req) -> dict:
        # The fields as set, not as defaulted: a replica then knows, as a local server does, whether the
        # client sent max_tokens (--max-tokens-cap refuses a larger one but caps the default).
        body = req.model_dump(exclude_unset=True)
        if body.get("seed") is None:
            body["seed"] = random.getrandbits(62)  # retries must regenerate the same text
        return body

    async def chat_prompt(self, messages: list, tools: list | None = None) -> tuple[list[int], str | None]:
        """The prompt ids of a conversation, rendered on a replica (which holds the tokenizer), and the tool-call
        format of its template when there are ``tools``."""
        async def attempt():
            out = await self.handle.chat_prompt.remote(messages, tools)
            _raise_if_error(out)
            return out["ids"], out["tool_format"]

        return await self._retrying(attempt)

    async def _retrying(self, attempt):
        """Run ``attempt()`` until it neither dies with its replica nor finds it full."""
        from ray.exceptions import RayActorError

        for n in range(RETRIES):
            try:
                return await attempt()
            except RayActorError:
                if n == RETRIES - 1:
                    raise APIError(503, "every replica tried failed; retry later", type="server_error") from None
            except APIError as e:
                if e.status != 429 or n == RETRIES - 1:
                    raise
            self.retries.inc()
            await asyncio.sleep(0.1 * 2 ** n)

    async def complete(self, req) -> dict:
        return await self.call("complete", self._body(req))

    async def call(self, method: str, body: dict) -> dict:
        """A replica's ``method`` on ``body``, retried as ``_retrying`` says, counted in the router's metrics."""
        start = time.perf_counter()

        async def attempt():
            out = await getattr(self.handle, method).remote(body)
            _raise_if_error(out)
            return out

        try:
            out = await self._retrying(attempt)
        except Exception as e:
            self.requests.labels(getattr(e, "status", 500)).inc()
            raise
        self.requests.labels(200).inc()
        self.latency.observe(time.perf_counter() - start)
        return out

    async def stream(self, req) -> AsyncIterator[dict]:
        from ray.exceptions import RayActorError

        body, start = self._body(req), time.perf_counter()
        delivered: dict[int, int] = {}  # choice index -> characters the client already has
        for n in range(RETRIES):
            produced: dict[int, int] = {}
            try:
                async for chunk in self.handle.options(stream=True).stream.remote(body):
                    _raise_if_error(chunk)
                    choices = []
                    for c in chunk["choices"]:
                        i, text = c["index"], c["text"]
                        before = produced.get(i, 0)
                        produced[i] = before + len(text)
                        skip = max(0, delivered.get(i, 0) - before)  # a retry repeats what was sent
                        if skip < len(text) or c["finish_reason"] is not None:
                            choices.append({**c, "text": text[skip:]})
                            delivered[i] = max(delivered.get(i, 0), produced[i])
                    if choices or not chunk["choices"]:
                        yield {**chunk, "choices": choices}
                self.requests.labels(200).inc()
                self.latency.observe(time.perf_counter() - start)
                return
            except RayActorError:
                if n == RETRIES - 1:
                    self.requests.labels(503).inc()
                    raise APIError(503, "every replica tried failed; retry later", type="server_error") from None
            except APIError as e:
                if e.status != 429 or n == RETRIES - 1 or delivered:
                    self.requests.labels(e.status).inc()
                    raise
            self.retries.inc()
            await asyncio.sleep(0.1 * 2 ** n)

    async def health(self) -> tuple[bool, str]:
        from ray.exceptions import RayActorError

        try:
            return await self.handle.health.remote()
        except RayActorError as e:
            return False, f"replica unreachable: {e.__class__.__name__}"

    def metrics(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class EncoderReplica(EngineReplica):
    """A Ray Serve replica of an encoder (`scalenlp serve --replicas N` on an encoder checkpoint)."""

    @staticmethod
    def local_backend(config: EncoderEngineConfig, limits: ServeLimits, model_name: str) -> EncoderBackend:
        return build_encoder_backend(config, model_name)  # the prompt and token limits are generation's

    async def _answer(self, route: str, request_model, body: dict) -> dict:
        try:
            return await getattr(self.backend, route)(request_model(**body))
        except APIError as e:
            return {"__error__": [e.status, e.body()]}

    async def embeddings(self, body: dict) -> dict:
        return await self._answer("embeddings", request_models()[0], body)

    async def classify(self, body: dict) -> dict:
        return await self._answer("classify", request_models()[1], body)

    async def tag(self, body: dict) -> dict:
        return await self._answer("tag", request_models()[2], body)

    async def qa(self, body: dict) -> dict:
        return await self._answer("qa", request_models()[3], body)


class RayEncoderBackend(EncoderOnly, RayBackend):
    """The router's backend for encoder replicas: requests are forwarded as they came, retried as generation's are."""

    async def embeddings(self, req) -> dict:
        return await self.call("embeddings", req.model_dump(exclude_none=True))

    async def classify(self, req) -> dict:
        return await self.call("classify", req.model_dump(exclude_none=True))

    async def tag(self, req) -> dict:
        return await self.call("tag", req.model_dump(exclude_none=True))

    async def qa(self, req) -> dict:
        return await self.call("qa", req.model_dump(exclude_none=True))


class Router:
    """The ingress deployment: the FastAPI app of `scalenlp serve`, forwarding to the replicas."""

    def __init__(self, replicas, model_name: str, limits: ServeLimits, encoder: bool = False):
        self.backend = (RayEncoderBackend if encoder else RayBackend)(replicas, model_name)
        self.fastapi_app = create_app(self.backend, limits.api_key, limits.max_body_bytes)

    def __serve_build_asgi_app__(self):
        return self.fastapi_app

    def report_metrics(self, replica_id: str, families: list) -> None:
        """Called by each replica every METRICS_PERIOD_S (the app runs one router, which gets them all)."""
        self.backend.replica_metrics.report(replica_id, families)


def replica_options(replicas: int, max_replicas: int | None, max_batch: int, replica_cpus: float) -> dict:
    """Ray Serve options of the replica deployment: a fixed count, or autoscaling between bounds
    aiming at ``max_batch`` ongoing requests per replica (its slots are then full, nothing waits)."""
    if replicas < 1:
        raise UserError(f"--replicas must be at least 1, got {replicas}")
    if max_replicas is not None and max_replicas < replicas:
        raise UserError(f"--max-replicas ({max_replicas}) is below --replicas ({replicas}); raise it or drop it")
    scaling = ({"num_replicas": replicas} if not max_replicas or max_replicas == replicas else
               {"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                       "initial_replicas": replicas, "target_ongoing_requests": max_batch}})
    return {"max_ongoing_requests": max_batch * 2, "ray_actor_options": {"num_cpus": replica_cpus}, **scaling}


def build_application(config: EngineConfig | EncoderEngineConfig, limits: ServeLimits, model_name: str,
                      replicas: int, max_replicas: int | None, replica_cpus: float):
    """The Ray Serve application: Router -> EngineReplica (or, for an encoder's config, EncoderReplica)
    deployment. The replicas receive the config and the limits themselves (they pickle)."""
    _, serve = _import_ray()
    encoder = isinstance(config, EncoderEngineConfig)
    replica_class, batch = (EncoderReplica, config.forward_batch) if encoder else (EngineReplica, config.max_batch)
    replica = serve.deployment(replica_class, name=replica_class.__name__, health_check_period_s=2,
                               **replica_options(replicas, max_replicas, batch, replica_cpus))
    router = serve.deployment(serve.ingress()(Router), name=ROUTER_NAME, num_replicas=1,  # gets every metrics report
                              max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    threads = max(1, int(replica_cpus))
    return router.bind(replica.bind(config, limits, model_name, threads), model_name, limits, encoder)


def _init_ray(ray, address: str | None, init_kwargs: dict) -> None:
    try:
        ray.init(address=address, ignore_reinit_error=True, **init_kwargs)
    except ConnectionError as e:
        if address is None:
            raise
        raise UserError(f"cannot join the Ray cluster at {address} ({e}); check that it runs there, and for a "
                        "cluster with token authentication set RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN "
                        "(or ~/.ray/auth_token)") from None


def start(config: EngineConfig | EncoderEngineConfig, limits: ServeLimits, model_name: str, *, replicas: int,
          max_replicas: int | None = None, replica_cpus: float = 1.0, ray_address: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, ray_init_kwargs: dict | None = None) -> tuple[str, bool]:
    """Start (or join, at ``ray_address``) Ray and deploy ``replicas`` replicas (autoscaling up to
    ``max_replicas``) of the engine ``config`` names, behind a router serving ``model_name`` under ``limits``
    at ``host:port``. Returns the HTTP address, and whether the Serve instance is ours to shut down when we
    stop (not when it already ran on a joined cluster)."""
    ray, serve = _import_ray()
    _, checkpoint = checkpoint_kind(config.checkpoint)  # fail here, not inside a replica
    config = dataclasses.replace(config, checkpoint=str(checkpoint.resolve()))  # the replicas' working folder differs
    if not ray.is_initialized():
        _init_ray(ray, ray_address, ray_init_kwargs or {})
    before = serve.status()
    if APP_NAME in before.applications:
        raise UserError(f"the Ray cluster at {ray_address or 'this machine'} already serves an application "
                        f"named {APP_NAME!r} (another `scalenlp serve`, or one that did not stop cleanly); stop it, "
                        f"or remove it with ray.serve.delete({APP_NAME!r}), and try again")
    owns_serve = not ray_address or not before.proxies
    serve.start(http_options={"host": host, "port": port})
    if not owns_serve:
        # Serve already runs on the joined cluster, and its proxies keep the address they were started with.
        # Ray offers no public call to read it; its client's config holds it.
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        if (http.host, http.port) != (host, port):
            print(f"note: the cluster's Ray Serve already listens on {http.host}:{http.port}; --host and --port "
                  "apply only where scalenlp starts Serve", file=sys.stderr, flush=True)
            host, port = http.host, http.port
    app = build_application(config, limits, model_name, replicas, max_replicas, replica_cpus)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}", owns_serve


def stop(owns_serve: bool) -> None:
    """Take our application down and disconnect from Ray (which stops a Ray instance we started)."""
    ray, serve = _import_ray()
    if owns_serve:
        serve.shutdown()
    else:  # other applications may be using it
        serve.delete(APP_NAME)
    ray.shutdown()


def serve_replicas(config: EngineConfig | EncoderEngineConfig, limits: ServeLimits, model_name: str, *,
                   replicas: int, max_replicas: int | None = None, replica_cpus: float = 1.0,
                   ray_address: str | None = None, host: str = "127.0.0.1", port: int = 8000) -> int:
    """`scalenlp serve --replicas`: ``start``, then serve until Ctrl-C or SIGTERM."""
    if not ray_address:
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    most = max(replicas, max_replicas or 0)
    cpus = None if ray_address else max(os.cpu_count() or 1, int(most * replica_cpus) + 1)
    url, owns_serve = start(config, limits, model_name, replicas=replicas, max_replicas=max_replicas,
                            replica_cpus=replica_cpus, ray_address=ray_address, host=host, port=port,
                            ray_init_kwargs={"num_cpus": cpus} if cpus else {})
    # SIGTERM (a service manager's stop) takes the application down as Ctrl-C does; Ray's own handler
    # would end the process without it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving {replicas} replica(s) at {url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        stop(owns_serve)
