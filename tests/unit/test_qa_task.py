"""training.task = "qa" in this process: a tiny encoder fine-tuned on hand-made questions, scored with exact
match and F1 in metrics.jsonl, the best checkpoint kept by F1, and its mistakes as one error line."""

from __future__ import annotations

import json

import pytest
import torch

from train_helpers import error_lines, main_train, qa_sets, tiny_encoder, train_here, write_questions


@pytest.fixture(scope="module")
def qa_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa")
    init = tiny_encoder(root / "tiny")
    train, dev = write_questions(root / "train.jsonl", 64), write_questions(root / "dev.jsonl", 16, offset=1)
    run = root / "run"
    train_here(run, *qa_sets(init, train, dev, "training.steps=40", "training.eval_every=20",
                             "checkpoint.keep_best=f1"))
    return run


def test_qa_fine_tune_reports_squad_scores_and_learns(qa_run):
    records = [json.loads(line) for line in (qa_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "f1" in r]
    assert [r["step"] for r in evals] == [20, 40]
    assert all(0 <= r["exact_match"] <= r["f1"] <= 100 and r["eval_loss"] > 0 for r in evals)
    assert evals[-1]["f1"] > 50, evals  # a random head picks the right city about 1 time in 8


def test_the_best_checkpoint_is_a_question_answering_export(qa_run):
    from scalenlp.loader import read

    best = json.loads((qa_run / "best" / "best.json").read_text())
    assert best["f1"] == max(json.loads(line).get("f1", -1) for line in (qa_run / "metrics.jsonl").open())
    pretrained = read(qa_run / "best")
    assert pretrained.args.task == "question_answering" and not pretrained.args.pooler
    assert tuple(pretrained.state["qa_outputs.weight"].shape) == (2, pretrained.args.dim)


def test_the_loss_is_the_mean_of_start_and_end_cross_entropy_over_real_tokens():
    from scalenlp.train.tasks.qa import span_loss

    logits = torch.randn(3, 5, 2)
    labels = torch.tensor([[1, 2], [0, 0], [4, 3]])
    model = lambda *_: logits  # noqa: E731
    want = sum(torch.nn.functional.cross_entropy(logits[..., k], labels[:, k]) for k in (0, 1)) / 2
    full = torch.ones(3, 5, dtype=torch.long)
    assert span_loss(model, (full, full, full, labels)) / (2 * 3) == pytest.approx(want.item())
    # The first row has 3 real tokens: its padded positions' logits do not count.
    padded = full.clone()
    padded[0, 3:] = 0
    row0 = sum(torch.nn.functional.cross_entropy(logits[0, :3, k], labels[0, k], reduction="sum") for k in (0, 1))
    rest = sum(torch.nn.functional.cross_entropy(logits[1:, :, k], labels[1:, k], reduction="sum") for k in (0, 1))
    assert span_loss(model, (full, padded, full, labels)) == pytest.approx((row0 + rest).item())


def test_qa_mistakes_are_one_error_line(tmp_path, capsys):
    init = tiny_encoder(tmp_path / "tiny")
    data = write_questions(tmp_path / "q.jsonl", 8)
    assert main_train(tmp_path / "r1", "training.task=qa", f"data.path={data}") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: training.task=\"qa\" needs model.init (an encoder checkpoint, e.g. a BERT folder) and data.path "
        "(SQuAD .json or .jsonl questions)"]
    assert main_train(tmp_path / "r2", *qa_sets(init, data, data, "data.doc_stride=32")) == 2
    assert "data.doc_stride=32 must be below training.seq_len=32" in error_lines(capsys.readouterr().err)[0]
    wrong = tmp_path / "q.txt"
    wrong.write_text("hi")
    assert main_train(tmp_path / "r3", *qa_sets(init, wrong, data, "training.steps=1")) == 2
    assert "unsupported file type '.txt'" in error_lines(capsys.readouterr().err)[0]
