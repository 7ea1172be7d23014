"""A RoBERTa classifier fine-tuned by two processes takes the steps one process takes. Its head has a dense layer of
its own, so the pooler RobertaModel carries is left out of the model: a weight without a gradient stalls DDP."""

from __future__ import annotations

import pytest

from train_helpers import classify_sets, read_metrics, roberta_sentiment, run_train, train_here


@pytest.mark.slow  # two runs, one in two new processes: 25 s of CPU, 100 s wall on a loaded 2-core machine
def test_roberta_classifier_under_ddp_takes_the_steps_of_one(tmp_path):
    init, data = roberta_sentiment(tmp_path)
    sets = classify_sets(init, data, None, "training.steps=3", "training.global_batch_size=8", "training.seq_len=16",
                         "training.eval_every=0", "training.lr=3e-3", "training.warmup_steps=1",
                         "checkpoint.export=false", "parallel.data_parallel=ddp")
    train_here(tmp_path / "one", *sets)
    run_train(tmp_path / "two", *sets, nproc=2)
    one, two = ([r["loss"] for r in read_metrics(tmp_path / run)] for run in ("one", "two"))
    assert len(one) == 3 and one[0] != one[-1]
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)
