"""training.task = "token_classification" with two processes: under ZeRO-3 and tensor parallelism the losses are the
one-process run's step by step, and the entity scores, each rank predicting its share of the eval windows, are
the whole file's (its single-process behaviour, in this process: tests/unit/test_tagging_task.py)."""

from __future__ import annotations

import json

import pytest

from train_helpers import read_metrics, run_train, tiny_encoder, train_here, write_tagged


def scores(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "f1" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: 8 steps of a tiny encoder, evaluated at steps 4 and 8 (entity F1 0.22, then 0.8), in this process; its settings and
    its records. The eval file's 25 sentences split unevenly over two ranks, and seq_len 12 cuts some into
    windows."""
    folder = tmp_path_factory.mktemp("tag2")
    sets = ["training.task=token_classification", f"model.init={tiny_encoder(folder / 'tiny')}",
            f"data.path={write_tagged(folder / 'train.conll', 64)}",
            f"data.eval_path={write_tagged(folder / 'dev.conll', 25, seed=1)}", "training.device=cpu",
            "training.log_every=1", "checkpoint.every=0", "checkpoint.export=false", "training.global_batch_size=8",
            "training.seq_len=12", "training.lr=2e-2", "training.warmup_steps=1", "training.steps=8",
            "training.eval_every=4"]
    train_here(folder / "one", *sets)
    return sets, read_metrics(folder / "one"), scores(folder / "one")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.data_parallel=zero3"], ["parallel.tp=2"]], ids=["zero3", "tp"])
def test_two_processes_train_and_score_as_one(tmp_path, one_process, layout):
    sets, one, one_scores = one_process
    run_train(tmp_path / "two", *sets, *layout, nproc=2)
    assert one[-1]["loss"] < one[0]["loss"]  # it learns
    assert [r["loss"] for r in read_metrics(tmp_path / "two")] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    two_scores = scores(tmp_path / "two")
    assert [r["step"] for r in two_scores] == [4, 8]
    for a, b in zip(two_scores, one_scores):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-4)
        assert {k: v for k, v in a.items() if k != "eval_loss"} == pytest.approx(
            {k: v for k, v in b.items() if k != "eval_loss"}, abs=1e-6)
    assert 0 < one_scores[0]["f1"] < one_scores[-1]["f1"]  # entities are found, and more of them later
