"""LoRA and QLoRA fine-tuning of SmolLM2-135M against a full fine-tune, and against peft + transformers.

    OMP_NUM_THREADS=1 python benchmarks/adapters.py [--steps 3] [--batch 1] [--seq 128]
                                                    [--only memory|speed|layouts|products] [--compile] [--bf16]

Each measurement runs in a process of its own (so one's memory never counts in another's), on the same random
token batches, with fused AdamW over what trains:

- full: every weight trains (fp32);
- lora-plain: rank 16 (alpha 32) on every linear of the blocks (lora.targets = all-linear), the base frozen, its
  weights as they are (lora.pack_frozen=off);
- lora-onednn: the same with the frozen base held as oneDNN-packed W and W^T (lora.pack_frozen=onednn);
- lora-transposed: the same with a row-major copy of W^T beside W (lora.pack_frozen=transposed);
- lora-mkl: the same with a copy of W packed by MKL for the step's rows beside W (lora.pack_frozen=mkl);
- lora: the layout per shape that lora.pack_frozen=auto (the default) picks on this machine (train/frozen_packing.py,
  its figure measured once and cached): LoRA as the trainer runs it, each adapted linear one autograd node
  (models/adapters.py's _LoRAProducts), q/k/v and gate/up one each (training.stack_projections);
- lora-op-by-op: the same with each adapted linear's operations recorded one by one by autograd, as before the node;
- lora-unstacked: lora with training.stack_projections=false, a node per adapted linear;
- qlora: lora with the frozen block linears in NF4 (compress/nf4.py), which is not packed;
- peft: transformers' LlamaForCausalLM of the same weights with peft's LoraConfig(r=16, lora_alpha=32,
  target_modules="all-linear").

``--bf16``: every model's forward under bf16 autocast (training.mixed_precision=bf16; transformers' bf16=True), the
layouts then holding W cast to bf16 (lora-mkl stays plain: MKL packs float32 only).

Figures: parameters that train; resident memory once the model is built (at rest) and its peak over the training
steps (Linux's VmHWM, reset after loading, so the transient of reading the GGUF file is not counted); tokens/s over
the steps after the first (which pays one-time allocations). Speed against peft is measured apart, in one process
holding the models and taking their steps in turn, so that other work on the machine weighs on all alike:
the LoRA kinds and peft; with ``--compile`` another, our LoRA with ``training.compile`` (each block and the
loss through torch.compile, as parallelize's apply_compile does, the base in the layouts auto picks among those
compile takes; its first step, untimed, compiles).

layouts (only with ``--only layouts``): QLoRA of SmolLM2 through `scalenlp train --nproc 2` on the README demo's
data (configs/demo.toml), under DDP (each rank holds the whole NF4 base) and under ZeRO-3 (each holds half of it,
and half of the frozen fp32 embedding, gathering a block's weights per use): each rank's resident memory at its
last step, as the run's metrics record it (``rss_bytes/rankN``). Its peak would show the loading instead: every
rank reads the fp32 checkpoint and quantizes it before sharding.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scalenlp.models.frozen import COMPILABLE, LAYOUTS

KINDS = ("full", "lora", "lora-op-by-op", "lora-plain", "lora-onednn", "lora-transposed", "lora-mkl", "qlora", "peft")
LORA_KINDS = ("lora", "lora-op-by-op", "lora-unstacked", "lora-plain", "lora-onednn", "lora-transposed", "lora-mkl")
RANK, ALPHA = 16, 32


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _settle() -> None:
    """Hand freed memory back to the system, so resident memory shows what is still held."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _our_model(kind: str, rows: int, layouts: tuple[str, ...] = LAYOUTS, dtype: torch.dtype = torch.float32):
    """Our model of ``kind`` for batches of ``rows`` tokens; the frozen LoRA base of "lora-<layout>" held in that
    layout (lora.pack_frozen=<layout>), of "lora" in auto's layouts among ``layouts``, for products in ``dtype``
    (bf16: the layouts hold W cast to it, as training.mixed_precision=bf16 does)."""
    from scalenlp.loader import read
    from scalenlp.models.adapters import (
        LoRALinear,
        LoraSpec,
        adaptable,
        add_adapters,
        freeze_all_but_adapters,
        match_targets,
        pack_frozen,
    )
    from scalenlp.models.decoder import stack_projections
    from scalenlp.models.io import build_decoder
    from scalenlp.models.packaged import packaged_model

    pre = read(packaged_model("smollm2"))
    model = build_decoder(pre.args, pre.state, "cpu", torch.float32).train()
    del pre
    if kind.startswith("lora") or kind == "qlora":
        if kind == "qlora":
            from scalenlp.compress.nf4 import quantize_nf4

            quantize_nf4(model, adaptable(model))
        add_adapters(model, LoraSpec(RANK, ALPHA), match_targets(model, "all-linear"))
        freeze_all_but_adapters(model)
        if kind in ("lora", "lora-op-by-op", "lora-unstacked"):
            pack_frozen(model, rows, auto_pick(model, rows, layouts, dtype).layouts, dtype)
        elif kind in ("lora-onednn", "lora-transposed", "lora-mkl"):
            pack_frozen(model, rows, kind.removeprefix("lora-"), dtype)
        stack_projections(model, kind != "lora-unstacked")  # as training does (training.stack_projections)
        if kind == "lora-op-by-op":
            for layer in model.modules():
                if isinstance(layer, LoRALinear):
                    layer._lora_operands = lambda x: None  # what the node is worth: the layer op by op
    # The summed loss (computed a chunk of tokens at a time), as a mean like transformers'.
    return model, lambda tokens: model(tokens[:, :-1], targets=tokens[:, 1:]) / tokens[:, 1:].numel()


def _peft_model():
    from peft import LoraConfig, get_peft_model

    from scalenlp.loader import load
    from scalenlp.models.hf import to_hf
    from scalenlp.models.packaged import packaged_model

    ours, _ = load(packaged_model("smollm2"), dtype=torch.float32)
    hf = to_hf(ours)
    del ours
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")).train()
    # transformers shifts the labels itself: the same T - 1 predicted tokens a row as ours.
    return model, lambda tokens: model(input_ids=tokens, labels=tokens).loss


def _params(model) -> int:
    """Parameters, a base weight that lora.pack_frozen=onednn replaced by packed copies counted as one."""
    from scalenlp.models.adapters import LoRALinear

    replaced = sum(m.in_features * m.out_features for m in model.modules()
                   if isinstance(m, LoRALinear) and "weight" not in m._parameters)
    return sum(p.numel() for p in model.parameters()) + replaced


def measure(kind: str, steps: int, batch: int, seq: int, bf16: bool = False) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32  # as speed() runs it
    model, loss_of = _peft_model() if kind == "peft" else _our_model(kind, batch * seq, LAYOUTS, dtype)
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    vocab = 49152
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(i))
               for i in range(steps)]
    _settle()
    at_rest = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
    times, losses = [], []
    for tokens in batches:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = times[1:] or times
    return {"kind": kind, "params": _params(model), "trained": sum(p.numel() for p in trained),
            "rss_at_rest": at_rest, "rss_peak": _status("VmHWM"),
            "tokens_per_s": batch * seq * len(timed) / sum(timed), "losses": losses}


def auto_pick(model, rows: int, layouts: tuple[str, ...], dtype: torch.dtype = torch.float32):
    """The layout per shape lora.pack_frozen=auto (the default) holds the plain LoRA ``model``'s frozen base in
    on this machine, among those of ``layouts`` that hold products in ``dtype``, and why (a
    frozen_packing.PackingChoice)."""
    from scalenlp.models.adapters import frozen_shapes
    from scalenlp.models.frozen import run_layouts
    from scalenlp.train.frozen_packing import choose_packing

    layouts = tuple(name for name in layouts if name in run_layouts(dtype))
    return choose_packing(frozen_shapes(model), rows, layouts, dtype=dtype)


def speed(steps: int, batch: int, seq: int, compile: bool = False, bf16: bool = False) -> tuple[dict, dict, dict]:
    """Tokens per second of wall time, and per second of this process's CPU time, of our LoRA (in each layout)
    and of peft's (and of ours compiled), the models' steps taken in turn in this one process: on a machine shared
    with other work the load then weighs on all alike (separate processes meet different loads), and the CPU time
    leaves out the time spent waiting for the cores. ``bf16``: every model's forward under bf16 autocast, as
    training.mixed_precision=bf16 and transformers' bf16 training run it: our LoRA with its base held as the
    trainer holds it then (auto's layouts of W cast to bf16), and lora-plain, the base cast by autocast every
    step as peft's is."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    runs = {kind: _our_model(kind, batch * seq, LAYOUTS, dtype) for kind in (("lora", "lora-plain") if bf16
                                                                               else LORA_KINDS)}
    runs["peft"] = _peft_model()
    if compile:  # the trainer's layouts under training.compile, which cannot take oneDNN's packed weights
        from scalenlp.parallel.parallelize import apply_compile

        runs["compiled"] = _our_model("lora", batch * seq, COMPILABLE, dtype)
        apply_compile(runs["compiled"][0])
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=True)
                  for k, (m, _) in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(steps + 1):  # the first round pays one-time allocations: not timed
        tokens = torch.randint(0, 49152, (batch, seq + 1), generator=torch.Generator().manual_seed(i))
        for kind, (_, loss_of) in list(runs.items())[::1 if i % 2 else -1]:  # each order every other round
            start, start_cpu = time.perf_counter(), time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(tokens)
            loss.backward()
            optimizers[kind].step()
            optimizers[kind].zero_grad(set_to_none=True)
            if i:
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - start_cpu)
    return ({k: batch * seq * len(t) / sum(t) for k, t in times.items()},
            {k: batch * seq * len(t) / sum(t) for k, t in cpu.items()}, times)


def rounds(times: dict[str, list[float]], kind: str, other: str = "peft") -> str:
    """``kind``'s speed against ``other``'s round by round: the median ratio and its range. On a shared host a burst
    of other work can slow a few steps of one model; the median leaves them out where the sums above count them."""
    ratios = [theirs / ours for ours, theirs in zip(times[kind], times[other])]
    return f"median of {len(ratios)} rounds {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def products(rows: int) -> None:
    """lora.pack_frozen's products alone, as auto times them (train/frozen_packing.py): each of SmolLM2's frozen
    shapes at ``rows`` rows, its forward product and input gradient, plain against each layout, in interleaved
    rounds; per shape the median over rounds of plain time / the layout's time, and the step's products (each
    shape weighed by how many linears have it)."""
    from scalenlp.train.frozen_packing import _record, time_products

    shapes = {"q, o": ((576, 576), 60), "k, v": ((576, 192), 60), "gate, up": ((576, 1536), 60),
              "down": ((1536, 576), 30), "output": ((576, 49152), 1)}
    counts = [count for _, count in shapes.values()]
    timed = time_products([shape for shape, _ in shapes.values()], rows, counts)
    layouts = [name for name in timed if name != "plain"]
    for i, (name, ((k, n), _)) in enumerate(shapes.items()):
        figures = []
        for layout in layouts:
            ratios = [plain[i] / other[i] for plain, other in zip(timed["plain"], timed[layout])]
            figures.append(f"{layout} {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        print(f"{name} ({k} -> {n}), {rows} rows, forward and input gradient, against plain: {', '.join(figures)}")
    ms = {name: sum(shapes) for name, shapes in _record(timed, counts)["ms"].items()}  # as auto weighs them
    print(f"a step's frozen products (SmolLM2, {rows} rows): {ms['plain']:.1f} ms plain, "
          + ", ".join(f"{ms[layout]:.1f} ms {layout} ({ms['plain'] / ms[layout]:.2f}x as fast)" for layout in layouts))


def layouts(steps: int) -> None:
    """Resident memory per rank of QLoRA under DDP and ZeRO-3, two processes each (the docstring's layouts)."""
    from lora_quality import LORA, ROOT, train
    from scalenlp.models.packaged import packaged_model

    # glibc keeps freed memory of up to 32 MiB an allocation in its heap once such blocks were freed (its mmap
    # threshold grows), so a rank's resident size would count the freed checkpoint it loaded; pinned at 1 MiB,
    # large blocks go back to the system when freed, in the runs started from here.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2 ** 20)
    mib, held = 2 ** 20, {}
    with tempfile.TemporaryDirectory() as work:
        for layout in ("ddp", "zero3"):
            run = Path(work) / layout
            seconds, params = train(run, f"model.init={packaged_model('smollm2')}", *LORA, "lora.quantize_base=nf4",
                                    f"training.steps={steps}", "training.global_batch_size=2", "training.log_every=1",
                                    "checkpoint.export=false", f"parallel.data_parallel={layout}",
                                    config=ROOT / "configs" / "demo.toml")
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
            held[layout] = [last[f"rss_bytes/rank{r}"] for r in (0, 1)]
            print(f"QLoRA {layout:>5}, 2 processes: resident at step {last['step']}: rank 0 "
                  f"{held[layout][0] / mib:,.0f} MiB, rank 1 {held[layout][1] / mib:,.0f} MiB | {seconds:.0f} s | "
                  f"{params}")
    print(f"QLoRA resident per rank, zero3 / ddp = {held['zero3'][0] / held['ddp'][0]:.2f} (rank 0), "
          f"{held['zero3'][1] / held['ddp'][1]:.2f} (rank 1); "
          f"ddp - zero3 = {(held['ddp'][0] - held['zero3'][0]) / mib:,.0f} MiB (rank 0)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--only", choices=("memory", "speed", "layouts", "products"),
                        help="one part (layouts runs only when asked: QLoRA under DDP and ZeRO-3, 2 processes each; "
                             "products too: lora.pack_frozen's products alone, each layout against plain)")
    parser.add_argument("--compile", action="store_true", help="speed: also our LoRA with training.compile")
    parser.add_argument("--bf16", action="store_true", help="every model under bf16 autocast")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a child process's measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.batch, args.seq, args.bf16)))
        return 0
    if args.only == "layouts":
        layouts(args.steps)
        return 0
    if args.only == "products":
        products(args.batch * args.seq)
        return 0
    rows, dtype = args.batch * args.seq, torch.bfloat16 if args.bf16 else torch.float32
    plain = _our_model("lora-plain", rows)[0]
    print(f"lora: lora.pack_frozen=auto's layouts here: {auto_pick(plain, rows, LAYOUTS, dtype).reason}")
    if args.compile:
        print(f"under training.compile: {auto_pick(plain, rows, COMPILABLE, dtype).reason}")
    del plain
    if args.only != "memory":
        fast, per_cpu, times = speed(args.steps, args.batch, args.seq, args.compile, args.bf16)
        print(f"tokens/s, steps in turn in one process: lora {fast['lora']:,.1f}, peft+transformers "
              f"{fast['peft']:,.1f}: lora / peft = {fast['lora'] / fast['peft']:.2f}x (per CPU second: "
              f"{per_cpu['lora'] / per_cpu['peft']:.2f}x; {rounds(times, 'lora')})")
        for without, what in (("lora-op-by-op", "the one-node layer"),
                              ("lora-unstacked", "q/k/v and gate/up in one node each")):
            if without in fast:
                print(f"{what}: lora / {without} = {fast['lora'] / fast[without]:.3f}x (per CPU second: "
                      f"{per_cpu['lora'] / per_cpu[without]:.3f}x; {rounds(times, 'lora', without)})")
        for kind in [k for k in LORA_KINDS[1:] if k in fast]:
            print(f"{kind} {fast[kind]:,.1f} tokens/s: {fast[kind] / fast['peft']:.2f}x peft, "
                  f"{fast[kind] / fast['lora-plain']:.2f}x lora-plain (per CPU second: "
                  f"{per_cpu[kind] / per_cpu['peft']:.2f}x, {per_cpu[kind] / per_cpu['lora-plain']:.2f}x)")
        if args.compile:
            print(f"lora with training.compile {fast['compiled']:,.1f} tokens/s: {fast['compiled'] / fast['peft']:.2f}x "
                  f"peft, {fast['compiled'] / fast['lora']:.2f}x lora eager (per CPU second: "
                  f"{per_cpu['compiled'] / per_cpu['peft']:.2f}x, {per_cpu['compiled'] / per_cpu['lora']:.2f}x; "
                  f"against peft {rounds(times, 'compiled')})")
    if args.only == "speed":
        return 0
    results = {}
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--steps", str(args.steps), "--batch",
                              str(args.batch), "--seq", str(args.seq), *(["--bf16"] if args.bf16 else [])],
                             capture_output=True, text=True, check=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    print(f"SmolLM2-135M, batch {args.batch} x {args.seq} tokens, {args.steps} steps, "
          f"{torch.get_num_threads()} thread(s){', under bf16 autocast' if args.bf16 else ''}")
    print(f"{'run':>11} | {'trained params':>16} | {'RSS at rest':>11} | {'peak RSS (steps)':>16} | {'tokens/s':>8}")
    for kind, r in results.items():
        print(f"{kind:>11} | {r['trained']:>9,} ({r['trained'] / r['params']:.2%}) | {r['rss_at_rest'] / mib:>7,.0f} MiB "
              f"| {r['rss_peak'] / mib:>12,.0f} MiB | {r['tokens_per_s']:>8,.0f}")
    full, plain, qlora, peft = (results[k] for k in ("full", "lora-plain", "qlora", "peft"))
    lora = results["lora"]
    held = ", ".join(f"{kind} / lora-plain = {results[kind]['rss_peak'] / plain['rss_peak']:.2f} "
                     f"(+{(results[kind]['rss_peak'] - plain['rss_peak']) / mib:,.0f} MiB)"
                     for kind in ("lora-onednn", "lora-transposed", "lora-mkl"))
    print(f"peak RSS: lora / full = {lora['rss_peak'] / full['rss_peak']:.2f}, qlora / lora = "
          f"{qlora['rss_peak'] / lora['rss_peak']:.2f}, {held}; at rest: qlora / lora = "
          f"{qlora['rss_at_rest'] / lora['rss_at_rest']:.2f}")
    print(f"tokens/s in separate processes (each met its own load; the one-process figure above is the fair one): "
          f"lora / peft = {lora['tokens_per_s'] / peft['tokens_per_s']:.2f}x, lora / full = "
          f"{lora['tokens_per_s'] / full['tokens_per_s']:.2f}x, qlora / lora = "
          f"{qlora['tokens_per_s'] / lora['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
