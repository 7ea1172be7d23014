"""training.param_dtype=bfloat16 on one process: FSDP over a process group of one, bf16 compute, fp32 master
weights, through `scalenlp train`."""

from __future__ import annotations

import pytest

from train_helpers import TINY, read_metrics, run_train


@pytest.mark.slow
def test_bf16_parameters_train_one_process_close_to_fp32(tmp_path, corpus):
    """training.param_dtype=bfloat16 wraps even one process in FSDP (bf16 compute, fp32 master weights)."""
    sets = [*TINY, f"data.path={corpus}", "training.steps=4"]
    run_train(tmp_path / "fp32", *sets)
    run_train(tmp_path / "bf16", *sets, "training.param_dtype=bfloat16")
    fp32, bf16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "bf16")
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=2e-2)
    assert bf16[0]["loss"] != fp32[0]["loss"]  # computed in bf16 indeed
    assert "bf16" in bf16[0]["peak_source"] or "datasheet" in bf16[0]["peak_source"]
