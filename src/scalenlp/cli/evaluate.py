"""`scalenlp eval`: perplexity of a language model over a text file, with sliding windows; with ``--chat``, a
chat model's accuracy on questions whose answers must contain a known string; with ``--tasks``, accuracy on
multiple-choice questions scored by log-likelihood as lm-evaluation-harness scores them
(``scalenlp.evaluation.multiple_choice``), batched through the engine and sharded with ``--tp``.

Perplexity follows the method of Hugging Face's "Perplexity of fixed-length models" guide: the file is tokenized whole, a
window of ``--seq`` tokens slides by ``--stride``, and each window scores only the tokens the previous
window did not (the earlier ones are context). A stride below the window gives every scored token more
context, closer to the model's true perplexity, at the cost of more forwards.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from scalenlp.engine.config import LOAD_OPTIONS, EngineConfig
from scalenlp.errors import UserError
from scalenlp.evaluation.multiple_choice import EVAL_COMPILE


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens scored
    windows: int
    seconds: float
    tokens_per_sec: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_arguments(parser, (*LOAD_OPTIONS, "max_seq_len", "max_batch", "tp"), dtype={
        "default": "float32", "help": "weight dtype (default float32: perplexity and accuracy are quality figures, "
                                      "bf16 shifts them)"},
        tp={"help": "with --tasks or --chat: tensor-parallel processes for the model (gloo on CPU, NCCL on GPUs)"},
        max_batch={"help": "with --tasks: most sequences in one forward (default 64)"},
        max_seq_len={"help": "with --tasks: positions per sequence, which a longer question and choice are cut to "
                             "from the left (default: the model's context length; a smaller one saves cache memory "
                             "on long-context models)"})
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", help="UTF-8 text file whose perplexity to measure")
    what.add_argument("--chat", metavar="FILE.jsonl",
                      help='questions, one JSON object per line: {"messages": [...], "expect": "text"}; a greedy '
                           'answer is right when it contains the expected text (case-insensitive)')
    what.add_argument("--tasks", metavar="FILE.jsonl",
                      help='multiple-choice questions, one JSON object per line: {"context": "...", "choices": '
                           '["...", ...], "answer": index or choice text}; reports acc (highest log-likelihood), '
                           'acc_norm (per character) and acc_bytes (per byte), as lm-evaluation-harness does')
    parser.add_argument("--seq", type=int, default=None, help="tokens per window (default: the model's context, "
                                                              "at most 1024)")
    parser.add_argument("--stride", type=int, default=None, help="tokens the window moves by (default: --seq / 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the file's first N tokens")
    parser.add_argument("--max-answer-tokens", type=int, default=48, help="with --chat: tokens per answer")
    parser.add_argument("--target-delimiter", default=" ",
                        help="with --tasks: text between the context and each choice (default a space, as "
                             "lm-evaluation-harness)")
    parser.add_argument("--out", metavar="FILE.json",
                        help="with --tasks: also write the result, with every choice's log-likelihood, to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def perplexity(model, ids: list[int], seq: int, stride: int) -> Perplexity:
    """Sliding-window perplexity of ``ids`` under ``model`` (a decoder returning logits)."""
    import torch  # here, not at the top: `scalenlp --help` imports every command module
    import torch.nn.functional as F

    device = next(model.parameters()).device
    tokens = torch.tensor(ids, device=device)
    nll, counted, windows, prev_end = 0.0, 0, 0, 0
    start = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(ids), stride):
            end = min(begin + seq, len(ids))
            # Targets are positions begin+1 .. end-1 of the window; only those past prev_end are new.
            first = max(prev_end, begin + 1)
            if first < end:
                logits = model(tokens[None, begin:end - 1]).float()[0, first - begin - 1:]
                nll += F.cross_entropy(logits, tokens[first:end], reduction="sum").item()
                counted += end - first
                windows += 1
            prev_end = end
            if end == len(ids):
                break
    seconds = time.perf_counter() - start
    mean = nll / counted
    return Perplexity(math.exp(mean), mean, counted, windows, seconds, counted / seconds)


def read_questions(path: str) -> list[dict]:
    """The --chat file: one {"messages": [...], "expect": str} per line."""
    from scalenlp.data.chat import check_messages
    from scalenlp.data.text import jsonl_rows

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--chat {path!r} is not a file; pass a JSONL file of questions")
    questions = []
    for lineno, item, problem in jsonl_rows(file):
        try:
            if problem is not None:
                raise ValueError(problem)
            check_messages(item["messages"])
            if not isinstance(item["expect"], str) or not item["expect"]:
                raise ValueError("expect must be a non-empty string")
        except (KeyError, TypeError, ValueError, UserError) as e:
            raise UserError(f"{file}:{lineno}: not a question ({e}); each line needs "
                            f'{{"messages": [...], "expect": "text"}}') from None
        questions.append(item)
    if not questions:
        raise UserError(f"--chat {path} holds no questions")
    return questions


def chat_accuracy(args) -> int:
    """Greedy answers to every question, all in one continuous batch, and the share that is right."""
    from scalenlp.engine.llm import LLM
    from scalenlp.engine.sampling import SamplingParams

    questions = read_questions(args.chat)
    start = time.perf_counter()
    with LLM(EngineConfig.from_args(args, max_batch=min(16, len(questions)), compile=EVAL_COMPILE)) as llm:
        answers = llm.chat([q["messages"] for q in questions],
                           SamplingParams(max_tokens=args.max_answer_tokens, temperature=0))
    right = [q["expect"].lower() in a.lower() for q, a in zip(questions, answers)]
    accuracy = sum(right) / len(right)
    if args.json:
        print(json.dumps({"accuracy": accuracy, "correct": sum(right), "total": len(right),
                          "seconds": time.perf_counter() - start, "checkpoint": str(args.checkpoint),
                          "answers": [{"question": q["messages"][-1]["content"], "answer": a, "expect": q["expect"],
                                       "right": r} for q, a, r in zip(questions, answers, right)]}))
        return 0
    for q, a, r in zip(questions, answers, right):
        print(f"{'right' if r else 'wrong':5}  Q: {q['messages'][-1]['content']}\n       A: {' '.join(a.split())}")
    print(f"accuracy {accuracy:.0%} ({sum(right)} of {len(right)} answers contain the expected text) "
          f"| {args.checkpoint}")
    return 0


def multiple_choice(args) -> int:
    """Every choice of every question scored in one batched loglikelihood call, and the accuracies."""
    from scalenlp.engine.llm import LLM
    from scalenlp.evaluation.multiple_choice import read_questions, score

    questions = read_questions(args.tasks)
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--out {args.out}: the folder {out.parent} does not exist; create it first")
    with LLM(EngineConfig.from_args(args, compile=EVAL_COMPILE)) as llm:
        result = score(llm.engine, questions, args.target_delimiter)
    summary = {key: value for key, value in asdict(result).items() if key != "details"}
    summary.update(tasks=str(args.tasks), checkpoint=str(args.checkpoint), dtype=args.dtype, tp=args.tp,
                   target_delimiter=args.target_delimiter)
    if out is not None:
        out.write_text(json.dumps({**summary, "questions_detail": result.details}, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"acc {result.acc:.4f}  acc_norm {result.acc_norm:.4f}  acc_bytes {result.acc_bytes:.4f} over "
              f"{result.questions} questions ({result.continuations} continuations scored in {result.seconds:.1f} s)"
              f" | {args.tasks} | {args.checkpoint}")
    return 0


def run(args) -> int:

    from scalenlp.compress.quantized import quantization_of
    from scalenlp.engine.decoder_engine import pick_device
    from scalenlp.engine.dtype import LayerShapes, choose_dtype
    from scalenlp.loader import instantiate, read
    from scalenlp.models.decoder import Transformer

    if args.tasks:
        return multiple_choice(args)
    if args.chat:
        return chat_accuracy(args)
    if args.tp > 1:
        raise UserError("--tp works with --tasks and --chat; perplexity over --data runs in one process, drop --tp")
    data = Path(args.data)
    if not data.is_file():
        raise UserError(f"--data {args.data!r} is not a file; pass a UTF-8 text file to score")
    try:
        text = data.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--data {args.data} is not UTF-8 text (byte {e.start}); convert it first") from None
    device = pick_device(args.device)
    pre = read(args.checkpoint)
    model = instantiate(pre, device=device, dtype=choose_dtype(device, args.dtype, LayerShapes.of(pre.args)).dtype,
                        quantize=quantization_of(args.quantize, args.group_size))
    if not isinstance(model, Transformer):
        raise UserError(f"{args.checkpoint} is not a language model; eval measures a decoder's perplexity")
    seq = args.seq or min(model.args.max_seq_len, 1024)
    stride = args.stride or max(1, seq // 2)
    if not 2 <= seq <= model.args.max_seq_len:
        raise UserError(f"--seq {seq} must be between 2 and the model's context length {model.args.max_seq_len}")
    if not 1 <= stride <= seq:
        raise UserError(f"--stride {stride} must be between 1 and --seq ({seq})")
    ids = pre.tokenizer.encode(text).ids[:args.max_tokens]
    if len(ids) < 2:
        raise UserError(f"--data {args.data} has fewer than 2 tokens; there is nothing to score")
    result = perplexity(model, ids, seq, stride)
    if args.json:
        print(json.dumps({**asdict(result), "seq": seq, "stride": stride, "checkpoint": str(args.checkpoint)}))
    else:
        print(f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.4f} nats) over {result.tokens:,} tokens in "
              f"{result.windows} windows of {seq} (stride {stride}) | {result.tokens_per_sec:,.0f} tokens/s")
    return 0
