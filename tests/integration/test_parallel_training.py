"""The trainer (`scalenlp train --nproc N`) under parallel layouts: the same losses, gradient norms and evaluations
as one process (its layout errors before any process starts: tests/unit/test_launch_errors.py)."""

from __future__ import annotations

import pytest

from train_helpers import TINY, read_evaluations, read_metrics, run_train, train_here

# Each test runs `scalenlp train` on two or four processes (20-40 s here), its one-process reference in this one.
pytestmark = pytest.mark.slow


def test_2d_layout_trains_and_evaluates_like_one_process(tmp_path, corpus):
    """ZeRO-2 x TP 2 with sequence parallelism and gradient accumulation, on 4 processes. (A pp2 gpipe run was here
    too: the trainer's pipeline under gpipe, evaluation included, is test_reset_positions' pp run; the schedule's
    numerics against one process, benchmarks/parity.py's "pp2 gpipe" in test_parallel_parity.)"""
    sets = [*TINY, f"data.path={corpus}", "training.steps=4", "training.eval_every=2", "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, nproc, layout in [
        ("dp2xtp2", 4, ["parallel.tp=2", "parallel.data_parallel=zero2", "parallel.sequence_parallel=true",
                        "training.micro_batch_size=1"]),
    ]:
        run_train(tmp_path / name, *sets, *layout, nproc=nproc)
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
        assert len(read_evaluations(tmp_path / name)) == 2, name


def test_tensor_parallel_gpt2_family_trains_like_one_process(tmp_path, corpus):
    # GPT-2 options leave some parameters plain tensors under TP (the learned position table,
    # LayerNorms): the optimizer must keep them apart from the DTensors. An odd vocabulary shards unevenly
    # (the first rank holds one row more) and still trains like one process: scalenlp.layout lets tp skip it.
    sets = [*TINY, f"data.path={corpus}", "training.steps=3", "model.flavor=debug-gpt2", "model.vocab_size=401",
            "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    run_train(tmp_path / "tp2", *sets, "parallel.tp=2", nproc=2)
    for a, b in zip(single, read_metrics(tmp_path / "tp2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
