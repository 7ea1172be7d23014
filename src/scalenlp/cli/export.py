"""`scalenlp export`: any checkpoint the loader reads, written as a Hugging Face folder or a GGUF file; a LoRA run's
adapter as a PEFT adapter folder; or a base with an adapter merged in (``--merge --adapter``).

The Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the
chat template) loads with ``transformers``' ``from_pretrained``; the GGUF file carries the tokenizer and
chat template, so llama.cpp-based tools run the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scalenlp.errors import UserError

FORMATS = ("hf", "gguf", "peft")
GGUF_TYPES = ("f32", "f16", "q8_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder, an export folder, a Hugging Face model folder or a .gguf file")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="hf: a transformers folder; gguf: one file; peft: a LoRA run's adapter alone, as a PEFT "
                             "adapter folder (its base: model.init's Hugging Face export)")
    parser.add_argument("--out", required=True, help="folder (hf, peft) or .gguf file (gguf) to write; must not exist")
    parser.add_argument("--type", default="f16", choices=GGUF_TYPES, help="GGUF weight type (default f16)")
    parser.add_argument("--merge", action="store_true",
                        help="fold --adapter into --checkpoint's weights and write the merged model (hf or gguf); a "
                             "LoRA run's own export is merged already")
    parser.add_argument("--adapter", default="",
                        help="with --merge: a LoRA adapter for --checkpoint (a PEFT adapter folder or a run's "
                             "export/adapter)")


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
    """``--out`` as a path that does not exist yet (nothing is ever overwritten); its missing parent folders are
    made, as ``mkdir -p`` would."""
    out = Path(path)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new path (nothing is overwritten)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"--out {out}: a part of {out.parent} is a file, not a folder; choose another path") from None
    except OSError as e:
        raise UserError(f"--out {out}: cannot make its folder {out.parent} ({e.strerror}); choose another path") from None
    return out


def _has_adapter(checkpoint: str) -> bool:
    from scalenlp.loader import checkpoint_kind
    from scalenlp.models.adapter_io import ADAPTER_FOLDER

    kind, folder = checkpoint_kind(checkpoint)
    return kind == "export" and (folder / ADAPTER_FOLDER).is_dir()


def write_peft_folder(checkpoint: str, out: Path) -> None:
    """A LoRA run's adapter (``export/adapter``, under our names) as PEFT writes it: Hugging Face module names."""
    from scalenlp.loader import checkpoint_kind
    from scalenlp.models.adapter_io import ADAPTER_FOLDER, hf_module_names, read_adapter, write_adapter
    from scalenlp.models.io import load_model_args, replacing_folder

    if not _has_adapter(checkpoint):
        raise UserError(f"{checkpoint} holds no LoRA adapter ({ADAPTER_FOLDER}/ in a run's export): --format peft "
                        f"writes the adapter of a run trained with lora.rank > 0")
    folder = checkpoint_kind(checkpoint)[1]
    args = load_model_args(folder)
    spec, weights = read_adapter(folder / ADAPTER_FOLDER, args)
    base = json.loads((folder / ADAPTER_FOLDER / "adapter_config.json").read_text()).get("base_model_name_or_path", "")
    with replacing_folder(out) as tmp:
        write_adapter(tmp, spec, weights, hf_module_names(args), base)


def merge_adapter(model, adapter: str):
    """``model`` with the adapter in folder ``adapter`` folded into its weights."""
    from scalenlp.models.adapter_io import read_adapter
    from scalenlp.models.adapters import add_adapters, load_adapter_weights, merge_adapters

    spec, weights = read_adapter(adapter, model.args)
    add_adapters(model, spec, weights)
    load_adapter_weights(model, weights, adapter)
    return merge_adapters(model).eval()


def run(args) -> int:
    from scalenlp.loader import load

    out = new_output(args.out)
    if args.format == "gguf" and out.suffix != ".gguf":
        raise UserError(f"--out {out} must end in .gguf for --format gguf")
    if args.adapter and not args.merge:
        raise UserError("--adapter is folded in by --merge; add --merge (to train on from it, set lora.init instead)")
    if args.merge and args.format == "peft":
        raise UserError("--merge writes a whole model; choose --format hf or gguf (--format peft writes the adapter "
                        "alone)")
    if args.merge and not args.adapter and not _has_adapter(args.checkpoint):
        raise UserError(f"--merge needs --adapter (a PEFT adapter folder or a run's export/adapter): "
                        f"{args.checkpoint} is not a LoRA run, whose export would be merged already")
    if args.format == "peft":
        write_peft_folder(args.checkpoint, out)
        print(f"wrote {out} (peft)")
        return 0
    model, pre = load(args.checkpoint)
    if args.adapter:
        model = merge_adapter(model, args.adapter)
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
