"""Encoder replicas on Ray Serve: classify and embeddings answered as one process answers them, by both replicas.
(A quantized decoder's replica, built in this process: unit/test_quantization.py.)"""

import os
import threading
import time

import httpx
import pytest
import torch

from infer_helpers import RAY_INIT, minilm_classifier
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.parallel.mesh import free_port
from scalenlp.serving import cluster
from scalenlp.serving.limits import ServeLimits

pytestmark = pytest.mark.slow  # starts Ray and Serve: 45-70 s here

torch.set_num_threads(1)
os.environ.update(cluster.LOCAL_RAY_ENV)  # the local Ray instance stays on loopback (read on import)
pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'scalenlp[cluster]'")
KEY = "sk-enc"
TEXTS = ["A man is playing a guitar.", "Hi", "the movie is a disaster", "a gorgeous, witty, seductive movie."]


def test_encoder_replicas(tmp_path):
    """Two encoder replicas behind the router: concurrent classify and embeddings requests are answered (as one
    process answers them), both replicas serve, the generation routes are refused and the key is required."""
    classifier = minilm_classifier(tmp_path)
    config = EncoderEngineConfig(classifier, dtype="float32", device="cpu", forward_batch=4, max_batch_texts=8)
    url, owns_serve = cluster.start(config, ServeLimits(api_key=KEY), "cls", replicas=2, replica_cpus=0.5,
                                    port=free_port(), ray_init_kwargs=RAY_INIT)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        engine = encoder_from_checkpoint(EncoderEngineConfig(classifier, dtype="float32"))
        expected = engine.run("classify", TEXTS)
        engine.stop()
        results = [None] * 16

        def one(i):
            body = {"model": "cls", "input": TEXTS[i % len(TEXTS)]}
            results[i] = httpx.post(url + "/v1/classify", json=body, headers=headers, timeout=600)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
        for i, r in enumerate(results):
            got = torch.tensor(list(r.json()["data"][0]["probabilities"].values()))
            torch.testing.assert_close(got, expected[i % len(TEXTS)], atol=1e-6, rtol=0)
        out = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": TEXTS[:2]}, headers=headers,
                         timeout=600)
        assert out.status_code == 200 and len(out.json()["data"]) == 2
        too_many = httpx.post(url + "/v1/embeddings", json={"model": "cls", "input": ["a"] * 9}, headers=headers)
        assert too_many.status_code == 400 and "--max-batch-texts" in too_many.json()["error"]["message"]
        refused = httpx.post(url + "/v1/completions", json={"model": "cls", "prompt": "a"}, headers=headers)
        assert refused.status_code == 400 and "encoder" in refused.json()["error"]["message"]
        assert httpx.post(url + "/v1/classify", json={"model": "cls", "input": "a"}).status_code == 401
        # Each replica reports its batcher's counters to the router; both took requests.
        while True:
            served = {line.split('replica="')[1].split('"')[0]: float(line.split()[-1])
                      for line in httpx.get(url + "/metrics", headers=headers).text.splitlines()
                      if line.startswith("scalenlp_encoder_requests_total{")}
            if sum(served.values()) >= len(results) + 1:
                break
            time.sleep(0.5)
        assert len(served) == 2 and all(served.values()), served
    finally:
        cluster.stop(owns_serve)
