"""Many LoRA adapters on one base model (engine/lora.py, the server's adapter routes), in this process: requests
for the base and two adapters in one continuous batch give each the greedy tokens it gets alone, the merged model's
and (one case) PEFT's on transformers; both ways of computing the per-row products agree; /v1/models lists the
adapters; the admin routes load and unload at run time behind the API key; bad adapters are one line."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.lora import LoraSlots
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.adapter_io import write_adapter
from scalenlp.models.adapters import LoraSpec, adapter_weights, add_adapters, match_targets, merge_adapters
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.io import load_pretrained
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)
KEY = "sk-test"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 30, 41], [7, 3], [60, 2, 11, 12, 13], [8, 100, 4]]


def adapted(export, seed: int, targets: str = "all-linear", rank: int = 4):
    """The export's model with a random adapter of rank ``rank`` on ``targets`` (B not zero, so it changes
    outputs)."""
    model = load_pretrained(export)
    torch.manual_seed(seed)
    add_adapters(model, LoraSpec(rank=rank, alpha=2 * rank), match_targets(model, targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def adapters(tiny_export, tmp_path_factory):
    """Two adapter folders in our layout for the tiny export (one on every block linear, one on q/v only, of
    another rank), and each one's merged model."""
    root = tmp_path_factory.mktemp("adapters")
    found = {}
    for name, seed, targets, rank in (("alpha", 1, "all-linear", 4), ("beta", 2, "attention.w[qv]", 2)):
        model = adapted(tiny_export, seed, targets, rank)
        write_adapter(root / name, LoraSpec(rank=rank, alpha=2 * rank), adapter_weights(model), None)
        found[name] = (root / name, merge_adapters(model))
    return found


def engine_on(model, export, **kw) -> Engine:
    tok = load_tokenizer(export)
    return Engine(model, tok, max_batch=4, eos_id=find_eos_token_id(tok), pack_weights=False, **kw).start()


def greedy(engine: Engine, prompts, adapter=None) -> list[list[int]]:
    """Each prompt's greedy token ids."""
    import queue

    events = [queue.Queue() for _ in prompts]
    engine.submit_many([(p, GREEDY) for p in prompts], [q.put for q in events], adapter=adapter)
    out = []
    for q in events:
        ids = []
        while True:
            d = q.get()
            ids += d.token_ids
            if d.finish_reason is not None:
                break
        out.append(ids)
    return out


def serving(export, adapters, max_loras=3, rank=4) -> Engine:
    model = load_pretrained(export)
    slots = LoraSlots(model, max_loras, rank, torch.float32)
    for name, (path, _) in adapters.items():
        slots.load(name, path)
    return engine_on(model, export, adapters=slots)


def mixed(engine: Engine, plan: list[str | None]) -> list[list[int]]:
    """The greedy ids of PROMPTS[i] for adapter plan[i], all submitted together (one continuous batch)."""
    results: list = [None] * len(plan)
    barrier = threading.Barrier(len(plan))

    def one(i):
        barrier.wait()
        results[i] = greedy(engine, [PROMPTS[i]], plan[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_mixed_batch_gives_each_adapter_its_merged_models_tokens(tiny_export, adapters):
    expected = {None: greedy(engine := engine_on(load_pretrained(tiny_export), tiny_export), PROMPTS)}
    engine.stop()
    for name, (_, merged) in adapters.items():
        engine = engine_on(merged, tiny_export)
        expected[name] = greedy(engine, PROMPTS)
        engine.stop()
    assert expected["alpha"] != expected[None] and expected["beta"] != expected[None]
    engine = serving(tiny_export, adapters)
    try:
        # alone: every prompt on one adapter at a time
        for name in (None, "alpha", "beta"):
            assert greedy(engine, PROMPTS, name) == expected[name], name
        # together: the base and both adapters in the same prefill and decode steps
        plan = [None, "alpha", "beta", "alpha"]
        assert mixed(engine, plan) == [expected[name][i] for i, name in enumerate(plan)]
    finally:
        engine.stop()


@pytest.mark.parametrize("rows", [1, 4])
def test_dense_and_gathered_products_equal_the_merged_layer(tiny_export, adapters, rows):
    """Rows outnumbering the highest slot used compute densely with a mask, fewer gather per row: a batch of one
    row on slot 2 gathers; both equal each row's merged model."""
    model = load_pretrained(tiny_export)
    slots = LoraSlots(model, 3, 4, torch.float32)
    for name, (path, _) in adapters.items():
        slots.load(name, path)
    plan = [slots.index_of(n) for n in ("beta", None, "alpha", "beta")[:rows]]
    tokens = torch.tensor([p[:2] for p in PROMPTS])[:rows]
    slots.select(plan)
    assert (slots.selection.mask is None) == (rows == 1)
    with torch.no_grad():
        got = model(tokens)
        for row, name in enumerate(("beta", None, "alpha", "beta")[:rows]):
            ref = adapters[name][1] if name else load_pretrained(tiny_export)
            torch.testing.assert_close(got[row], ref(tokens[row:row + 1])[0], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def server(tiny_export, adapters):
    """The tiny export served with alpha loaded and a free slot, behind an API key."""
    model = load_pretrained(tiny_export)
    slots = LoraSlots(model, 2, 4, torch.float32)
    slots.load("alpha", adapters["alpha"][0])
    engine = engine_on(model, tiny_export, adapters=slots)
    with TestClient(create_app(LocalBackend(engine, "tiny"), api_key=KEY)) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        yield client, engine
    engine.stop()


def complete(client, model: str, prompt=PROMPTS[1]):
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0, "ignore_eos": True})


def test_models_lists_the_adapters_and_requests_pick_them(server, adapters):
    client, engine = server
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("alpha", "tiny")]
    assert listed[1]["root"] == str(adapters["alpha"][0])
    out = complete(client, "alpha").json()
    assert out["model"] == "alpha"
    assert out["choices"][0]["text"] == engine.tokenizer.decode(greedy(engine, [PROMPTS[1]], "alpha")[0])
    assert complete(client, "tiny").json()["choices"][0]["text"] != out["choices"][0]["text"]
    missing = complete(client, "gamma")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "'tiny', 'alpha'" in missing.json()["error"]["message"]


def test_adapters_load_and_unload_at_run_time_behind_the_key(server, adapters):
    client, engine = server
    body = {"lora_name": "beta", "lora_path": str(adapters["beta"][0])}
    assert client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert complete(client, "beta").status_code == 404
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert "beta" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    expected = engine.tokenizer.decode(greedy(engine, [PROMPTS[1]], "beta")[0])
    assert complete(client, "beta").json()["choices"][0]["text"] == expected
    again = client.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    full = client.post("/v1/load_lora_adapter", json={**body, "lora_name": "gamma"})
    assert full.status_code == 400 and "all 2 adapter slots are in use" in full.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
    assert complete(client, "beta").status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert gone.status_code == 404 and "adapters: alpha" in gone.json()["error"]["message"]
    # the freed slot takes another adapter
    assert client.post("/v1/load_lora_adapter", json={**body, "lora_name": "gamma"}).status_code == 200
    assert complete(client, "gamma").json()["choices"][0]["text"] == expected
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200


def test_without_an_api_key_the_admin_routes_are_refused(tiny_export):
    model = load_pretrained(tiny_export)
    engine = engine_on(model, tiny_export, adapters=LoraSlots(model, 1, 4, torch.float32))
    try:
        with TestClient(create_app(LocalBackend(engine, "tiny"))) as client:
            r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})
            assert r.status_code == 403 and "start the server with --api-key-file" in r.json()["error"]["message"]
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 403
    finally:
        engine.stop()


def test_bad_adapters_are_one_line(server, tmp_path, tiny_export):
    client, _ = server

    def load(path, name="bad"):
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "\n" not in message
        return message

    def folder(name, model, spec):
        write_adapter(tmp_path / name, spec, adapter_weights(model), None)
        return tmp_path / name

    assert "is not an adapter folder: it needs adapter_config.json" in load(tmp_path / "nowhere")
    torch.manual_seed(0)
    other = Transformer(ModelArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
    add_adapters(other, LoraSpec(rank=2, alpha=4), match_targets(other, "all-linear"))
    assert "needs (2, 64) and (32, 2); it was made for another base model" in load(folder("other", other, LoraSpec(rank=2, alpha=4)))
    wide = adapted(tiny_export, 0, rank=8)
    assert "rank 8, more than this engine's --max-lora-rank 4" in load(folder("wide", wide, LoraSpec(8, 16)))
    dora = load_pretrained(tiny_export)
    add_adapters(dora, LoraSpec(rank=2, alpha=4, dora=True), match_targets(dora, "all-linear"))
    assert "DoRA adapter" in load(folder("dora", dora, LoraSpec(rank=2, alpha=4, dora=True)))
    assert "the base model's name" in load(tmp_path / "dora", name="tiny")
    assert "non-empty" in load(tmp_path / "dora", name=" spaced ")
