"""``--device cpu``: measure this machine instead of assuming a spec.

Matmul rate (peak and half dimension), memory bandwidth, op dispatch, the loss's and attention's rates, the
serving engine's own figures (serving_figures), gloo's collectives, a process's resident memory and what the
parallel wrappers add (framework_overheads), each with the threads one process of that run gets.
docs/planner.md, "--device cpu", says what each figure feeds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from scalenlp.hardware import GPU_ELEMENTWISE_TRAFFIC, DeviceSpec
from scalenlp.parallel.mesh import free_port
from scalenlp.plan.comms import ring_time

# (m, n, k): thin shapes like a small model's projections, up to square ones.
MATMUL_SHAPES = ((2048, 64, 64), (2048, 256, 64), (2048, 64, 256), (512, 512, 512), (1024, 1024, 1024),
                 (2048, 4096, 64))


def _rate(fn, work: float, min_time: float = 0.5) -> float:
    """Median of five timed batches of calls, in work units per second: on a shared machine the median is
    what a long run gets, the best is a moment when nobody else was running."""
    fn()
    times = []
    for _ in range(5):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time / 5 or reps == 0:
            fn()
            reps += 1
        times.append(elapsed / reps)
    return work / sorted(times)[2]


def matmul_rates(dtype: torch.dtype = torch.float32, shapes=MATMUL_SHAPES) -> list[tuple[tuple[int, int, int], float]]:
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out.append(((m, n, k), _rate(lambda: a @ b, 2.0 * m * n * k)))
    return out


# (m, n, k) of inference: a decode step's batch (1-64 rows) and a prefill's prompts against a layer's weights.
SERVING_SHAPES = tuple((m, n, k) for m in (1, 4, 16, 64, 256, 1024) for n, k in ((1024, 1024), (2048, 512)))


def serving_matmul_rates(dtype: torch.dtype, shapes=SERVING_SHAPES,
                         working_set: int = 256 * 2**20) -> list[tuple[tuple[int, int, int], float]]:
    """Rates of inference's matmuls as a decode step runs them: through the engine's linear layers (pre-packed for
    oneDNN where the engine packs them, scalenlp.engine.packing), each call on the next of enough weight copies to
    fill ``working_set`` bytes (8x a 32 MiB last-level cache), so that the weights come from memory, as a served
    model's do, and not from the cache one reused matrix stays in. On the development machine (bf16, one thread)
    a packed 1024x1024 weight at one row ran at 31 GFLOP/s from the cache and 8 from memory, at 16 rows 161 and
    110; the plain product of two cached tensors, measured here before, ran at 19 and 136: the cost model
    priced a decode step of SmolLM2 from it 11-26% below what the engine took."""
    from torch import nn

    from scalenlp.engine.packing import can_pack, packed

    pools, out = {}, []
    with torch.no_grad():
        for m, n, k in shapes:
            if (n, k) not in pools:
                copies = max(2, working_set // (n * k * dtype.itemsize))
                linears = [nn.Linear(k, n, bias=False, dtype=dtype) for _ in range(copies)]
                pools[n, k] = [packed(lin) if can_pack(lin) else lin for lin in linears]
            layers, x = itertools.cycle(pools[n, k]), torch.randn(m, k, dtype=dtype)
            out.append(((m, n, k), _rate(lambda: next(layers)(x), 2.0 * m * n * k)))
    return out


def serving_figures(dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Peak and half dimension of this machine's matmuls in the serving precision over inference's shapes, run as
    the engine runs them (serving_matmul_rates): a CPU's bf16 kernels run thin rows far below their square-matrix
    rate, which the fp32 training shapes do not show; and the engine's own costs in that precision: host time per
    step, layer and sequence (engine_overheads), a prefill's memory-bound traffic (prefill_elementwise_traffic, at
    the bandwidth it is measured against), attention over the KV cache (decode_attention_rate) and the sampler per
    logit (sample_time_per_logit)."""
    rates, bandwidth = serving_matmul_rates(dtype), memory_bandwidth()
    peak, half = fit_matmul_curve(rates, bandwidth)
    overheads = engine_overheads(dtype)
    # At one row a product reads each weight once for 2 FLOPs: its rate, in bytes, is how fast a decode step streams
    # its weights. Through the packed kernel that is about half what summing a buffer reads (on the development
    # machine 10.7-12.2 GB/s against 23-24); priced at the sum's rate, SmolLM2's decode step came out 20-26% fast.
    one_row = statistics.median(rate for (m, _, _), rate in rates if m == 1) * dtype.itemsize / 2
    return {("peak_flops_bf16" if dtype == torch.bfloat16 else "peak_flops_fp32"): peak, "gemm_half_dim": half,
            "read_bw": one_row, "hbm_bw": bandwidth, **overheads,
            "elementwise_traffic": prefill_elementwise_traffic(dtype, overheads, bandwidth),
            "decode_attention_flops": decode_attention_rate(dtype),
            "sample_s_per_logit": sample_time_per_logit(dtype)}


def fit_matmul_curve(rates, bandwidth: float) -> tuple[float, float]:
    """(peak, half_dim) of the cost model's matmul time, flops / (peak · Π d/(d + half_dim)) + result
    bytes / bandwidth, by least squares in log space on the arithmetic part of each measured time."""
    arithmetic = []
    for (m, n, k), rate in rates:
        flops = 2.0 * m * n * k
        seconds = flops / rate - 4.0 * m * n / bandwidth
        arithmetic.append(((m, n, k), flops / max(seconds, 0.25 * flops / rate)))
    best = (math.inf, 0.0, 0.0)
    for step in range(200):
        half = 2 ** (step / 20)  # 1 .. ~1000
        logs = [math.log(r) - sum(math.log(d / (d + half)) for d in dims) for dims, r in arithmetic]
        log_peak = sum(logs) / len(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        if err < best[0]:
            best = (err, math.exp(log_peak), half)
    return best[1], best[2]


def memory_bandwidth() -> float:
    """Bytes/s of a large elementwise op that allocates its output, as eager PyTorch ops do: on a CPU,
    first touching fresh pages costs as much as streaming them, so preallocated buffers overstate it."""
    a, b = torch.ones(1 << 23), torch.ones(1 << 23)
    return _rate(lambda: torch.add(a, b), 3 * 4 * a.numel(), min_time=0.3)


def _debug_engine(layers: int, batch: int, dtype: torch.dtype, new: int, prompt: int = 4, **widths):
    """An engine on the Llama-style debug model with ``layers`` layers and a 64-token vocabulary, in ``dtype``: a
    model whose arithmetic is negligible, so that what a step costs is the engine's and the ops' own time
    (``widths``: model.* shape keys that widen it where the arithmetic is what is timed)."""
    from tokenizers import Tokenizer, models

    from scalenlp.engine.decoder_engine import Engine
    from scalenlp.models.flavors import build_model, model_args

    vocab = 64
    model = build_model(model_args("debug", n_layers=layers, vocab_size=vocab, max_seq_len=prompt + new,
                                   **widths)).to(dtype).eval()
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return Engine(model, tokenizer, max_batch=batch, max_queue=batch).start()


def _serve(engine, batch: int, prompt: int, new: int) -> tuple[float, list[list[float]]]:
    """Submit ``batch`` greedy requests of ``prompt`` tokens for ``new`` tokens each, together (their prompts
    prefill as one batch), and wait for all: the submit time and each request's token times."""
    from scalenlp.engine.sampling import SamplingParams

    stamps, done = [[] for _ in range(batch)], threading.Event()

    def on_event(i, d):
        stamps[i].append(d.time)
        if d.finish_reason and all(len(s) == new for s in stamps):
            done.set()

    ids = [1 + i % 60 for i in range(prompt)]
    start = time.perf_counter()
    engine.submit_many([(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))] * batch,
                       [lambda d, i=i: on_event(i, d) for i in range(batch)])
    done.wait()
    return start, stamps


def _tpot(engine, batch: int, new: int) -> float:
    """Median over ``batch`` requests of 4-token prompts, served together, of the seconds between their tokens,
    counted as benchmarks/serve_plan_vs_measured.py counts TPOT."""
    _, stamps = _serve(engine, batch, 4, new)
    return sorted((s[-1] - s[0]) / (new - 1) for s in stamps)[batch // 2]


def engine_overheads(dtype: torch.dtype, batch: int = 16, layers: int = 9, new: int = 24) -> dict[str, float]:
    """A decode step's host time outside its arithmetic, through the engine itself (scalenlp.engine.decoder_engine: the
    loop's own tensors, each layer's ~50 small ops, the sampler, detokenizing and each request's callback), in the
    serving dtype with the engine's packed weights: the step time of the debug model (_debug_engine) at 1 and
    ``layers`` layers and 1 and ``batch`` sequences, four points that give four figures: per layer and per step,
    and what each sequence of the batch adds to each (on a CPU the fused attention kernel and the cache's scatter
    cost per row even when the rows are tiny). The four are timed in turn, five times, and each keeps its median:
    on a shared machine a load that changes between them would otherwise go into the differences."""
    points = [(n, b) for n in (1, layers) for b in (1, batch)]
    engines = {p: _debug_engine(p[0], p[1], dtype, new) for p in points}
    try:
        _tpot(engines[points[0]], 1, 4)  # warm-up
        times = {p: [] for p in points}
        for _ in range(5):
            for p in points:
                times[p].append(_tpot(engines[p], p[1], new))
    finally:
        for engine in engines.values():
            engine.stop()
    t = {p: sorted(v)[2] for p, v in times.items()}
    per_layer = {b: (t[layers, b] - t[1, b]) / (layers - 1) for b in (1, batch)}
    per_step = {b: t[1, b] - per_layer[b] for b in (1, batch)}
    layer_seq = max(0.0, (per_layer[batch] - per_layer[1]) / (batch - 1))
    step_seq = max(0.0, (per_step[batch] - per_step[1]) / (batch - 1))
    return dict(decode_layer_overhead_s=max(0.0, per_layer[1] - layer_seq), decode_layer_sequence_overhead_s=layer_seq,
                decode_step_overhead_s=max(0.0, per_step[1] - step_seq), decode_sequence_overhead_s=step_seq)


def _ttft(engine, batch: int, prompt: int) -> float:
    """Seconds from submitting ``batch`` prompts of ``prompt`` tokens together to the last of their first tokens."""
    start, stamps = _serve(engine, batch, prompt, 1)
    return max(s[0] for s in stamps) - start


def _layer_arithmetic(model: torch.nn.Module, dtype: torch.dtype, batch: int, prompt: int) -> float:
    """Seconds of a served model's first layer's linears (as the engine packed them) and causal attention over
    ``batch`` prompts of ``prompt`` tokens, each timed alone."""
    import torch.nn.functional as F

    args, seconds = model.args, 0.0
    with torch.no_grad():
        for linear in (m for m in model.layers["0"].modules() if hasattr(m, "in_features")):
            x = torch.randn(batch * prompt, linear.in_features, dtype=dtype)
            seconds += 1.0 / _rate(lambda: linear(x), 1.0, min_time=0.2)
        q = torch.randn(batch, args.n_heads, prompt, args.head_dim, dtype=dtype)
        kv = torch.randn(batch, args.n_kv_heads, prompt, args.head_dim, dtype=dtype)
        seconds += 1.0 / _rate(lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True),
                               1.0, min_time=0.2)
    return seconds


def prefill_elementwise_traffic(dtype: torch.dtype, overheads: dict[str, float], bandwidth: float, batch: int = 16,
                                prompt: int = 64, layers: int = 5) -> float:
    """elementwise_traffic (bytes moved per stored activation byte, scalenlp.plan.cost) as a prefill through the
    engine moves it on this CPU: what a layer adds to the first token's time (the debug model 256 wide at 1 and
    ``layers`` layers, ``batch`` prompts of ``prompt`` tokens, medians of five alternated runs) beyond its linears
    and attention timed alone and its host time per layer (``overheads``: engine_overheads), over the layer's
    activations at ``bandwidth``, the one the prefill is then priced at (an add's first-touch bandwidth swings
    4-27 GB/s here with what the allocator holds; the product is what is measured). On the development machine
    27-48 against 16-27 GB/s (the GPU fit's 4.62 at HBM's): eager norms, rotary embeddings, head transposes and the
    cache's writes; priced at the GPU's figure, the engine's first token came out 8-30% early."""
    from scalenlp.plan.cost import activation_bytes_per_layer, shape_of

    widths = dict(dim=256, n_heads=8, n_kv_heads=4, ffn_dim=688)
    engines = {n: _debug_engine(n, batch, dtype, 1, prompt, **widths) for n in (1, layers)}
    try:
        times = {n: [] for n in engines}
        for engine in engines.values():
            _ttft(engine, batch, prompt)  # warm-up
        for _ in range(5):
            for n, engine in engines.items():
                times[n].append(_ttft(engine, batch, prompt))
        model = engines[layers].model
        arithmetic = _layer_arithmetic(model, dtype, batch, prompt)
    finally:
        for engine in engines.values():
            engine.stop()
    per_layer = (statistics.median(times[layers]) - statistics.median(times[1])) / (layers - 1)
    host = overheads["decode_layer_overhead_s"] + batch * overheads["decode_layer_sequence_overhead_s"]
    stored = activation_bytes_per_layer(shape_of("debug", model.args), batch, prompt, 1, False, "none",
                                        "bf16" if dtype == torch.bfloat16 else "fp32", True)
    return max(0.0, per_layer - arithmetic - host) * bandwidth * 3 / stored


def decode_attention_rate(dtype: torch.dtype, batch: int = 8, heads: int = 8, kv_heads: int = 4,
                          head_dim: int = 64) -> float:
    """FLOP/s of attention over a KV cache as the engine's decode step runs it (one query a row, a boolean mask,
    grouped heads, the serving dtype), counted as the cost model counts it (4 · rows · heads · head_dim per cached
    token): the slope between 128 and 512 cached tokens, so that the kernel's fixed cost per row, which
    engine_overheads counts, is left out. On the development machine's CPU it ran at 0.7-2.5 GFLOP/s in bf16 (load
    dependent), about a tenth of the training kernel's rate (attention_rate) measured beside it."""
    import torch.nn.functional as F

    seconds = []
    for kv in (128, 512):
        q = torch.randn(batch, heads, 1, head_dim, dtype=dtype)
        k, v = (torch.randn(batch, kv_heads, kv, head_dim, dtype=dtype) for _ in range(2))
        mask = torch.ones(batch, 1, 1, kv, dtype=torch.bool)
        seconds.append(1.0 / _rate(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                                   1.0, min_time=0.3))
    return 4 * batch * heads * head_dim * (512 - 128) / max(seconds[1] - seconds[0], 1e-9)


def sample_time_per_logit(dtype: torch.dtype, batch: int = 16) -> float:
    """Seconds per logit of picking a decode step's tokens (the engine's gather of each row's logits, then the
    sampler: float conversion and argmax, greedy) over a 32k vocabulary, less the same at 1k (the sampler's fixed
    cost, which engine_overheads counts)."""
    from scalenlp.engine.sampling import SamplingBatch, SamplingParams, sample

    params = SamplingBatch.build([SamplingParams(temperature=0)] * batch, [0] * batch, [0] * batch, "cpu")
    index = torch.arange(batch)
    seconds = []
    for vocab in (1024, 32768):
        logits = torch.randn(batch, 1, vocab, dtype=dtype)
        seconds.append(1.0 / _rate(lambda: sample(logits[index, -1], params), 1.0, min_time=0.3))
    return max(0.0, seconds[1] - seconds[0]) / (batch * (32768 - 1024))


def op_overhead() -> float:
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    return 1.0 / _rate(lambda: a + b, 1.0)


def _step_time(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Median seconds of forward + backward + AdamW step of a micro model (same call count on every rank)."""
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(25):
        dist.barrier()
        start = time.perf_counter()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def framework_overheads(world: int) -> tuple[float, float]:
    """(seconds per FSDP unit, seconds per tensor-parallel linear) that PyTorch's wrappers add to a training
    step on this machine, from a micro model of four linears run plain, fully sharded and tensor-parallel:
    hooks, DTensor dispatch and sharding propagation, the optimizer over DTensors, collectives' latency."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    layers = 4

    def micro():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])

    x = torch.randn(8, 32)
    plain = _step_time(micro(), x)
    sharded = micro()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp = _step_time(sharded, x)
    split = parallelize_module(micro(), mesh, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                              for i in range(layers)})
    tp = _step_time(split, x)
    return max(0.0, (fsdp - plain) / (layers + 1)), max(0.0, (tp - plain) / layers)


def vocab_parallel_loss_factor(world: int) -> float:
    """How many times longer cross-entropy forward + backward over a vocabulary shard takes under
    tensor parallelism's ``loss_parallel`` than the fused kernel over a plain tensor of the same
    size: loss_parallel composes the log-softmax from separate passes (max, subtract, exponentiate,
    sum, and again for the gradient) where the fused kernels make one each way. Timed on a one-rank
    mesh per process, so that only the passes count: its three per-token all-reduces are priced with the
    other collectives, and waits on another rank would make the ratio swing (2.2 to 5.1 when tried).
    The logits are a tensor-parallel step's size (2048 tokens × 2048 local classes, fp32)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    tokens, local = 2048, 2048
    logits = torch.randn(tokens, local, requires_grad=True)
    targets = torch.randint(0, local, (tokens,))
    own = init_device_mesh("cpu", (world, 1), mesh_dim_names=("others", "own"))["own"]
    sharded = DTensor.from_local(logits.detach(), own, (Shard(1),)).requires_grad_()

    def vocab_parallel():
        with loss_parallel():
            F.cross_entropy(sharded, targets).backward()

    def plain():
        F.cross_entropy(logits, targets).backward()

    best = {plain: math.inf, vocab_parallel: math.inf}
    for _ in range(8):  # interleaved, each at its best: both are pure compute, so noise only ever adds
        for fn in best:
            start = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - start)
    return best[vocab_parallel] / best[plain]


def loss_time_per_logit(tokens: int = 2048, classes: int = 4096) -> float:
    """Seconds per logit of cross-entropy forward + backward (fp32, PyTorch's fused log-softmax kernels,
    the gradient's zero fill included) at a training step's size, out of the caches. A pass over the
    logits is partly arithmetic (an exponential per element), so it is timed rather than derived from
    the bandwidth."""
    import torch.nn.functional as F

    logits = torch.randn(tokens, classes, requires_grad=True)
    targets = torch.randint(0, classes, (tokens,))
    return 1.0 / _rate(lambda: F.cross_entropy(logits, targets).backward(), tokens * classes)


def attention_rate(batch: int = 8, heads: int = 8, seq: int = 128, head_dim: int = 32) -> float:
    """FLOP/s of causal scaled-dot-product attention, forward + backward, counted as the cost model counts it
    (the two score matmuls, the masked half skipped). On a CPU the fused kernel runs far below the matmul
    peak (24-38 GFLOP/s against ~200 for a large matmul on one core of the development machine, for head
    dims 16 to 128), so attention is timed rather than priced as a matmul."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    flops = 3 * 2 * (2 * batch * heads * seq * seq * head_dim) * 0.5
    return _rate(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), flops)


def compute_figures() -> dict[str, float]:
    """Matmul curve, memory bandwidth, bf16/fp32 ratio, attention's rate, the loss's time per logit and
    dispatch cost of this process's share of the CPU."""
    bandwidth = memory_bandwidth()
    peak, half = fit_matmul_curve(matmul_rates(), bandwidth)
    return dict(peak_flops_fp32=peak, peak_flops_bf16=peak * _rate_ratio(), gemm_half_dim=half, hbm_bw=bandwidth,
                op_overhead_s=op_overhead(), loss_s_per_logit=loss_time_per_logit(), attention_flops=attention_rate())


def _collective_after_compute(collective, reps: int) -> float:
    """Seconds a collective (a call) adds to a loop of compute bursts: in a training step a collective
    follows compute (its buffers out of cache, the ranks just converging), and there it costs more than
    back to back on idle ranks (on a 2-core development machine a 2 MiB all-reduce took 4.0 ms after
    compute against 2.4 ms idle)."""
    import torch.distributed as dist

    a = torch.randn(256, 256)

    def loop(communicate: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            for _ in range(8):
                a @ a
            if communicate:
                collective()
        return (time.perf_counter() - start) / reps

    loop(True)  # warm-up
    return max(loop(True) - loop(False), 1e-6)


def _runtime_bytes() -> int:
    """What a training process holds besides its model, activations and buffers: its imports, and what a
    few training steps leave behind (the math libraries' workspaces, autograd's, and the heap that the
    allocator keeps from freed activations: 55-70 MiB on the development machine), measured once the
    steps' own model and optimizer are freed."""
    from torch import nn

    from scalenlp.hardware import resident_bytes

    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(2048, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer
    return resident_bytes(peak=False)


def _worker(rank: int, world: int, port: int, with_compute: int) -> None:
    """One of the measuring processes (``python -m scalenlp.plan.measure RANK WORLD PORT WITH_COMPUTE``); rank 0
    prints JSON. With WITH_COMPUTE every rank measures compute at the same time, so that each sees the share
    of the machine a rank of a ``world``-process run gets."""
    import torch.distributed as dist

    import scalenlp.train.trainer  # noqa: F401  the training process's own imports count towards its runtime memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = dict(rss=_runtime_bytes())  # before any other tensor of ours
        if with_compute:
            dist.barrier()
            result.update(compute_figures())
        small, large = torch.ones(1), torch.ones(1 << 22)  # 4 bytes; 16 MiB
        shard = torch.ones(large.numel() // world)
        result["nbytes"] = large.numel() * 4
        for name, collective, reps in (("small", lambda: dist.all_reduce(small), 30),
                                       ("large", lambda: dist.all_reduce(large), 6),
                                       ("gather", lambda: dist.all_gather_single(large, shard), 6),
                                       ("scatter", lambda: dist.reduce_scatter_single(shard, large), 6)):
            result[name] = _collective_after_compute(collective, reps)
        result["fsdp_unit"], result["tp_linear"] = framework_overheads(world)
        result["loss_parallel"] = vocab_parallel_loss_factor(world)
        if rank == 0:
            print(json.dumps(result))
    finally:
        dist.destroy_process_group()


def distributed_figures(world: int, with_compute: bool) -> dict[str, float]:
    """What ``world`` local gloo processes measure: all-reduce bus bandwidth (bytes/s) and latency per hop (s),
    all-gather's and reduce-scatter's time against the ring's at that bandwidth, the resident bytes of a
    process with scalenlp's training imports and a process group besides its model (_runtime_bytes), the
    wrappers' overheads (framework_overheads), and with_compute, each rank's compute figures."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "scalenlp.plan.measure", str(r), str(world), str(port),
                               str(int(with_compute))], stdout=subprocess.PIPE, env=env, text=True)
             for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the gloo measurement processes failed; see their messages above")
    result = json.loads(outputs[0].strip().splitlines()[-1])
    hops = 2 * (world - 1)
    bus_bw = hops / world * result["nbytes"] / max(result["large"] - result["small"], 1e-9)
    # All-gather and reduce-scatter make half the all-reduce's hops; gloo's take longer than that (on the
    # development machine 2.3x and 3.8x for 16 MiB over 2 processes), which FSDP meets at every unit.
    ring_half = ring_time("all_gather", result["nbytes"], world, bus_bw, result["small"] / hops)
    figures = dict(latency_s=result["small"] / hops, intra_node_bw=bus_bw, nic_bw=bus_bw,
                   all_gather_factor=result["gather"] / ring_half, reduce_scatter_factor=result["scatter"] / ring_half,
                   runtime_bytes=result["rss"], fsdp_unit_overhead_s=result["fsdp_unit"],
                   tp_linear_overhead_s=result["tp_linear"], vocab_parallel_loss_factor=result["loss_parallel"])
    if with_compute:
        figures.update({k: result[k] for k in ("peak_flops_fp32", "peak_flops_bf16", "gemm_half_dim", "hbm_bw",
                                               "op_overhead_s", "loss_s_per_logit", "attention_flops")})
    return figures


def measure_cpu(processes: int = 1, overrides: dict[str, float] | None = None) -> DeviceSpec:
    """A DeviceSpec for one of ``processes`` training processes sharing this machine: with several, compute is
    measured by that many processes at once (torchrun gives each one thread); alone, by this process with
    torch's thread count."""
    threads = 1 if processes > 1 else torch.get_num_threads()
    figures = distributed_figures(max(2, processes), with_compute=processes > 1)
    if processes == 1:
        figures.update(compute_figures())
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = DeviceSpec(name=f"cpu ({threads} thread{'s' if threads > 1 else ''} per process, measured)",
                      memory_bytes=total_ram / processes, gemm_efficiency=1.0,
                      elementwise_traffic=GPU_ELEMENTWISE_TRAFFIC, overlaps_communication=False, **figures)
    return dataclasses.replace(spec, **(overrides or {}))


def _rate_ratio() -> float:
    """bf16 over fp32 matmul rate at a mid-sized shape (CPUs without bf16 units emulate it slowly)."""
    a32, b32 = torch.randn(512, 512), torch.randn(512, 512)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    return _rate(lambda: a16 @ b16, 1.0) / _rate(lambda: a32 @ b32, 1.0)


if __name__ == "__main__":
    _worker(*(int(a) for a in sys.argv[1:5]))
