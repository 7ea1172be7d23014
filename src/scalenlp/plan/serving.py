"""`scalenlp plan --serve`: how many devices, at which tensor-parallel degree, serve a model within latency targets.

A layout is a tensor-parallel degree t and devices // t replicas. Each is priced per device for weights, KV
cache and the largest batch that fits, and in time for TTFT (a prompt's prefill) and TPOT (one decode step of
the batch, at least the weights and KV cache streamed from memory) with the training cost model's rates;
layouts that meet the targets are ranked by devices used, then throughput. docs/planner.md, "Serving".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scalenlp.errors import UserError
from scalenlp.hardware import DeviceSpec
from scalenlp.plan import comms
from scalenlp.plan.cost import (
    ELEMENT_BYTES,
    ModelShape,
    _gemm_time,
    activation_bytes_per_layer,
    gemm_efficiency,
    layer_matmuls,
)

# Bytes per weight: the serving precision's, or a quantized width: int8 one byte (a scale per output channel is
# negligible), int4 two weights a byte plus a bf16 scale and zero per group of 64 (`scalenlp quantize`'s default).
WEIGHT_BYTES = {**ELEMENT_BYTES, "int8": 1.0, "int4": 0.5 + 4 / 64}
# What a quantized model keeps outside its blocks (compress/quantized.py, engine/sharded.py), whole on every
# tensor-parallel rank: the output projection in int8 (int4 included), and the token embedding table in int8 too, or
# nothing more when tied (it is looked up in the output projection); learned positions at the serving precision.
TABLES_QUANTIZED = "int8"


@dataclass(frozen=True)
class ServeLayout:
    tp: int
    replicas: int
    batch: int  # sequences per replica's batch
    weights_per_device: float  # bytes
    kv_per_sequence: float  # bytes per device for one sequence of the full context
    kv_per_device: float  # at this batch
    max_batch: int  # the largest batch the memory holds
    ttft_s: float
    tpot_s: float
    tokens_per_sec: float  # output tokens per second over all replicas

    @property
    def devices(self) -> int:
        return self.tp * self.replicas

    def to_dict(self) -> dict:
        return {**asdict(self), "devices": self.devices}


def weight_bytes(shape: ModelShape, quantize: str, tp: int = 1, precision: str = "bf16") -> float:
    """Weights held by one of ``tp`` ranks. A floating model is split whole (the vocabulary too); a quantized one
    splits its blocks only."""
    if quantize in ELEMENT_BYTES:
        return shape.total_params * ELEMENT_BYTES[quantize] / tp
    return (shape.layers * shape.layer_params * WEIGHT_BYTES[quantize] / tp
            + (1 if shape.tied else 2) * table_bytes(shape, quantize, tp)
            + (shape.embedding_params + shape.head_params - 2 * shape.vocab * shape.hidden) * ELEMENT_BYTES[precision])


def table_bytes(shape: ModelShape, quantize: str, tp: int = 1) -> float:
    """One vocabulary x hidden table (the token embeddings, or the output projection) on one of ``tp`` ranks: split
    with a floating model, whole and in int8 beside a quantized one's blocks."""
    if quantize in ELEMENT_BYTES:
        return shape.vocab * shape.hidden * ELEMENT_BYTES[quantize] / tp
    return shape.vocab * shape.hidden * WEIGHT_BYTES[TABLES_QUANTIZED]


def kv_bytes_per_token(shape: ModelShape, tp: int, precision: str = "bf16") -> float:
    """K and V of one token in every layer, on one tensor-parallel rank, cached at the serving precision."""
    return 2 * shape.layers * shape.kv_dim / tp * ELEMENT_BYTES[precision]


def prefill_time(shape: ModelShape, device: DeviceSpec, batch: int, prompt: int, tp: int, precision: str) -> float:
    """Forward of ``batch`` prompts of ``prompt`` tokens on one tensor-parallel rank, first tokens included."""
    e = 2 if precision == "bf16" else 4
    peak = device.peak_flops(precision)
    matmuls = layer_matmuls(shape, batch, prompt, tp)
    times = [_gemm_time(f, dims, peak, device, e) for f, dims in matmuls]
    for i in (1, 2):  # attention scores: the causal half, at the fused kernel's measured rate where there is one
        times[i] = matmuls[i][0] * 0.5 / device.attention_flops if device.attention_flops else times[i] * 0.5
    logits = _gemm_time(2 * batch * shape.hidden * shape.vocab / tp, (batch, shape.vocab / tp, shape.hidden),
                        peak, device, e)
    reduce = 2 * comms.ring_time("all_reduce", e * batch * prompt * shape.hidden, tp, device.intra_node_bw,
                                 device.latency_s)
    # Norms, rotary embeddings, the gate's activation and the residual adds: the training cost model's memory-bound
    # traffic (elementwise_traffic times the layer's activations over a forward, backward and recompute) for a
    # forward alone, a third of it.
    stored = activation_bytes_per_layer(shape, batch, prompt, tp, False, "none", precision, True)
    elementwise = device.elementwise_traffic * stored / 3 / device.hbm_bw
    return shape.layers * (sum(times) + reduce + elementwise) + logits + host_time(shape, device, batch, tp)


def host_time(shape: ModelShape, device: DeviceSpec, batch: int, tp: int) -> float:
    """What one engine step of ``batch`` sequences spends outside its matmuls and streaming, which the device does
    not hide: per layer and per step, each with a share per sequence, and the sampler's pass over the batch's
    logits. On a CPU all four are measured through the engine (scalenlp.plan.measure.engine_overheads, and
    sample_time_per_logit); on a GPU the per-layer figure is fitted on lmdeploy's rows (plan.calibrate) and the
    others are 0."""
    per_layer = device.decode_layer_overhead_s + batch * device.decode_layer_sequence_overhead_s
    per_step = device.decode_step_overhead_s + batch * device.decode_sequence_overhead_s
    return shape.layers * per_layer + per_step + batch * shape.vocab / tp * device.sample_s_per_logit


def decode_time(shape: ModelShape, device: DeviceSpec, batch: int, kv_tokens: float, tp: int, precision: str,
                quantize: str) -> float:
    """One decode step of ``batch`` sequences holding ``kv_tokens`` cached tokens each, on one rank."""
    e = 2 if precision == "bf16" else 4
    peak = device.peak_flops(precision)
    # The batch is each matmul's thin dimension: the arithmetic runs at the efficiency the cost model gives that
    # shape, and the step can be no faster than streaming the weights and the cache either.
    projections = [m for i, m in enumerate(layer_matmuls(shape, batch, 1, tp)) if i not in (1, 2)]
    logits = (2 * batch * shape.hidden * shape.vocab / tp, (batch, shape.vocab / tp, shape.hidden))
    matmul = shape.layers * sum(f / (peak * gemm_efficiency(dims, device)) for f, dims in projections) \
        + logits[0] / (peak * gemm_efficiency(logits[1], device))
    attention_flops = 4 * batch * kv_tokens * shape.hidden / tp * shape.layers
    # A step looks up one row of the token embeddings per sequence and streams every other weight; tied, the table
    # is the output projection too and streams as that.
    lookup = 0 if shape.tied else table_bytes(shape, quantize, tp)
    streamed = (weight_bytes(shape, quantize, tp, precision) - lookup
                + batch * kv_tokens * kv_bytes_per_token(shape, tp, precision))
    # Attention over the cache at the rate measured for it where there is one (CPU: one query a row under a mask
    # runs far below the training kernel's rate), else the fused kernel's, else as matmuls.
    rate = device.decode_attention_flops or device.attention_flops or peak * device.gemm_efficiency
    compute = matmul + attention_flops / rate
    reduce = 2 * shape.layers * comms.ring_time("all_reduce", e * batch * shape.hidden, tp, device.intra_node_bw,
                                                device.latency_s)
    return max(compute, streamed / (device.read_bw or device.hbm_bw)) + reduce + host_time(shape, device, batch, tp)


def max_batch(shape: ModelShape, device: DeviceSpec, context: int, tp: int, quantize: str,
              precision: str = "bf16") -> int:
    free = device.memory_bytes - device.runtime_bytes - weight_bytes(shape, quantize, tp, precision)
    per_sequence = context * kv_bytes_per_token(shape, tp, precision) + 4 * shape.vocab / tp  # cache, fp32 logits
    return max(0, int(free // per_sequence))


def tensor_parallel_degrees(shape: ModelShape, devices: int, gpus_per_node: int) -> list[int]:
    return [t for t in range(1, min(devices, gpus_per_node) + 1)
            if devices % t == 0 and gpus_per_node % t == 0 and shape.heads % t == 0 and shape.kv_heads % t == 0]


def evaluate(shape: ModelShape, device: DeviceSpec, tp: int, replicas: int, batch: int, context: int, prompt: int,
             precision: str, quantize: str) -> ServeLayout:
    output = context - prompt
    ttft = prefill_time(shape, device, 1, prompt, tp, precision)
    tpot = decode_time(shape, device, batch, prompt + output / 2, tp, precision, quantize)
    per_request = ttft + max(0, output - 1) * tpot
    kv_seq = context * kv_bytes_per_token(shape, tp, precision)
    return ServeLayout(tp=tp, replicas=replicas, batch=batch, weights_per_device=weight_bytes(shape, quantize, tp, precision),
                       kv_per_sequence=kv_seq, kv_per_device=batch * kv_seq,
                       max_batch=max_batch(shape, device, context, tp, quantize, precision), ttft_s=ttft, tpot_s=tpot,
                       tokens_per_sec=replicas * batch * output / per_request)


def plan_serving(shape: ModelShape, device: DeviceSpec, devices: int, gpus_per_node: int, context: int, prompt: int,
                 *, concurrency: int | None = None, rate: float | None = None, ttft_ms: float | None = None,
                 tpot_ms: float | None = None, precision: str = "bf16", quantize: str | None = None) -> list[ServeLayout]:
    """Layouts that serve ``shape`` on at most ``devices`` devices: with ``concurrency``, each tensor-parallel
    degree with that many sequences spread over its replicas; with ``rate`` (requests/s) and latency targets,
    for each degree the fewest replicas whose largest batch within the targets carries the rate. Ranked by
    devices, then throughput. ``quantize`` (int8 | int4) narrows the weights; None keeps them at ``precision``."""
    quantize = quantize or precision
    degrees = tensor_parallel_degrees(shape, devices, gpus_per_node)
    fitting = [t for t in degrees if max_batch(shape, device, context, t, quantize, precision) >= 1]
    if not fitting:
        raise UserError(_no_fit_message(shape, device, devices, gpus_per_node, context, quantize, precision))
    out = []
    for t in fitting:
        limit = max_batch(shape, device, context, t, quantize, precision)
        if concurrency is not None:
            replicas = devices // t
            batch = -(-concurrency // replicas)
            if batch <= limit:
                out.append(evaluate(shape, device, t, replicas, batch, context, prompt, precision, quantize))
            continue
        best = None
        for batch in _batches(limit):
            layout = evaluate(shape, device, t, 1, batch, context, prompt, precision, quantize)
            if (ttft_ms is None or layout.ttft_s * 1e3 <= ttft_ms) and (tpot_ms is None or layout.tpot_s * 1e3 <= tpot_ms):
                best = layout
        if best is None:
            continue
        requests_per_replica = best.tokens_per_sec / (context - prompt)
        replicas = max(1, math.ceil((rate or 0.0) / requests_per_replica)) if rate else devices // t
        if replicas * t <= devices:
            out.append(evaluate(shape, device, t, replicas, best.batch, context, prompt, precision, quantize))
    out.sort(key=lambda s: (s.devices, -s.tokens_per_sec))
    return out


def _batches(limit: int) -> list[int]:
    """Batch sizes tried: powers of two up to the memory's limit, and the limit."""
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return out + ([limit] if limit and limit not in out else [])


def _no_fit_message(shape: ModelShape, device: DeviceSpec, devices: int, gpus_per_node: int, context: int,
                    quantize: str, precision: str) -> str:
    gib = 2**30
    largest = max(tensor_parallel_degrees(shape, devices, gpus_per_node), default=1)
    need = weight_bytes(shape, quantize, precision=precision) / gib
    what = []
    for t in tensor_parallel_degrees(shape, gpus_per_node, gpus_per_node):
        if t > largest and max_batch(shape, device, context, t, quantize, precision) >= 1:
            what.append(f"--devices {t} (tensor parallelism {t})")
            break
    for q in ("int8", "int4"):
        if WEIGHT_BYTES[q] < WEIGHT_BYTES[quantize] and any(
                max_batch(shape, device, context, t, q, precision) >= 1 for t in tensor_parallel_degrees(shape, devices, gpus_per_node)):
            what.append(f"--quantize {q} ({weight_bytes(shape, q, precision=precision) / gib:,.1f} GiB of weights)")
            break
    fix = " or ".join(what) if what else "a device with more memory"
    return (f"{shape.name}'s weights ({need:,.1f} GiB at {quantize}) and one {context}-token sequence's KV cache do not "
            f"fit on {device.name} ({device.memory_bytes / gib:,.1f} GiB) at any tensor-parallel degree up to "
            f"{largest}; use {fix}")
