"""`scalenlp generate`: one prompt in, text streamed to the terminal as it is produced."""

from __future__ import annotations

import argparse
import sys


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `generate` and `serve`."""
    parser.add_argument("--checkpoint", required=True, help="a training run folder or its export/ folder")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype; auto = bf16 where the device computes in it natively (default)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    parser.add_argument("--max-batch", type=int, default=8, help="sequence slots in the KV cache (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="positions per slot, prompt + output (default: the model's context length)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel processes for one model (gloo on CPU, NCCL on GPUs)")


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
    """Load the checkpoint named by the engine options and start an engine on it."""
    import torch

    from scalenlp.data.tokenizer import find_eos_token_id
    from scalenlp.errors import UserError
    from scalenlp.infer.engine import Engine, load_tokenizer_for, pick_device, pick_dtype, resolve_export
    from scalenlp.models.io import load_pretrained

    export = resolve_export(args.checkpoint)
    device = torch.device(args.device) if args.device else pick_device()
    dtype = pick_dtype(device, args.dtype)
    tokenizer = load_tokenizer_for(export)
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_seq_len is not None and args.max_seq_len < 2:  # a prompt token and an output token
        raise UserError(f"--max-seq-len must be at least 2, got {args.max_seq_len}")
    if args.tp > 1:
        if args.compile:
            raise UserError("--compile is not supported with --tp yet; drop one of them")
        from scalenlp.infer.sharded import start_sharded

        model = start_sharded(export, args.tp, args.dtype)
    else:
        model = load_pretrained(export, device=device, dtype=dtype)
    return Engine(model, tokenizer, max_batch=args.max_batch, max_queue=max_queue, max_seq_len=args.max_seq_len,
                  eos_id=find_eos_token_id(tokenizer, export),  # none: every request runs to max_tokens
                  compile=args.compile).start()


def run(args) -> int:
    import queue

    from scalenlp.errors import UserError
    from scalenlp.infer.engine import RequestError, check_text
    from scalenlp.infer.sampling import InvalidParam, SamplingParams

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
    events: queue.Queue = queue.Queue()
    try:
        for i, prompt in enumerate(args.prompt):
            try:
                engine.submit(engine.encode(prompt), params, events.put)
            except RequestError as e:
                raise UserError(str(e)) from None
            if len(args.prompt) > 1:
                sys.stdout.write(("\n" if i else "") + f"--- sample {i + 1} of {len(args.prompt)} ---\n")
            sys.stdout.write(prompt)
            finish = None
            while finish is None:
                delta = events.get()
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                finish = delta.finish_reason
            sys.stdout.write("\n")
            if finish == "abort":
                break
    finally:
        engine.stop()
    if finish == "abort":
        raise UserError(f"generation failed: {engine.error!r}")
    return 0
