"""training.mixed_precision=fp16: autocast fp16 with dynamic loss scaling, on the CPU (torch runs fp16 autocast
there). An overflowing step changes no weight and halves the scale; the loss curve follows fp32's; a resume keeps
the scale; under DDP and ZeRO-3 an overflow in one rank's gradient is skipped by every rank
(SCALENLP_FAULT=overflow)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from scalenlp.train.tasks import load_config
from scalenlp.train.trainer import Trainer
from train_helpers import TINY, error_lines, main_train, read_metrics, run_train, train_here

# The peak is given: MFU is not under test, and measuring this CPU's fp16 matmul rate takes ~90 s (fp16 matmuls
# run ~60x slower than fp32 ones here).
FP16 = [*TINY, "training.mixed_precision=fp16", "training.peak_tflops=1", "checkpoint.export=false"]
# fp16 against fp32 over six steps of the debug model, relative, at any step: measured at most 6.5e-6 for the
# loss and 3.5e-5 for the gradient norm (clipping a gradient still scaled by 2**16 would log a norm 2**16 larger).
CURVE_TOLERANCE = 3e-4


def scales(records: list[dict]) -> list[tuple[float, int]]:
    return [(r["loss_scale"], r["skipped_steps"]) for r in records]


def test_fp16_overflow_skips_the_update_and_halves_the_scale(tmp_path, corpus):
    # 2**60 times a gradient of ~1e-3 is far above fp16's largest value, 65504: the first step overflows.
    cfg = load_config(None, [*FP16, f"data.path={corpus}", "training.steps=1", f"training.loss_scale_init={2.0**60}"])
    trainer = Trainer(cfg, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}
    with trainer.watchdog:
        [record] = trainer.fit()
    assert (record["loss_scale"], record["skipped_steps"]) == (2.0**59, 1)
    assert math.isfinite(record["loss"])  # the forward pass was fine; only its gradient was not
    for name, p in trainer.model_parts[0].named_parameters():
        assert torch.equal(p, before[name]), name


def test_fp16_follows_fp32_and_resumes_with_its_scale(tmp_path, corpus):
    sets = [*FP16, f"data.path={corpus}", "training.steps=6", "checkpoint.every=3", "checkpoint.keep=2",
            "training.loss_scale_interval=2"]
    train_here(tmp_path / "fp32", *[s for s in sets if "mixed_precision" not in s and "loss_scale" not in s])
    train_here(tmp_path / "fp16", *sets)
    fp32, fp16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "fp16")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in fp16] == pytest.approx([r[key] for r in fp32], rel=CURVE_TOLERANCE), key
    assert [r["loss"] for r in fp16] != [r["loss"] for r in fp32]  # computed in fp16 indeed
    # No overflow at the default 2**16: the scale doubles every loss_scale_interval=2 steps.
    assert scales(fp16) == [(2.0**16 * 2 ** (step // 2), 0) for step in range(1, 7)]

    cut = tmp_path / "cut"  # the same run, interrupted after step 3
    shutil.copytree(tmp_path / "fp16", cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    (cut / "metrics.jsonl").write_text("")
    train_here(cut, *sets, "checkpoint.resume=true")
    resumed = read_metrics(cut)
    # The scale and its count towards growing carry over: restarted at 2**16, step 4 would log 2**17.
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [(r["step"], r["loss"], r["grad_norm"])
                                                                         for r in fp16[3:]]
    assert scales(resumed) == scales(fp16[3:])


@pytest.mark.slow
def test_fp16_ranks_agree_on_an_overflow_of_one_rank(tmp_path, corpus, monkeypatch):
    """One element of rank 1's gradient overflows at step 2: under DDP, ZeRO-3, tensor and pipeline parallelism
    every rank skips that step and halves its scale, and the losses are those of one process whose step 2
    overflowed (under TP and PP rank 1 holds other parameters than rank 0: its overflow must still stop rank 0)."""
    sets = [*FP16, f"data.path={corpus}", "training.steps=4", "checkpoint.every=0"]
    monkeypatch.setenv("SCALENLP_FAULT", "overflow@0:2")
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    assert scales(single) == [(2.0**16, 0), (2.0**15, 1), (2.0**15, 1), (2.0**15, 1)]
    monkeypatch.setenv("SCALENLP_FAULT", "overflow@1:2")
    layouts = {"ddp": ["parallel.data_parallel=ddp"], "zero3": ["parallel.data_parallel=zero3"],
               "tp": ["parallel.tp=2"], "pp": ["parallel.pp=2", "parallel.pp_microbatches=2"]}
    for layout, options in layouts.items():
        run_train(tmp_path / layout, *sets, *options, nproc=2)
        got = read_metrics(tmp_path / layout)
        assert scales(got) == scales(single), layout
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in single], rel=1e-5), layout


@pytest.mark.parametrize("sets, expected", [
    (["training.mixed_precision=fp16", "training.param_dtype=bfloat16"], "fp16 contradicts training.param_dtype"),
    (["training.loss_scale_interval=100"], "training.loss_scale_interval is set but only fp16 scales its loss"),
    (["training.mixed_precision=fp16", "training.loss_scale_backoff=1"], "training.loss_scale_backoff must be in"),
    (["training.mixed_precision=fp16", "training.loss_scale_growth=1"], "training.loss_scale_growth must be in"),
])
def test_bad_fp16_settings_are_one_error_line(tmp_path, corpus, capsys, sets, expected):
    assert main_train(tmp_path / "run", *TINY, f"data.path={corpus}", *sets) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and expected in errors[0], errors
