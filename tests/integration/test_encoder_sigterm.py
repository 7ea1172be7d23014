"""`scalenlp serve` on an encoder exits on SIGTERM while a long request is in flight: it drains for at most
--drain-timeout seconds, then cancels the request (issue 32, item 1: it used to encode all 2,048 texts first,
minutes, whatever the signals)."""

import signal
import threading
import time

import httpx
import pytest

from infer_helpers import serve_process
from scalenlp.models.packaged import packaged_model

# 30 x 10 tokens, past MiniLM's 256; 2,048 of them are 3.5 MB, inside the default body limit (4 MiB).
TEXT = " ".join(["sentence embeddings compare the meanings of whole texts"] * 30)


@pytest.mark.slow
def test_sigterm_drains_for_at_most_the_drain_timeout_then_exits():
    flags = ("--model-name", "minilm", "--dtype", "float32", "--device", "cpu", "--forward-batch", "1",
             "--max-request-tokens", "10000000", "--drain-timeout", "2")
    with serve_process(packaged_model("minilm"), *flags) as (url, proc):
        answers = []

        def long_request():  # 2,048 texts of 256 tokens, one per forward pass: minutes on a CPU
            try:
                answers.append(httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": [TEXT] * 2048},
                                          timeout=600).status_code)
            except httpx.TransportError as e:
                answers.append(e)

        client = threading.Thread(target=long_request, daemon=True)
        client.start()
        while "scalenlp_encoder_requests_total 1.0" not in httpx.get(url + "/metrics", timeout=30).text:
            assert not answers, answers  # answered before it was queued
            time.sleep(0.2)  # until the request is queued
        time.sleep(1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
        print(f"exited {rc} {took:.1f} s after SIGTERM (--drain-timeout 2)")
        assert rc == 0, rc  # drained, then out through the engine's stop (not killed by the re-raised signal)
        client.join(timeout=30)
        assert answers and answers[0] != 200, answers  # cancelled, not finished
