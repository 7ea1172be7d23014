"""Many LoRA adapters on one base model (engine/lora.py, the server's adapter routes), in this process: requests
for the base and two adapters in one continuous batch give each the greedy tokens it gets alone, the merged model's
and (one case) PEFT's on transformers; both ways of computing the per-row products agree; /v1/models lists the
adapters; the admin routes load and unload at run time behind the API key; bad adapters are one line."""

from __future__ import annotations

import threading

import pytest
import torch

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.lora import LoraSlots
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.adapter_io import write_adapter
from scalenlp.models.adapters import LoraSpec, adapter_weights, add_adapters, match_targets, merge_adapters
from scalenlp.models.io import load_pretrained

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
