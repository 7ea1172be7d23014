"""`scalenlp export`: any checkpoint the loader reads, written as a Hugging Face folder or a GGUF file.

The Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the
chat template) loads with ``transformers``' ``from_pretrained``; the GGUF file carries the tokenizer and
chat template, so llama.cpp-based tools run the model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scalenlp.errors import UserError

FORMATS = ("hf", "gguf")
GGUF_TYPES = ("f32", "f16", "q8_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder, an export folder, a Hugging Face model folder or a .gguf file")
    parser.add_argument("--format", required=True, choices=FORMATS, help="hf: a transformers folder; gguf: one file")
    parser.add_argument("--out", required=True, help="folder (hf) or .gguf file (gguf) to write; must not exist")
    parser.add_argument("--type", default="f16", choices=GGUF_TYPES, help="GGUF weight type (default f16)")


def write_hf_folder(model, pre, out: Path) -> None:
    """A model as a transformers folder, with the tokenizer and its config (chat template) beside the weights."""
    from scalenlp.models.encoder import Encoder
    from scalenlp.models.hf_encoder import write_encoder_folder
    from scalenlp.models.io import replacing_folder, write_tokenizer

    # transformers' fast tokenizer reads its class and special tokens from the tokenizer config.
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **pre.tokenizer_config}
    if isinstance(model, Encoder):
        write_encoder_folder(model, pre.tokenizer, tokenizer_config, out)
        return
    from scalenlp.models.hf import to_hf  # builds a transformers model

    with replacing_folder(out) as tmp:
        to_hf(model).save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp, pre.tokenizer, tokenizer_config)


def new_output(path: str) -> Path:
    """``--out`` as a path that does not exist yet, in a folder that does (nothing is ever overwritten)."""
    out = Path(path)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new path (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")
    return out


def run(args) -> int:
    from scalenlp.loader import load

    out = new_output(args.out)
    if args.format == "gguf" and out.suffix != ".gguf":
        raise UserError(f"--out {out} must end in .gguf for --format gguf")
    model, pre = load(args.checkpoint)
    if pre.quantization is not None:
        raise UserError(f"{args.checkpoint} is quantized ({pre.quantization.describe()}); export its floating-point "
                        f"original")
    if args.format == "gguf":
        from scalenlp.models.gguf import write_gguf

        write_gguf(model, pre.tokenizer, pre.tokenizer_config, out, dtype=args.type)
    else:
        write_hf_folder(model, pre, out)
    print(f"wrote {out} ({args.format}{', ' + args.type if args.format == 'gguf' else ''})")
    return 0
