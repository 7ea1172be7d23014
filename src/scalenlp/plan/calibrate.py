"""Where the planner's GPU constants come from: a fit on published training runs, done once.

``python -m scalenlp.plan.calibrate`` refits and prints the constants that devices.py carries, and each
calibration row's prediction beside its published figure. What is fitted, and why on these rows:

- GPU_GEMM_HALF_DIM, GPU_ELEMENTWISE_TRAFFIC and the A100's gemm_efficiency, jointly, by least squares
  on log per-GPU TFLOP/s over the six rows of Megatron-LM 2021 Table 1 (Narayanan et al., A100 80GB,
  mixed precision, full recomputation) that the tests do not use. They run 3.6B to 530B parameters on
  TP 2-8 and PP 1-35, so thin and wide matmuls, TP traffic and bubbles all pull on the three numbers.
- The H100's gemm_efficiency alone on the Llama 3 paper's 16,384-GPU row (TP8, PP16, DP128, 400
  TFLOP/s per GPU); shape constants stay as fitted on the A100 rows. The H200 shares it (same die).

Held out for the tests: Megatron's 1.7B, 18.4B, 145.6B and 1008B rows and Llama 3's 8,192-GPU row.
For each row the planner picks microbatch and pipeline schedule itself among the layouts with the
published TP, PP and DP degrees, as the papers' authors tuned theirs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scalenlp.plan.cost import Layout, Workload, model_shape, predict
from scalenlp.hardware import DeviceSpec, get_device
from scalenlp.plan.search import search


@dataclass(frozen=True)
class PublishedRun:
    source: str
    model: str  # model_shape spec
    seq: int
    global_batch: int
    devices: int
    tp: int
    pp: int
    device: str
    tflops_per_gpu: float  # as the paper counts it: Megatron with recomputation, Llama 3 model FLOPs
    recompute: str
    flash_attention: bool
    zero: int | None  # data-parallel flavour the run used; None leaves it to the planner
    states: str = "mixed"  # both papers keep bf16/fp16 weights and gradients with an fp32 master copy


def megatron_row(hidden: int, heads: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float):
    """A row of Narayanan et al. 2021, Table 1: GPT, vocabulary 51,200, sequence 2,048, fp16, full recompute,
    plain data parallelism. Pipelined, Megatron keeps the tied output layer as its own copy on the last
    stage and sums the two copies' gradients once per step, as scalenlp does and the cost model counts."""
    spec = f"hidden={hidden},layers={layers},heads={heads},ffn={4 * hidden},vocab_size=51200,family=gpt2,dropout=0.1"
    return PublishedRun(f"Megatron-LM 2021 Table 1, h={hidden}", spec, 2048, batch, gpus, tp, pp, "a100-80gb",
                        tflops, "full", False, 0)


LLAMA3_405B = "hidden=16384,layers=126,heads=128,kv_heads=8,ffn=53248,vocab_size=128256"


def llama3_row(gpus: int, tflops: float) -> PublishedRun:
    """Llama 3 paper, Table 4: 405B, 8,192-token sequences, 16M tokens per batch, no activation checkpointing,
    FSDP-style sharded data parallelism (stage left to the planner)."""
    return PublishedRun(f"Llama 3 405B, {gpus} H100", LLAMA3_405B, 8192, 2048, gpus, 8, 16, "h100-sxm",
                        tflops, "none", True, None)


A100_ROWS = [
    megatron_row(3072, 32, 30, 2, 1, 64, 512, 138),
    megatron_row(4096, 32, 36, 4, 1, 128, 512, 142),
    megatron_row(8192, 64, 48, 8, 2, 512, 1536, 138),
    megatron_row(10240, 80, 60, 8, 4, 1024, 1792, 140),
    megatron_row(16384, 128, 96, 8, 16, 1920, 2160, 155),
    megatron_row(20480, 128, 105, 8, 35, 2520, 2520, 163),
]
H100_ROWS = [llama3_row(16384, 400)]


def best_layout(run: PublishedRun, device: DeviceSpec) -> Layout:
    """The planner's fastest layout with the run's TP and PP degrees (microbatch and schedule free, among the
    schedules of the time).

    Memory is not filtered: the published runs fit with kernels (fused SwiGLU, Megatron's buffers) this
    model does not count, and what is checked here is speed."""
    shape = model_shape(run.model, run.seq)
    work = Workload(seq=run.seq, global_batch=run.global_batch, precision="bf16", states=run.states,
                    flash_attention=run.flash_attention)
    fixed = dict(tp=run.tp, pp=run.pp, recompute=run.recompute, sequence_parallel=run.flash_attention)
    if run.zero is not None:
        fixed["zero"] = run.zero
    unlimited = dataclasses.replace(device, memory_bytes=math.inf)
    ranked = search(shape, work, unlimited, run.devices, 8, fixed=fixed).ranked
    # The published runs predate zero-bubble schedules (Megatron's and Llama 3's are interleaved 1F1B).
    return next(p.layout for p in ranked if p.layout.schedule != "zero_bubble")


def predicted_tflops(run: PublishedRun, device: DeviceSpec, layout: Layout | None = None) -> float:
    """Per-GPU TFLOP/s counted the way the run's paper counts it."""
    shape = model_shape(run.model, run.seq)
    work = Workload(seq=run.seq, global_batch=run.global_batch, precision="bf16", states=run.states,
                    flash_attention=run.flash_attention)
    p = predict(shape, work, layout or best_layout(run, device), device)
    return p.tflops_per_device


def _loss(rows, device: DeviceSpec, layouts) -> float:
    return sum(math.log(predicted_tflops(r, device, lay) / r.tflops_per_gpu) ** 2 for r, lay in zip(rows, layouts))


def _golden(f, lo: float, hi: float, steps: int = 24) -> float:
    """Minimum of a unimodal f on [lo, hi]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(steps):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def fit(rows, device: DeviceSpec, names_and_bounds: dict[str, tuple[float, float]], rounds: int = 3) -> DeviceSpec:
    """Coordinate descent on the named DeviceSpec fields; layouts re-chosen by the planner each round."""
    for _ in range(rounds):
        layouts = [best_layout(r, device) for r in rows]
        for name, (lo, hi) in names_and_bounds.items():
            def loss(x, name=name):
                return _loss(rows, dataclasses.replace(device, **{name: x}), layouts)
            device = dataclasses.replace(device, **{name: _golden(loss, lo, hi)})
    return device


def main() -> None:
    # A fixed starting point, so that the fit reproduces whatever devices.py currently holds.
    start = dict(gemm_efficiency=0.7, gemm_half_dim=128.0, elementwise_traffic=4.0)
    a100 = fit(A100_ROWS, get_device("a100-80gb", start),
               {"gemm_efficiency": (0.3, 1.0), "gemm_half_dim": (1.0, 1024.0), "elementwise_traffic": (0.0, 30.0)},
               rounds=4)
    shared = {k: getattr(a100, k) for k in ("gemm_half_dim", "elementwise_traffic")}
    h100 = fit(H100_ROWS, get_device("h100-sxm", shared), {"gemm_efficiency": (0.3, 1.0)}, rounds=2)
    print(f"GPU_GEMM_HALF_DIM = {a100.gemm_half_dim:.1f}")
    print(f"GPU_ELEMENTWISE_TRAFFIC = {a100.elementwise_traffic:.2f}")
    print(f"A100_GEMM_EFFICIENCY = {a100.gemm_efficiency:.3f}")
    print(f"H100_GEMM_EFFICIENCY = {h100.gemm_efficiency:.3f}")
    for rows, device in ((A100_ROWS, a100), (H100_ROWS, h100)):
        for r in rows:
            lay = best_layout(r, device)
            got = predicted_tflops(r, device, lay)
            print(f"{r.source:40s} published {r.tflops_per_gpu:6.1f}  predicted {got:6.1f} "
                  f"({got / r.tflops_per_gpu - 1:+.1%})  {lay.describe()}")


if __name__ == "__main__":
    main()
