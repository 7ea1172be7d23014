"""`scalenlp generate`: one prompt in, text streamed to the terminal as it is produced."""

from __future__ import annotations

import argparse
import sys

from scalenlp.cli.quantize import add_load_arguments


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `generate` and `serve`."""
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder, an export folder, a Hugging Face model folder or a .gguf file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype; auto = bf16 where the device computes in it natively (default)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    parser.add_argument("--max-batch", type=int, default=8, help="sequence slots in the KV cache (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="positions per slot, prompt + output (default: the model's context length)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel processes for one model (gloo on CPU, NCCL on GPUs)")
    add_load_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", required=True, action="append",
                        help="text to continue; repeat for several prompts, generated one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="same seed, same text")
    parser.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")


def build_engine(args, max_queue: int = 64):
    """The engine the engine options name (see ``add_engine_arguments``), built as the Python API builds it."""
    from scalenlp.engine.llm import engine_from_checkpoint

    return engine_from_checkpoint(args.checkpoint, dtype=args.dtype, device=args.device, max_batch=args.max_batch,
                                  max_seq_len=args.max_seq_len, compile=args.compile, tp=args.tp, max_queue=max_queue,
                                  quantize=args.quantize, group_size=args.group_size)


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
    from scalenlp.errors import UserError
    from scalenlp.engine.decoder_engine import RequestError, check_text
    from scalenlp.engine.sampling import InvalidParam, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    try:  # before the model is loaded
        params.check()
        for prompt in args.prompt:
            # Bytes that are not UTF-8 reach Python's argv as lone surrogates.
            check_text(prompt, "--prompt")
    except InvalidParam as e:
        raise UserError(f"--{e.param.replace('_', '-')}: {e}") from None
    except RequestError as e:
        raise UserError(str(e)) from None
    engine = build_engine(args)
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
