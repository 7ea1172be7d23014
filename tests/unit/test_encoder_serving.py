"""Encoders served: /v1/embeddings through the official `openai` client (MiniLM, equal to
sentence-transformers), /v1/classify on a small random classifier (equal to a direct forward), the
batcher sharing forward passes between concurrent requests, bad requests answered 4xx, and the
`scalenlp classify` / `embed` commands. (`scalenlp serve` on a classifier: integration/test_commands.py; encoder
replicas on Ray Serve: integration/test_ray_serve_encoders.py.)"""

import base64
import json
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from infer_helpers import CLASSIFIER_LABELS as LABELS
from infer_helpers import ServerThread, minilm_classifier
from scalenlp import loader
from scalenlp.cli import main
from scalenlp.engine.config import EncoderEngineConfig, EngineConfig
from scalenlp.engine.decoder_engine import QueueFull
from scalenlp.engine.encoder_engine import EncoderEngine, encoder_from_checkpoint
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend
from scalenlp.serving.encoder import EncoderBackend

torch.set_num_threads(1)

MINILM = packaged_model("minilm")
KEY = "sk-enc"
SENTENCES = ["A man is playing a guitar.", "The quick brown fox jumps over the lazy dog near the riverbank today.",
             "Hi", "Sentence embeddings compare meanings.", "it 's a charming and often affecting journey .",
             "unflinchingly bleak and desperate", "the movie is a disaster", "a gorgeous, witty, seductive movie."]
MAX_TEXTS = 16


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(MINILM), device="cpu")
    return torch.from_numpy(st.encode(SENTENCES, normalize_embeddings=True))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """infer_helpers.minilm_classifier: read, never written."""
    return minilm_classifier(tmp_path_factory.mktemp("cls"))


def serve(engine, name):
    return ServerThread(create_app(EncoderBackend(engine, name), api_key=KEY))


@pytest.fixture(scope="module")
def minilm():
    # A long wait, so that requests sent together surely share a forward pass.
    engine = encoder_from_checkpoint(EncoderEngineConfig(MINILM, dtype="float32", batch_wait_ms=200,
                                                         max_batch_texts=MAX_TEXTS))
    server = serve(engine, "minilm")
    yield server, engine
    server.stop()
    engine.stop()


@pytest.fixture(scope="module")
def classifying(classifier):
    engine = encoder_from_checkpoint(EncoderEngineConfig(classifier, dtype="float32"))
    server = serve(engine, "cls")
    yield server, engine
    server.stop()
    engine.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, route, body, key=KEY):
    return httpx.post(server.url + route, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_embeddings_equal_sentence_transformers(minilm, reference):
    server, engine = minilm
    out = client(server).embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(SENTENCES)))
    torch.testing.assert_close(torch.tensor([d.embedding for d in out.data]), reference, atol=1e-5, rtol=0)
    ids = [engine.tokenizer.encode(s, add_special_tokens=False).ids for s in SENTENCES]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(i) + 2 for i in ids)  # [CLS] ... [SEP]
    # The client's default asks for base64 and decodes it; token ids are embedded as their text is.
    encoded = client(server).embeddings.create(model="minilm", input=ids)
    torch.testing.assert_close(torch.tensor([d.embedding for d in encoded.data]), reference, atol=1e-5, rtol=0)
    raw = post(server, "/v1/embeddings", {"model": "minilm", "input": SENTENCES[0], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(vector.copy()), reference[0], atol=1e-5, rtol=0)


def test_concurrent_requests_share_forward_passes(minilm, reference):
    server, engine = minilm
    before = engine.forwards
    results = [None] * len(SENTENCES)
    start = threading.Barrier(len(SENTENCES))

    def one(i):
        start.wait()
        results[i] = client(server).embeddings.create(model="minilm", input=SENTENCES[i]).data[0].embedding

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(SENTENCES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.forwards - before < len(SENTENCES)
    torch.testing.assert_close(torch.tensor(results), reference, atol=1e-5, rtol=0)  # each got its own vector
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert f"scalenlp_encoder_forwards_total {float(engine.forwards)}" in metrics


def test_classify_equals_a_direct_forward(classifying, classifier):
    server, _ = classifying
    r = post(server, "/v1/classify", {"model": "cls", "input": SENTENCES[:3]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    model, pre = loader.load(classifier)
    tok = pre.tokenizer
    tok.no_padding()
    for d, text in zip(data, SENTENCES):
        assert list(d["probabilities"]) == LABELS
        assert sum(d["probabilities"].values()) == pytest.approx(1, abs=1e-6)
        with torch.no_grad():
            expected = model(torch.tensor([tok.encode(text).ids])).softmax(-1)[0]
        torch.testing.assert_close(torch.tensor(list(d["probabilities"].values())), expected, atol=1e-6, rtol=0)
        assert d["label"] == LABELS[int(expected.argmax())]
    assert len({d["label"] for d in data} | {max(d["probabilities"].values()) for d in data}) > 2  # not uniform
    one = post(server, "/v1/classify", {"model": "cls", "input": SENTENCES[0]}).json()["data"]
    assert one[0]["probabilities"] == pytest.approx(data[0]["probabilities"], abs=1e-6)
    # A classifier's encoder embeds too, pooled as its arguments say.
    emb = post(server, "/v1/embeddings", {"model": "cls", "input": SENTENCES[0]}).json()["data"][0]["embedding"]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(emb), model.embed(torch.tensor([tok.encode(SENTENCES[0]).ids]))[0],
                                   atol=1e-6, rtol=0)


def test_classify_takes_the_body_its_docs_and_schema_state(classifying):
    """docs/serving.md shows {"input": ...} alone: with one model served, the model may be left out, and the
    OpenAPI document says so, and says what comes back."""
    server, _ = classifying
    r = post(server, "/v1/classify", {"input": SENTENCES[:2]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "cls" and [d["index"] for d in out["data"]] == [0, 1]
    doc = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    route = doc["paths"]["/v1/classify"]["post"]
    body = doc["components"]["schemas"][route["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                                         .rsplit("/", 1)[1]]
    assert body["required"] == ["input"] and set(body["properties"]) == {"model", "input", "user"}
    answer = route["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(answer["required"]) == set(out) and set(answer["properties"]["data"]["items"]["required"]) == set(
        out["data"][0])


@pytest.mark.parametrize("route, body, status, says", [
    ("/v1/embeddings", {"model": "minilm", "input": []}, 400, "empty"),
    ("/v1/embeddings", {"model": "minilm", "input": ""}, 400, "empty"),
    ("/v1/embeddings", {"model": "minilm", "input": ["fine", "  "]}, 400, "input 1 is empty"),
    ("/v1/embeddings", {"model": "minilm", "input": [[]]}, 400, "empty"),
    ("/v1/embeddings", {"model": "minilm", "input": 5}, 400, "input"),
    ("/v1/embeddings", {"model": "minilm", "input": ["a", 3]}, 400, "input"),
    ("/v1/embeddings", {"input": [True, 2]}, 400, "input"),
    ("/v1/embeddings", {"model": "minilm", "input": [10**9]}, 400, "vocabulary"),
    ("/v1/embeddings", {"model": "minilm", "input": ["a"] * (MAX_TEXTS + 1)}, 400, "--max-batch-texts"),
    ("/v1/embeddings", {"model": "minilm", "input": "a", "dimensions": 64}, 400, "384 dimensions"),
    ("/v1/embeddings", {"model": "minilm", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ("/v1/embeddings", {"model": "minilm", "input": "a", "pooling": "max"}, 400, "pooling"),
    ("/v1/embeddings", {"model": "other", "input": "a"}, 404, "does not exist"),
    ("/v1/classify", {"model": "minilm", "input": "a"}, 400, "not a classifier"),
    ("/v1/classify", {"model": "minilm", "input": [1, 2]}, 400, "input"),
    ("/v1/completions", {"model": "minilm", "prompt": "a"}, 400, "use /v1/embeddings or /v1/classify"),
    ("/v1/completions", {"model": "minilm", "prompt": "a", "stream": True}, 400, "is an encoder"),
    ("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "a"}]}, 400, "encoder"),
])
def test_bad_requests_get_4xx(minilm, route, body, status, says):
    r = post(minilm[0], route, body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


def test_api_key_and_dimensions_equal(minilm):
    assert post(minilm[0], "/v1/embeddings", {"model": "minilm", "input": "a"}, key="wrong").status_code == 401
    r = post(minilm[0], "/v1/embeddings", {"model": "minilm", "input": "a", "dimensions": 384})
    assert len(r.json()["data"][0]["embedding"]) == 384


def test_encoder_routes_on_a_decoder(tiny_export):
    from scalenlp.engine.llm import engine_from_checkpoint

    engine = engine_from_checkpoint(EngineConfig(tiny_export, dtype="float32", max_batch=1))
    server = ServerThread(create_app(LocalBackend(engine, "dec")))
    try:
        for route in ("/v1/embeddings", "/v1/classify"):
            r = post(server, route, {"model": "dec", "input": "a"})
            assert r.status_code == 400 and "is a decoder" in r.json()["error"]["message"]
    finally:
        server.stop()
        engine.stop()


def test_queue_full_is_refused(classifier):
    model, pre = loader.load(classifier)
    engine = EncoderEngine(model, pre.tokenizer, max_queue=1, forward_batch=1, batch_wait_ms=0)
    release, taken = threading.Event(), threading.Event()
    forward = engine._forward

    def held(*a):
        taken.set()
        release.wait()
        return forward(*a)

    engine._forward = held
    engine.start()
    try:
        ids = engine.encode(["one text"])
        running = engine.submit("embed", ids)
        taken.wait()
        waiting = engine.submit("embed", ids)
        with pytest.raises(QueueFull):
            engine.submit("embed", ids)
        release.set()
        torch.testing.assert_close(running.result(), waiting.result())
    finally:
        release.set()
        engine.stop()


def test_a_short_request_is_answered_while_a_long_pass_runs(classifier):
    """With a short-pass worker, a one-word request is answered while a long text's pass is still running (held
    here until then): with one worker it would wait for that pass to end, as a pass cannot be interrupted."""
    model, pre = loader.load(classifier)
    engine = EncoderEngine(model, pre.tokenizer, batch_wait_ms=0, short_pass_tokens=16)
    release, long_taken = threading.Event(), threading.Event()
    forward = engine._forward

    def held(kind, batch):
        if max(len(job.ids[i]) for job, i in batch) > 16:
            long_taken.set()
            release.wait(60)
        return forward(kind, batch)

    engine._forward = held
    engine.start()
    try:
        long = engine.submit("embed", engine.encode([" ".join(["word"] * 40)]))
        assert long_taken.wait(60)
        short = engine.submit("embed", engine.encode(["word"]))
        short.result(timeout=60)  # a hang guard: answered at once, while the long pass is held
        assert not long.done()
        release.set()
        torch.testing.assert_close(long.result(timeout=60), engine.run("embed", [" ".join(["word"] * 40)]))
    finally:
        release.set()
        engine.stop()


def test_classify_and_embed_commands(classifier, capsys):
    model, pre = loader.load(classifier)
    tok = pre.tokenizer
    tok.no_padding()
    texts = SENTENCES[:2]
    assert main(["classify", "--checkpoint", str(classifier), "--text", texts[0], "--text", texts[1], "--json",
                 "--dtype", "float32"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with torch.no_grad():
        expected = [model(torch.tensor([tok.encode(t).ids])).softmax(-1)[0] for t in texts]
    assert [line["text"] for line in lines] == texts
    for line, p in zip(lines, expected):
        assert line["label"] == LABELS[int(p.argmax())]
        torch.testing.assert_close(torch.tensor(list(line["probabilities"].values())), p, atol=1e-6, rtol=0)
    assert main(["classify", "--checkpoint", str(classifier), "--text", texts[0], "--dtype", "float32"]) == 0
    label, spread, text = capsys.readouterr().out.rstrip("\n").split("\t")
    assert label == lines[0]["label"] and text == texts[0] and spread.count("=") == len(LABELS)

    assert main(["embed", "--checkpoint", str(MINILM), "--text", texts[0], "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == f"dim=384  norm=1.0000\t{texts[0]}\n"
    assert main(["embed", "--checkpoint", str(classifier), "--text", texts[0], "--json", "--dtype", "float32"]) == 0
    vector = json.loads(capsys.readouterr().out)["embedding"]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(vector), model.embed(torch.tensor([tok.encode(texts[0]).ids]))[0],
                                   atol=1e-6, rtol=0)
    assert main(["classify", "--checkpoint", str(MINILM), "--text", "a"]) == 2
    assert "not a classifier" in capsys.readouterr().err


def test_a_batch_takes_each_requests_shortest_texts_in_turn():
    """Batches serve the waiting requests in turn (fair), each its shortest texts first (less padding), and a
    request served goes behind those the batch did not reach."""
    from scalenlp.engine.encoder_engine import Job, fair_batch

    first, second = Job("embed", [[0] * n for n in (9, 1, 30, 8)]), Job("embed", [[0] * n for n in (29, 2, 10, 31)])
    third = Job("embed", [[0] * 5])
    unbounded = sum(len(ids) for job in (first, second, third) for ids in job.ids) ** 2  # no token budget here
    batch, rest = fair_batch([first, second, third], 2, unbounded)
    assert [(job, len(job.ids[i])) for job, i in batch] == [(first, 1), (second, 2)]
    assert rest == [third, first, second]
    batch, rest = fair_batch(rest, 4, unbounded)
    assert [(job, len(job.ids[i])) for job, i in batch] == [(third, 5), (first, 8), (second, 10), (first, 9)]
    assert rest == [first, second]  # third is done; the others keep the order they were served in


def test_a_batch_stays_within_its_token_budget_and_a_longer_text_runs_alone():
    """Padded to its longest text, a batch holds at most the budget's token positions: a short request still joins
    a long one's pass, a text that would push the padding past the budget waits, and a text over the budget on its
    own is taken alone rather than never."""
    from scalenlp.engine.encoder_engine import Job, fair_batch

    budget = 64
    big, small = Job("embed", [[0] * (budget // 2)] * 6), Job("embed", [[0] * 3])
    batch, rest = fair_batch([big], len(big.ids), budget)
    assert [len(big.ids[i]) for _, i in batch] == [budget // 2] * 2 and rest == [big]
    rest.append(small)  # a short request arrives: it shares the next pass, and the big one's second text waits
    batch, rest = fair_batch(rest, len(big.ids), budget)
    assert [(job, len(job.ids[i])) for job, i in batch] == [(small, 3), (big, budget // 2)]
    assert rest == [big] and len(big.pending) == 3
    huge = Job("embed", [[0] * (budget + 1)] * 2)
    batch, rest = fair_batch([huge, big], len(big.ids), budget)
    assert [(job, len(job.ids[i])) for job, i in batch] == [(huge, budget + 1)]
    assert rest == [big, huge]  # big was not reached (it did not fit): its turn comes first next time



def test_a_request_just_arrived_is_in_the_next_batch_when_a_batch_holds_fewer_texts_than_there_are_requests():
    """With a token budget a pass may hold fewer texts than there are waiting requests: the turn goes to the
    requests that have had the fewest tokens encoded, so a newcomer does not wait for a round of all the others."""
    from scalenlp.engine.encoder_engine import Job, fair_batch

    width = 8
    queue = [Job("embed", [[0] * width] * 4) for _ in range(6)]
    while any(job.taken == 0 for job in queue):  # two texts a pass, until every request has had one
        batch, queue = fair_batch(queue, len(queue), 2 * width)
    newcomer = Job("embed", [[0] * width])
    queue.append(newcomer)
    batch, queue = fair_batch(queue, len(queue), 2 * width)
    assert newcomer in [job for job, _ in batch] and not newcomer.pending


def test_passes_are_padded_to_a_bounded_set_of_widths():
    """A pass is padded to one of a few widths (oneDNN compiles and keeps a kernel per input shape): 48 up to 256
    tokens, never narrower than its longest text nor wider than the longest a text can be, and at most an eighth
    wider than its longest text."""
    from scalenlp.engine.encoder_engine import padded_width

    widths = [padded_width(n, 256) for n in range(1, 257)]
    assert len(set(widths)) == 48 and widths[-1] == 256
    assert all(n <= w <= n * 1.125 for n, w in enumerate(widths, 1))
    assert padded_width(100, 100) == 100 and padded_width(129, 140) == 140  # the cap: no text is longer
    assert padded_width(300, 256) == 300  # token ids past the model's window are not cut here


def test_a_batch_budget_counts_the_padded_width():
    """The token budget bounds the positions a pass computes, padding included."""
    from scalenlp.engine.encoder_engine import Job, fair_batch, padded_width

    job = Job("embed", [[0] * 17] * 4)  # padded to 18: three fit in 53 positions unpadded, two padded
    batch, _ = fair_batch([job], 4, 53, lambda n: padded_width(n, 256))
    assert len(batch) == 2


def test_padded_passes_give_the_vectors_of_unpadded_ones():
    """Texts of every length from 3 to 40 tokens, sent together and alone, embed as one unpadded forward of each
    does (the padding is masked), and the passes took widths from the bounded set only."""
    from scalenlp.engine.encoder_engine import padded_width

    engine = encoder_from_checkpoint(EncoderEngineConfig(MINILM, dtype="float32", batch_wait_ms=50))
    try:
        texts = [" ".join(["word"] * n) for n in range(1, 39)]
        widths, embed = [], engine.model.embed
        engine.model.embed = lambda ids, mask: widths.append(ids.shape[1]) or embed(ids, mask)
        try:
            together = engine.run("embed", texts)
        finally:
            del engine.model.embed
        assert set(widths) <= {padded_width(n, engine.max_seq_len) for n in range(1, 41)} and len(set(widths)) > 1
        with torch.inference_mode():
            alone = torch.cat([engine.model.embed(torch.tensor([ids])) for ids in engine.encode(texts)])
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    finally:
        engine.stop()
