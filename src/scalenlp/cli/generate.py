"""`scalenlp generate`: one prompt in, text streamed to the terminal as it is produced."""

from __future__ import annotations

import argparse
import sys

from scalenlp.engine.config import LORA_OPTIONS, EngineConfig

# `generate` and `chat` take every engine flag but --max-queue (one user at a terminal has no queue to bound) and
# the adapter flags (nothing at a terminal picks an adapter; merge one into the model to use it there).
TERMINAL_SKIP = ("max_queue", *LORA_OPTIONS)
# At a terminal the decode step stays eager unless asked: a few prompts never earn back the minute or more that
# compiling it costs the start (a server, serving for hours, decides by measurement: --compile auto).
TERMINAL_DEFAULTS = {"compile": {"default": "off", "help": "torch.compile the decode step: on (--compile alone), off "
                                                          "(default here: a few prompts do not earn back the compile "
                                                          "time), or auto (as serve decides)"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_arguments(parser, skip=TERMINAL_SKIP, **TERMINAL_DEFAULTS)
    parser.add_argument("--prompt", required=True, action="append",
                        help="text to continue; repeat for several prompts, generated one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="same seed, same text")
    parser.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")


def stream_to_stdout(engine, prompt_ids: list[int], params) -> tuple[str, str]:
    """Run one request, writing its text to stdout as it comes: (the text, the finish reason). Raises
    RequestError when the request cannot be served."""
    import queue

    events: queue.Queue = queue.Queue()
    engine.submit(prompt_ids, params, events.put)
    text, finish = "", None
    while finish is None:
        delta = events.get()
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text += delta.text
        finish = delta.finish_reason
    return text, finish


def run(args) -> int:
    from scalenlp.data.text import check_text
    from scalenlp.engine.decoder_engine import RequestError
    from scalenlp.engine.sampling import InvalidParam, SamplingParams
    from scalenlp.errors import UserError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    try:  # before the model is loaded
        params.check()
        for prompt in args.prompt:
            # Bytes that are not UTF-8 reach Python's argv as lone surrogates.
            check_text(prompt, "--prompt")
    except InvalidParam as e:
        raise UserError(f"--{e.param.replace('_', '-')}: {e}") from None
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.llm import engine_from_checkpoint

    engine = engine_from_checkpoint(EngineConfig.from_args(args))
    announce(engine)
    try:
        for i, prompt in enumerate(args.prompt):
            ids = engine.encode(prompt)
            try:
                engine.check(ids, params)
            except RequestError as e:
                raise UserError(str(e)) from None
            if len(args.prompt) > 1:
                sys.stdout.write(("\n" if i else "") + f"--- sample {i + 1} of {len(args.prompt)} ---\n")
            sys.stdout.write(prompt)
            _, finish = stream_to_stdout(engine, ids, params)
            sys.stdout.write("\n")
            if finish == "abort":
                break
    finally:
        engine.stop()
    if finish == "abort":
        raise UserError(f"generation failed: {engine.error!r}")
    return 0
