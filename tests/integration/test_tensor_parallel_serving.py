"""`scalenlp serve --tp 2`: two gloo processes, greedy output token-for-token identical to TP=1."""

import json

import httpx
import pytest
import torch

from infer_helpers import make_export, serve_process
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
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
