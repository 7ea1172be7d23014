"""Tensor parallelism over two gloo processes answers as one process does: `scalenlp serve --tp 2` token for token
on a Llama with an odd vocabulary; under `LLM(tp=2)`, a GPT-2 (biases, learned positions), chat on a Hugging Face
chat model (every rank reading the folder), a structurally pruned export, and quantized models (at load, as an
export, and activation-aware)."""

import json

import httpx
import pytest
import torch

from infer_helpers import SENTENCES, make_export, quantizable_decoder, serve_process
from scalenlp.cli import main
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.llm import LLM
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained

pytestmark = pytest.mark.slow  # each starts a second rank, and the first test a server: 20-80 s each here

torch.set_num_threads(1)
PROMPTS = ["the quick brown fox", "hello", "continuous batching lets requests join", "a"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def on_one_and_two_ranks(checkpoint, ask, **options) -> list:
    """What ``ask(llm)`` returns with the checkpoint on one process and on two tensor-parallel ranks: the second
    rank is a spawned process, this one the first (the server's HTTP path is the first test's)."""
    answers = []
    for tp in (1, 2):
        with LLM(checkpoint, dtype="float32", tp=tp, **options) as llm:
            answers.append(ask(llm))
    return answers


def odd_vocabulary_export(root, flavor):
    """An odd vocabulary (the tokenizer has at most 320 tokens) shards unevenly over the two ranks."""
    export = make_export(root, flavor, vocab_size=321)
    assert json.loads((export / "model_args.json").read_text())["vocab_size"] % 2 == 1
    return export


def test_serve_tp2_greedy_identical_to_tp1(tmp_path):
    export = odd_vocabulary_export(tmp_path, "debug")
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=4, eos_id=find_eos_token_id(tok)).start()
    try:
        expected = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.stop()
    with serve_process(export, "--tp", "2", "--dtype", "float32", "--max-batch", "4", "--model-name", "m") as (url, _):
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"model": "m", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == expected


def test_gpt2_tp2_greedy_identical_to_tp1(tmp_path):
    one, two = on_one_and_two_ranks(odd_vocabulary_export(tmp_path, "debug-gpt2"),
                                    lambda llm: llm.generate(PROMPTS, GREEDY), max_batch=4)
    assert one == two


def test_chat_on_a_tensor_parallel_hf_model(hf_chat_model):
    """Every rank reads the Hugging Face folder, and chat (the template, its end of turn) answers as on one process."""
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    one, two = on_one_and_two_ranks(hf_chat_model,
                                    lambda llm: llm.chat(question, SamplingParams(max_tokens=12, temperature=0)))
    assert one == two


def test_structured_export_under_tp2_as_on_one_process(tmp_path):
    export = make_export(tmp_path, "small-llama")  # 8 heads in 4 KV groups, ffn 688: 0.5 keeps 2 groups, 344
    out = tmp_path / "pruned"
    assert main(["prune", "--checkpoint", str(export), "--method", "structured", "--out", str(out)]) == 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one, two = on_one_and_two_ranks(out, lambda llm: llm.generate(["the quick brown fox", "hello"], params),
                                    max_batch=2)
    assert one == two


def test_tp2_quantized_greedy_equals_tp1(tmp_path):
    """Quantized at load (int8) and a quantized export (int4, group 32), sharded over two ranks: both quantize the
    whole model, then slice it, so the ranks multiply by the single-process weights and only the order of the
    sums differs; greedy tokens match the single process's. GPT-2's shape: biases, the row-parallel one added once."""
    export = make_export(tmp_path / "m", "debug-gpt2")
    assert main(["quantize", "--checkpoint", str(export), "--method", "int4", "--group-size", "32",
                 "--out", str(tmp_path / "q")]) == 0
    for checkpoint, options in ((export, {"quantize": "int8"}), (tmp_path / "q", {})):
        one, two = on_one_and_two_ranks(checkpoint, lambda llm: llm.generate(PROMPTS, GREEDY), **options)
        assert one == two


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
    one, two = on_one_and_two_ranks(out, lambda llm: llm.generate(["the quick brown fox", "hello"],
                                                                   SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True)))
    assert one == two
