"""Adapter folders in PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

Two namings of the same layout: PEFT's (``base_model.model.<Hugging Face module>.lora_A.weight``, which
``peft.PeftModel.from_pretrained`` loads onto the transformers model our Hugging Face export writes) and ours (the
same keys under our module names, ``"scalenlp_names": true`` in the config), which a run's ``export/adapter`` holds
for any model, whether or not it has a Hugging Face twin. ``read_adapter`` reads either.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from scalenlp.errors import UserError
from scalenlp.models.adapters import LoraSpec, LoraWeights
from scalenlp.models.decoder import ModelArgs, Transformer

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FOLDER = "adapter"  # where a LoRA run's export keeps its adapter, beside the merged model
PREFIX = "base_model.model."
# PEFT's tensor names inside a module, by our LoraWeights field.
PARTS = {"A": "lora_A.weight", "B": "lora_B.weight", "magnitude": "lora_magnitude_vector"}


def hf_module_names(args) -> dict[str, str]:
    """{our linear's module name: the Hugging Face model's} for a decoder whose export keeps each linear whole
    (Llama and its relatives). GPT-2 fuses q/k/v into one transposed Conv1D, which per-projection adapters do
    not map onto: refused with one line, as are encoders."""
    from scalenlp.models.hf import to_hf_state_dict

    if not isinstance(args, ModelArgs):
        raise UserError("PEFT adapters are written for decoders (Llama family); for an encoder, use the merged "
                        "export (the run's export/ folder or scalenlp export --merge)")
    with torch.device("meta"):
        ours = {name: torch.empty(t.shape) for name, t in Transformer(args).state_dict().items()}
    # The Hugging Face state dict hands a tensor through unchanged where a weight maps one to one: giving it
    # tensors of our own (on the meta device, free) and matching them by identity gives the name map without
    # restating it.
    theirs = {id(t): name for name, t in to_hf_state_dict(SimpleNamespace(args=args, state_dict=lambda: ours)).items()}
    names = {}
    for name, tensor in ours.items():
        if name.startswith("layers.") and name.endswith(".weight") and id(tensor) in theirs:
            names[name.removesuffix(".weight")] = theirs[id(tensor)].removesuffix(".weight")
    if not any(k.endswith("attention.wq") for k in names):
        raise UserError("this model's Hugging Face class fuses or transposes its projections (GPT-2's c_attn); "
                        "PEFT adapters are written for the Llama family only. Use the merged export instead")
    return names


def write_adapter(folder: Path, spec: LoraSpec, weights: dict[str, LoraWeights], hf_names: dict[str, str] | None,
                  base: str = "") -> None:
    """Write ``weights`` (by our module names) to ``folder``: under Hugging Face names where ``hf_names`` is
    given (PEFT loads it), else under ours."""
    def name(module: str) -> str:
        return hf_names[module] if hf_names is not None else module

    tensors = {}
    for module, w in weights.items():
        for field, part in PARTS.items():
            value = getattr(w, field)
            if value is not None:
                tensors[f"{PREFIX}{name(module)}.{part}"] = value.detach().float().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "use_rslora": spec.use_rslora, "use_dora": spec.dora, "bias": "none",
              "fan_in_fan_out": False, "target_modules": sorted(name(m) for m in weights), "modules_to_save": None,
              "base_model_name_or_path": base, "inference_mode": True, "init_lora_weights": True,
              "rank_pattern": {}, "alpha_pattern": {}}
    if hf_names is None:
        config["scalenlp_names"] = True
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def read_adapter(path: str | Path, args) -> tuple[LoraSpec, dict[str, LoraWeights]]:
    """(its hyperparameters, {our module name: weights}) of an adapter folder made by PEFT or by scalenlp, for the
    base model ``args`` describes."""
    folder = Path(path)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise UserError(f"lora.init={str(path)!r} is not an adapter folder: it needs {CONFIG} and {WEIGHTS} (what "
                        f"PEFT's save_pretrained writes, or a run's export/adapter)")
    try:
        config = json.loads((folder / CONFIG).read_text())
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as e:  # JSON or safetensors errors of a damaged file
        raise UserError(f"cannot read the adapter in {folder}: {e}") from None
    problem = _unsupported(config)
    if problem:
        raise UserError(f"the adapter in {folder} {problem}")
    spec = LoraSpec(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0),
                    bool(config.get("use_rslora")), bool(config.get("use_dora")))
    to_ours = None if config.get("scalenlp_names") else {hf: ours for ours, hf in hf_module_names(args).items()}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        field = next((f for f, part in PARTS.items() if key.endswith("." + part)), None)
        if field is None:
            raise UserError(f"the adapter in {folder} holds {key}, which is not a LoRA weight (only lora_A, lora_B "
                            f"and DoRA magnitudes are read; modules_to_save are not)")
        module = key.removeprefix(PREFIX).removesuffix("." + PARTS[field])
        ours = module if to_ours is None else to_ours.get(module)
        if ours is None:
            raise UserError(f"the adapter in {folder} adapts {module}, which this base model does not have; it was "
                            f"made for another base model")
        parts.setdefault(ours, {})[field] = value
    weights = {}
    for module, p in parts.items():
        if "A" not in p or "B" not in p:
            raise UserError(f"the adapter in {folder} lacks lora_{'A' if 'A' not in p else 'B'} for {module}")
        if p["A"].shape[0] != spec.rank or p["B"].shape[1] != spec.rank:
            raise UserError(f"the adapter in {folder}: {module} has rank {p['A'].shape[0]}, its config says r="
                            f"{spec.rank}")
        weights[module] = LoraWeights(p["A"], p["B"], spec.scaling, p.get("magnitude"))
    if not weights:
        raise UserError(f"the adapter in {folder} holds no LoRA weights")
    return spec, weights


def _unsupported(config: dict) -> str:
    """What in a PEFT config this reader cannot honour, as the end of a sentence; empty when all is well."""
    if config.get("peft_type") != "LORA":
        return f"is a {config.get('peft_type')!r} adapter; only LORA adapters are read"
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        return "sets rank_pattern or alpha_pattern (a rank or alpha per layer); only one rank and alpha are read"
    if config.get("bias", "none") != "none":
        return f"trains biases (bias={config['bias']!r}); only bias=\"none\" adapters are read"
    if config.get("fan_in_fan_out"):
        return "is for transposed (Conv1D, GPT-2) layers; only Llama-family adapters are read"
    return ""
