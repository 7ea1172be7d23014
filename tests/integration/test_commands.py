"""The `scalenlp` command in a process of its own, as a user runs it: `chat` on piped stdin, `serve` on a classifier,
and a byte that is not UTF-8 among the arguments (one error line, exit code 2)."""

import os
import subprocess
import sys

import httpx
import pytest

from infer_helpers import CLASSIFIER_LABELS, minilm_classifier, run_request, serve_process
from scalenlp.data.chat import encode_chat
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # each starts the command in a new interpreter (torch imported there): 13-27 s here


def test_chat_command_with_piped_stdin(hf_chat_model):
    folder = hf_chat_model
    engine = engine_from_checkpoint(EngineConfig(folder, dtype="float32", device="cpu", max_batch=2))
    system = {"role": "system", "content": "be brief"}

    def answer(messages):
        ids = encode_chat(engine.tokenizer, messages, engine.tokenizer_config)
        return run_request(engine, ids, SamplingParams(max_tokens=6, temperature=0))[0]

    try:
        first = answer([system, {"role": "user", "content": "hello"}])
        # The second turn sees the first; after /reset the third sees only the system message.
        second = answer([system, {"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "the quick"}])
        third = answer([system, {"role": "user", "content": "the quick"}])
    finally:
        engine.stop()
    assert second != third  # else the test could not tell whether the history was kept
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "scalenlp", "chat", "--checkpoint", str(folder), "--dtype", "float32",
                          "--device", "cpu", "--temperature", "0", "--max-tokens", "6", "--system", "be brief"],
                         input="hello\nthe quick\n\n/reset\nthe quick\n/exit\nnever read\n", capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{first}\n{second}\n{third}\n"
    assert "new conversation" in out.stderr


def test_serve_command_picks_the_encoder(tmp_path):
    classifier = minilm_classifier(tmp_path)
    headers = {"Authorization": "Bearer sk-enc"}
    with serve_process(classifier, "--api-key", "sk-enc", "--dtype", "float32", "--model-name", "cls") as (url, _):
        r = httpx.post(url + "/v1/classify", json={"model": "cls", "input": "good"}, headers=headers)
        assert r.status_code == 200 and list(r.json()["data"][0]["probabilities"]) == CLASSIFIER_LABELS
        assert httpx.post(url + "/v1/classify", json={"model": "cls", "input": "good"}).status_code == 401


def test_generate_invalid_utf8_argv_is_one_error_line(tiny_export):
    """The real thing: bytes that are not UTF-8 on the command line of a new process."""
    r = subprocess.run([sys.executable, "-m", "scalenlp.cli", "generate", "--checkpoint", str(tiny_export),
                        "--prompt", b"caf\xe9"], capture_output=True)
    assert r.returncode == 2 and r.stderr.startswith(b"error: --prompt is not valid Unicode"), r.stderr
    assert r.stderr.count(b"\n") == 1
