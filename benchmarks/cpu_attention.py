"""scalenlp's CPU causal-attention kernel against PyTorch's SDPA (its CPU flash attention), float32, one thread.

    python benchmarks/cpu_attention.py [--seq 2048] [--batch 2] [--rounds 5]

For each head size the kernel takes (16 and 32; model dim 256, so 16 and 8 heads), forward and
backward times of both, measured interleaved (round by round, best kept), and their ratio. The training
step's share of attention decides what the ratio is worth: at torchtitan's debug model (head size 16) attention
is about half of a CPU step.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from scalenlp.models import cpu_attention


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not cpu_attention.available():
        raise SystemExit("error: the kernel did not build (needs g++ and ninja); see the warning above")
    print(f"causal attention, float32, 1 thread, batch {args.batch}, sequence {args.seq}; best of {args.rounds} "
          "interleaved rounds")
    print(f"{'head size':>9}{'heads':>6}{'SDPA fwd s':>12}{'bwd s':>8}{'kernel fwd s':>14}{'bwd s':>8}"
          f"{'fwd x':>7}{'bwd x':>7}{'fwd+bwd x':>11}")
    for head in cpu_attention.HEAD_SIZES:
        heads = 256 // head
        q, k, v = (torch.randn(args.batch, args.seq, heads, head).transpose(1, 2).requires_grad_()
                   for _ in range(3))
        dout = torch.randn(args.batch, heads, args.seq, head)
        impls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 "kernel": lambda: cpu_attention.causal_attention(q, k, v)}
        best = {(name, part): float("inf") for name in impls for part in ("fwd", "bwd")}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                with torch.no_grad():
                    best[name, "fwd"] = min(best[name, "fwd"], timed(fn))
                out = fn()
                best[name, "bwd"] = min(best[name, "bwd"], timed(lambda: out.backward(dout)))
        s_f, s_b, k_f, k_b = (best[key] for key in (("sdpa", "fwd"), ("sdpa", "bwd"), ("kernel", "fwd"),
                                                     ("kernel", "bwd")))
        print(f"{head:>9}{heads:>6}{s_f:>12.3f}{s_b:>8.3f}{k_f:>14.3f}{k_b:>8.3f}{s_f / k_f:>7.2f}{s_b / k_b:>7.2f}"
              f"{(s_f + s_b) / (k_f + k_b):>11.2f}")


if __name__ == "__main__":
    main()
