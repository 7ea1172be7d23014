"""The compiled decode step's artifacts kept between starts, so that a server started again compiles from cache.

Compiling SmolLM2's 30-layer decode step took 77-110 s at every start on the project's 2-core machine: with
Inductor's freezing on, AOTAutograd's cache refuses the graph ("Cannot cache a graph with freezing enabled") and
Inductor's FX graph cache bypasses it ("mkldnn tensors unpickleable": the weights it packed are constants of the
graph), so nothing was reused. The compiled step is now built without freezing (``compiled_step``), which both
caches take; after a compile that did not come from them, what they hold (``torch.compiler.save_cache_artifacts``,
PyTorch's portable "mega-cache") is written to one file in the per-machine cache folder, named as the other
measured-once records are (processor, torch version, threads) and by a hash of everything the graph is built for:
the model's class and arguments, its weights' dtype, the KV cache's blocks and dtype. A later start loads that file
into Inductor's caches before compiling (``load``), so that Dynamo's trace is all it redoes.

The file's header holds its key and the payload's SHA-256; a file that is unreadable, truncated, for another key or
refused by PyTorch is reported in the start-up line and the step compiled as if there were none (then written
anew). What the caches serve is checked by their own keys (the traced graph, Inductor's configuration, the torch
version), so a stale file can cost a compile, never give another graph.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from scalenlp.engine.dtype import name_of
from scalenlp.files import write_file
from scalenlp.hardware import engine_cache_path

MAGIC = b"scalenlp compiled decode step\n"


def step_key(model, cache_dtype: torch.dtype, num_blocks: int, block_size: int) -> str:
    """What the compiled decode step of ``model`` (a Transformer) with this KV cache is built for, as text."""
    weights = sorted({name_of(p.dtype) for p in model.parameters()})
    # The kinds of layer tell a quantized or packed model from a plain one of the same widths and dtype.
    layers = sorted({type(m).__qualname__ for m in model.modules()})
    # And a quantized layer's kernel (an int4 layer runs scalenlp's or PyTorch's), which the graph calls.
    kernels = sorted({m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), str)})
    return json.dumps({"model": type(model).__qualname__, "args": dataclasses.asdict(model.args), "weights": weights,
                       "layers": layers, "kernels": kernels,
                       "kv_cache": [name_of(cache_dtype), num_blocks, block_size]}, sort_keys=True, default=str)


def artifacts_path(key: str, device: torch.device, dtype: torch.dtype) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return engine_cache_path("compiled-step", device, f"{name_of(dtype)}-{digest}", suffix=".bin")


def load(path: Path, key: str) -> tuple[bool, str | None]:
    """Load the artifacts cached at ``path`` into Inductor's caches: whether they loaded, and if a file was there
    but not used, why."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False, None
    except OSError as e:
        return False, f"could not be read ({e.strerror})"
    try:
        header, payload = _split(data)
        if header.get("key") != key:
            return False, "was written for another model or KV cache"
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return False, "is damaged (its checksum does not match)"
        # None: PyTorch could not unpickle it (it logs why); an exception: artifacts it could not install.
        if torch.compiler.load_cache_artifacts(payload) is None:
            return False, "was refused by this PyTorch"
    except Exception as e:  # a file from another version or a damaged one: compile as if it were absent
        return False, f"could not be loaded ({type(e).__name__}: {e})"
    return True, None


def save(path: Path, key: str) -> bool:
    """Write what Inductor's caches recorded in this process to ``path``; whether there was anything to write. A
    folder that cannot be written costs the next start a compile, nothing else."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    payload = saved[0]
    header = json.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "torch": torch.__version__})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, MAGIC + header.encode() + b"\n" + payload, shared=True)
    except OSError:
        return False
    return True


def _split(data: bytes) -> tuple[dict, bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not a compiled-step cache file")
    header, newline, payload = data[len(MAGIC):].partition(b"\n")
    if not newline:
        raise ValueError("truncated")
    return json.loads(header), payload
