"""`scalenlp classify` and `scalenlp embed`: an encoder checkpoint over texts given on the command line.

    scalenlp classify --checkpoint runs/sst2 --text "a gripping film" --text "dull" [--json]
    scalenlp embed --checkpoint MiniLM/ --text "a sentence" [--json]

Without --json each text gets one line (the label and every class probability; the vector's dimension
and norm); with --json one JSON object per text, as /v1/classify and /v1/embeddings carry them.
"""

from __future__ import annotations

import argparse
import json

from scalenlp.engine.config import LOAD_OPTIONS, EncoderEngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EncoderEngineConfig.add_arguments(parser, LOAD_OPTIONS, checkpoint={
        "help": "an encoder: a run folder, an export folder or a Hugging Face BERT folder"})
    parser.add_argument("--text", required=True, action="append", help="a text; repeat for several")
    parser.add_argument("--json", action="store_true", help="one JSON object per text")


def run(args) -> int:
    from scalenlp.engine.decoder_engine import RequestError
    from scalenlp.engine.dtype import announce
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint
    from scalenlp.errors import UserError

    kind = "classify" if args.command == "classify" else "embed"
    engine = encoder_from_checkpoint(EncoderEngineConfig.from_args(args, max_batch_texts=len(args.text)))
    try:
        rows = engine.run(kind, args.text)
    except RequestError as e:
        raise UserError(str(e)) from None
    finally:
        engine.stop()
    announce(engine)
    for text, row in zip(args.text, rows):
        if kind == "classify":
            probabilities = dict(zip(engine.labels, row.tolist()))
            label = engine.labels[int(row.argmax())]
            if args.json:
                print(json.dumps({"text": text, "label": label, "probabilities": probabilities}))
            else:
                spread = "  ".join(f"{name}={p:.4f}" for name, p in probabilities.items())
                print(f"{label}\t{spread}\t{text}")
        elif args.json:
            print(json.dumps({"text": text, "embedding": row.tolist()}))
        else:
            print(f"dim={row.numel()}  norm={float(row.norm()):.4f}\t{text}")
    return 0
