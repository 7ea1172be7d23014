"""data.reset_positions=true restarts the positions at each document under every layout: it changes the losses
of one process, and tensor- and pipeline-parallel runs (two processes) match that."""

from __future__ import annotations

import json

import pytest

from train_helpers import TINY, read_evaluations, read_metrics, run_train, train_here


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.slow  # two two-process runs: 40-90 s here under load
def test_reset_positions_restart_each_document_under_any_layout(tmp_path):
    docs = tmp_path / "docs.jsonl"  # documents of 3-12 words: several start inside each 32-token window
    words = "the of and to a in is it you that he was for on are with as his they be at one have this".split()
    docs.write_text("".join(json.dumps({"text": " ".join(words[(i * 5 + j) % len(words)] for j in range(3 + i % 10))})
                            + "\n" for i in range(2000)))
    sets = [*TINY, f"data.path={docs}", "training.steps=8", "training.eval_every=8", "checkpoint.export=false"]
    train_here(tmp_path / "plain", *sets)  # the one-process runs in this process
    train_here(tmp_path / "reset", *sets, "data.reset_positions=true")
    run_train(tmp_path / "reset_tp", *sets, "data.reset_positions=true", "parallel.tp=2", nproc=2)
    # Four microbatches of one row: each stage must get its own microbatch's positions. Under gpipe, the one schedule
    # no other test runs through the trainer (1f1b: test_tied_pipeline, test_fine_tuning_layouts, test_fp16_training).
    run_train(tmp_path / "reset_pp", *sets, "data.reset_positions=true", "parallel.pp=2", "parallel.pp_microbatches=4",
              "parallel.pp_schedule=gpipe", nproc=2)
    plain, reset, tp, pp = (losses(tmp_path / run) for run in ("plain", "reset", "reset_tp", "reset_pp"))
    (val_plain,), (val_reset,), (val_pp,) = ([r["val_loss"] for r in read_evaluations(tmp_path / run)]
                                             for run in ("plain", "reset", "reset_pp"))
    # The layouts agree to ~5e-7 here; by step 8 the positions move the loss by up to 3e-4 (evaluation's too).
    tol = 2e-5
    assert max(abs(a - b) for a, b in zip(plain, reset)) > 5 * tol and abs(val_plain - val_reset) > 5 * tol
    assert tp == pytest.approx(reset, abs=tol)
    assert pp == pytest.approx(reset, abs=tol) and val_pp == pytest.approx(val_reset, abs=tol)
