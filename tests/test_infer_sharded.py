"""`scalenlp serve --tp 2`: two gloo processes, greedy output token-for-token identical to TP=1."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from infer_helpers import make_export, wait_healthy
from train_helpers import HANG_GUARD_S, cli_env, error_lines

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.infer.engine import Engine
from scalenlp.infer.sampling import SamplingParams
from scalenlp.infer.sharded import free_port
from scalenlp.models.io import load_pretrained
from scalenlp.train import faults

torch.set_num_threads(1)
PROMPTS = ["the quick brown fox", "hello", "continuous batching lets requests join", "a"]


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_tp2_greedy_identical_to_tp1(tmp_path, flavor):
    # An odd vocabulary (the tokenizer has at most 320 tokens) shards unevenly over the two ranks, and serves alike.
    export = make_export(tmp_path, flavor, vocab_size=321)
    assert json.loads((export / "model_args.json").read_text())["vocab_size"] % 2 == 1
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=4, eos_id=find_eos_token_id(tok)).start()
    try:
        expected = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", str(export), "--tp", "2",
                             "--port", str(port), "--dtype", "float32", "--max-batch", "4", "--model-name", "m"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "m", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == expected
    finally:
        proc.terminate()
        proc.wait(timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_whose_forward_raises_ends_generate(tmp_path, rank):
    """The first decode step (forward 1, after the prefill) raises on one rank: the other ranks wait in a
    collective it never joins, yet every process ends, with one error line that names the rank and the error."""
    export = make_export(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "scalenlp", "generate", "--checkpoint", str(export), "--tp", "2",
                           "--dtype", "float32", "--prompt", "hello", "--max-tokens", "4"],
                          env={**cli_env(), faults.ENV: f"raise@{rank}:1"}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    [line] = error_lines(proc.stderr)
    assert f"tensor-parallel rank {rank} failed: RuntimeError('{faults.ENV}: injected failure at step 1')" in line
