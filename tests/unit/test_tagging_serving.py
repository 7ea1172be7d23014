"""A token-classification encoder in use: the batcher's entities equal transformers' token-classification pipeline
(aggregation_strategy="first") on the exported ...ForTokenClassification folder, long texts are read in windows of
whole words, POST /v1/tag answers entities with type, text, character offsets and score, /v1/classify and /v1/tag
refuse the other kind of model with a 400 that says which to use, and `scalenlp tag` prints the entities."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from infer_helpers import ServerThread, minilm_classifier
from scalenlp.cli import main
from scalenlp.data.entities import text_entities
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.io import save_pretrained
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.app import create_app
from scalenlp.serving.encoder import EncoderBackend

torch.set_num_threads(1)

TAGS = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
TEXTS = ["Paul Smith flew from Johannesburg to New York on Tuesday.", "hello there",
         "Ms. Okonkwo-Baptiste visited the Uffizi, then ate gelato near Ponte Vecchio!"]
KEY = "sk-tag"


@pytest.fixture(scope="module")
def tagger(tmp_path_factory):
    """A small random tagger with MiniLM's tokenizer; its head is scaled so that its tags vary from word to word."""
    torch.manual_seed(3)
    model = Encoder(EncoderArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, task="token_classification",
                                labels=TAGS, pooler=False))
    with torch.no_grad():
        model.classifier.weight.mul_(30)
    return save_pretrained(model, tmp_path_factory.mktemp("tagger") / "export",
                           packaged_model("minilm") / "tokenizer.json")


@pytest.fixture(scope="module")
def engine(tagger):
    engine = encoder_from_checkpoint(EncoderEngineConfig(tagger, dtype="float32"))
    yield engine
    engine.stop()


def same(found: list[dict], expected: list[dict]) -> bool:
    """The same entities (type, text, offsets), with scores equal to float32's precision."""
    def spans(entities):
        return [(e["type"], e["text"], e["start"], e["end"]) for e in entities]

    return spans(found) == spans(expected) and \
        [e["score"] for e in found] == pytest.approx([e["score"] for e in expected], abs=1e-5)


def direct_entities(engine, text: str, windows: list[list[int]]) -> list[dict]:
    """The entities of ``text`` from a forward of each window by hand, the windows' rows put end to end."""
    e = engine.words.encode(text, add_special_tokens=False)
    ends = len(engine.prefix), len(engine.suffix)
    with torch.no_grad():
        rows = [engine.model(torch.tensor([w]))[0].softmax(-1)[ends[0]:len(w) - ends[1]] for w in windows]
    return text_entities(text, e.offsets, e.word_ids, torch.cat(rows).numpy(), TAGS)


def test_entities_equal_a_forward_by_hand(engine):
    found = engine.tag(TEXTS)
    assert sum(map(len, found)) >= 3  # the scaled head finds entities to compare
    for text, entities in zip(TEXTS, found):
        assert same(entities, direct_entities(engine, text, engine.tag_windows([text])))
        for e in entities:
            assert text[e["start"]:e["end"]] == e["text"] and e["type"] in ("LOC", "PER") and 0 < e["score"] <= 1


@pytest.mark.slow  # transformers and its pipeline: 7 s on a quiet 2-core machine, 75 s under a load of 14
def test_entities_equal_transformers_pipeline(tagger, engine, tmp_path):
    from transformers import pipeline

    found = engine.tag(TEXTS)
    hf = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tagger), "--format", "hf", "--out", str(hf)]) == 0
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"][-1].endswith("ForTokenClassification")
    assert config["id2label"] == {str(i): t for i, t in enumerate(TAGS)}
    assert config["label2id"] == {t: i for i, t in enumerate(TAGS)}
    tag = pipeline("token-classification", model=str(hf), aggregation_strategy="first", device="cpu")
    for text, entities in zip(TEXTS, found):
        theirs = tag(text)
        assert [(e["type"], e["start"], e["end"]) for e in entities] == \
            [(t["entity_group"], t["start"], t["end"]) for t in theirs]
        assert [e["score"] for e in entities] == pytest.approx([float(t["score"]) for t in theirs], abs=1e-4)


def test_long_texts_are_tagged_in_windows_of_whole_words(tagger):
    engine = encoder_from_checkpoint(EncoderEngineConfig(tagger, dtype="float32", max_seq_len=8))
    try:
        text = " ".join(TEXTS * 2)
        windows = engine.tag_windows([text])
        whole = engine.words.encode(text, add_special_tokens=False)
        assert len(windows) > 5 and max(map(len, windows)) <= 8
        assert [t for w in windows for t in w[1:-1]] == whole.ids  # every token, once, in order
        found = engine.tag([text])[0]
        assert same(found, direct_entities(engine, text, windows))
        assert found and max(e["end"] for e in found) > len(text) // 2  # entities past the first windows too
    finally:
        engine.stop()


def post(server, route, body):
    return httpx.post(server.url + route, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_tag_route_and_the_wrong_kind_of_model(engine, tmp_path):
    server = ServerThread(create_app(EncoderBackend(engine, "ner"), api_key=KEY))
    classifier = encoder_from_checkpoint(EncoderEngineConfig(minilm_classifier(tmp_path), dtype="float32"))
    classifying = ServerThread(create_app(EncoderBackend(classifier, "cls"), api_key=KEY))
    try:
        r = post(server, "/v1/tag", {"model": "ner", "input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(same(d["entities"], e) for d, e in zip(body["data"], engine.tag(TEXTS)))
        assert body["usage"]["prompt_tokens"] == sum(map(len, engine.tag_windows(TEXTS)))
        one = post(server, "/v1/tag", {"model": "ner", "input": TEXTS[0]}).json()["data"]
        assert len(one) == 1 and same(one[0]["entities"], body["data"][0]["entities"])
        refused = post(server, "/v1/classify", {"model": "ner", "input": "a"})
        assert refused.status_code == 400
        assert "not a classifier (its task is 'token_classification')" in refused.json()["error"]["message"]
        assert "/v1/tag" in refused.json()["error"]["message"]
        refused = post(classifying, "/v1/tag", {"model": "cls", "input": "a"})
        assert refused.status_code == 400
        assert "not a tagger (its task is 'classification')" in refused.json()["error"]["message"]
        assert "/v1/classify" in refused.json()["error"]["message"]
        for bad, why in (({"model": "ner", "input": []}, "must not be empty"),
                         ({"model": "ner", "input": ["a", " "]}, "input 1 is empty"),
                         ({"model": "ner", "input": [[101, 102]]}, "input")):
            r = post(server, "/v1/tag", bad)
            assert r.status_code == 400 and why in r.text, r.text
    finally:
        classifying.stop()
        server.stop()
        classifier.stop()


def test_tag_command(tagger, engine, tmp_path, capsys):
    assert main(["tag", "--checkpoint", str(tagger), "--text", TEXTS[0], "--text", TEXTS[1], "--json",
                 "--dtype", "float32"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2]
    assert all(same(line["entities"], e) for line, e in zip(lines, engine.tag(TEXTS[:2])))
    assert main(["tag", "--checkpoint", str(tagger), "--text", TEXTS[0], "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out.splitlines()
    first = lines[0]["entities"][0]
    assert printed[0] == f"0\t{first['type']}\t{first['start']}-{first['end']}\t{first['score']:.4f}\t{first['text']}"
    assert main(["tag", "--checkpoint", str(minilm_classifier(tmp_path)), "--text", "a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this model is not a tagger")
