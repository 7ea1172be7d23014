"""Checkpoints never turn good state into bad: a damaged shard is named and a failed resume writes nothing, a
planted index runs nothing, a full disk keeps the previous checkpoint, and an asynchronous save is reported once
it is whole. (Non-finite steps: test_nonfinite_steps.py; SIGTERM: test_sigterm.py; config values:
test_out_of_range_values.py.)"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from scalenlp.errors import UserError
from scalenlp.train import trainer as trainer_module
from scalenlp.train.checkpoint import _SafePlanner, load_full_model, read_train_state
from train_helpers import TINY, error_lines, main_train, train_here


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its modification time and content."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in folder.rglob("*") if p.is_file()}


def in_process(run_dir: Path, corpus: Path, *sets: str):
    return train_here(run_dir, *TINY, f"data.path={corpus}", *sets)


# -- checkpoints: checksums, planted payloads, resumes that fail before writing ---------------------------

@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, corpus):
    """Two steps and their checkpoint, run once for the tests below (the first run in this process pays its imports
    here): copy it to change it. Its settings and its folder."""
    sets = [*TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.every=2"]
    run = tmp_path_factory.mktemp("two_steps") / "run"
    train_here(run, *sets)
    return sets, run


def test_a_shard_damaged_in_place_is_named_and_nothing_is_written(tmp_path, two_steps, capsys):
    sets, trained = two_steps
    run = shutil.copytree(trained, tmp_path / "run")
    before = snapshot(run)
    capsys.readouterr()

    assert main_train(run, *sets, "training.steps=4", "training.global_batch_size=8", "checkpoint.resume=true") == 2
    assert "global_batch_size=4" in error_lines(capsys.readouterr().err)[0]
    assert snapshot(run) == before  # config.toml included: every check passes before anything is written

    shard = run / "checkpoints" / "step-2" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # same size, 100 KB of 0xff inside
        f.seek(size // 4)
        f.write(b"\xff" * min(100_000, size // 2))
    assert main_train(run, *sets, "training.steps=4", "checkpoint.resume=true") == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "__0_0.distcp" in errors[0]
    assert {k: v for k, v in snapshot(run).items() if "__0_0" not in k} == \
        {k: v for k, v in before.items() if "__0_0" not in k}


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_metadata(folder: Path, payload: bytes) -> None:
    """Replace the checkpoint's index and its checksum, as someone who can write the run folder would."""
    (folder / ".metadata").write_bytes(payload)
    state = json.loads((folder / "train_state.json").read_text())
    state["sha256"][".metadata"] = hashlib.sha256(payload).hexdigest()
    (folder / "train_state.json").write_text(json.dumps(state))


def test_a_planted_checkpoint_index_runs_nothing(tmp_path, two_steps, monkeypatch):
    folder = shutil.copytree(two_steps[1] / "checkpoints" / "step-2", tmp_path / "step-2")
    marker = tmp_path / "ran"

    plant_metadata(folder, pickle.dumps(Payload(marker)))
    with pytest.raises(UserError, match="refusing its .metadata"):
        read_train_state(folder)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(BaseException):  # noqa: B017 DCP wraps the refusal; what matters is that nothing ran
        load_full_model(folder, net)
    assert not marker.exists()

    # A module whose import has a side effect: refused by name, never imported.
    (tmp_path / "planted_module.py").write_text(f"open({str(marker)!r}, 'w')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plant_metadata(folder, b"\x80\x04cplanted_module\nanything\n.")
    with pytest.raises(UserError, match="planted_module.anything is not part of a checkpoint index"):
        read_train_state(folder)
    assert not marker.exists() and "planted_module" not in sys.modules

    # Non-tensor values inside the shards are read with weights_only=True.
    with pytest.raises(pickle.UnpicklingError):
        _SafePlanner().load_bytes(None, io.BytesIO(pickle.dumps(Payload(marker))))
    assert not marker.exists()


# -- a full disk ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True])  # True: the write fails in DCP's writer thread
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, corpus, monkeypatch, async_save):
    """ENOSPC simulated in-process: DCP's file streams for step-4 fail after their first bytes."""
    real = FileSystem.create_stream

    class FullDisk:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            self.stream.write(bytes(data)[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real(self, path, mode) as stream:
            yield FullDisk(stream) if "step-4.tmp" in str(path) and "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    run = tmp_path / "run"
    with pytest.raises(UserError, match="no space left.*removed the partial step-4.tmp, kept step-2") as e:
        in_process(run, corpus, "training.steps=4", "checkpoint.every=2", f"checkpoint.async_save={async_save}")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    read_train_state(run / "checkpoints" / "step-2")  # whole


def test_an_asynchronous_save_is_logged_as_saved_once_it_is_whole(tmp_path, corpus, monkeypatch):
    lines = []

    def log(self, msg):  # each line with whether the checkpoint it names is whole as it is logged
        if msg.startswith("checkpoint saved: "):
            msg = f"{msg} (whole: {(Path(msg.split(': ', 1)[1]) / 'train_state.json').is_file()})"
        lines.append(msg)

    monkeypatch.setattr(trainer_module.Trainer, "log", log)
    run = tmp_path / "run"
    in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "checkpoint.async_save=true")
    about_saves = [line for line in lines if "checkpoint" in line and "step-" in line]
    assert about_saves == ["saving checkpoint step-2 asynchronously",
                           f"checkpoint saved: {run / 'checkpoints' / 'step-2'} (whole: True)",
                           f"checkpoint saved: {run / 'checkpoints' / 'step-4'} (whole: True)"]  # the last step waits


