"""Issue 32's smaller reproductions on the training and planning side, each now one error line (or a bounded answer)
instead of a traceback: a full disk during the final export, and what the other tests of this file name."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch
from safetensors import SafetensorError

from scalenlp.errors import UserError
from scalenlp.loader import checkpoint_kind
from scalenlp.models import io as model_io
from scalenlp.plan import search
from scalenlp.plan.planner import plan
from train_helpers import TINY, error_lines, main_train, train_here


def test_a_full_disk_during_the_final_export_is_one_line_and_leaves_no_partial_folder(tmp_path, corpus, monkeypatch):
    real = model_io.save_file

    def full_disk(state, path):  # the weights' first bytes land, then the device is full (safetensors' own error)
        with open(path, "wb") as f:
            f.write(b"partial")
        raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error 28) at "
                              f"path {path!r}")

    monkeypatch.setattr(model_io, "save_file", full_disk)
    run = tmp_path / "run"
    with pytest.raises(UserError, match="no space left on the device while writing .*export; removed the partial "
                                        "export.tmp.*step-2.*checkpoint.resume=true") as e:
        train_here(run, *TINY, f"data.path={corpus}", "training.steps=2")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("export")) == []
    monkeypatch.setattr(model_io, "save_file", real)
    train_here(run, *TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.resume=true")  # as the line says
    assert (run / "export" / model_io.WEIGHTS).is_file() and not (run / "export.tmp").exists()


def test_a_huge_global_batch_is_planned_without_counting_up_to_it(monkeypatch):
    """`plan --global-batch 1000000000000` enumerated every number up to the batch for its micro-batch sizes; the
    search now only takes divisors of device counts, and a batch above what the config takes is one line."""
    real = search.divisors

    def divisors_of_device_counts(n):
        assert n <= search.MAX_DEVICES, f"divisors({n}) counts up to a batch"
        return real(n)

    monkeypatch.setattr(search, "divisors", divisors_of_device_counts)
    result = plan("debug", 128, 10**12, 8)
    assert result.layouts and all(p.layout.microbatch <= 10**12 for p in result.layouts)
    assert search._microbatches(3 * 2**20) == [2**k for k in range(13)] + [3 * 2**20]
    assert search._microbatches(96) == [1, 2, 4, 8, 16, 32, 96] and search._microbatches(64) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(UserError, match="--global-batch must be between 1 and"):
        plan("debug", 128, 2**64, 8)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("planted", ["a pickled payload", "a state of the wrong shape", "not a torch file"])
def test_a_planted_random_state_is_refused_in_one_line(tmp_path, corpus, capsys, planted):
    """rng-rank0.pt replaced, with the checksum in train_state.json to match (as someone who can write the run
    folder would): the resume stops at one line naming the file, before loading anything, and runs nothing."""
    sets = [*TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.every=2"]
    run, marker = tmp_path / "run", tmp_path / "ran"
    train_here(run, *sets)
    folder = run / "checkpoints" / "step-2"
    rng = folder / "rng-rank0.pt"
    if planted == "a pickled payload":
        rng.write_bytes(pickle.dumps(Payload(marker)))
    elif planted == "a state of the wrong shape":
        torch.save({"cpu": torch.zeros(3, dtype=torch.uint8)}, rng)
    else:
        rng.write_bytes(b"\xff" * 64)
    state = json.loads((folder / "train_state.json").read_text())
    state["sha256"][rng.name] = hashlib.sha256(rng.read_bytes()).hexdigest()
    (folder / "train_state.json").write_text(json.dumps(state))
    capsys.readouterr()

    assert main_train(run, *sets, "training.steps=4", "checkpoint.resume=true") == 2
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "refusing rng-rank0.pt" in error_lines(err)[0]
    assert "Traceback" not in err and "weights_only" not in err and not marker.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]  # nothing newer written


def test_a_folder_that_is_not_a_model_says_what_it_holds(tmp_path):
    """A run folder whose export was being replaced when the machine went down: export/ already renamed to
    export.old/, the new one still export.tmp/. The line names both and the way back."""
    run = tmp_path / "run"
    for name in ("export.old", "export.tmp"):
        (run / name).mkdir(parents=True)
    (run / "export.old" / model_io.ARGS).write_text("{}")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(UserError) as e:
        checkpoint_kind(run)
    assert str(e.value).endswith("it holds export.old/, export.tmp/, metrics.jsonl (export.old/ is the previous "
                                 "export, left by an interrupted write: rename it to export/ to load it)")
    (run / "empty").mkdir()
    with pytest.raises(UserError, match="; it is empty$"):
        checkpoint_kind(run / "empty")
