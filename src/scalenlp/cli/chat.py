"""`scalenlp chat`: talk to a chat model in the terminal.

Each line read from stdin is a user message; the answer streams to stdout and both join the history,
which the model's chat template renders into the next prompt. ``/reset`` starts a new conversation,
``/exit`` or end of input ends. A line that is not UTF-8 text (``printf 'hi \xff'``) gets one error line naming
the byte and is left out, and the conversation goes on: a typo in one line should not end a session, nor should
the model see a guess at what the bytes meant. Answers go to stdout and notices to stderr, so piped input gives
a transcript of the answers alone.
"""

from __future__ import annotations

import argparse
import sys

from scalenlp.cli.generate import TERMINAL_DEFAULTS, TERMINAL_SKIP
from scalenlp.engine.config import EngineConfig

RESET, EXIT = "/reset", "/exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_arguments(parser, skip=TERMINAL_SKIP, **TERMINAL_DEFAULTS)
    parser.add_argument("--system", default=None, help="a system message that opens every conversation")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest answer in tokens (default: the rest of the model's context)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="same seed, same answers")


def read_lines(interactive: bool):
    """User lines, with a prompt when a person is typing. Bytes that are not UTF-8 arrive as lone surrogates
    (``surrogateescape``) for the text check to name, instead of a decoding error that would end the chat."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive:
            if not line:
                return
            # Piped in: show the question on stderr, so that a terminal reads a conversation while stdout
            # stays a transcript of the answers alone.
            # (bytes that are not UTF-8 shown as escapes: the stream may not take them back)
            shown = line.rstrip().encode("utf-8", "backslashreplace").decode("utf-8")
            print(f"> {shown}", file=sys.stderr, flush=True)
        yield line.rstrip("\n")


def run(args) -> int:
    from scalenlp.cli.generate import stream_to_stdout
    from scalenlp.data.chat import ChatError, chat_template
    from scalenlp.data.template_workers import TemplateWorkers
    from scalenlp.data.text import text_problem
    from scalenlp.engine.decoder_engine import RequestError
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.llm import engine_from_checkpoint
    from scalenlp.engine.sampling import SamplingParams
    from scalenlp.errors import UserError

    engine = engine_from_checkpoint(EngineConfig.from_args(args))
    try:
        chat_template(engine.tokenizer_config)  # a model without a template fails here, before any input
        # The model's template and tokenizer run in a worker process, as the server runs them: under its limits.
        templates = TemplateWorkers(engine.tokenizer, engine.tokenizer_config, workers=1)
    except BaseException:
        engine.stop()
        raise
    announce(engine)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.checkpoint}; {RESET} starts over, {EXIT} or Ctrl-D ends", file=sys.stderr)
    try:
        for line in read_lines(interactive):
            if line.strip() == EXIT:
                break
            if line.strip() == RESET:
                history = list(opening)
                print("(new conversation)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            if (problem := text_problem(line, "this line")) is not None:
                print(f"error: {problem}; the conversation goes on without it", file=sys.stderr)
                continue
            turn = history + [{"role": "user", "content": line}]
            try:
                ids = templates.chat_ids_blocking(turn)
                rest = max(1, engine.max_seq_len - len(ids))
                max_tokens = args.max_tokens if args.max_tokens is not None else rest
                params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, seed=args.seed)
                answer, finish = stream_to_stdout(engine, ids, params)
            except (ChatError, RequestError) as e:
                print(f"error: {e}; {RESET} starts a new conversation", file=sys.stderr)
                continue
            print(flush=True)
            if finish == "abort":
                raise UserError(f"generation failed: {engine.error!r}")
            history = turn + [{"role": "assistant", "content": answer}]
    finally:
        templates.close()
        engine.stop()
    return 0
