"""`scalenlp tag`: the entities a token-classification encoder finds in texts given on the command line.

    scalenlp tag --checkpoint runs/ner --text "Paul flew to New York" --text "..." [--json]

Without --json each entity gets one line: the text's number, its type, its character offsets, its score and
its text (a text without entities: one line saying so); with --json one JSON object per text, its entities
as /v1/tag carries them. A text longer than the model's window is read in windows of whole words.
"""

from __future__ import annotations

import argparse
import json

from scalenlp.engine.config import LOAD_OPTIONS, EncoderEngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EncoderEngineConfig.add_arguments(parser, LOAD_OPTIONS, checkpoint={
        "help": "a token-classification encoder: a run folder, an export folder or a Hugging Face "
                "...ForTokenClassification folder"})
    parser.add_argument("--text", required=True, action="append", help="a text; repeat for several")
    parser.add_argument("--json", action="store_true", help="one JSON object per text")


def run(args) -> int:
    from scalenlp.engine.decoder_engine import RequestError
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint
    from scalenlp.errors import UserError

    engine = encoder_from_checkpoint(EncoderEngineConfig.from_args(args, max_batch_texts=len(args.text)))
    try:
        found = engine.tag(args.text)
    except RequestError as e:
        raise UserError(str(e)) from None
    finally:
        engine.stop()
    announce(engine)
    for i, (text, entities) in enumerate(zip(args.text, found)):
        if args.json:
            print(json.dumps({"text": text, "entities": entities}))
            continue
        if not entities:
            print(f"{i}\t(no entities)")
        for e in entities:
            print(f"{i}\t{e['type']}\t{e['start']}-{e['end']}\t{e['score']:.4f}\t{e['text']}")
    return 0
