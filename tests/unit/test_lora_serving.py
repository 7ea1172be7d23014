"""Many LoRA adapters on one base model (engine/lora.py, the server's adapter routes), in this process: requests
for the base and two adapters in one continuous batch give each the greedy tokens it gets alone, the merged model's
and (one case) PEFT's on transformers; every way of computing the per-row products agrees; /v1/models lists the
adapters; the admin routes load and unload at run time behind the API key; bad adapters are one line."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine import lora as engine_lora
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.lora import FusedMultiLoRA, LoraSlots, UnknownAdapter
from scalenlp.engine.packing import fuse_projections, pack_linears
from scalenlp.engine.sampling import SamplingParams
from scalenlp.errors import UserError
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
    return collect(events)


def collect(events) -> list[list[int]]:
    """The token ids each queue of Deltas received, up to its finish."""
    out = []
    for q in events:
        ids, finished = [], False
        while not finished:
            d = q.get()
            ids += d.token_ids
            finished = d.finish_reason is not None
        out.append(ids)
    return out


def serving(export, adapters, max_loras=3, rank=4) -> Engine:
    model = load_pretrained(export)
    slots = LoraSlots(model, max_loras, rank, torch.float32)
    for name, (path, _) in adapters.items():
        slots.load(name, path)
    return engine_on(model, export, adapters=slots)


def mixed(engine: Engine, plan: list[str | None]) -> list[list[int]]:
    """The greedy ids of PROMPTS[i] for adapter plan[i], all in one batch: submitted while this thread holds the
    engine's lock, so that its loop admits them together."""
    import queue

    events = [queue.Queue() for _ in plan]
    with engine._wake:
        for i, name in enumerate(plan):
            engine.submit(PROMPTS[i], GREEDY, events[i].put, adapter=name)
    return collect(events)


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


@pytest.mark.parametrize("rows,tokens,path", [(1, 1, "gathered"), (4, 1, "dense"), (4, 2, "gathered"),
                                              (1, 1, "kernel"), (4, 1, "kernel")])
def test_every_way_of_the_products_equals_the_merged_layer(tiny_export, adapters, rows, tokens, path, monkeypatch):
    """A decode step (one token per row) on a CPU runs the kernel; without it, with rows outnumbering the highest
    slot used it computes densely with a mask; a prefill or fewer rows gather per row: each equals each row's
    merged model."""
    if path == "kernel":
        assert engine_lora.kernel_available(), "the LoRA decode kernel did not build"
    else:
        monkeypatch.setattr(engine_lora, "kernel_available", lambda: False)
    model = load_pretrained(tiny_export)
    slots = LoraSlots(model, 3, 4, torch.float32)
    for name, (path_, _) in adapters.items():
        slots.load(name, path_)
    plan = ("beta", None, "alpha", "beta")[:rows]
    tokens = torch.tensor([p[:tokens] for p in PROMPTS])[:rows]
    layer = slots.layers["layers.0.attention.wq"]
    calls = []
    layer.register_forward_hook(lambda m, args, out: calls.append(
        "gathered" if args[0].shape[-2] > 1 else "kernel" if m.selection.kernel else
        "dense" if m.selection.mask is not None else "gathered"))
    slots.select([slots.index_of(n) for n in plan])
    with torch.no_grad():
        got = model(tokens)
        for row, name in enumerate(plan):
            ref = adapters[name][1] if name else load_pretrained(tiny_export)
            torch.testing.assert_close(got[row], ref(tokens[row:row + 1])[0], rtol=1e-4, atol=1e-4)
    assert calls == [path]


@pytest.mark.parametrize("path", ["kernel", "dense", "gathered"])
def test_fused_projections_keep_each_parts_adapters(tiny_export, adapters, path, monkeypatch):
    """The engine's packing fuses q/k/v and gate/up into one base product each with adapters served too: each
    part adds its rows' own adapter products into its columns of the output, in every way of the products, as the
    unfused layers do; an adapter loaded after fusing is written into the parts and served; packing keeps that."""
    if path != "kernel":
        monkeypatch.setattr(engine_lora, "kernel_available", lambda: False)
    model, fused = load_pretrained(tiny_export), load_pretrained(tiny_export)
    slots = {id(m): LoraSlots(m, 3, 4, torch.float32) for m in (model, fused)}
    for m in (model, fused):
        slots[id(m)].load("alpha", adapters["alpha"][0])
    fuse_projections(fused)
    layer = fused.layers["0"]
    assert isinstance(layer.attention.wqkv, FusedMultiLoRA) and isinstance(layer.feed_forward.w13, FusedMultiLoRA)
    assert not hasattr(layer.attention, "wq") and not hasattr(layer.feed_forward, "w1")
    for m in (model, fused):
        slots[id(m)].load("beta", adapters["beta"][0])
        slots[id(m)].select([slots[id(m)].index_of(n) for n in ("beta", None, "alpha", "beta")])
    assert slots[id(fused)].selection.kernel == (path == "kernel")
    tokens = torch.tensor([p[:2 if path == "gathered" else 1] for p in PROMPTS])
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(fused(tokens), want, rtol=1e-5, atol=1e-5)
        pack_linears(fused)  # the fused base swapped for its packed form inside the wrapper
        assert type(layer.attention.wqkv.base) is not torch.nn.Linear
        torch.testing.assert_close(fused(tokens), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_each_rows_adapter_whatever_the_rows_an_adapter_has(dtype):
    """The kernel computes the rows of one adapter together, four at a time: adapters with 1, 2, 4 and 5 rows (a
    group of four and one more), rows on the base model and a partial tile of outputs (100: one tile of 64 and
    one of 36) each get out += B[s] (A[s] x), the base rows nothing."""
    assert engine_lora.kernel_available(), "the LoRA decode kernel did not build"
    torch.manual_seed(0)
    slots = torch.tensor([2, 0, 4, 3, 3, 1, 2, 3, 2, 4, 2, 3, 2, 1])  # slot 4 of 5: the zero slot, base rows
    x, a, b = torch.randn(len(slots), 40), torch.randn(5, 8, 40), torch.randn(5, 8, 100)
    a[4], b[4] = 0, 0
    out = torch.randn(len(slots), 100)
    want = out.double() + torch.einsum("rk,rjk,rjn->rn", x.double(), a[slots].double(), b[slots].double())
    got = out.to(dtype)
    torch.ops.scalenlp_lora.add_lora(got, x.to(dtype), a.to(dtype), b.to(dtype), slots)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    base = slots == 4
    assert torch.equal(got[base], out.to(dtype)[base])


def test_the_kernel_in_bfloat16_is_as_near_float32_as_the_dense_product(tiny_export, adapters, monkeypatch):
    """bfloat16 weights (the engine's default on CPUs that have it): the kernel sums in float32 where the dense
    product's matmuls accumulate bfloat16, so the two differ by rounding; the kernel's logits are no further from
    the float32 model's than the dense product's, and a row on the base model is left as it was."""
    assert engine_lora.kernel_available(), "the LoRA decode kernel did not build"
    tokens = torch.tensor([p[:1] for p in PROMPTS])
    plan = ("beta", None, "alpha", "beta")
    logits = {}
    for path, dtype in (("float32", torch.float32), ("kernel", torch.bfloat16), ("dense", torch.bfloat16)):
        if path == "dense":
            monkeypatch.setattr(engine_lora, "kernel_available", lambda: False)
        model = load_pretrained(tiny_export).to(dtype)
        slots = LoraSlots(model, 3, 4, dtype)
        for name, (folder, _) in adapters.items():
            slots.load(name, folder)
        slots.select([slots.index_of(n) for n in plan])
        assert slots.selection.kernel == (path != "dense")
        with torch.no_grad():
            logits[path] = model(tokens).float()
    error = {path: (logits[path] - logits["float32"]).abs().max().item() for path in ("kernel", "dense")}
    assert error["kernel"] <= 1.5 * error["dense"], error
    assert torch.equal(logits["kernel"][1], logits["dense"][1])  # the base row: the dense product adds zeros


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


def test_a_request_without_model_names_one_when_adapters_are_served(server):
    client, _ = server
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
        r = client.post(route, json={**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "serves several models ('tiny', 'alpha'" in r.json()["error"]["message"]


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


def test_unloading_an_adapter_lets_its_requests_finish(tiny_export, adapters):
    engine = serving(tiny_export, adapters)
    try:
        expected = greedy(engine, PROMPTS[:2], "alpha")
        long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        got = [[], []]
        finished = [threading.Event(), threading.Event()]

        def on_event(i):
            def event(d):
                got[i] += d.token_ids
                if d.finish_reason is not None:
                    finished[i].set()
            return event

        engine.submit_many([(p, long) for p in PROMPTS[:2]], [on_event(0), on_event(1)], adapter="alpha")
        while not got[0]:  # running on the adapter
            finished[0].wait(0.01)
        engine.unload_adapter("alpha")
        with pytest.raises(UnknownAdapter, match=r"no adapter named 'alpha' is loaded \(adapters: beta\)"):
            engine.submit(PROMPTS[0], GREEDY, print, adapter="alpha")
        assert engine.adapters.retiring == {1}  # its slot waits for the requests in flight
        for event in finished:
            event.wait()
        assert [g[:8] for g in got] == expected and all(len(g) == 100 for g in got)
        greedy(engine, PROMPTS[:1])  # a step after they finished frees the slot
        assert engine.adapters.retiring == set()
        engine.adapters.load("gamma", adapters["beta"][0])
        assert engine.adapters.index_of("gamma") == 1
        assert greedy(engine, PROMPTS, "gamma") == greedy(engine, PROMPTS, "beta")
    finally:
        engine.stop()


def test_serve_flags_load_adapters_and_bad_flags_are_one_line(tiny_export, adapters):
    from scalenlp.engine.config import EngineConfig
    from scalenlp.engine.llm import LLM

    flags = [f"{name}={path}" for name, (path, _) in adapters.items()]
    with LLM(tiny_export, lora=flags, dtype="float32") as llm:
        slots = llm.engine.adapters
        assert (slots.max_loras, slots.max_rank, sorted(slots.names)) == (2, 4, ["alpha", "beta"])
        out = llm.generate(["the quick"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "alpha")
    merged = engine_on(adapters["alpha"][1], tiny_export)
    try:
        assert out == merged.generate(["the quick"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        merged.stop()
    for lora, message in ((["alpha"], "must be NAME=PATH"), (["a=x", "a=y"], "names 'a' twice")):
        with pytest.raises(UserError, match=message):
            EngineConfig(tiny_export, lora=lora).check()
    with pytest.raises(UserError, match="--max-loras 1 is fewer than the 2 --lora adapters"):
        EngineConfig(tiny_export, lora=flags, max_loras=1).check()
    with pytest.raises(UserError, match="not served with --tp or --compile"):
        EngineConfig(tiny_export, lora=flags, compile=True).check()


def test_serve_takes_repeated_lora_flags_and_generate_none():
    import argparse

    from scalenlp.cli import generate, serve
    from scalenlp.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--checkpoint", "m", "--lora", "a=x", "--lora", "b = y", "--max-loras", "3"])
    config = EngineConfig.from_args(args)
    assert config.adapters() == {"a": "x", "b": "y"} and config.max_loras == 3 and config.serves_adapters
    assert not EngineConfig.from_args(parser.parse_args(["--checkpoint", "m"])).serves_adapters
    terminal = argparse.ArgumentParser()
    generate.add_arguments(terminal)
    with pytest.raises(SystemExit):
        terminal.parse_args(["--checkpoint", "m", "--lora", "a=x"])


def test_an_adapter_peft_made_serves_peft_s_greedy_tokens(hf_llama, tmp_path, transformers):
    from peft import LoraConfig, get_peft_model

    from scalenlp.loader import load

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    torch.manual_seed(3)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "peft")
    prompt = [5, 17, 60, 33, 102]
    with torch.no_grad():
        expected = peft_model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    model, pre = load(hf_llama, dtype=torch.float32)
    slots = LoraSlots(model, 1, 4, torch.float32)
    slots.load("peft", tmp_path / "peft")
    engine = Engine(model, pre.tokenizer, max_batch=2, pack_weights=False, adapters=slots).start()
    try:
        assert greedy(engine, [prompt], "peft")[0] == expected[0, len(prompt):].tolist()
        assert greedy(engine, [prompt])[0] != expected[0, len(prompt):].tolist()
    finally:
        engine.stop()
