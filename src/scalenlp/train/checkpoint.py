"""Checkpoints through torch.distributed.checkpoint (DCP), resumable exactly and under a new layout.

<root>/step-N/ holds the DCP shards of model and optimizer (keyed by parameter name, so a save from
one layout loads into another: DCP reshards), ``rng-rank{r}.pt`` per rank, and ``train_state.json``
(step, LR schedule, data position, the SHA-256 of every other file) written last. A checkpoint is
written as ``step-N.tmp`` and renamed when every rank has finished, so a crash mid-save never leaves
a half checkpoint that looks complete, and older checkpoints are pruned only after the new one exists.

Asynchronous saves (checkpoint.async_save): DCP copies the state to host memory, then writes it from a
thread over a process group of its own while training goes on. The train state, with its checksums, is
written and the folder renamed only once every rank's write has finished (DCP's future on rank 0 resolves
after it has gathered every rank's result), so an unfinished write is a ``.tmp`` folder like a crashed one.

Trust: reading a checkpoint runs no code from it. DCP keeps its index (``.metadata``) and non-tensor
values as pickles and reads them with plain ``pickle``; here the index goes through an unpickler that
only builds DCP's own metadata classes, and the values through ``torch.load(weights_only=True)``, as
tensors and RNG states already do. The checksums catch damage (a disk, a copy), not an attacker, who
can rewrite them along with the files; such a checkpoint can hold any weights, as any model file can.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from scalenlp.errors import UserError
from scalenlp.files import replace_folder
from scalenlp.models.io import disk_full
from scalenlp.parallel.data_parallel import local_optimizer, restore_hyperparameters
from scalenlp.parallel.mesh import barrier

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes, dtypes and layouts, and paths; any other name (os.system,
    builtins.eval, ...) is refused, so a planted index cannot run code."""

    def find_class(self, module: str, name: str):
        # Decide on the names before looking anything up: importing an unknown module can run code.
        if (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath")}:
            return super().find_class(module, name)
        found = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
        if isinstance(found, type) and found.__module__ == module:  # a class DCP defines for its index
            return found
        if module == "torch" and isinstance(found := getattr(torch, name, None), torch.dtype):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the index read by ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values (learning rates, betas) with ``weights_only=True``.
    The parent unpickles with ``weights_only=False``: it gets the value back re-pickled by us."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        checked = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _dcp_call(fn, state: dict, path: Path, no_dist: bool) -> None:
    """dcp.save / dcp.load (through the safe reader), without DCP's warning that a single process is a
    single process."""
    safe = {"storage_reader": _SafeReader(path), "planner": _SafePlanner()} if fn is dcp.load else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        fn(state, checkpoint_id=str(path), no_dist=no_dist, **safe)


def load_full_model(path: Path, model: nn.Module) -> None:
    """Fill an unsharded model from a checkpoint saved under any layout, in this process alone
    (DCP reshards on read): how the final weights are exported. A model with frozen weights (a LoRA base)
    takes only its trained ones, all that such a checkpoint holds."""
    frozen, trained = _has_frozen(model), _trained_names(model)
    state = {"model": {k: v for k, v in model.state_dict().items() if not frozen or k in trained}}
    _dcp_call(dcp.load, state, path, no_dist=True)
    model.load_state_dict(state["model"], strict=not frozen)


def _has_frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _trained_names(model: nn.Module) -> set[str]:
    """Every name of every parameter that trains, a shared one under each of its names."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _failures(e: BaseException) -> list[BaseException]:
    """The exception and what it wraps: its causes, and each rank's failure inside DCP's CheckpointException."""
    found, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is f for f in found):
            continue
        found.append(x)
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            todo += [failure for failure, _ in x.failures.values()]
    return found


def _disk_full(e: BaseException) -> bool:
    return any(disk_full(x) for x in _failures(e))


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _read_rng(file: Path) -> dict | None:
    """A rank's saved random state; None without one (resuming on more ranks than were saved: seeds stay as set).
    torch's safe loader reads it, and whatever else the file holds is refused in one line: torch's own refusal is
    a traceback that suggests loading the file unsafely."""
    if not file.is_file():
        return None
    try:
        rng = torch.load(file, weights_only=True)
    except Exception:  # noqa: BLE001 - whatever a hostile or damaged file raises, the answer is a refusal
        rng = None
    cpu = rng.get("cpu") if isinstance(rng, dict) else None
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.shape == torch.get_rng_state().shape
            and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 for v in rng.values())):
        raise UserError(f"checkpoint {file.parent}: refusing {file.name}, which is not a random-number state this "
                        f"program saved (only torch's uint8 generator states are read from it); delete "
                        f"{file.parent} to resume from an older one")
    return rng


def _state_dicts(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    """Model and optimizer state of every part (pipeline stages on this rank), merged by parameter name.
    Flattened optimizer keys ("state.<fqn>.exp_avg") make parts merge without clobbering each other."""
    model_sd, optim_sd = {}, {}
    for part, opt in zip(parts, optimizers):
        frozen = _has_frozen(part)
        m, o = get_state_dict(part, local_optimizer(opt), options=_options(strict=True, frozen=frozen))
        if frozen:  # DCP drops a frozen weight under its first name only: a tied output projection's second stays
            trained = _trained_names(getattr(part, "module", part))  # DDP's wrapper prefixes "module."
            m = {k: v for k, v in m.items() if k in trained}
        model_sd.update(m)
        optim_sd.update(o)
    return model_sd, optim_sd


def _tied_copy_keys(parts: list[nn.Module], optim_sd: dict) -> dict[str, str]:
    """{key of ``optim_sd``: checkpoint key} for the optimizer entries of a tied embedding's copy on a
    pipeline's last stage (see pipeline.py). One process keys the tied weight's optimizer state by
    its first name alone (state.tok_embeddings.weight.*; its model state has both names), so that
    stage reads the embedding's entries, which every checkpoint has and which equal its own."""
    last = parts[-1]
    args = getattr(last, "args", None)
    if args is None or not args.tie_embeddings or last.tok_embeddings is not None or last.output is None:
        return {}
    prefixes = ("state.output.weight.", "param_groups.output.weight.")
    return {k: k.replace(".output.weight.", ".tok_embeddings.weight.", 1) for k in optim_sd if k.startswith(prefixes)}


def _options(strict: bool, frozen: bool = False) -> StateDictOptions:
    """With ``frozen`` weights (a LoRA run's base, rebuilt from model.init) only trained ones are saved and
    loaded, so loading cannot be strict about the rest."""
    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict and not frozen,
                            ignore_frozen_params=frozen)


def _manifest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file but the train state that lists them: a damaged file is named before DCP reads it."""
    digests = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != STATE_FILE:
            with open(p, "rb") as f:
                digests[p.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def read_train_state(path: Path) -> dict:
    """The train state of a checkpoint whose every file is as it was saved, its index safe to read;
    otherwise one line that names what is wrong."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        saved = state["sha256"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); delete it to resume from an "
                        f"older one") from None
    found = _manifest(path)
    for name in sorted(set(saved) | set(found)):
        if saved.get(name) != found.get(name):
            what = "is missing" if name not in found else "was not saved with it" if name not in saved else \
                "differs from what was saved (SHA-256 mismatch)"
            raise UserError(f"checkpoint {path} is damaged: {name} {what}; delete {path} to resume from an "
                            f"older one")
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - whatever a hostile pickle raises, the answer is a refusal
        raise UserError(f"checkpoint {path}: refusing its .metadata ({e}); a checkpoint index holds only "
                        f"DCP's metadata, so this file was replaced; delete {path}") from None
    return state


class Checkpointer:
    def __init__(self, root: Path, keep: int, rank: int, async_save: bool = False,
                 log: Callable[[str], None] = lambda line: None):
        """``log`` gets rank 0's lines: a save that starts writing on, and each checkpoint once it is whole."""
        self.root, self.keep, self.rank, self.async_save, self.log = Path(root), keep, rank, async_save, log
        self._pending = None  # an asynchronous save: (step, tmp folder, DCP's future, train state)
        self._group = None  # the process group asynchronous writes run over, off the training's own

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every finished checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and (d / STATE_FILE).is_file():
                found.append((int(m.group(1)), d))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             train_state: dict, wait: bool = True) -> Path:
        """Write checkpoint ``step``; with async_save, return once the state is copied unless ``wait``
        (the folder named exists when ``wait`` returns or a later save starts)."""
        self.wait()  # one write at a time: the previous one is whole before the next begins
        tmp = self.root / f"step-{step}.tmp"
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            barrier()
            model_sd, optim_sd = _state_dicts(parts, optimizers)
            # Before the write starts: the RNG state is this step's, and on disk before any rank's write ends.
            torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")
            state = {"model": model_sd, "optim": optim_sd}
            if self.async_save:
                self._pending = (step, tmp, self._async_write(state, tmp), train_state)
            else:
                _dcp_call(dcp.save, state, tmp, no_dist=not dist.is_initialized())
                barrier()
                self._pending = (step, tmp, None, train_state)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed(step, tmp, e)
        if wait or not self.async_save:
            self.wait()
        elif self.rank == 0:
            self.log(f"saving checkpoint step-{step} asynchronously")
        return self.root / f"step-{step}"

    def _async_write(self, state: dict, tmp: Path):
        if dist.is_initialized() and self._group is None:
            # Training's collectives and the writer thread's must not interleave on one group.
            self._group = dist.new_group(backend="gloo")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group,
                                  no_dist=not dist.is_initialized())

    def poll(self) -> None:
        """At a step boundary: finish an asynchronous save whose write is done, on rank 0 (no collective)."""
        if self._pending is not None and self._pending[2] is not None and self._pending[2].done():
            self._finish()

    def wait(self) -> None:
        """Finish the save in progress, if any; every rank calls it at the same point."""
        if self._pending is not None:
            self._finish()
        if self.async_save:
            barrier()  # rank 0 may have finished it in poll() already: the others still meet it here

    def _finish(self) -> None:
        step, tmp, future, train_state = self._pending
        self._pending = None
        try:
            if future is not None:
                future.result()
        except BaseException as e:
            self._failed(step, tmp, e)
        if self.rank == 0:
            final = self.root / f"step-{step}"
            state = {**train_state, "step": step, "sha256": _manifest(tmp)}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            replace_folder(tmp, final)  # a re-save of the same step replaces it only once the new one is whole
            for _, old in self.complete()[:-self.keep]:  # the new one is complete now: it is never pruned
                shutil.rmtree(old)
            self.log(f"checkpoint saved: {final}")
        if future is None:
            barrier()

    def _failed(self, step: int, tmp: Path, e: BaseException):
        shutil.rmtree(tmp, ignore_errors=True)  # every failing rank tries: none knows the others failed
        if _disk_full(e):
            kept = self.latest()
            raise UserError(f"no space left on the device while saving checkpoint step-{step} in {self.root}; "
                            f"removed the partial {tmp.name}, kept {kept.name if kept else 'no older checkpoint'}; "
                            f"free space, then continue with --set checkpoint.resume=true") from None
        raise e

    def load(self, path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
        """Restore model, optimizer and this rank's RNG in place from a checkpoint that ``read_train_state``
        has verified; returns the saved train state."""
        train_state = json.loads((path / STATE_FILE).read_text())
        rng = _read_rng(path / f"rng-rank{self.rank}.pt")  # before anything is loaded: it may be refused
        model_sd, optim_sd = _state_dicts(parts, optimizers)
        saved_as = _tied_copy_keys(parts, optim_sd)
        wanted = {saved_as.get(k, k): v for k, v in optim_sd.items()}
        try:
            _dcp_call(dcp.load, {"model": model_sd, "optim": wanted}, path, no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures in a BaseException
            # (missing keys, shapes, corrupt files); its last line names the cause.
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise UserError(f"checkpoint {path} does not match this run ({reason[:300]}); resume with the model "
                            f"settings it was saved with, or start a new --run-dir") from None
        # DCP fills tensors in place but replaces other values (learning rates): take all back by key.
        optim_sd = {k: wanted[saved_as.get(k, k)] for k in optim_sd}
        for part, opt in zip(parts, optimizers):
            # Each part takes its own keys from the merged dicts, so strictness only holds for a single part.
            set_state_dict(part, local_optimizer(opt), model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=_options(strict=len(parts) == 1, frozen=_has_frozen(part)))
            restore_hyperparameters(opt)
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return train_state
