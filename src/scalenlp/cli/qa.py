"""`scalenlp qa`: the answer a question-answering encoder finds in a context, from the command line.

    scalenlp qa --checkpoint runs/squad --question "Who won?" --context "The Broncos won 24-10." [--json]

Repeat --question to ask several about the same context, or give one --context per --question. Without --json
each answer gets one line: the question's number, the character offsets of the answer in its context, its score
and its text; with --json one JSON object per question, as /v1/qa carries it. A context longer than the model's
window is read in overlapping windows.
"""

from __future__ import annotations

import argparse
import json

from scalenlp.engine.config import LOAD_OPTIONS, EncoderEngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EncoderEngineConfig.add_arguments(parser, LOAD_OPTIONS, checkpoint={
        "help": "a question-answering encoder: a run folder, an export folder or a Hugging Face "
                "...ForQuestionAnswering folder"})
    parser.add_argument("--question", required=True, action="append", help="a question; repeat for several")
    parser.add_argument("--context", required=True, action="append",
                        help="the text holding the answer: one for every question, or one per --question")
    parser.add_argument("--allow-empty", action="store_true",
                        help="answer nothing when the model scores \"no answer\" highest (SQuAD v2.0 models)")
    parser.add_argument("--json", action="store_true", help="one JSON object per question")


def run(args) -> int:
    from scalenlp.engine.decoder_engine import RequestError
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint
    from scalenlp.errors import UserError

    questions, contexts = args.question, args.context
    if len(contexts) == 1:
        contexts = contexts * len(questions)
    elif len(contexts) != len(questions):
        raise UserError(f"{len(questions)} --question and {len(contexts)} --context; give one --context for all "
                        f"the questions or one per --question")
    engine = encoder_from_checkpoint(EncoderEngineConfig.from_args(args, max_batch_texts=len(questions)))
    try:
        answers = engine.answer(questions, contexts, args.allow_empty)
    except RequestError as e:
        raise UserError(str(e)) from None
    finally:
        engine.stop()
    announce(engine)
    for i, (question, a) in enumerate(zip(questions, answers)):
        if args.json:
            print(json.dumps({"question": question, "answer": a.text, "start": a.start, "end": a.end,
                              "score": a.score}))
        else:
            print(f"{i}\t{a.start}-{a.end}\t{a.score:.4f}\t{a.text or '(no answer)'}")
    return 0
