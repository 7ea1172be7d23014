"""Trainer end to end through the CLI: determinism, exact resume, DDP parity, failures."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from scalenlp.config import TrainingConfig
from scalenlp.models.io import load_pretrained
from scalenlp.train.optim import lr_factor
from train_helpers import (TINY, HANG_GUARD_S, cli_env, error_lines, read_evaluations, read_metrics, run_train,
                           write_corpus)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def test_lr_schedules():
    cosine = TrainingConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1)  # the default: decay from the warm-up's end
    assert [lr_factor(s, cosine) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    # torchtitan's debug recipe (warmup 2, decay_ratio 0.8, linear to 0): its LambdaLR factors, step by step.
    wsd = TrainingConfig(steps=20, warmup_steps=2, min_lr_ratio=0.0, lr_decay="linear", decay_ratio=0.8)
    assert [lr_factor(s, wsd) for s in range(20)] == pytest.approx([0.5, 1, 1, 1, 1] + [1 - k / 16 for k in range(1, 16)])
    assert lr_factor(9, dataclasses.replace(wsd, decay_ratio=0.95)) == pytest.approx(1 - 7 / 18)  # at most the steps after warm-up


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_same_seed_same_losses_bit_for_bit(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=5"]
    run_train(tmp_path / "a", *sets)
    run_train(tmp_path / "b", *sets)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(losses(tmp_path / "a")) == 5
    other = run_train(tmp_path / "c", *sets, "training.seed=7")
    assert other.returncode == 0 and losses(tmp_path / "c") != losses(tmp_path / "a")


def test_resume_equals_uninterrupted(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=8", "checkpoint.every=4", "checkpoint.keep=3",
            "model.dropout=0.1"]  # dropout: the RNG state must survive the resume too
    full = tmp_path / "full"
    run_train(full, *sets)
    reference = read_metrics(full)
    record = {r["step"]: r for r in reference}

    # The same run, interrupted after step 4: drop everything written after that checkpoint.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-8")
    shutil.rmtree(cut / "export")
    (cut / "metrics.jsonl").write_text("")
    run_train(cut, *sets, "checkpoint.resume=true")
    resumed = read_metrics(cut)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for r in resumed:
        assert r["loss"] == record[r["step"]]["loss"]
        assert r["grad_norm"] == record[r["step"]]["grad_norm"]
        assert r["lr"] == record[r["step"]]["lr"]


def test_ddp_two_processes_match_single_process(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=4"]
    run_train(tmp_path / "single", *sets)
    run_train(tmp_path / "ddp", *sets, nproc=2)
    single, ddp = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in ddp] == [1, 2, 3, 4]
    for a, b in zip(single, ddp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # Gradient accumulation (2 micro-batches per rank) is the same optimisation again.
    run_train(tmp_path / "accum", *sets, "training.micro_batch_size=1", nproc=2)
    for a, b in zip(single, read_metrics(tmp_path / "accum")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_plain_torchrun_launch_is_the_same_job(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=3", "checkpoint.export=false"]
    run_train(tmp_path / "ours", *sets, nproc=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "scalenlp", "train", "--run-dir", str(tmp_path / "torchrun")]
    for s in sets:
        torchrun += ["--set", s]
    proc = subprocess.run(torchrun, capture_output=True, text=True, env=cli_env(), timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "torchrun") == losses(tmp_path / "ours")


def test_run_writes_metrics_checkpoints_and_a_loadable_export(tmp_path, corpus):
    run = tmp_path / "run"
    run_train(run, *TINY, f"data.path={corpus}", "training.steps=6", "checkpoint.every=2", "checkpoint.keep=2",
              "training.eval_every=3")
    records = read_metrics(run)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "peak_mem_bytes"):
        assert key in records[-1]
    assert records[-1]["tokens_per_sec"] > 0 and 0 < records[-1]["mfu"] < 1
    assert [r["lr"] for r in records[:2]] == pytest.approx([1.5e-3, 3e-3])  # what each step ran with: warm-up 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4", "step-6"]  # keep=2
    assert "val_loss" in (run / "metrics.jsonl").read_text()
    assert (run / "config.toml").is_file() and (run / "export" / "config.toml").is_file()
    model = load_pretrained(run / "export")
    assert model.args.n_layers == 2
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, model.args.vocab_size) and torch.isfinite(logits).all()


def test_reset_positions_restart_each_document_under_any_layout(tmp_path):
    docs = tmp_path / "docs.jsonl"  # documents of 3-12 words: several start inside each 32-token window
    words = "the of and to a in is it you that he was for on are with as his they be at one have this".split()
    docs.write_text("".join(json.dumps({"text": " ".join(words[(i * 5 + j) % len(words)] for j in range(3 + i % 10))})
                            + "\n" for i in range(2000)))
    sets = [*TINY, f"data.path={docs}", "training.steps=8", "training.eval_every=8", "checkpoint.export=false"]
    run_train(tmp_path / "plain", *sets)
    run_train(tmp_path / "reset", *sets, "data.reset_positions=true")
    run_train(tmp_path / "reset_tp", *sets, "data.reset_positions=true", "parallel.tp=2", nproc=2)
    # Four microbatches of one row: each stage must get its own microbatch's positions.
    run_train(tmp_path / "reset_pp", *sets, "data.reset_positions=true", "parallel.pp=2", "parallel.pp_microbatches=4",
              nproc=2)
    plain, reset, tp, pp = (losses(tmp_path / run) for run in ("plain", "reset", "reset_tp", "reset_pp"))
    (val_plain,), (val_reset,), (val_pp,) = ([r["val_loss"] for r in read_evaluations(tmp_path / run)]
                                             for run in ("plain", "reset", "reset_pp"))
    # The layouts agree to ~5e-7 here; by step 8 the positions move the loss by up to 3e-4 (evaluation's too).
    tol = 2e-5
    assert max(abs(a - b) for a, b in zip(plain, reset)) > 5 * tol and abs(val_plain - val_reset) > 5 * tol
    assert tp == pytest.approx(reset, abs=tol)
    assert pp == pytest.approx(reset, abs=tol) and val_pp == pytest.approx(val_reset, abs=tol)


@pytest.mark.parametrize("sets, nproc, expected", [
    (["training.stepz=3"], 1, "unknown config key 'training.stepz'"),
    (["training.steps=many"], 1, "training.steps: expected int"),
    (["training.mixed_precision=fp8"], 1, "training.mixed_precision='fp8' is not one of"),
    (["parallel.tp=4"], 2, "world size 2"),
    (["training.global_batch_size=3"], 2, "not divisible by the 2 data-parallel ranks"),
    (["training.seq_len=1000"], 1, "over the model's max_seq_len 256"),
    (["model.flavor=huge"], 1, "model.flavor='huge' is unknown"),
    (["data.path=/nonexistent/corpus.txt"], 1, "/nonexistent/corpus.txt"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, corpus, sets, nproc, expected):
    proc = run_train(tmp_path / "run", *TINY, f"data.path={corpus}", *sets, nproc=nproc, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    assert errors and expected in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_data_folder_is_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_train(tmp_path / "run", *TINY, f"data.path={tmp_path / 'empty'}", check=False)
    assert proc.returncode == 2 and error_lines(proc.stderr) and "Traceback" not in proc.stderr


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_checkpoints_are_never_overwritten_and_bad_ones_refused(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.every=2"]
    run = tmp_path / "run"
    run_train(run, *sets)
    before = (run / "metrics.jsonl").read_text()

    again = run_train(run, *sets, check=False)  # a new run into a used folder must not clobber it
    assert again.returncode == 2 and "checkpoint.resume=true" in error_lines(again.stderr)[0]
    assert (run / "metrics.jsonl").read_text() == before

    mismatch = run_train(run, *sets, "training.steps=4", "model.flavor=debug-gpt2", "checkpoint.resume=true",
                         check=False)
    assert mismatch.returncode == 2 and "does not match this run" in error_lines(mismatch.stderr)[0]

    (run / "checkpoints" / "step-2" / ".metadata").write_bytes(b"not a checkpoint")
    corrupt = run_train(run, *sets, "training.steps=4", "checkpoint.resume=true", check=False)
    assert corrupt.returncode == 2 and error_lines(corrupt.stderr), corrupt.stderr
    assert "Traceback" not in corrupt.stderr


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_a_crashed_rank_does_not_leave_the_others_hanging(tmp_path, corpus):
    cmd = [sys.executable, "-m", "scalenlp", "train", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    for s in [*TINY, f"data.path={corpus}", "training.steps=100000", "training.timeout_s=60"]:
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks are in the loop
        assert launcher.poll() is None, launcher.communicate()[1]
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-f", "-P", str(launcher.pid), "scalenlp"], capture_output=True, text=True)
    pids = [int(p) for p in workers.stdout.split()]
    assert len(pids) == 2, workers
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode != 0
    assert error_lines(stderr) and "failed" in error_lines(stderr)[-1]


def test_peak_memory_is_the_process_own_not_its_spawner():
    """Linux carries getrusage's peak across exec: a run started from a large process must not report it."""
    ballast = torch.ones(256 * 2**20)  # 1 GiB resident in this process
    probe = "from scalenlp.hardware import resident_bytes; print(resident_bytes(peak=True))"
    child_peak = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                    check=True).stdout)
    assert child_peak < 0.8 * ballast.numel() * ballast.element_size()
