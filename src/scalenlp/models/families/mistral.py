"""Mistral (``MistralForCausalLM``): a Llama whose layers all attend within ``sliding_window`` where it is set."""

from __future__ import annotations

from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import llama

MODEL_TYPE, CLASS, CONFIG = "mistral", "MistralForCausalLM", "MistralConfig"


def args_from_config(c: dict) -> ModelArgs:
    return llama.common(c, "Mistral", hf_type=MODEL_TYPE, **llama.window(c, c["num_hidden_layers"]))


def config_kwargs(args: ModelArgs) -> dict:
    return llama.common_config(args) | dict(sliding_window=llama.window_everywhere(args, "Mistral"))


to_hf, from_hf = llama.to_hf, llama.from_hf
