"""`scalenlp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine, in this
process, or (``--replicas N``) in front of engine replicas on Ray Serve.
"""

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

from scalenlp.engine.config import SHARED_OPTIONS, EncoderEngineConfig, EngineConfig
from scalenlp.errors import UserError, require
from scalenlp.serving.limits import ServeLimits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000)
    ServeLimits.add_arguments(parser)
    parser.add_argument("--model-name", default=None, help="name in /v1/models (default: the checkpoint folder's name)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="serve N engine replicas behind a load-balancing router on Ray Serve")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="with --replicas: autoscale between --replicas and this many on queue length")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--replica-cpus", type=float, default=1.0,
                        help="with --replicas: CPUs Ray reserves for each replica (also its torch threads)")
    # The options both engines share are declared above, with the decoder's.
    EncoderEngineConfig.add_arguments(parser.add_argument_group("encoders (embeddings and classification)"),
                                      skip=SHARED_OPTIONS)


def engine_config(args) -> EngineConfig | EncoderEngineConfig:
    """The options of the engine the checkpoint needs: an encoder's, or a decoder's."""
    from scalenlp.engine.encoder_engine import is_encoder  # torch: not for `scalenlp --help`

    if not is_encoder(args.checkpoint):
        return EngineConfig.from_args(args)
    if args.tp > 1 or args.compile == "on" or args.lora or args.max_loras:
        raise UserError("--tp, --compile and the LoRA flags are for decoders; serve an encoder without them (an "
                        "encoder's adapter is served merged: scalenlp export --merge)")
    return EncoderEngineConfig.from_args(args)


def run(args) -> int:
    # The options' ranges, checked before the model is loaded.
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    limits = ServeLimits.from_args(args)
    limits.check()
    config = engine_config(args)
    config.check()
    model_name = args.model_name or default_model_name(args.checkpoint)
    if isinstance(config, EngineConfig) and config.serves_adapters:
        if model_name in config.adapters():
            raise UserError(f"--lora names an adapter {model_name!r}, the base model's name; rename the adapter or "
                            f"set --model-name")
        if args.replicas:
            raise UserError("LoRA adapters are served by one process for now; drop --replicas or the --lora flags")
    for module in ("fastapi", "uvicorn"):  # before a model is loaded
        require(module, "serve")
    if args.replicas:
        # Ray is an optional extra, and a heavy import: only --replicas needs it.
        from scalenlp.serving.cluster import serve_replicas

        return serve_replicas(config, limits, model_name, replicas=args.replicas, max_replicas=args.max_replicas,
                              replica_cpus=args.replica_cpus, ray_address=args.ray_address, host=args.host,
                              port=args.port)
    # Heavy, and not needed by `scalenlp --help`, which imports this module.
    import uvicorn

    from scalenlp.serving.app import create_app
    from scalenlp.serving.backend import LocalBackend, generation_backend
    from scalenlp.serving.connections import server_config
    from scalenlp.serving.encoder import build_encoder_backend

    if isinstance(config, EncoderEngineConfig):
        backend = build_encoder_backend(config, model_name)
    else:
        backend = generation_backend(config, limits, model_name)
    engine = backend.engine
    # SIGTERM: uvicorn stops accepting, waits --drain-timeout seconds for the requests in flight, then cancels
    # them (a cancelled encoder or decoder request leaves the engine's queue) and returns.
    app = create_app(backend, limits.api_key, limits.max_body_bytes)
    server = uvicorn.Server(server_config(app, limits, host=args.host, port=args.port, log_level="warning"))
    if isinstance(backend, LocalBackend):  # the generation engine tells when its loop dies
        # Nothing renders a chat template after the drain: the app's shutdown stops the template workers.
        app.router.on_shutdown.append(backend.close)
        engine.on_death = lambda error: setattr(server, "should_exit", True)
        if not engine.alive:  # it died before it could be told
            server.should_exit = True
    # uvicorn raises the SIGTERM it drained on again once it is done, which under the default handler ends the
    # process before the `finally` below stops the engine (and a sharded model's follower ranks): this handler
    # takes that second signal, so a drained server exits through it with 0.
    with _sigterm_stops(server):
        try:
            server.run()
        finally:
            engine.stop()
            if isinstance(backend, LocalBackend):
                backend.close()  # when the server never started, and so never shut down
    if getattr(engine, "error", None) is not None:
        # Not a user error: exit 1, which a supervisor (systemd, Kubernetes) answers with a restart.
        print(f"fatal: the engine stopped ({engine.error!r}); exiting so that a supervisor restarts the server",
              file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _sigterm_stops(server):
    """SIGTERM outside uvicorn's own handler (before it starts, or the signal it raises again after its drain)
    asks the server to exit instead of ending the process; where signals cannot be handled (not the main
    thread), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def default_model_name(checkpoint: str) -> str:
    path = Path(checkpoint).resolve()
    return path.parent.name if path.name == "export" else path.name
