"""Tensor parallelism over two gloo processes answers as one process does: `scalenlp serve --tp 2` token for token
on a Llama and a GPT-2 with an odd vocabulary, on a Hugging Face chat model and on a structurally pruned export;
quantized (at load, as an export, and activation-aware) under `LLM(tp=2)`."""

import json

import httpx
import pytest
import torch

from infer_helpers import SENTENCES, make_export, quantizable_decoder, run_request, serve_process
from scalenlp.cli import main
from scalenlp.data.chat import encode_chat
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.llm import LLM, engine_from_checkpoint
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)
PROMPTS = ["the quick brown fox", "hello", "continuous batching lets requests join", "a"]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.slow  # a server and its second rank: 45-90 s here
@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_tp2_greedy_identical_to_tp1(tmp_path, flavor):
    # An odd vocabulary (the tokenizer has at most 320 tokens) shards unevenly over the two ranks, and serves alike.
    export = make_export(tmp_path, flavor, vocab_size=321)
    assert json.loads((export / "model_args.json").read_text())["vocab_size"] % 2 == 1
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=4, eos_id=find_eos_token_id(tok)).start()
    try:
        expected = engine.generate(PROMPTS, SamplingParams(max_tokens=16, **GREEDY))
    finally:
        engine.stop()
    with serve_process(export, "--tp", "2", "--dtype", "float32", "--max-batch", "4", "--model-name", "m") as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"model": "m", "prompt": PROMPTS, "max_tokens": 16, **GREEDY})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == expected


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_chat_on_a_tensor_parallel_hf_model(hf_chat_model):
    """`serve --tp 2` reads a Hugging Face folder on every rank and answers chat as one process does."""
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    engine = engine_from_checkpoint(EngineConfig(hf_chat_model, dtype="float32", device="cpu", max_batch=2))
    try:
        ids = encode_chat(engine.tokenizer, question, engine.tokenizer_config)
        expected = run_request(engine, ids, SamplingParams(max_tokens=12, temperature=0))[0]
    finally:
        engine.stop()
    with serve_process(hf_chat_model, "--tp", "2", "--dtype", "float32", "--model-name", "m") as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={"model": "m", "messages": question, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.slow  # two serving processes
def test_structured_export_serves_under_tp2_as_on_one_process(tmp_path):
    export = make_export(tmp_path, "small-llama")  # 8 heads in 4 KV groups, ffn 688: 0.5 keeps 2 groups, 344
    out = tmp_path / "pruned"
    assert main(["prune", "--checkpoint", str(export), "--method", "structured", "--out", str(out)]) == 0
    prompts = ["the quick brown fox", "hello"]
    params = dict(max_tokens=8, **GREEDY)
    with LLM(out, dtype="float32", max_batch=2) as llm:
        expected = llm.generate(prompts, SamplingParams(**params))
    with serve_process(out, "--tp", "2", "--dtype", "float32", "--max-batch", "2", "--model-name", "m") as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=300, json={"model": "m", "prompt": prompts, **params})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == expected


@pytest.mark.slow  # two processes
def test_tp2_quantized_greedy_equals_tp1(tmp_path):
    """Quantized at load (int8) and a quantized export (int4, group 32), sharded over two ranks: both quantize the
    whole model, then slice it, so the ranks multiply by the single-process weights and only the order of the
    sums differs; greedy tokens match the single process's. GPT-2's shape: biases, the row-parallel one added once."""
    export = make_export(tmp_path / "m", "debug-gpt2")
    assert main(["quantize", "--checkpoint", str(export), "--method", "int4", "--group-size", "32",
                 "--out", str(tmp_path / "q")]) == 0
    params = SamplingParams(max_tokens=16, **GREEDY)
    for checkpoint, options in ((export, {"quantize": "int8"}), (tmp_path / "q", {})):
        outputs = []
        for tp in (1, 2):
            with LLM(checkpoint, dtype="float32", tp=tp, **options) as llm:
                outputs.append(llm.generate(PROMPTS, params))
        assert outputs[0] == outputs[1]


@pytest.mark.slow  # two processes
def test_calibrated_export_serves_under_tp2_as_on_one_process(tmp_path):
    """The folded norms and the scaled, rounded weights of an activation-aware int4 export shard like any int4
    export: greedy tokens on two ranks are the single process's."""
    export = quantizable_decoder(tmp_path, loud_channels=4)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(SENTENCES * 8))
    out = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(export), "--method", "int4", "--group-size", "32",
                 "--calibration", str(text), "--calibration-samples", "4", "--calibration-seq", "32",
                 "--out", str(out)]) == 0
    outputs = []
    for tp in (1, 2):
        with LLM(out, dtype="float32", tp=tp) as llm:
            outputs.append(llm.generate(["the quick brown fox", "hello"], SamplingParams(max_tokens=12, **GREEDY)))
    assert outputs[0] == outputs[1]
