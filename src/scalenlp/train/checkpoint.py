"""Checkpoints through torch.distributed.checkpoint (DCP), resumable exactly and under a new layout.

<root>/step-N/ holds the DCP shards of model and optimizer (keyed by parameter name, so a save from
one layout loads into another: DCP reshards), ``rng-rank{r}.pt`` per rank, and ``train_state.json``
(step, LR schedule, data position) written last. A checkpoint is written as ``step-N.tmp`` and
renamed when every rank has finished, so a crash mid-save never leaves a half checkpoint that
looks complete, and older checkpoints are pruned only after the new one exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from scalenlp.errors import UserError
from scalenlp.parallel.mesh import barrier
from scalenlp.parallel.data_parallel import local_optimizer, restore_hyperparameters

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dcp_call(fn, state: dict, path: Path, no_dist: bool) -> None:
    """dcp.save / dcp.load, without DCP's warning that a single process is a single process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        fn(state, checkpoint_id=str(path), no_dist=no_dist)


def load_full_model(path: Path, model: nn.Module) -> None:
    """Fill an unsharded model from a checkpoint saved under any layout, in this process alone
    (DCP reshards on read): how the final weights are exported."""
    state = {"model": model.state_dict()}
    _dcp_call(dcp.load, state, path, no_dist=True)
    model.load_state_dict(state["model"])


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_dicts(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    """Model and optimizer state of every part (pipeline stages on this rank), merged by parameter name.
    Flattened optimizer keys ("state.<fqn>.exp_avg") make parts merge without clobbering each other."""
    model_sd, optim_sd = {}, {}
    for part, opt in zip(parts, optimizers):
        m, o = get_state_dict(part, local_optimizer(opt), options=_options(strict=True))
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


def _options(strict: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


def _manifest(folder: Path) -> dict:
    """Size of every file and a hash of DCP's index: a truncated or overwritten checkpoint is caught
    before DCP reads it (its index is a pickle, so it should only ever read what we wrote)."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != STATE_FILE}
    metadata = folder / ".metadata"
    digest = hashlib.sha256(metadata.read_bytes()).hexdigest() if metadata.is_file() else None
    return {"files": files, "metadata_sha256": digest}


class Checkpointer:
    def __init__(self, root: Path, keep: int, rank: int):
        self.root, self.keep, self.rank = Path(root), keep, rank

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
             train_state: dict) -> Path:
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = _state_dicts(parts, optimizers)
        _dcp_call(dcp.save, {"model": model_sd, "optim": optim_sd}, tmp, no_dist=not dist.is_initialized())
        torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")
        barrier()
        if self.rank == 0:
            state = {**train_state, "step": step, "manifest": _manifest(tmp)}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            if final.exists():  # a re-save of the same step: replace it only once the new one is whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.complete()[:-self.keep]:
                shutil.rmtree(old)
        barrier()
        return final

    def load(self, path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
        """Restore model, optimizer and this rank's RNG in place; returns the saved train state."""
        try:
            train_state = json.loads((path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"checkpoint {path} is unreadable ({e}); delete it to resume from an older one") from None
        if train_state.get("manifest") != _manifest(path):
            raise UserError(f"checkpoint {path} is damaged (its files differ from what was saved); delete it "
                            f"to resume from an older one")
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
                           options=_options(strict=len(parts) == 1))
            restore_hyperparameters(opt)
        rng_file = path / f"rng-rank{self.rank}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than were saved: seeds stay as set
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return train_state
