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
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained
from scalenlp.parallel.mesh import free_port
from scalenlp import faults

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


@pytest.mark.slow
def test_a_follower_failing_under_serve_answers_the_request_in_flight_with_503(tmp_path):
    """Rank 1's first decode step raises while a request is in flight: that request gets a 503 that names the
    rank and its error (not a dropped connection), and the server exits 1 for its supervisor to restart it."""
    export = make_export(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", str(export), "--tp", "2",
                             "--port", str(port), "--dtype", "float32", "--model-name", "m"],
                            env={**cli_env(), faults.ENV: "raise@1:1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", timeout=HANG_GUARD_S,
                       json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert "tensor-parallel rank 1 failed" in r.json()["error"]["message"]
        assert proc.wait(timeout=HANG_GUARD_S) == 1
    finally:
        proc.kill()
        proc.wait()


def _exit_when_told(go, code: int) -> None:
    go.wait()
    sys.exit(code)


def test_a_follower_that_dies_is_reported_to_the_engine_with_its_exit_code():
    import multiprocessing
    import threading

    from scalenlp.engine.sharded import Followers

    ctx = multiprocessing.get_context("spawn")
    reports, _ = ctx.Pipe(duplex=False)
    go, told, done = ctx.Event(), [], threading.Event()
    follower = ctx.Process(target=_exit_when_told, args=(go, 3))
    follower.start()
    watched = Followers([follower], reports)
    watched.on_failure = lambda error: (told.append(error), done.set())
    go.set()  # only now: with no engine to tell, the watcher would end this process
    assert done.wait(HANG_GUARD_S)
    assert [str(e) for e in told] == ["tensor-parallel rank 1 died (exit code 3)"]


def test_a_follower_that_dies_while_rank_0_loads_ends_rank_0_with_one_line():
    """No engine yet (rank 0 loading, or waiting for the others to join): nothing is in flight, rank 0 exits 1."""
    script = ("import multiprocessing, time, sys\n"
              "from scalenlp.engine.sharded import Followers\n"
              "if __name__ == '__main__':\n"
              "    ctx = multiprocessing.get_context('spawn')\n"
              "    p = ctx.Process(target=sys.exit, args=(3,)); p.start()\n"
              "    Followers([p], ctx.Pipe(duplex=False)[0])\n"
              "    time.sleep(3600)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 1
    assert error_lines(proc.stderr) == ["error: tensor-parallel rank 1 died (exit code 3); stopping"]
