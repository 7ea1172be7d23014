"""Embedding throughput: sentence-transformers' ``encode`` beside our in-process batcher and our
``/v1/embeddings`` (a `scalenlp serve` process, concurrent clients), on the same SST-2 sentences, the same
model (all-MiniLM-L6-v2, float32) and the same number of torch threads, measured in one run.

    python benchmarks/embeddings.py [--texts 2000] [--threads 1] [--clients 4] [--request-texts 128]

Prints sentences/s for each, each one's ratio to sentence-transformers, and the largest difference of
our vectors from theirs (they must agree: same model, same pooling).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scalenlp.models.packaged import packaged_model
from scalenlp.parallel.mesh import free_port

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"
MINILM = packaged_model("minilm")


def sst2_sentences(folder: Path, n: int) -> list[str]:
    """dev.tsv, then train.tsv from its top, to ``n`` sentences (the files end lines differently: CRLF, LF)."""
    texts: list[str] = []
    for name in ("dev.tsv", "train.tsv"):
        lines = (folder / name).read_text().splitlines()[1:]  # header first
        texts += [line.split("\t", 1)[1].strip() for line in lines if "\t" in line]
    return texts[:n]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


async def post_all(url: str, texts: list[str], clients: int, request_texts: int) -> np.ndarray:
    """Every text embedded through ``clients`` concurrent connections, ``request_texts`` texts per request."""
    import httpx

    chunks = [list(range(i, min(i + request_texts, len(texts)))) for i in range(0, len(texts), request_texts)]
    rows: dict[int, np.ndarray] = {}

    async def client(http):
        while chunks:
            chunk = chunks.pop()
            r = await http.post(url + "/v1/embeddings", json={"model": "minilm", "input": [texts[i] for i in chunk],
                                                              "encoding_format": "base64"})
            r.raise_for_status()
            for i, d in zip(chunk, r.json()["data"]):
                rows[i] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return np.stack([rows[i] for i in range(len(texts))])


def serve(threads: int, forward_batch: int, max_texts: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", str(MINILM), "--port", str(port),
                             "--dtype", "float32", "--model-name", "minilm", "--forward-batch", str(forward_batch),
                             "--max-batch-texts", str(max_texts)], env=env)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"scalenlp serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="the SST-2 folder (default: ../shared/data/sst2)")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for every contender")
    parser.add_argument("--batch", type=int, default=32, help="sentence-transformers' batch size and our forward batch")
    parser.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients")
    parser.add_argument("--request-texts", type=int, default=128, help="texts per HTTP request")
    args = parser.parse_args()

    import httpx
    import torch
    from sentence_transformers import SentenceTransformer

    from scalenlp.engine.config import EncoderEngineConfig
    from scalenlp.engine.encoder_engine import encoder_from_checkpoint

    torch.set_num_threads(args.threads)
    texts = sst2_sentences(args.data, args.texts)
    print(f"{len(texts)} SST-2 sentences, all-MiniLM-L6-v2 float32, {args.threads} torch thread(s), batch {args.batch}")

    st = SentenceTransformer(str(MINILM), device="cpu")
    st.encode(texts[:args.batch])  # warm-up
    seconds, reference = timed(lambda: st.encode(texts, batch_size=args.batch, normalize_embeddings=True))
    st_rate = len(texts) / seconds
    results = [("sentence-transformers encode", st_rate, 0.0)]

    engine = encoder_from_checkpoint(EncoderEngineConfig(MINILM, dtype="float32", forward_batch=args.batch,
                                                         max_batch_texts=len(texts)))
    engine.run("embed", texts[:args.batch])
    seconds, ours = timed(lambda: engine.run("embed", texts).numpy())
    engine.stop()
    results.append(("scalenlp batcher, in process", len(texts) / seconds, float(np.abs(ours - reference).max())))
    engine = None  # its model freed before the server loads its own

    proc, url = serve(args.threads, args.batch, len(texts))
    try:
        asyncio.run(post_all(url, texts[:args.batch], 1, args.batch))  # warm-up
        seconds, served = timed(lambda: asyncio.run(post_all(url, texts, args.clients, args.request_texts)))
        counters = {line.split()[0]: float(line.split()[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                    if line.startswith("scalenlp_encoder_")}
    finally:
        proc.terminate()
        proc.wait()
    results.append((f"scalenlp /v1/embeddings, {args.clients} clients x {args.request_texts} texts",
                    len(texts) / seconds, float(np.abs(served - reference).max())))

    print(f"served: {counters['scalenlp_encoder_forwards_total']:.0f} forwards, real tokens "
          f"{counters['scalenlp_encoder_tokens_total'] / counters['scalenlp_encoder_padded_tokens_total']:.0%} of "
          "the positions computed")
    width = max(len(name) for name, *_ in results)
    for name, rate, diff in results:
        print(f"{name:<{width}}  {rate:8.1f} sentences/s  {rate / st_rate:5.2f}x  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
