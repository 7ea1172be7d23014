"""Training throughput: scalenlp's trainer vs Hugging Face GPT2LMHeadModel in a plain loop.

Same GPT-2 shape, same batch, same AdamW, same precision, measured side by side in one run (this
machine's timings drift, so only the ratios are comparable across runs). MFU is against the fp32
and bf16 matmul peaks measured at the start of the run.

    python benchmarks/train_throughput.py [--flavor gpt2-124m] [--vocab 8192] [--batch 4] [--seq 256] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scalenlp.config import load_config
from scalenlp.models.flavors import build_model, model_args
from scalenlp.train.peak import MATMUL_SIZE, measure_matmul_flops
from scalenlp.train.trainer import Trainer


def scalenlp_tokens_per_sec(args, precision: str, run_dir: Path) -> float:
    cfg = load_config(None, [
        f"model.flavor={args.flavor}", f"model.vocab_size={args.vocab}", f"training.seq_len={args.seq}",
        f"training.global_batch_size={args.batch}", f"training.steps={args.steps}",
        f"training.mixed_precision={precision}", "training.log_every=1", "training.eval_every=0",
        "checkpoint.every=0", "checkpoint.export=false", f"training.compile={str(args.compile).lower()}",
        "tokenizer.vocab_size=4096",
    ])
    trainer = Trainer(cfg, run_dir / precision)
    records = trainer.fit()
    return statistics.median(r["tokens_per_sec"] for r in records[args.warmup:])


def hf_tokens_per_sec(args, precision: str) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    a = model_args(args.flavor)
    config = GPT2Config(vocab_size=args.vocab, n_positions=a.max_seq_len, n_embd=a.dim, n_layer=a.n_layers,
                        n_head=a.n_heads, n_inner=a.ffn_dim, activation_function="gelu_new", resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=a.norm_eps, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    rates = []
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
        start = time.perf_counter()
        with amp:
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(args.batch * args.seq / (time.perf_counter() - start))
    return statistics.median(rates[args.warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="gpt2-124m", help="a GPT-2-style flavor (learned positions, LayerNorm, GELU)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--compile", action="store_true", help="train scalenlp with training.compile=true")
    p.add_argument("--precisions", default="fp32,bf16")
    args = p.parse_args()

    shape = model_args(args.flavor, vocab_size=args.vocab)
    flops_per_token = build_model(shape, "meta").flops_per_token(args.seq)
    cpu = torch.device("cpu")
    peaks = {"fp32": measure_matmul_flops(cpu, torch.float32, MATMUL_SIZE["cpu"]),
             "bf16": measure_matmul_flops(cpu, torch.bfloat16, MATMUL_SIZE["cpu"])}
    print(f"{args.flavor} (vocab {args.vocab}), batch {args.batch} x {args.seq}, {torch.get_num_threads()} threads; "
          f"measured matmul peak fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            ours = scalenlp_tokens_per_sec(args, precision, Path(tmp))
            theirs = hf_tokens_per_sec(args, precision)
            rows.append((precision, ours, theirs))
    print(f"\n{'precision':<10}{'scalenlp tok/s':>16}{'HF tok/s':>12}{'ratio':>8}{'scalenlp MFU':>14}{'HF MFU':>9}"
          f"{'MFU vs fp32 peak':>18}")
    for precision, ours, theirs in rows:
        mfu = ours * flops_per_token / peaks[precision]
        print(f"{precision:<10}{ours:>16,.0f}{theirs:>12,.0f}{ours / theirs:>7.2f}x{mfu:>14.1%}"
              f"{theirs * flops_per_token / peaks[precision]:>9.1%}{ours * flops_per_token / peaks['fp32']:>18.1%}")


if __name__ == "__main__":
    main()
