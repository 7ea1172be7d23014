"""`scalenlp` entry point: one subcommand per capability, each living beside the code it drives.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and keeps heavy imports
inside ``run`` so that ``--help`` stays fast. Errors a user can fix (UserError) end as one line
``error: ...`` with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from scalenlp.errors import UserError

COMMANDS = {
    "train": ("scalenlp.cli.train", "pre-train a language model (single process or --nproc N)"),
    "generate": ("scalenlp.cli.generate", "generate text from a checkpoint, streaming to the terminal"),
    "chat": ("scalenlp.cli.chat", "talk to a chat model in the terminal (its chat template, streaming answers)"),
    "serve": ("scalenlp.cli.serve", "OpenAI-compatible HTTP server (sharded with --tp, replicas with --replicas)"),
    "eval": ("scalenlp.cli.evaluate", "perplexity of a language model over a text file (sliding windows)"),
    "classify": ("scalenlp.cli.encode", "label texts with a classification encoder (label and probabilities)"),
    "embed": ("scalenlp.cli.encode", "sentence embeddings of texts from an encoder (pooled as its folder says)"),
    "tag": ("scalenlp.cli.tag", "named entities in texts from a token-classification encoder (type, offsets, score)"),
    "qa": ("scalenlp.cli.qa", "answer a question from a context with a question-answering encoder (text, offsets)"),
    "export": ("scalenlp.cli.export", "write a checkpoint as a Hugging Face folder or a GGUF file"),
    "quantize": ("scalenlp.cli.quantize", "write a checkpoint with int8 or int4 weights that every command loads"),
    "prune": ("scalenlp.cli.prune", "prune a checkpoint (magnitude, wanda, 2:4 or structured) to an export"),
    "plan": ("scalenlp.cli.plan", "which parallel layout fits a model on a cluster, and how fast it runs"),
    "deploy": ("scalenlp.cli.deploy", "write Kubernetes manifests (deploy k8s) or a Slurm sbatch script (deploy slurm)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalenlp",
        description="Transformer NLP models from one CPU to a cluster: train, generate, serve, plan.",
        epilog="Run `scalenlp COMMAND --help` for the options of each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(cmd)
        cmd.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
