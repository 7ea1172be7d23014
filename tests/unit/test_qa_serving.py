"""Question answering served: the encoder engine's answers equal the training evaluation's path (windows, a
forward, n-best) on short and long contexts, POST /v1/qa, `scalenlp qa`, and bad requests answered 4xx or as one
error line. The model is a tiny encoder fine-tuned here for a few seconds on "Where does NAME live?"."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from infer_helpers import ServerThread, minilm_classifier
from scalenlp import loader
from scalenlp.cli import main
from scalenlp.data.spans import QAExample, best_answer, make_windows
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.decoder_engine import RequestError
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.serving.app import create_app
from scalenlp.serving.encoder import EncoderBackend
from train_helpers import qa_sets, tiny_encoder, train_here, write_questions

CONTEXT = "Grace lives in Lima and works there every day."
# Longer than the tiny model's 64-token window: the engine reads it in overlapping windows.
LONG = " ".join(["The weather was mild and the streets were quiet that year."] * 8 + [CONTEXT])


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa_serve")
    train, dev = write_questions(root / "train.jsonl", 64), write_questions(root / "dev.jsonl", 8, offset=1)
    train_here(root / "run", *qa_sets(tiny_encoder(root / "tiny"), train, dev, "training.steps=40",
                                      "training.eval_every=0"))
    return root / "run" / "export"


@pytest.fixture(scope="module")
def engine(export):
    engine = encoder_from_checkpoint(EncoderEngineConfig(export, dtype="float32"))
    yield engine
    engine.stop()


def offline_answer(export, question: str, context: str):
    """The answer as training's evaluation finds it: make_windows, one forward per window, best_answer."""
    model, pre = loader.load(export)
    windows = make_windows([QAExample("q", question, context, [], 1)], pre.tokenizer, model.args.max_seq_len,
                           model.args.max_seq_len // 4, "request")
    starts, ends = [], []
    with torch.no_grad():
        for i in range(len(windows)):
            ids, mask, types, _ = windows.data.collate([i])
            logits = model(ids, mask, types)[0]
            starts.append(logits[:, 0])
            ends.append(logits[:, 1])
    return best_answer(starts, ends, windows.spans, context), len(windows)


@pytest.mark.parametrize("context", [CONTEXT, LONG], ids=["short", "long"])
def test_engine_answers_as_the_evaluation_does(engine, export, context):
    want, windows = offline_answer(export, "Where does Grace live?", context)
    assert windows == (1 if context == CONTEXT else windows) and (context == CONTEXT or windows > 1)
    got = engine.answer(["Where does Grace live?"], [context])[0]
    assert (got.text, got.start, got.end) == (want.text, want.start, want.end)
    assert got.score == pytest.approx(want.score, rel=1e-4)
    assert context[got.start:got.end] == got.text


def test_the_fine_tuned_model_finds_the_place(engine):
    answers = engine.answer(["Where does Grace live?", "Where does Ken live?"],
                            [CONTEXT, "Ken lives in Oslo and works there every day."])
    assert [a.text for a in answers] == ["Lima", "Oslo"]
    assert all(0 < a.score <= 1 for a in answers)


def test_bad_questions_are_request_errors(engine):
    with pytest.raises(RequestError, match="question 0: the question is .* tokens long"):
        engine.answer([" ".join(["where"] * 80)], [CONTEXT])
    with pytest.raises(RequestError, match="2 questions and 1 contexts"):
        engine.answer(["a?", "b?"], [CONTEXT])
    with pytest.raises(RequestError, match="empty"):
        engine.answer(["Where?"], [" "])


def test_v1_qa(engine, tmp_path):
    server = ServerThread(create_app(EncoderBackend(engine, "qa"), api_key="k"))
    classifier = encoder_from_checkpoint(EncoderEngineConfig(minilm_classifier(tmp_path), dtype="float32"))
    other = ServerThread(create_app(EncoderBackend(classifier, "cls"), api_key="k"))
    try:
        def post(s, body):
            return httpx.post(s.url + "/v1/qa", json=body, headers={"Authorization": "Bearer k"}, timeout=60)

        one = post(server, {"model": "qa", "question": "Where does Grace live?", "context": LONG})
        assert one.status_code == 200, one.text
        data = one.json()["data"]
        want = engine.answer(["Where does Grace live?"], [LONG])[0]
        assert [(d["answer"], d["start"], d["end"]) for d in data] == [(want.text, want.start, want.end)]
        many = post(server, {"model": "qa", "question": ["Where does Grace live?", "Where does Ken live?"],
                             "context": [CONTEXT, "Ken lives in Oslo and works there every day."]}).json()
        assert [d["answer"] for d in many["data"]] == ["Lima", "Oslo"] and many["usage"]["prompt_tokens"] > 0
        assert post(server, {"model": "qa", "question": ["a?", "b?"], "context": [CONTEXT, CONTEXT, CONTEXT]}
                    ).status_code == 400
        too_long = post(server, {"model": "qa", "question": " ".join(["where"] * 80), "context": CONTEXT})
        assert too_long.status_code == 400 and "tokens long" in too_long.text
        assert post(server, {"model": "qa", "question": "x?"}).status_code in (400, 422)
        wrong = post(other, {"model": "cls", "question": "Where?", "context": CONTEXT})
        assert wrong.status_code == 400 and "does not answer questions" in wrong.text
    finally:
        server.stop()
        other.stop()
        classifier.stop()


def test_qa_command(export, engine, capsys):
    assert main(["qa", "--checkpoint", str(export), "--question", "Where does Grace live?", "--context", LONG,
                 "--json", "--dtype", "float32"]) == 0
    line = json.loads(capsys.readouterr().out)
    want = engine.answer(["Where does Grace live?"], [LONG])[0]
    assert (line["answer"], line["start"], line["end"]) == (want.text, want.start, want.end)
    assert main(["qa", "--checkpoint", str(export), "--question", "Where does Grace live?", "--context", CONTEXT,
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.split("\t")[-1] == "Lima\n"
    assert main(["qa", "--checkpoint", str(export), "--question", "a?", "--question", "b?", "--context", "x",
                 "--context", "y", "--context", "z"]) == 2
    assert "2 --question and 3 --context" in capsys.readouterr().err
