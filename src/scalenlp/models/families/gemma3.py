"""Gemma 3 text models (``Gemma3ForCausalLM``, model_type gemma3_text): Gemma 2's block with a (1 + w) RMSNorm
over each head's query and key instead of score soft-capping, five local layers to each global one, and
the local layers' own RoPE base (``rope_local_base_freq``, 10 000, where the global ones use 1 000 000)."""

from __future__ import annotations

from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.families import gemma2, llama

MODEL_TYPE, CLASS, CONFIG = "gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig"
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def layer_types(c: dict, n_layers: int) -> list[str]:
    """Gemma 3's rule where config.json lists no layer_types: every sliding_window_pattern-th layer global."""
    pattern = c.get("sliding_window_pattern", 6)
    return [LOCAL if (i + 1) % pattern else GLOBAL for i in range(n_layers)]


def rope_fields(c: dict) -> dict:
    """The ModelArgs fields of Gemma 3's two RoPEs: transformers 5 writes one parameter set per layer type, older
    configs ``rope_theta`` and ``rope_scaling`` (the global layers', linear in the 4B and larger models) and
    ``rope_local_base_freq``. The local layers' RoPE is never scaled."""
    params = c.get("rope_parameters") or {}
    if GLOBAL in params or LOCAL in params:
        theta, scaling = llama.rope(params.get(GLOBAL, {}), "Gemma 3")
        local_theta, local_scaling = llama.rope(params.get(LOCAL, {}), "Gemma 3")
    else:
        theta, scaling = llama.rope(c.get("rope_scaling") or params, "Gemma 3")
        local_theta, local_scaling = c.get("rope_local_base_freq"), {}
    if local_scaling:
        raise UserError("Gemma 3 with scaled RoPE on its sliding-window layers is not supported")
    return dict(rope_theta=c.get("rope_theta") or theta or 1_000_000.0,
                rope_local_theta=local_theta or 10_000.0, **scaling)


def args_from_config(c: dict) -> ModelArgs:
    rope = rope_fields(c)
    c = {k: v for k, v in c.items() if k not in ("rope_scaling", "rope_parameters")}  # read by rope_fields
    return llama.common(c, "Gemma 3", hf_type=MODEL_TYPE, qk_norm=True, **rope, **gemma2.gemma_options(c, "Gemma 3"),
                        **llama.window(c, c["num_hidden_layers"], layer_types))


def config_kwargs(args: ModelArgs) -> dict:
    return gemma2.gemma_config(args) | dict(rope_parameters={
        GLOBAL: (llama.scaling_config(args) or dict(rope_type="default")) | dict(rope_theta=args.rope_theta),
        LOCAL: dict(rope_type="default", rope_theta=args.rope_local_theta or args.rope_theta)})


to_hf, from_hf = gemma2.to_hf, gemma2.from_hf
