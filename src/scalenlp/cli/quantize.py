"""`scalenlp quantize`: a checkpoint's linear weights rounded to int8 or int4 and written as an export folder
that every command loading a model (serve, generate, chat, eval, classify, embed) reads directly; those
commands quantize at load instead with ``--quantize`` (an engine option, ``scalenlp.engine.config``). The rounding and the kernels live in
``scalenlp.compress.quantized``; both paths produce the same tensors, so they run identically. With
``--calibration``, int4 rounds activation-aware (``scalenlp.compress.awq``) from that text's activations: the same
layout and kernels, nearer the float model.

    scalenlp quantize --checkpoint model.gguf --method int4 --group-size 64 --out smollm2-int4
    scalenlp generate --checkpoint smollm2-int4 --prompt "Once upon a time"
    scalenlp quantize --checkpoint model.gguf --method int4 --calibration wiki.valid.raw --out smollm2-awq
    scalenlp eval --checkpoint model.gguf --quantize int8 --data wiki.test.raw
    scalenlp serve --checkpoint smollm2.Q4_1.gguf --quantize int4 --group-size 32 --tp 2   # the file's own 4-bit codes
"""

from __future__ import annotations

import argparse

from scalenlp.engine.config import METHOD_CHOICES, METHOD_HELP
from scalenlp.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a floating-point model: a run folder, an export folder, a Hugging Face folder or a .gguf")
    parser.add_argument("--method", required=True, choices=METHOD_CHOICES, help=METHOD_HELP)
    parser.add_argument("--group-size", type=int, default=64,
                        help="int4: inputs per scale, 32, 64 or 128 (default 64); 32 takes a GGUF file's Q4_0/Q4_1 "
                             "blocks as they are")
    parser.add_argument("--calibration", metavar="FILE",
                        help="int4: UTF-8 text (not the evaluation split) whose activations choose per-channel scales "
                             "and each group's clipping (AWQ); without it, each group rounds by its weights alone")
    parser.add_argument("--calibration-samples", type=int, default=32, metavar="N",
                        help="windows of --calibration-seq tokens spread over the text (default 32)")
    parser.add_argument("--calibration-seq", type=int, default=512, metavar="T",
                        help="tokens per calibration window (default 512)")
    parser.add_argument("--out", required=True, help="export folder to write; must not exist")


def run(args) -> int:
    import dataclasses
    import json

    from safetensors.torch import save_file

    from scalenlp.cli.export import new_output
    from scalenlp.compress.quantized import QUANTIZATION, quantization_json, quantization_of
    from scalenlp.loader import instantiate, read
    from scalenlp.models.io import ARGS, WEIGHTS, replacing_folder, write_tokenizer

    spec = quantization_of(args.method, args.group_size)
    out = new_output(args.out)
    pre = read(args.checkpoint)
    if pre.quantization is not None:
        raise UserError(f"{args.checkpoint} is already quantized ({pre.quantization.describe()}); quantize its "
                        f"floating-point original")
    # Built on the CPU in the checkpoint's own dtype: the stored tensors are the same on every device.
    model = calibrated(pre, spec, args) if args.calibration else instantiate(pre, "cpu", None, quantize=spec)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    with replacing_folder(out) as tmp:
        save_file(state, str(tmp / WEIGHTS))
        (tmp / ARGS).write_text(json.dumps(dataclasses.asdict(pre.args), indent=2))
        (tmp / QUANTIZATION).write_text(quantization_json(spec))
        write_tokenizer(tmp, pre.tokenizer, pre.tokenizer_config)
        sentence_config = pre.path / "sentence_bert_config.json"  # where an embedding model truncates
        if pre.path.is_dir() and sentence_config.is_file():
            (tmp / sentence_config.name).write_text(sentence_config.read_text())
    size = (out / WEIGHTS).stat().st_size
    print(f"wrote {out}: {spec.describe()}, {size / 2**20:,.1f} MiB of weights")
    return 0


def calibrated(pre, spec, args):
    """``pre`` quantized by AWQ from ``--calibration`` (a float32 copy takes the folded scales)."""
    import logging

    import torch

    from scalenlp.compress.awq import awq
    from scalenlp.compress.calibration import calibration_batches
    from scalenlp.compress.quantized import build_quantized
    from scalenlp.loader import instantiate

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # awq() reports each block's alphas
    model = instantiate(pre, "cpu", torch.float32)
    batches = calibration_batches(args.calibration, pre.tokenizer, args.calibration_samples, args.calibration_seq)
    grams = awq(model, batches, spec)
    # The file's own 4-bit blocks (GGUF) no longer fit the scaled weights: everything rounds again.
    return build_quantized(pre.args, model.state_dict(), spec, True, "cpu", where=str(pre.path), grams=grams)
