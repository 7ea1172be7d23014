"""Serving benchmarks.

  python benchmarks/serve.py prepare OUT          a GPT-2-124M-shaped export with random weights and a
                                                  byte-level BPE trained on the shared data sets
  python benchmarks/serve.py decode --checkpoint OUT    (any checkpoint the loader reads, e.g. SmolLM2's .gguf)
      decode tokens/s at batch 1 and 8, scalenlp engine vs Hugging Face generate() on the same
      weights (converted with scalenlp.models.hf), 16 concurrent requests of mixed lengths
      (continuous batching vs HF one request at a time and HF static batching), and the
      weight-streaming bound: read bandwidth measured in this run / bytes of weights.
  python benchmarks/serve.py serving --url http://127.0.0.1:8000 --rate 4 --num-prompts 64
      Poisson arrivals against a running `scalenlp serve` (or any OpenAI-compatible server):
      TTFT, TPOT, ITL, E2E latency (mean, p50, p90, p99), request and token throughput, and
      goodput under SLOs, with vLLM's benchmark_serving definitions:
        TTFT  send -> first chunk with text;   ITL  gaps between consecutive chunks;
        TPOT  (E2E - TTFT) / (output tokens - 1), per request;   E2E  send -> last chunk;
        goodput  requests per second that meet every given SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CORPUS = [DATA / "tinyshakespeare" / "input.txt", DATA / "wikitext2" / "valid.txt", DATA / "wikitext2" / "test.txt"]


# ---- prepare ----

def prepare(args) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from scalenlp.models.flavors import build_model, model_args
    from scalenlp.models.io import save_pretrained

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(p) for p in CORPUS if p.is_file()],
              trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    torch.manual_seed(0)
    model = build_model(model_args(args.flavor, vocab_size=tok.get_vocab_size()))
    save_pretrained(model, out / "export", out / "tokenizer.json")
    print(f"{args.flavor} with vocab {tok.get_vocab_size()}: {model.num_params() / 1e6:.1f}M parameters -> {out / 'export'}")


# ---- decode: scalenlp vs Hugging Face on the same weights ----

def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes/s of the best of several full reads of a buffer far larger than the caches."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def weight_bytes(model) -> int:
    """Bytes one decode step streams: every unique parameter (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode(args) -> None:
    import torch

    from scalenlp.engine.decoder_engine import Engine
    from scalenlp.engine.dtype import LayerShapes, choose_dtype
    from scalenlp.engine.sampling import SamplingParams
    from scalenlp.loader import instantiate, read
    from scalenlp.models.hf import to_hf

    # One intra-op thread by default: on a machine shared with other work, OpenMP's barriers wait for
    # descheduled threads and make each small op cost milliseconds (both sides get the same setting).
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pretrained = read(args.checkpoint)
    dtype = choose_dtype(torch.device("cpu"), args.dtype, LayerShapes.of(pretrained.args))
    if dtype.reason:
        print(dtype.line(), flush=True)
    model = instantiate(pretrained, dtype=dtype.dtype)
    hf = to_hf(model)
    tokenizer = pretrained.tokenizer
    vocab = model.args.vocab_size
    wbytes, n_params = weight_bytes(model), model.num_params()  # before the engine packs the weights
    engine = Engine(model, tokenizer, max_batch=16, max_queue=1024, max_seq_len=args.prompt_len + args.new_tokens + 1,
                    compile=args.compile).start()
    n_new = args.new_tokens

    def ours(prompts, max_tokens, gaps=None):
        """Run a continuous batch to the end; ``gaps`` collects the decode steps' durations."""
        flags = [threading.Event() for _ in prompts]
        stamps = []

        def on_event(d, f):
            if f is flags[0]:
                stamps.append(d.time)
            if d.finish_reason:
                f.set()

        engine.submit_many([(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
                            for p, m in zip(prompts, max_tokens)],
                           [lambda d, f=f: on_event(d, f) for f in flags])
        for f in flags:
            f.wait()
        if gaps is not None:
            gaps.extend(b - a for a, b in zip(stamps[1:], stamps[2:]))  # skip prefill and the step after it

    class GapStreamer:
        """HF calls ``put`` once with the prompt, then once per decode step."""

        def __init__(self, gaps):
            self.gaps, self.stamps = gaps, []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            self.gaps.extend(b - a for a, b in zip(self.stamps[2:], self.stamps[3:]))

    @torch.inference_mode()
    def theirs(batch, max_tokens, gaps=None):
        hf.generate(batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                    attention_mask=torch.ones_like(batch), streamer=GapStreamer(gaps) if gaps is not None else None)

    # Other processes share this machine, so figures drift during a run: everything is measured
    # interleaved (ours, HF, bandwidth) and reported two ways. "Run": tokens over wall time of whole
    # runs (an n-token run minus a 1-token run, so prefill cancels), best of the repeats. "Step":
    # from the median and the fastest single decode step, which a loaded machine disturbs least.
    bandwidths = [read_bandwidth()]
    print(f"model: {n_params / 1e6:.1f}M parameters, vocab {vocab}, {dtype.dtype}, {wbytes / 1e6:.0f} MB of weights; "
          f"torch threads {torch.get_num_threads()}; compile={args.compile}", flush=True)
    rates = {}
    for batch in (1, 8):
        prompts = torch.randint(0, vocab, (batch, args.prompt_len))
        lists = prompts.tolist()
        ours(lists, [2] * batch)  # warm-up (and compile)
        theirs(prompts, 2)
        runs = {key: [] for key in ("ours_n", "ours_1", "hf_n", "hf_1")}
        gaps_ours, gaps_hf = [], []
        for _ in range(args.repeats):
            runs["ours_n"].append(timed(lambda: ours(lists, [n_new] * batch, gaps_ours)))
            runs["ours_1"].append(timed(lambda: ours(lists, [1] * batch)))
            runs["hf_n"].append(timed(lambda: theirs(prompts, n_new, gaps_hf)))
            runs["hf_1"].append(timed(lambda: theirs(prompts, 1)))
            bandwidths.append(read_bandwidth(repeats=3))
        rates[batch] = {
            "run": (batch * (n_new - 1) / (min(runs["ours_n"]) - min(runs["ours_1"])),
                    batch * (n_new - 1) / (min(runs["hf_n"]) - min(runs["hf_1"]))),
            "median step": (batch / statistics.median(gaps_ours), batch / statistics.median(gaps_hf)),
            "best step": (batch / min(gaps_ours), batch / min(gaps_hf)),
        }
    bw = max(bandwidths)
    bound = bw / wbytes
    print(f"read bandwidth (best of {len(bandwidths)} measured during the run): {bw / 1e9:.1f} GB/s -> "
          f"weight-streaming bound at batch 1: {bound:.1f} tokens/s")
    for batch, by_method in rates.items():
        for method, (r_ours, r_hf) in by_method.items():
            extra = f"  ({r_ours / bound:.0%} of the weight-streaming bound)" if batch == 1 else ""
            print(f"batch {batch} ({method:11s}): scalenlp {r_ours:7.1f} tok/s   HF generate {r_hf:7.1f} tok/s   "
                  f"speed-up {r_ours / r_hf:.2f}x{extra}", flush=True)

    # 16 concurrent requests of mixed prompt and output lengths.
    rng = random.Random(0)
    reqs = [(torch.randint(0, vocab, (rng.randint(8, args.prompt_len),)).tolist(), rng.randint(n_new // 4, n_new))
            for _ in range(16)]
    useful = sum(m for _, m in reqs)
    t_cb = timed(lambda: ours([p for p, _ in reqs], [m for _, m in reqs]))
    t_seq = timed(lambda: [theirs(torch.tensor([p]), m) for p, m in reqs])
    width = max(len(p) for p, _ in reqs)
    padded = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs])  # left padding, as HF wants for decoders
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p, _ in reqs])[:, None]).long()

    @torch.inference_mode()
    def hf_static():
        longest = max(m for _, m in reqs)
        hf.generate(padded, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                    pad_token_id=0)

    t_static = timed(hf_static)
    print(f"16 concurrent requests ({useful} output tokens, lengths {n_new // 4}..{n_new}): "
          f"scalenlp continuous batching {useful / t_cb:.1f} tok/s; HF one at a time {useful / t_seq:.1f} tok/s "
          f"-> {t_seq / t_cb:.2f}x; HF static batch of 16 {useful / t_static:.1f} useful tok/s -> {t_static / t_cb:.2f}x")
    engine.stop()


# ---- serving: Poisson arrivals against a running server ----

def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0.5: the median) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (f"mean {statistics.fmean(values) * 1e3:8.1f}  p50 {quantile(values, 0.5) * 1e3:8.1f}  "
            f"p90 {quantile(values, 0.9) * 1e3:8.1f}  p99 {quantile(values, 0.99) * 1e3:8.1f} ms")


def latencies(ok: list[dict]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E and all inter-token gaps (ITL), in seconds, of ``one_request``'s
    successful results."""
    return {"TTFT": [r["stamps"][0] - r["sent"] for r in ok],
            "TPOT": [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1],
            "ITL": [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])],
            "E2E": [r["stamps"][-1] - r["sent"] for r in ok]}


async def one_request(client, url, headers, body, delay):
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    stamps, tokens, prompt_tokens, error = [], 0, 0, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                if chunk.get("usage"):
                    tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": repr(e)}
    if error or not stamps:
        return {"error": error or "no text"}
    return {"sent": sent, "stamps": stamps, "tokens": tokens, "prompt_tokens": prompt_tokens}


async def serving(args) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1024)) as client:
        model = args.model or (await client.get(args.url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        text = " ".join(p.read_text(errors="ignore") for p in CORPUS if p.is_file()).split() or ["hello"] * 1000
        rng = random.Random(args.seed)
        delays, t = [], 0.0
        for _ in range(args.num_prompts):
            delays.append(t)
            t += rng.expovariate(args.rate) if args.rate != float("inf") else 0.0
        bodies = []
        for _ in range(args.num_prompts):
            start = rng.randrange(0, max(1, len(text) - args.input_words))
            bodies.append({"model": model, "prompt": " ".join(text[start:start + args.input_words]),
                           "max_tokens": args.output_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}})
        began = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, args.url + "/v1/completions", headers, b, d)
                                         for b, d in zip(bodies, delays)))
        duration = time.perf_counter() - began
    ok = [r for r in results if "error" not in r]
    failed = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    slo = {k: float(v) / 1e3 for k, v in (item.split(":") for item in args.goodput)}
    good = [r for r in ok if ("ttft" not in slo or r["stamps"][0] - r["sent"] <= slo["ttft"])
            and ("e2el" not in slo or r["stamps"][-1] - r["sent"] <= slo["e2el"])
            and ("tpot" not in slo or r["tokens"] <= 1
                 or (r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) <= slo["tpot"])]
    print(f"server {args.url}, model {model}; {args.num_prompts} requests, Poisson rate {args.rate}/s, "
          f"~{args.input_words} prompt words, {args.output_tokens} output tokens each")
    print(f"successful {len(ok)}, failed {len(failed)}{' (first: ' + failed[0] + ')' if failed else ''}; "
          f"duration {duration:.1f} s")
    print(f"request throughput  {len(ok) / duration:8.2f} req/s")
    print(f"output throughput   {out_tokens / duration:8.1f} tok/s; total (in + out) {(in_tokens + out_tokens) / duration:.1f} tok/s")
    if slo:
        print(f"goodput             {len(good) / duration:8.2f} req/s under SLOs {args.goodput}")
    for name, values in latencies(ok).items():
        print(f"{name:5s} {percentiles(values)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out")
    p.add_argument("--flavor", default="gpt2-124m")
    p.add_argument("--vocab-size", type=int, default=50257, help="target; BPE stops when the corpus has no more merges")
    d = sub.add_parser("decode")
    d.add_argument("--checkpoint", required=True)
    d.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--compile", action="store_true")
    d.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    s = sub.add_parser("serving")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    s.add_argument("--api-key", default=None)
    s.add_argument("--model", default=None, help="default: the first of /v1/models")
    s.add_argument("--rate", type=float, default=4.0, help="mean requests per second (inf = all at once)")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-words", type=int, default=32)
    s.add_argument("--output-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:200"],
                   help="SLOs in ms as KEY:VALUE, keys ttft, tpot, e2el (vLLM's --goodput)")
    args = parser.parse_args(argv)
    if args.mode == "prepare":
        prepare(args)
    elif args.mode == "decode":
        decode(args)
    else:
        asyncio.run(serving(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
