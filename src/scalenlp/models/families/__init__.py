"""Hugging Face decoder families: one small adapter per ``model_type``, each mapping that family's
``config.json`` onto ``ModelArgs`` options and its tensor names onto ours, and back for export.

Every adapter module has:

- ``MODEL_TYPE``, ``CLASS`` (the transformers ``...ForCausalLM``) and ``CONFIG`` (its config class);
- ``args_from_config(c: dict) -> ModelArgs`` (a UserError for what the family has and we do not);
- ``config_kwargs(args) -> dict``: the transformers config of the same model;
- ``to_hf(args, state)`` and ``from_hf(args, state)``: state dicts under the other side's names.

A model's family is ``ModelArgs.hf_type`` where set (models read from these families carry it), else GPT-2
or Llama as told by the shape, which is how models trained here and the first two families always worked.
"""

from __future__ import annotations

from types import ModuleType

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import gemma2, gemma3, gpt2, llama, mistral, phi3, qwen2, qwen3

FAMILIES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (gpt2, llama, qwen2, qwen3, mistral, gemma2, gemma3,
                                                             phi3)}
ENCODERS = "bert (BertModel, BertForSequenceClassification, BertForTokenClassification)"


def supported() -> str:
    """The decoder families, as one error line names them."""
    return ", ".join(f"{name} ({m.CLASS})" for name, m in FAMILIES.items())


def for_config(c: dict) -> ModuleType:
    """The adapter of a ``config.json``'s model_type."""
    model_type = c.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"cannot load a Hugging Face {model_type!r} model; supported: {supported()}, {ENCODERS}")
    return FAMILIES[model_type]


def for_args(args: ModelArgs) -> ModuleType:
    """The adapter whose transformers class computes exactly what a model with these arguments computes."""
    if args.hf_type:
        if args.hf_type not in FAMILIES:
            raise UserError(f"model_args.json names the Hugging Face family {args.hf_type!r}, which this version "
                            f"does not know; known: {', '.join(FAMILIES)}")
        return FAMILIES[args.hf_type]
    for m in (gpt2, llama):
        if m.matches(args):
            return m
    raise UserError(f"no Hugging Face equivalent for norm={args.norm}, activation={args.activation}, "
                    f"position={args.position}, bias={args.bias}: GPT-2 needs {gpt2.SHAPE} and no GQA, "
                    f"Llama needs {llama.SHAPE} and none of the other families' options")
