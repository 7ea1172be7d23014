"""One training run, in this process: the learning-rate schedules, what a run writes (metrics, checkpoints kept, a
loadable export), same seed same losses bit for bit, an exact resume, checkpoints never overwritten and bad ones
refused, and bad input as one error line from the CLI's main. Several processes, torchrun, a crashed rank and the
CLI as a subprocess: tests/integration/test_data_parallel_training.py, test_reset_positions.py and
test_train_failures.py."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from scalenlp.config import TrainingConfig
from scalenlp.models.io import load_pretrained
from scalenlp.train.optim import lr_factor
from train_helpers import TINY, error_lines, main_train, read_metrics, train_here

# Dropout: the RNG state must survive a resume too.
STEPS = ["training.steps=8", "checkpoint.every=2", "checkpoint.keep=2", "training.eval_every=3", "model.dropout=0.1"]


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """Eight steps with a checkpoint every two (the last two kept) and an evaluation every three, run once for the
    tests below: read it, or copy it to change it. Its settings and its folder."""
    sets = [*TINY, f"data.path={corpus}", *STEPS]
    folder = tmp_path_factory.mktemp("train") / "run"
    train_here(folder, *sets)
    return sets, folder


def test_lr_schedules():
    cosine = TrainingConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1)  # the default: decay from the warm-up's end
    assert [lr_factor(s, cosine) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    # torchtitan's debug recipe (warmup 2, decay_ratio 0.8, linear to 0): its LambdaLR factors, step by step.
    wsd = TrainingConfig(steps=20, warmup_steps=2, min_lr_ratio=0.0, lr_decay="linear", decay_ratio=0.8)
    assert [lr_factor(s, wsd) for s in range(20)] == pytest.approx([0.5, 1, 1, 1, 1] + [1 - k / 16 for k in range(1, 16)])
    assert lr_factor(9, dataclasses.replace(wsd, decay_ratio=0.95)) == pytest.approx(1 - 7 / 18)  # at most the steps after warm-up


def test_run_writes_metrics_checkpoints_and_a_loadable_export(run):
    _, run = run
    records = read_metrics(run)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "peak_mem_bytes"):
        assert key in records[-1]
    assert records[-1]["tokens_per_sec"] > 0 and 0 < records[-1]["mfu"] < 1
    assert [r["lr"] for r in records[:2]] == pytest.approx([1.5e-3, 3e-3])  # what each step ran with: warm-up 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-6", "step-8"]  # keep=2
    assert "val_loss" in (run / "metrics.jsonl").read_text()
    assert (run / "config.toml").is_file() and (run / "export" / "config.toml").is_file()
    model = load_pretrained(run / "export")
    assert model.args.n_layers == 2
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, model.args.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_same_losses_bit_for_bit(tmp_path, run):
    sets, reference = run
    train_here(tmp_path / "again", *sets)  # in this process, whose RNGs the first run has moved on
    assert losses(tmp_path / "again") == losses(reference) and len(losses(reference)) == 8
    train_here(tmp_path / "other", *sets, "training.seed=7", "training.steps=2")  # the same warm-up steps
    assert losses(tmp_path / "other") != losses(reference)[:2]


def test_resume_equals_uninterrupted(tmp_path, run):
    sets, full = run
    record = {r["step"]: r for r in read_metrics(full)}
    # The same run, interrupted after step 6: drop everything written after that checkpoint.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-8")
    shutil.rmtree(cut / "export")
    (cut / "metrics.jsonl").write_text("")
    train_here(cut, *sets, "checkpoint.resume=true")
    resumed = read_metrics(cut)
    assert [r["step"] for r in resumed] == [7, 8]
    for r in resumed:
        assert r["loss"] == record[r["step"]]["loss"]
        assert r["grad_norm"] == record[r["step"]]["grad_norm"]
        assert r["lr"] == record[r["step"]]["lr"]


def test_checkpoints_are_never_overwritten_and_bad_ones_refused(tmp_path, run, capsys):
    sets, reference = run
    shutil.copytree(reference, tmp_path / "run")
    run = tmp_path / "run"
    before = (run / "metrics.jsonl").read_text()

    assert main_train(run, *sets) == 2  # a new run into a used folder must not clobber it
    assert "checkpoint.resume=true" in error_lines(capsys.readouterr().err)[0]
    assert (run / "metrics.jsonl").read_text() == before

    assert main_train(run, *sets, "training.steps=10", "model.flavor=debug-gpt2", "checkpoint.resume=true") == 2
    assert "does not match this run" in error_lines(capsys.readouterr().err)[0]

    (run / "checkpoints" / "step-8" / ".metadata").write_bytes(b"not a checkpoint")
    assert main_train(run, *sets, "training.steps=10", "checkpoint.resume=true") == 2
    assert error_lines(capsys.readouterr().err)


@pytest.mark.parametrize("sets, nproc, expected", [
    (["training.stepz=3"], 1, "unknown config key 'training.stepz'"),
    (["training.steps=many"], 1, "training.steps: expected int"),
    (["training.mixed_precision=fp8"], 1, "training.mixed_precision='fp8' is not one of"),
    (["parallel.tp=4"], 2, "world size 2"),  # two processes: refused before they start
    (["training.global_batch_size=3"], 2, "not divisible by the 2 data-parallel ranks"),
    (["training.seq_len=1000"], 1, "over the model's max_seq_len 256"),
    (["model.flavor=huge"], 1, "model.flavor='huge' is unknown"),
    (["data.path=/nonexistent/corpus.txt"], 1, "/nonexistent/corpus.txt"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, corpus, capsys, sets, nproc, expected):
    assert main_train(tmp_path / "run", *TINY, f"data.path={corpus}", *sets, nproc=nproc) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and expected in errors[0], errors


def test_empty_data_folder_is_reported(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main_train(tmp_path / "run", *TINY, f"data.path={tmp_path / 'empty'}") == 2
    assert len(error_lines(capsys.readouterr().err)) == 1
