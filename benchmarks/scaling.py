"""Training throughput of each 2-process layout on this machine, and 2 processes x 1 thread
against 1 process x 2 threads for DDP and ZeRO-3.

    python benchmarks/scaling.py [--steps 6]

Every run trains the same model on the same global batch (fp32, gloo) through the parity
harness's loop (benchmarks/parity.py); tokens/s is the global batch's tokens over the fastest step
after 2 warm-up steps. On a shared 2-core machine the figures move with the other load:
compare rows measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.parity import LAYOUTS, Shape, run_layouts, train  # noqa: E402

SHAPE = Shape(model=(("vocab_size", 4096), ("dim", 256), ("n_layers", 4), ("n_heads", 8), ("n_kv_heads", 4),
                     ("ffn_dim", 688), ("max_seq_len", 128)),
              seq=128, global_batch=8, micro_batch=4)
WARMUP = 2


def tokens_per_sec(step_s: list[float]) -> float:
    # The fastest step: the one least disturbed by the other processes sharing these cores.
    return SHAPE.global_batch * SHAPE.seq / min(step_s[WARMUP:])


def single_process(threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    return tokens_per_sec(train({}, 1, steps, SHAPE)["step_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    names = [n for n, (world, _) in LAYOUTS.items() if world == 2]
    one_thread = single_process(1, args.steps)
    two_threads = single_process(2, args.steps)
    results = run_layouts(names, args.steps, SHAPE)
    args_text = ", ".join(f"{k}={v}" for k, v in SHAPE.model)
    print(f"model: debug flavor with {args_text}; batch {SHAPE.global_batch} x {SHAPE.seq} tokens, fp32")
    print(f"{'layout':<20}{'processes x threads':>21}{'tokens/s':>11}{'vs 1 x 1':>10}")
    print(f"{'single':<20}{'1 x 1':>21}{one_thread:>11,.0f}{1.0:>10.2f}")
    print(f"{'single':<20}{'1 x 2':>21}{two_threads:>11,.0f}{two_threads / one_thread:>10.2f}")
    rates = {}
    for name in names:
        rates[name] = tokens_per_sec(results[name]["step_s"])
        print(f"{name:<20}{'2 x 1':>21}{rates[name]:>11,.0f}{rates[name] / one_thread:>10.2f}")
    print("\n2 processes x 1 thread / 1 process x 2 threads:")
    for name in ("ddp2", "zero3x2"):
        print(f"  {name:<10}{rates[name] / two_threads:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
