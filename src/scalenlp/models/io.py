"""Exported models: ``model.safetensors`` + ``model_args.json`` + ``tokenizer.json`` (+ ``tokenizer_config.json``
with BOS, EOS and the chat template) in one folder. Decoders and encoders share the format; an encoder's
``model_args.json`` carries ``"architecture": "bert"``.

This is what training hands to inference and to Hugging Face conversion. Loading builds the model on
the meta device and assigns the tensors read from safetensors, so nothing is allocated twice and
no pickle is ever read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from scalenlp.data.tokenizer import TOKENIZER_CONFIG, load_tokenizer
from scalenlp.errors import UserError
from scalenlp.files import replace_folder
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.limits import read_from
from scalenlp.models.memory import bytes_per, check_fits
from scalenlp.models.pretrained import Pretrained, read_tokenizer_config

WEIGHTS, ARGS, TOKENIZER = "model.safetensors", "model_args.json", "tokenizer.json"


def save_pretrained(model: Transformer | Encoder, out_dir: str | Path, tokenizer: Tokenizer | str | Path | None = None,
                    extra_files: dict[str, str] | None = None, tokenizer_config: dict | None = None) -> Path:
    """Write to a temporary sibling folder, then rename over ``out_dir``: a crash leaves the old export intact.
    ``tokenizer`` is a ``Tokenizer`` or a ``tokenizer.json`` path; ``tokenizer_config`` (BOS, EOS, chat
    template) is written as ``tokenizer_config.json``; ``extra_files`` maps file names to text written
    alongside (for example the resolved config)."""
    state = model.state_dict()
    with torch.device("meta"):
        missing = [k for k in type(model)(model.args).state_dict() if k not in state]
    if missing:  # the export would not load; an Engine's packing (engine/packing.py) turns linear weights into buffers
        raise UserError(f"cannot save the model: it has no {missing[0]}, as when an Engine packs it for inference; "
                        f"save the model as loaded, before building an Engine on it")
    with replacing_folder(out_dir) as tmp:
        state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        if getattr(model.args, "tie_embeddings", False):
            state.pop("output.weight", None)  # the same storage as tok_embeddings.weight; safetensors rejects aliases
        save_file(state, str(tmp / WEIGHTS))
        (tmp / ARGS).write_text(json.dumps(dataclasses.asdict(model.args), indent=2))
        write_tokenizer(tmp, tokenizer, tokenizer_config)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out_dir)


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the device is full: an OSError's ENOSPC, or the same in safetensors' own error type."""
    return isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e)


@contextlib.contextmanager
def replacing_folder(out_dir: str | Path) -> Iterator[Path]:
    """An empty temporary sibling of ``out_dir`` to write into, renamed over ``out_dir`` when the block
    finishes: a crash leaves the old folder intact, and a block that fails leaves no temporary folder (a full
    disk is then one error line)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            kept = f", kept the previous {out.name}" if out.exists() else ""
            raise UserError(f"no space left on the device while writing {out}; removed the partial {tmp.name}{kept}; "
                            f"free space, then write it again") from None
        raise
    replace_folder(tmp, out)


def write_tokenizer(folder: Path, tokenizer: Tokenizer | str | Path | None, tokenizer_config: dict | None) -> None:
    """``tokenizer.json`` (from a ``Tokenizer`` or a copy of a file) and ``tokenizer_config.json``, where given."""
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save(str(folder / TOKENIZER))
    elif tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER)
    if tokenizer_config:
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2))


def load_model_args(path: str | Path) -> ModelArgs | EncoderArgs:
    file = Path(path) / ARGS
    if not file.is_file():
        raise UserError(f"{path} is not an exported model (no {ARGS}); pass a run's export/ folder")
    try:
        fields = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is corrupt ({e}); re-export the model") from None
    if not isinstance(fields, dict):
        raise UserError(f"{file} holds a JSON {type(fields).__name__}, not an object of model arguments; re-export "
                        f"the model")
    with read_from(str(file)):  # also an unknown field (a TypeError from the constructor)
        args = (EncoderArgs if fields.get("architecture") == "bert" else ModelArgs)(**fields)
        args.check()
    return args


def read_weights(path: str | Path) -> tuple[ModelArgs | EncoderArgs, dict[str, torch.Tensor]]:
    """An export folder's model arguments and weights; safetensors are memory-mapped, not copied."""
    args = load_model_args(path)
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{path} has {ARGS} but no {WEIGHTS}; re-export the model")
    try:
        return args, load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise UserError(f"cannot read {weights}: {e}") from None


def read_export(path: str | Path) -> Pretrained:
    """An export folder as a ``Pretrained`` (weights, tokenizer and its config)."""
    folder = Path(path)
    args, state = read_weights(folder)
    if not (folder / TOKENIZER).is_file():
        raise UserError(f"{folder} has no {TOKENIZER}; export the model together with its tokenizer")
    return Pretrained(args, state, load_tokenizer(folder / TOKENIZER), read_tokenizer_config(folder), "export", folder)


def build_decoder(args: ModelArgs, state: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, where: str = "the checkpoint") -> Transformer:
    """A decoder built on the meta device with ``state`` assigned (moved to ``device``/``dtype`` only where
    they differ); ``dtype`` casts floating weights (RoPE tables stay float32). Arguments whose weights and tables
    cannot fit in the device's memory are refused before anything is allocated."""
    check_fits(args, device, bytes_per(dtype, state), where)
    with torch.device("meta"):
        model = Transformer(args)
    state = cast_state(state, device, dtype)
    if args.tie_embeddings:
        state["output.weight"] = state.get("tok_embeddings.weight")
    assign_state(model, state, where)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if args.position == "rope":  # non-persistent buffers are still on meta
        model.rope_cos, model.rope_sin = rope_tables(args, device=device)
    return model.eval()


def build_encoder(args: EncoderArgs, state: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, where: str = "the checkpoint") -> Encoder:
    """An encoder built on the meta device with ``state`` assigned; ``dtype`` casts floating weights. Arguments whose
    weights cannot fit in the device's memory are refused before anything is allocated."""
    check_fits(args, device, bytes_per(dtype, state), where)
    with torch.device("meta"):
        model = Encoder(args)
    assign_state(model, cast_state(state, device, dtype), where)
    return model.eval()


def build(args: ModelArgs | EncoderArgs, state: dict[str, torch.Tensor], device: str | torch.device = "cpu",
          dtype: torch.dtype | None = None, where: str = "the checkpoint") -> Transformer | Encoder:
    """The model ``args`` describe, a decoder or an encoder, with ``state`` assigned."""
    return (build_encoder if isinstance(args, EncoderArgs) else build_decoder)(args, state, device, dtype, where)


def cast_state(state: dict[str, torch.Tensor], device: str | torch.device,
               dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` on ``device`` with floating tensors in ``dtype`` (tensors already there are not copied)."""
    return {k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
            for k, v in state.items()}


def assign_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Assign every tensor of ``state`` to a model built on the meta device; a mismatch is the checkpoint's fault."""
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"the weights in {where} do not match its model arguments: {str(e).splitlines()[0]}") from None


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> Transformer | Encoder:
    """Load an export folder's model; ``dtype`` casts floating weights (RoPE tables stay float32)."""
    return build(*read_weights(path), device, dtype, where=str(path))
