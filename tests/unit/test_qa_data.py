"""Question-answering data: reading SQuAD and JSONL, windows with doc_stride, answers mapped to tokens through
offsets and back to text from logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scalenlp.data.spans import NO_SPAN, QAExample, answer_tokens, best_answer, make_windows, read_qa
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.errors import UserError
from scalenlp.models.packaged import packaged_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(packaged_model("minilm"))


def example(context: str, answer: str, question: str = "where is it?", nth: int = 0, qid: str = "q") -> QAExample:
    start = -1
    for _ in range(nth + 1):
        start = context.index(answer, start + 1)
    return QAExample(qid, question, context, [(answer, start)], 1)


def window_texts(windows, tokenizer):
    """Each window's labelled answer as text, through its tokens' character spans ('' for [CLS])."""
    out = []
    for i, (s, e) in enumerate(windows.data.labels):
        spans, context = windows.spans[i], windows.examples[windows.example[i]].context
        out.append("" if s == e == 0 else context[spans[s, 0]:spans[e, 1]])
    return out


LONG = " ".join(f"word{i}" for i in range(60))  # word0..word59: one or more tokens each, no repeats


def test_windows_overlap_by_doc_stride_and_cover_the_context(tokenizer):
    w = make_windows([example(LONG, "word30")], tokenizer, max_len=32, stride=8, path="x")
    assert len(w) > 2
    firsts, lasts = [], []
    for spans in w.spans:
        inside = spans[spans[:, 0] != NO_SPAN]
        firsts.append(inside[0, 0])
        lasts.append(inside[-1, 1])
    assert firsts[0] == 0 and lasts[-1] == len(LONG)
    for i in range(1, len(w)):
        a = w.spans[i - 1][w.spans[i - 1][:, 0] != NO_SPAN]
        b = w.spans[i][w.spans[i][:, 0] != NO_SPAN]
        assert [tuple(x) for x in a[-8:]] == [tuple(x) for x in b[:8]]  # exactly doc_stride tokens shared
    assert all(len(w.data.ids[w.data.offsets[i]:w.data.offsets[i + 1]]) <= 32 for i in range(len(w)))


def test_windows_without_the_answer_point_at_the_first_token(tokenizer):
    w = make_windows([example(LONG, "word30")], tokenizer, max_len=32, stride=8, path="x")
    texts = window_texts(w, tokenizer)
    assert "word30" in texts
    assert set(texts) == {"word30", ""}
    assert all(tuple(label) == (0, 0) for label, t in zip(w.data.labels, texts) if t == "")


def test_answers_at_window_edges(tokenizer):
    # An answer that ends a window's context, one that starts the next, and one cut by a window's edge.
    w = make_windows([example(LONG, "word0")], tokenizer, max_len=32, stride=8, path="x")
    spans = w.spans[0][w.spans[0][:, 0] != NO_SPAN]
    last_word = LONG[spans[-1, 0]:spans[-1, 1]]
    first_of_context = make_windows([example(LONG, LONG[:spans[0, 1]])], tokenizer, 32, 8, "x")
    assert window_texts(first_of_context, tokenizer)[0] == LONG[:spans[0, 1]]
    # The whole of the first window's context is an answer only the first window holds.
    whole = LONG[:spans[-1, 1]]
    texts = window_texts(make_windows([example(LONG, whole)], tokenizer, 32, 8, "x"), tokenizer)
    assert texts[0] == whole and set(texts[1:]) == {""}
    # One character more and no window holds it all.
    texts = window_texts(make_windows([example(LONG, LONG[:spans[-1, 1] + 2])], tokenizer, 32, 8, "x"), tokenizer)
    assert set(texts) == {""}
    assert last_word.startswith("word") or last_word.isdigit()


def test_answer_tokens_round_sub_word_characters_out_to_whole_tokens():
    spans = np.array([[NO_SPAN, NO_SPAN], [0, 4], [4, 7], [8, 12], [NO_SPAN, NO_SPAN]], dtype=np.int32)
    assert answer_tokens(spans, 0, 7) == (1, 2)
    assert answer_tokens(spans, 5, 10) == (2, 3)  # starts mid-token, ends mid-token
    assert answer_tokens(spans, 8, 12) == (3, 3)
    assert answer_tokens(spans, 8, 13) == (0, 0)  # runs past the window


def test_unicode_offsets_are_characters_of_the_original_context(tokenizer):
    context = "Le café « Zoë » est à Zürich depuis 1984, près du lac."
    for answer in ("Zürich", "« Zoë »", "1984"):
        w = make_windows([example(context, answer)], tokenizer, max_len=64, stride=8, path="x")
        assert window_texts(w, tokenizer) == [answer]


def test_a_repeated_answer_is_labelled_where_answer_start_says(tokenizer):
    context = "Paris is big. Lyon is far from Paris. Nice is near Paris."
    for nth in range(3):
        w = make_windows([example(context, "Paris", nth=nth)], tokenizer, max_len=64, stride=8, path="x")
        s, e = w.data.labels[0]
        start = [i for i in range(len(context)) if context.startswith("Paris", i)][nth]
        assert tuple(w.spans[0][s]) == (start, start + 5) and s == e


def test_a_question_longer_than_the_window_is_reported_and_the_rest_used(tokenizer):
    log = []
    long_q = example("The cat sat on the mat.", "mat", question=" ".join(["why"] * 40), qid="long")
    long_q.line = 7
    w = make_windows([long_q, example("The cat sat on the mat.", "cat")], tokenizer, max_len=32, stride=8,
                     path="f.jsonl", log=log.append)
    assert window_texts(w, tokenizer) == ["cat"]
    assert any("f.jsonl:7:" in line and "data.doc_stride" in line for line in log), log


def test_jsonl_answer_not_at_its_start_is_reported_with_its_line(tmp_path):
    f = tmp_path / "qa.jsonl"
    rows = [{"question": "who?", "context": "Ada wrote it.", "answers": {"text": ["Ada"], "answer_start": [0]}},
            {"question": "what?", "context": "Ada wrote it.", "answers": {"text": ["wrote"], "answer_start": [0]}},
            {"question": "what?", "context": "Ada wrote it.", "answers": [{"text": "it", "answer_start": 10}]},
            {"question": "none?", "context": "Ada wrote it.", "answers": {"text": [], "answer_start": []}}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    log = []
    examples = read_qa(f, log=log.append)
    assert [(e.line, e.answers) for e in examples] == [(1, [("Ada", 0)]), (3, [("it", 10)]), (4, [])]
    assert any(f"{f}:2:" in line and "not at answer_start 0" in line and "at 4" in line for line in log), log


def test_squad_json_v1_and_v2(tmp_path):
    f = tmp_path / "squad.json"
    doc = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "Ada wrote it in 1843.", "qas": [
        {"id": "a", "question": "who?", "answers": [{"text": "Ada", "answer_start": 0}], "is_impossible": False},
        {"id": "b", "question": "why?", "answers": [], "is_impossible": True},
        {"id": "c", "question": "when?", "answers": [{"text": "1843", "answer_start": 3}]}]}]}]}
    f.write_text(json.dumps(doc, indent=1))
    log = []
    examples = read_qa(f, log=log.append)
    assert [(e.id, e.answers) for e in examples] == [("a", [("Ada", 0)]), ("b", [])]
    line = f.read_text()[:f.read_text().index('"c"')].count("\n") + 1
    assert any(f"{f}:{line}:" in x and "'c'" in x for x in log), log


def test_squad_questions_of_the_wrong_shape_are_skipped_with_their_line(tmp_path):
    """A SQuAD question whose answer has no start, whose question is not text, or that is not an object is one
    skipped line each, the rest read (a null answer_start raised TypeError out of the reader, found by
    test_text_checks' Hypothesis run)."""
    f = tmp_path / "squad.json"
    doc = {"data": [{"paragraphs": [{"context": "Ada wrote it.", "qas": [
        {"id": "a", "question": "who?", "answers": [{"text": "Ada", "answer_start": None}]},
        {"id": "b", "question": 7, "answers": [{"text": "Ada", "answer_start": 0}]},
        "c",
        {"id": "d", "question": "who?", "answers": [{"text": "Ada", "answer_start": 0}]}]}]}]}
    f.write_text(json.dumps(doc, indent=1))
    log = []
    assert [e.id for e in read_qa(f, log=log.append)] == ["d"]
    assert "skipped 3 question(s)" in log[0] and "answer_start" in log[1] and "strings" in log[2], log


def test_shared_squad_file_reads_whole():
    from pathlib import Path
    f = Path(__file__).resolve().parents[3] / "shared" / "data" / "squad" / "dev.json"
    if not f.is_file():
        pytest.skip("no shared SQuAD data")
    log = []
    examples = read_qa(f, log=log.append)
    assert len(examples) == 1251 and not log


@pytest.mark.parametrize("path,why", [("missing.json", "does not exist"), ("x.txt", "unsupported file type")])
def test_bad_files_are_one_error(tmp_path, path, why):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(UserError, match=why):
        read_qa(tmp_path / path)


def logits(n: int, **at: float) -> torch.Tensor:
    out = torch.full((n,), -5.0)
    for k, v in at.items():
        out[int(k[1:])] = v
    return out


SPANS = np.array([[NO_SPAN, NO_SPAN], [NO_SPAN, NO_SPAN], [0, 3], [4, 9], [10, 12], [13, 18], [NO_SPAN, NO_SPAN]],
                 dtype=np.int32)
CONTEXT = "Ada wrote it today"


def test_best_answer_maps_the_best_valid_pair_back_to_text():
    # The highest start is on the question (token 1), the highest end before the start: both invalid.
    start, end = logits(7, t1=9, t3=4), logits(7, t2=8, t4=3, t5=2)
    answer = best_answer([start], [end], [SPANS], CONTEXT)
    assert (answer.text, answer.start, answer.end) == ("wrote it", 4, 12)
    assert 0 < answer.score < 1
    # (3, 4) is two tokens long: the best one-token answer is (2, 2), whose end logit carries it.
    assert best_answer([start], [end], [SPANS], CONTEXT, max_answer_len=1).text == "Ada"


def test_best_answer_over_windows_and_the_empty_answer():
    weak = (logits(7, t3=1, t4=1), logits(7, t3=1, t4=1))
    strong = (logits(7, t5=6, t0=2), logits(7, t5=6, t0=2))
    a = best_answer([weak[0], strong[0]], [weak[1], strong[1]], [SPANS, SPANS], CONTEXT)
    assert a.text == "today"
    # SQuAD v2.0: [CLS] above every span wins when empty answers are allowed.
    null = (logits(7, t0=9, t3=1), logits(7, t0=9, t3=1))
    assert best_answer([null[0]], [null[1]], [SPANS], CONTEXT, allow_empty=True).text == ""
    assert best_answer([null[0]], [null[1]], [SPANS], CONTEXT).text == "wrote"
