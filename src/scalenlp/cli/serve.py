"""`scalenlp serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine, in this
process, or (``--replicas N``) in front of engine replicas on Ray Serve.
"""

import argparse
import os
import sys
from pathlib import Path

from scalenlp.errors import UserError
from scalenlp.serving.backend import LocalBackend, generation_backend
from scalenlp.serving.encoder import add_encoder_arguments, build_encoder_backend
from scalenlp.cli.generate import add_engine_arguments
from scalenlp.serving.app import DEFAULT_MAX_BODY_BYTES, create_app

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
    add_encoder_arguments(parser)


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
    args.model_name = args.model_name or default_model_name(args.checkpoint)
    if args.replicas:
        # Ray is an optional extra, and a heavy import: only --replicas needs it.
        from scalenlp.serving.cluster import serve_replicas

        return serve_replicas(args)
    # Heavy, and not needed by `scalenlp --help`, which imports this module.
    import uvicorn

    from scalenlp.engine.encoder_engine import is_encoder

    if is_encoder(args.checkpoint):
        backend = build_encoder_backend(args, args.model_name)
    else:
        backend = generation_backend(args, args.model_name)
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
    path = Path(checkpoint).resolve()
    return path.parent.name if path.name == "export" else path.name
