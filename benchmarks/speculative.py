"""Speculative decoding by prompt lookup (``--speculative-tokens K``), measured through ``Engine`` on the packaged
SmolLM2-135M-Instruct (float32, 1 thread), greedy, 128 tokens a request:

  python benchmarks/speculative.py [K ...]        (default: 0 2 4 8; 0 is plain decoding, the baseline)

  quote   the model is asked to repeat a WikiText-2 paragraph word for word: its output repeats the prompt, which
          lookup finds
  story   it is asked for a short story on a topic: little of the output is in the prompt

For each workload, batch 1 and 16 (every request submitted at once; batch 16 asks for 16 different paragraphs or
topics), and K: output tokens/s (all tokens over the time from submitting to the last one), the share of draft
tokens accepted, and whether every request's text is the one plain decoding gave (greedy must not change it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from paged_cache import timed
from scalenlp.data.chat import encode_chat
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, read
from scalenlp.models.packaged import packaged_model

DATA = Path("/work/shared/data/wikitext2/valid.txt")
TOPICS = ["a lighthouse keeper", "a lost cat", "a chess match", "a rainy market", "an old clock", "a space probe",
          "a village baker", "a mountain guide", "a night train", "a broken violin", "a desert well", "a kite",
          "a letter never sent", "a robot gardener", "a winter fair", "a ship's cook"]
MAX_TOKENS = 128


def workloads(pre, batch: int) -> dict[str, list[list[int]]]:
    """The chat prompts of each workload, ``batch`` of them."""
    # Paragraphs of 60-120 words: a 128-token answer repeats most of one.
    paragraphs = [line.strip() for line in DATA.read_text().splitlines()
                  if 60 <= len(line.split()) <= 120 and not line.strip().startswith("=")]

    def chat(text):
        return encode_chat(pre.tokenizer, [{"role": "user", "content": text}], pre.tokenizer_config)

    return {"quote": [chat(f"Repeat the following text word for word.\n\n{p}") for p in paragraphs[:batch]],
            "story": [chat(f"Write a short story about {t}.") for t in TOPICS[:batch]]}


def main(ks: list[int]) -> None:
    torch.set_num_threads(1)
    pre = read(packaged_model("smollm2"))
    model = instantiate(pre, device=torch.device("cpu"), dtype=torch.float32)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for batch in (1, 16):
        for name, prompts in workloads(pre, batch).items():
            plain = None
            for k in ks:
                engine = Engine(model, pre.tokenizer, max_batch=batch, max_queue=batch, speculative_tokens=k,
                                max_seq_len=2048, kv_cache_tokens=batch * 2048).start()
                timed(engine, prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm up
                engine.drafted = engine.accepted = 0
                tokens = [[] for _ in prompts]
                runs = timed(engine, prompts, params, tokens)
                engine.stop()
                seconds = max(t[-1] for _, t in runs) - runs[0][0]
                plain = plain or tokens
                print(f"{name} batch {batch:2d} K {k}: {batch * MAX_TOKENS / seconds:6.1f} tokens/s, "
                      f"{engine.acceptance_rate:4.0%} of {engine.drafted} drafts accepted, "
                      f"text {'as plain decoding' if tokens == plain else 'DIFFERS from plain decoding'}", flush=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main([int(k) for k in sys.argv[1:]] or [0, 2, 4, 8])
    print(f"({time.perf_counter() - start:.0f} s in all)")
