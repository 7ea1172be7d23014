"""Text that is not valid Unicode, and JSON a reader cannot hold, from every door: the server's routes answer 400 in
OpenAI's shape (a lone surrogate in chat messages, embeddings, classification, tagging and QA input was a plain-text
500), `scalenlp chat` names a stdin line that is not UTF-8 and goes on, and every training data reader skips the row
with its file:line (a JSONL "\\ud800" or a 5,000-digit number was a traceback; one byte that is not UTF-8 rejected a
whole TSV; a JSON true label became a class "True"). Then Hypothesis feeds arbitrary JSON, text, bytes and huge
numbers to every route and reader: never a 5xx nor a traceback, always OpenAI's error shape or one line."""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from infer_helpers import make_export
from scalenlp.cli.evaluate import read_questions as chat_questions
from scalenlp.data.chat import ChatError, check_messages
from scalenlp.data.labeled import read_labeled
from scalenlp.data.sft import read_conversations
from scalenlp.data.sources import read_pieces
from scalenlp.data.spans import read_qa
from scalenlp.data.tags import read_tagged
from scalenlp.data.text import json_row, text_problem
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.errors import UserError
from scalenlp.evaluation.multiple_choice import read_questions
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.io import load_pretrained, save_pretrained
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend
from scalenlp.serving.encoder import EncoderBackend

torch.set_num_threads(1)
# A short template: the tiny model's context is 128 tokens of a small byte-level BPE.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
HUGE = "9" * 5000  # more digits than Python turns into an int (4300)
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- the servers: a tiny decoder, three tiny encoders

def _encoder(root: Path, task: str, labels: list[str] | None = None) -> Path:
    tokenizer = load_tokenizer(packaged_model("minilm"))
    torch.manual_seed(0)
    args = EncoderArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=1, n_heads=2, ffn_dim=64,
                       max_seq_len=64, task=task, labels=labels or [])
    return save_pretrained(Encoder(args), root / task, tokenizer)


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """{route: a TestClient of the app serving it}: chat and completions on a tiny decoder with a chat template;
    embeddings and classify on a classifier, tag on a tagger, qa on a question answerer."""
    root = tmp_path_factory.mktemp("text_checks")
    export = make_export(root / "decoder")
    tok = load_tokenizer(export)
    decoder = Engine(load_pretrained(export), tok, max_batch=2, max_queue=8, eos_id=find_eos_token_id(tok),
                     tokenizer_config={"chat_template": TEMPLATE}).start()
    engines = [decoder]
    out = {}
    with TestClient(create_app(LocalBackend(decoder, "m", max_tokens_cap=2))) as generation:
        for route in ("/v1/completions", "/v1/chat/completions"):
            out[route] = generation
        for routes, task, labels in (
                (("/v1/embeddings", "/v1/classify"), "classification", ["no", "yes"]),
                (("/v1/tag",), "token_classification", ["O", "B-X", "I-X"]),
                (("/v1/qa",), "question_answering", None)):
            engine = encoder_from_checkpoint(EncoderEngineConfig(_encoder(root, task, labels), dtype="float32"))
            engines.append(engine)
            client = TestClient(create_app(EncoderBackend(engine, "m"))).__enter__()
            out.update({route: client for route in routes})
        yield out
        for client in {id(c): c for c in out.values() if c is not generation}.values():
            client.__exit__(None, None, None)
    for engine in engines:
        engine.stop()


def post(client: TestClient, route: str, body: str | bytes):
    return client.post(route, content=body, headers={"Content-Type": "application/json"})


def assert_openai_error(r, status: int | None = None) -> dict:
    """A 4xx in OpenAI's shape (or exactly ``status``)."""
    assert (r.status_code == status) if status else 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"], error
    return error


# A lone surrogate, as JSON's escape: what a client sends (FastAPI refuses a body that is not UTF-8 itself).
ROUTE_BODIES = {
    "/v1/chat/completions": '{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi \\ud800"}]}',
    "/v1/embeddings": '{"model": "m", "input": ["fine", "bad \\udfff text"]}',
    "/v1/classify": '{"model": "m", "input": "bad \\ud800"}',
    "/v1/tag": '{"model": "m", "input": ["Paul \\udcff flew"]}',
    "/v1/qa": '{"model": "m", "question": "who\\ud800?", "context": "Grace lives in Lima."}',
    "/v1/completions": '{"model": "m", "max_tokens": 1, "prompt": "x \\ud800"}',
}


@pytest.mark.parametrize("route", ROUTE_BODIES)
def test_a_lone_surrogate_is_a_400_on_every_route(clients, route):
    client = clients[route]
    error = assert_openai_error(post(client, route, ROUTE_BODIES[route]), 400)
    assert "not valid Unicode text" in error["message"], error
    # the same request with valid text is served
    fine = ROUTE_BODIES[route]
    for escape in ("\\ud800", "\\udfff", "\\udcff"):
        fine = fine.replace(escape, "ok")
    assert post(client, route, fine).status_code == 200


def test_the_one_check_names_what_is_wrong():
    assert text_problem("ok") is None
    assert "byte 0xFF at character 3" in text_problem(b"hi \xff".decode("utf-8", "surrogateescape"), "x")
    assert "lone surrogate, U+D800, at character 1" in text_problem("a\ud800", "x")
    assert "at most 3" in text_problem("abcd", "x", max_chars=3)
    assert text_problem(5, "the text") == "the text is int, not a string"
    assert json_row('{"a": ' + HUGE + "}")[1].startswith("a number longer than 4300 digits")
    assert json_row("[" * 100_000)[1] == "JSON nested too deeply to read"
    assert json_row('{"a": [1, {"b": "\\ud800"}]}')[1].startswith("the row.a[1].b is not valid Unicode")
    with pytest.raises(ChatError, match=r"messages\[0\]\.name is not valid Unicode"):
        check_messages([{"role": "user", "content": "ok", "name": "\udcff"}])


# ---------------------------------------------------------------- the chat command's stdin

def test_chat_stdin_not_utf8_is_one_line_and_the_chat_goes_on(tmp_path, monkeypatch, capsys):
    """`printf 'hi \\xff\\nhello\\n' | scalenlp chat`: the first line is named and left out, the second answered."""
    from scalenlp.cli import main

    export = make_export(tmp_path / "m")
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    # strict, as Python reads stdin in a UTF-8 locale
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi \xff\nhello\n"), encoding="utf-8"))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(export), "--max-tokens", "2", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert "error: this line is not valid Unicode text: byte 0xFF at character 3" in err, err
    assert "> hello" in err and "Traceback" not in err and out.count("\n") == 1, (out, err)


# ---------------------------------------------------------------- the data readers, one reproduction each

def _lines(path: Path, *rows: str | bytes) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else r.encode()) + b"\n" for r in rows))
    return path


def test_classification_jsonl_skips_surrogates_huge_numbers_and_true_labels(tmp_path):
    f = _lines(tmp_path / "d.jsonl", '{"text": "good", "label": "pos"}', '{"text": "bad \\ud800", "label": "pos"}',
               '{"text": "long", "label": ' + HUGE + "}", '{"text": "yes", "label": true}',
               '{"text": "fine", "label": 1}', b'{"text": "caf\xe9", "label": "neg"}')
    logged = []
    rows = read_labeled(f, "text", "label", log=logged.append)
    assert rows.texts == ["good", "fine"] and rows.labels == ["pos", "1"] and rows.lines == [1, 5]
    report = "\n".join(logged)
    assert f"{f}:2: the row.text is not valid Unicode" in report
    assert f"{f}:3: a number longer than 4300 digits" in report
    assert f"{f}:4: label True is not a string or a whole number" in report
    assert f"{f}:6: the line is not valid Unicode text: byte 0xE9" in report


@pytest.mark.parametrize("suffix,sep", [(".tsv", "\t"), (".csv", ",")])
def test_one_byte_not_utf8_skips_its_row_only(tmp_path, suffix, sep):
    f = _lines(tmp_path / f"d{suffix}", f"sentence{sep}label", f"a good film{sep}1",
               f"caf{sep}0".replace("caf", "caf\udce9").encode("utf-8", "surrogateescape"), f"dull{sep}0")
    logged = []
    rows = read_labeled(f, "sentence", "label", log=logged.append)
    assert rows.texts == ["a good film", "dull"] and rows.lines == [2, 4]
    assert any(f"{f}:3: " in line and "byte 0xE9" in line for line in logged), logged


def test_sft_conversations_skip_surrogates_and_huge_numbers(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    f = _lines(tmp_path / "c.jsonl", good, '{"messages": [{"role": "user", "content": "\\ud800"}]}',
               '{"messages": [], "n": ' + HUGE + "}", b"\xff" + good.encode())
    found = list(read_conversations([f]))
    assert isinstance(found[0][1], list)
    assert [where for where, _ in found] == [f"{f}:{n}" for n in (1, 2, 3, 4)]
    assert "not valid Unicode" in found[1][1] and "4300 digits" in found[2][1] and "byte 0xFF" in found[3][1]


def test_qa_and_tagging_skip_bad_rows(tmp_path):
    row = {"question": "Where?", "context": "in Lima", "answers": {"text": ["Lima"], "answer_start": [3]}}
    qa = _lines(tmp_path / "q.jsonl", json.dumps(row), json.dumps({**row, "question": "\ud800?"}),
                json.dumps(row)[:-1] + ', "n": ' + HUGE + "}", json.dumps({**row, "question": 7}))
    logged = []
    assert [e.line for e in read_qa(qa, log=logged.append)] == [1]
    assert ["not valid Unicode" in logged[1], "4300 digits" in logged[2], "must be strings" in logged[3]] == [True] * 3

    conll = _lines(tmp_path / "t.conll", "Paul\tB-PER", "", b"caf\xe9\tO", "", "Lima\tB-LOC")
    jsonl = _lines(tmp_path / "t.jsonl", '{"tokens": ["Paul"], "tags": ["B-PER"]}',
                   '{"tokens": ["\\ud800"], "tags": ["O"]}', '{"tokens": [' + HUGE + '], "tags": ["O"]}')
    for f, kept, bad in ((conll, [["Paul"], ["Lima"]], [f"{conll}:3: "]), (jsonl, [["Paul"]], [f"{jsonl}:2: ", f"{jsonl}:3: "])):
        logged = []
        assert read_tagged(f, log=logged.append).words == kept
        assert all(any(where in line for line in logged) for where in bad), logged


def test_pretraining_text_refuses_a_bad_line_with_file_and_line(tmp_path):
    """A pre-training corpus stops at a bad line (its policy for any bad line), now with file:line for these too."""
    for name, rows in (("a.jsonl", ['{"text": "ok"}', '{"text": "\\ud800"}']),
                       ("b.jsonl", ['{"text": "ok"}', '{"text": ' + HUGE + "}"]), ("c.tsv", ["text", b"\xff"])):
        f = _lines(tmp_path / name, *rows)
        with pytest.raises(UserError, match=rf"{name}:2: "):
            list(read_pieces([f], "text"))


def test_eval_question_files_refuse_a_bad_line_with_file_and_line(tmp_path):
    """`eval --tasks` and `--chat` stop at a bad line (a score over fewer questions would not compare): one line
    with file:line, where a byte that is not UTF-8 was a traceback."""
    row = json.dumps({"context": "2+2=", "choices": ["4", "5"], "answer": 0})
    for n, bad in enumerate((b"\xff" + row.encode(), row.replace('"4"', '"\\ud800"'), row.replace("0}", HUGE + "}"))):
        f = _lines(tmp_path / f"mc{n}.jsonl", row, bad)
        with pytest.raises(UserError, match=rf"mc{n}\.jsonl:2: not a multiple-choice question"):
            read_questions(f)
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "expect": "x"})
    f = _lines(tmp_path / "chat.jsonl", chat, b"\xff" + chat.encode())
    with pytest.raises(UserError, match=r"chat\.jsonl:2: not a question \(the line is not valid Unicode"):
        chat_questions(f)


# ---------------------------------------------------------------- properties: arbitrary input, never a 5xx or a traceback

# Text, a third of it holding a lone surrogate (Hypothesis leaves surrogates out unless asked, and those it
# draws when asked mostly pair up into valid text).
_PLAIN = st.text(max_size=6)
TEXT = st.builds(lambda a, s, b: a + s + b, _PLAIN, st.sampled_from(["", "", "\ud800", "\udcff"]), _PLAIN)
# The names and values the readers look for, so that drawn rows reach the checks past "no such field".
NAMES = ["text", "label", "messages", "role", "content", "question", "context", "answers", "answer_start", "tokens",
         "tags", "user", "assistant", "O", "B-X", "I-X"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.just(10**30), st.floats(), TEXT, st.sampled_from(NAMES))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(NAMES) | TEXT, inner, max_size=3)), max_leaves=8)
# What a field that takes text takes, with hostile text, or any JSON in its place.
TEXTS = TEXT | st.lists(TEXT, min_size=1, max_size=3) | JSON
BIG = "1" + "0" * 4400


def _text_of(value) -> str:
    """JSON text of ``value``, with every integer above 10**20 (``10**30`` among them) written as a 4,401-digit one (``json.dumps`` refuses
    to write such numbers itself)."""
    def shrink(v):
        if isinstance(v, bool) or not isinstance(v, (int, list, dict)):
            return v
        if isinstance(v, int):
            return "<BIG>" if abs(v) > 10**20 else v
        return [shrink(x) for x in v] if isinstance(v, list) else {k: shrink(x) for k, x in v.items()}
    return json.dumps(shrink(value)).replace('"<BIG>"', BIG)


# A route's own fields with arbitrary values, or anything at all in their place.
FIELDS = {
    "/v1/completions": {"prompt": TEXTS, "max_tokens": st.integers(0, 2), "n": st.integers(-1, 3), "stop": TEXTS},
    "/v1/chat/completions": {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]),
                                                                        "content": TEXTS}), max_size=2) | JSON,
                             "max_tokens": st.integers(0, 2)},
    "/v1/embeddings": {"input": TEXTS, "encoding_format": st.sampled_from(["float", "base64"]) | JSON},
    "/v1/classify": {"input": TEXTS},
    "/v1/tag": {"input": TEXTS},
    "/v1/qa": {"question": TEXTS, "context": TEXTS, "allow_empty": JSON},
}


@st.composite
def request_bodies(draw, route: str) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))  # not JSON, or not UTF-8, at all
    body = {"model": "m", **{k: draw(v) for k, v in FIELDS[route].items() if draw(st.booleans())}}
    if draw(st.integers(0, 5)) == 0:
        body[draw(TEXT)] = draw(JSON)
    text = _text_of(body).encode()
    if draw(st.integers(0, 5)) == 0:  # a byte that is not UTF-8 somewhere in it
        at = draw(st.integers(0, len(text)))
        text = text[:at] + b"\xff" + text[at:]
    return text


@pytest.mark.parametrize("route", FIELDS)
def test_any_request_is_answered_without_a_5xx(clients, route):
    # TestClient raises any exception the app lets escape: a traceback fails the test.
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request_bodies(route))
    def check(body):
        r = post(clients[route], route, body)
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r)

    check()


# A line: a JSON object with the readers' field names, any JSON, text, or bytes.
ROW = st.one_of(st.dictionaries(st.sampled_from(NAMES), JSON, min_size=1, max_size=4).map(_text_of),
                JSON.map(_text_of), TEXT, st.binary(max_size=30))
# A value where a reader expects text: text, text with a lone surrogate for sure, or anything.
BAD_TEXT = st.builds(lambda a, s, b: a + s + b, _PLAIN, st.sampled_from(["\ud800", "\udcff"]), _PLAIN)
VALUE = TEXT | BAD_TEXT | JSON
_TAG = st.sampled_from(["O", "B-X", "I-X"]) | VALUE
# Lines shaped as each reader's rows, with hostile values, so that most reach the checks past "no such field".
SHAPED = {
    ".jsonl": st.fixed_dictionaries({"text": VALUE, "label": VALUE}).map(_text_of),
    ".tsv": st.builds("{}\t{}".format, TEXT, VALUE),
    ".csv": st.builds("{},{}".format, TEXT, VALUE),
    "sft": st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": VALUE}), max_size=2)}).map(_text_of),
    "qa.jsonl": st.fixed_dictionaries({"question": VALUE, "context": VALUE, "answers": st.fixed_dictionaries(
        {"text": st.lists(VALUE, max_size=1), "answer_start": st.lists(st.integers(-1, 3) | JSON, max_size=1)})}
    ).map(_text_of),
    "qa.json": st.fixed_dictionaries({"data": st.lists(st.fixed_dictionaries({"paragraphs": st.lists(
        st.fixed_dictionaries({"context": VALUE, "qas": st.lists(st.fixed_dictionaries(
            {"id": VALUE, "question": VALUE, "answers": st.lists(st.fixed_dictionaries(
                {"text": VALUE, "answer_start": st.integers(-1, 3) | JSON}), max_size=1)}), max_size=2)}),
        max_size=2)}), max_size=1)}).map(_text_of),
    ".conll": st.builds("{}\t{}".format, TEXT, _TAG) | st.just(""),
    "tags.jsonl": st.fixed_dictionaries({"tokens": st.lists(VALUE, max_size=2),
                                         "tags": st.lists(_TAG, max_size=2)}).map(_text_of),
    "text.jsonl": st.fixed_dictionaries({"text": TEXT | BAD_TEXT}).map(_text_of),  # any bad line refuses the file
    "text.tsv": TEXT,
    "mc": st.fixed_dictionaries({"context": VALUE, "choices": st.lists(VALUE, max_size=2),
                                 "answer": st.integers(-1, 2) | JSON}).map(_text_of),
    "chat_questions": st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.just("user"), "content": VALUE}), max_size=1), "expect": VALUE}).map(_text_of),
}


def _write(path: Path, rows: list, first: str | None = None) -> Path:
    # A lone surrogate written as UTF-8 would write it (CESU-8 bytes): bytes that are not UTF-8, as any other.
    data = [r if isinstance(r, bytes) else r.encode("utf-8", "surrogatepass") for r in rows]
    path.write_bytes(b"\n".join(([first.encode()] if first else []) + data) + b"\n")
    return path


def _read_or_refuse(read, strings) -> None:
    """``read()`` returns rows whose every string is valid text (the tokenizer takes them), or raises one UserError
    line: nothing else escapes. ``strings`` picks the strings out of what ``read()`` returned."""
    try:
        found = read()
    except UserError as e:
        assert "\n" not in str(e), str(e)
        return
    json.dumps(strings(found), ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError on a lone surrogate


@pytest.mark.parametrize("kind", SHAPED)
def test_any_data_file_is_read_or_refused_in_one_line(kind):
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(st.one_of(SHAPED[kind], SHAPED[kind], SHAPED[kind], ROW), min_size=1, max_size=3))
    def check(rows):
        _read_any(rows, kind)

    check()


def _read_any(rows: list, kind: str) -> None:
    labeled = lambda x: [x.texts, x.labels]  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        if kind in (".tsv", ".csv"):
            f = _write(root / f"d{kind}", rows, first="text\tlabel" if kind == ".tsv" else "text,label")
            _read_or_refuse(lambda: read_labeled(f, "text", "label", log=lambda _: None), labeled)
        elif kind == ".jsonl":
            f = _write(root / "d.jsonl", ['{"text": "a", "label": "b"}', *rows])
            _read_or_refuse(lambda: read_labeled(f, "text", "label", log=lambda _: None), labeled)
        elif kind == "sft":
            f = _write(root / "c.jsonl", rows)
            for _, messages in read_conversations([f]):  # then each conversation's own check, as rendering does
                if not isinstance(messages, str):
                    _read_or_refuse(lambda: check_messages(messages), lambda _: messages)
        elif kind.startswith("qa"):
            f = _write(root / f"q.{kind.split('.')[1]}", rows)
            _read_or_refuse(lambda: read_qa(f, log=lambda _: None),
                            lambda found: [(e.question, e.context, e.answers) for e in found])
        elif kind == "mc":
            f = _write(root / "mc.jsonl", rows)
            _read_or_refuse(lambda: read_questions(f), lambda found: [(q.context, q.choices) for q in found])
        elif kind == "chat_questions":
            f = _write(root / "chat.jsonl", rows)
            _read_or_refuse(lambda: chat_questions(f), lambda found: found)
        elif kind.startswith("text"):
            f = _write(root / f"t.{kind.split('.')[1]}", rows, first="text" if kind.endswith("tsv") else None)
            _read_or_refuse(lambda: list(read_pieces([f], "text")), lambda found: [p.text for p in found])
        else:
            f = _write(root / ("t.conll" if kind == ".conll" else "t.jsonl"), rows)
            _read_or_refuse(lambda: read_tagged(f, log=lambda _: None), lambda found: [found.words, found.tags])
