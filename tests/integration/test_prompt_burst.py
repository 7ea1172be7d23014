"""Eight concurrent 4 MB prompts against `scalenlp serve` (issue 32, item 6: the server's RSS went from 3.0 to
6.9 GB and kept 4.9 GB, and a 2-token request beside them waited 46 s): each is refused before it is tokenized,
a small request beside them is served, and the server's RSS comes back to within 10% of its level before. The
same for eight 3.5 MB embedding requests, which are tokenized before they are priced and refused."""

import concurrent.futures
import json
import time

import httpx
import pytest

from infer_helpers import minilm_classifier, serve_process

pytestmark = pytest.mark.slow


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def rss_after(pid: int, before: float) -> list[float]:
    """The RSS of process ``pid`` read until it is within 10% of ``before`` (at most 20 times, 0.25 s apart): a
    request's body and parsed text are freed just after its response is sent, and the heap's free pages go back
    to the system from a worker thread after that."""
    after = []
    for _ in range(20):
        after.append(vm_rss_mb(pid))
        if after[-1] <= 1.1 * before:
            break
        time.sleep(0.25)
    print(f"RSS {before:.0f} MB before the burst, {after} after")
    return after


def test_burst_of_huge_prompts_is_refused_at_once_and_its_memory_returned(tiny_export):
    small = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    huge = json.dumps({"model": "tiny", "prompt": "the quick brown fox " * 200_000}).encode()  # 4 MB
    with serve_process(tiny_export, "--model-name", "tiny", "--max-body-bytes", str(5 << 20)) as (url, proc), \
            httpx.Client(timeout=None) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        def send(content: bytes) -> httpx.Response:
            return client.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})

        assert send(json.dumps(small).encode()).status_code == 200
        before = vm_rss_mb(proc.pid)
        burst = [pool.submit(send, huge) for _ in range(8)]
        beside = send(json.dumps(small).encode())
        assert beside.status_code == 200, beside.text
        for f in burst:
            r = f.result()
            assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"], r.text
        after = rss_after(proc.pid, before)
    assert after[-1] <= 1.1 * before


def test_burst_of_huge_embedding_requests_returns_its_memory(tmp_path, shared_data):
    words = (shared_data / "wikitext2" / "valid.txt").read_text(encoding="utf-8").split()[:100_000]
    texts = [" ".join(words[(i * 330) % 99_000:][:330]) for i in range(2048)]  # 3.5 MB, within the body limit
    huge = json.dumps({"model": "cls", "input": texts}).encode()
    with serve_process(minilm_classifier(tmp_path), "--model-name", "cls") as (url, proc), \
            httpx.Client(timeout=None) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        def send(content: bytes) -> httpx.Response:
            return client.post(url + "/v1/embeddings", content=content, headers={"Content-Type": "application/json"})

        assert send(json.dumps({"model": "cls", "input": "hello"}).encode()).status_code == 200
        before = vm_rss_mb(proc.pid)
        for r in [f.result() for f in [pool.submit(send, huge) for _ in range(8)]]:
            assert r.status_code == 400 and "--max-request-tokens" in r.json()["error"]["message"], r.text
        after = rss_after(proc.pid, before)
    assert after[-1] <= 1.1 * before
