"""`scalenlp classify` and `scalenlp embed`: an encoder checkpoint over texts given on the command line.

    scalenlp classify --checkpoint runs/sst2 --text "a gripping film" --text "dull" [--json]
    scalenlp embed --checkpoint MiniLM/ --text "a sentence" [--json]

Without --json each text gets one line (the label and every class probability; the vector's dimension
and norm); with --json one JSON object per text, as /v1/classify and /v1/embeddings carry them.
"""

from __future__ import annotations

import argparse
import json

from scalenlp.cli.quantize import add_load_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="an encoder: a run folder, an export folder or a Hugging Face BERT folder")
    parser.add_argument("--text", required=True, action="append", help="a text; repeat for several")
    parser.add_argument("--json", action="store_true", help="one JSON object per text")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype; auto = bf16 where the device computes in it natively (default)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    add_load_arguments(parser)


def run(args) -> int:
    from scalenlp.errors import UserError
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint
    from scalenlp.engine.decoder_engine import RequestError

    kind = "classify" if args.command == "classify" else "embed"
    engine = encoder_from_checkpoint(args.checkpoint, dtype=args.dtype, device=args.device,
                                     max_request_texts=len(args.text), quantize=args.quantize,
                                     group_size=args.group_size)
    try:
        rows = engine.run(kind, args.text)
    except RequestError as e:
        raise UserError(str(e)) from None
    finally:
        engine.stop()
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
