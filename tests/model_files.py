"""Tiny model files of every kind the loader reads, and ways to damage them: what the model-file bounds tests and
their fuzzer start from (tests/unit/test_model_file_bounds.py)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from infer_helpers import train_tokenizer
from scalenlp.models import families
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.gguf import write_gguf
from scalenlp.models.hf import to_hf_state_dict
from scalenlp.models.hf_encoder import write_encoder_folder
from scalenlp.models.io import save_pretrained


def tiny_files(root: Path) -> dict[str, Path]:
    """A random 2-layer Llama-shaped decoder (dim 32) as an export folder, a Hugging Face folder and an f32 GGUF
    file, and a 2-layer BERT (dim 32) as a Hugging Face folder, all with one byte-level BPE of 320 tokens."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    tok_path = train_tokenizer(root / "tok.json")
    tokenizer = Tokenizer.from_file(str(tok_path))
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                     max_seq_len=64)
    model = Transformer(args)
    hf = root / "hf"
    hf.mkdir()
    save_file(to_hf_state_dict(model), str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", **families.for_args(args).config_kwargs(args)}))
    shutil.copyfile(tok_path, hf / "tokenizer.json")
    encoder = Encoder(EncoderArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=2, n_heads=2, ffn_dim=64,
                                  max_seq_len=64))
    return {"export": save_pretrained(model, root / "export", tokenizer), "hf": hf,
            "gguf": write_gguf(model, tokenizer, {}, root / "model.gguf", "f32"),
            "encoder": write_encoder_folder(encoder, tokenizer, None, root / "encoder")}


def copy_model(source: Path, to: Path) -> Path:
    """A copy of a model folder or file at ``to`` (a file keeps its suffix)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, to)
        return to
    to = to.with_suffix(source.suffix)
    shutil.copyfile(source, to)
    return to


def edit_json(file: Path, change) -> None:
    """``file``'s JSON replaced by ``change(data)`` (which may change ``data`` in place and return None)."""
    data = json.loads(file.read_text())
    new = change(data)
    file.write_text(json.dumps(data if new is None else new))


def _at(reader: gguf.GGUFReader, part: np.ndarray) -> int:
    return part.ctypes.data - reader.data.ctypes.data


def gguf_places(path: Path) -> dict[str, tuple[int, str]]:
    """Where the file's integers lie: metadata key (scalars; arrays as ``key#length``) or ``tensor:NAME:offset`` /
    ``tensor:NAME:dim0`` -> (byte position, struct format)."""
    reader = gguf.GGUFReader(path)
    places: dict[str, tuple[int, str]] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            places[name + "#length"] = (_at(reader, field.parts[4]), "<Q")
        elif field.parts[-1].dtype.kind in "iu" and field.parts[-1].dtype.itemsize in (4, 8):
            places[name] = (_at(reader, field.parts[-1]), "<I" if field.parts[-1].dtype.itemsize == 4 else "<Q")
    for t in reader.tensors:
        places[f"tensor:{t.name}:offset"] = (_at(reader, t.field.parts[5]), "<Q")
        places[f"tensor:{t.name}:dim0"] = (_at(reader, t.field.parts[3]), "<Q")
    return places


def patch_gguf(path: Path, place: str, value: int) -> None:
    """Overwrite one integer of ``gguf_places`` in the file (masked to its width, so -64 is 2^64 - 64)."""
    at, fmt = gguf_places(path)[place]
    bits = 8 * struct.calcsize(fmt)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(fmt, value % (1 << bits)))
