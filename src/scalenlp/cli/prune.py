"""`scalenlp prune`: any checkpoint the loader reads, pruned (see ``scalenlp.compress.prune``) and written as an
export folder that generate, chat, serve, eval and classify load directly. A structured-pruned decoder
is a smaller model whose export `scalenlp export --format hf` turns into a transformers folder, and which
`scalenlp train` fine-tunes back (``model.init`` = the export) to recover quality.

Pruning runs on the CPU: the export holds dense weights (2:4 and unstructured zeros included), which is
what every loader and device reads; ``prune()`` on a CUDA model swaps 2:4 sparse kernels in itself.
"""

from __future__ import annotations

import argparse
import json

from scalenlp.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder, an export folder, a Hugging Face model folder or a .gguf file")
    parser.add_argument("--method", required=True,
                        help="magnitude: smallest |w| | wanda: |w|·input norm per output row (needs --calibration) "
                             "| 2:4: 2 of every 4 input weights | structured: whole KV groups and MLP neurons")
    parser.add_argument("--sparsity", type=float, default=0.5,
                        help="share of the block weights (structured: of the KV groups and MLP neurons, rounded to whole "
                             "units) removed, in (0, 1); default 0.5")
    parser.add_argument("--scope", default="layer",
                        help="magnitude: each layer loses --sparsity (layer) or one threshold over all (global)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="UTF-8 text whose activations score the weights (wanda; optional for 2:4, structured)")
    parser.add_argument("--calibration-samples", type=int, default=128, metavar="N",
                        help="windows of calibration text (default 128)")
    parser.add_argument("--calibration-seq", type=int, default=128, metavar="T",
                        help="tokens per calibration window (default 128)")
    parser.add_argument("--out", required=True, help="export folder to write; must not exist")


def run(args) -> int:
    import logging

    from scalenlp.cli.export import new_output
    from scalenlp.compress.calibration import calibration_batches
    from scalenlp.compress.prune import describe, prune
    from scalenlp.loader import instantiate, read
    from scalenlp.models.io import save_pretrained

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # prune() says which kernels 2:4 gets
    out = new_output(args.out)
    pre = read(args.checkpoint)
    integer = next((name for name, t in pre.state.items() if not t.is_floating_point()), None)
    if integer:
        raise UserError(f"{args.checkpoint} is quantized ({integer} holds integers); prune the float checkpoint, "
                        f"then quantize the pruned export")
    model = instantiate(pre)
    calibration = None
    if args.calibration:
        calibration = calibration_batches(args.calibration, pre.tokenizer, args.calibration_samples,
                                          args.calibration_seq)
    params = model.num_params()
    model = prune(model, args.method, args.sparsity, scope=args.scope, calibration=calibration)
    record = {"method": args.method, "sparsity": args.sparsity, "scope": args.scope, "source": str(args.checkpoint),
              "calibration": args.calibration, "calibration_samples": args.calibration_samples if calibration else 0,
              "parameters_before": params, "parameters_after": model.num_params()}
    save_pretrained(model, out, pre.tokenizer, tokenizer_config=pre.tokenizer_config,
                    extra_files={"pruning.json": json.dumps(record, indent=2)})
    shape = (f"parameters {params:,} -> {model.num_params():,}" if args.method == "structured" else describe(model))
    print(f"wrote {out} ({args.method}: {shape})")
    return 0
