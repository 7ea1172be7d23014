"""Cost model of one training step: memory per device, FLOPs and time, for a model, a layout and a device.

Memory counts model states per ZeRO stage (Rajbhandari et al. 2020) and activations per layer term by term
(Korthikanti et al. 2022), times the microbatches each pipeline schedule holds. Time is every matmul at a
calibrated rate for its shape, memory-bound kernels at the device's bandwidth, and the collectives of each
parallelism on the cluster's links (scalenlp.plan.comms), hidden or exposed as they run. docs/planner.md
derives each term; the GPU constants are fitted by scalenlp.plan.calibrate, and ``--device cpu`` measures
its own (scalenlp.plan.measure).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from scalenlp.errors import UserError
from scalenlp.hardware import DeviceSpec
from scalenlp.layout import INTERLEAVED, Layout, largest_shard
from scalenlp.plan import comms

# Bytes an Adam step streams per local optimizer parameter: read grad, weights, m, v; write weights, m, v.
OPTIMIZER_TRAFFIC = 28
# Kernels (or dispatched ops) per transformer layer for forward + backward; matters where dispatch is not hidden.
OPS_PER_LAYER = 60

# Linears of a block: q, k, v, o, and up, down (+ gate with SwiGLU).
LINEARS_PER_LAYER = {False: 6, True: 7}
# Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1, ZB-H1): splitting each backward into its
# input and weight halves lets the weight halves fill the cool-down, leaving (p − 1)(T_F + T_B − T_W) of idle time
# against 1F1B's (p − 1)(T_F + T_B + T_W); with T_F = T_B = T_W that is a third.
ZERO_BUBBLE_SHARE = 1 / 3

ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
# (weights, gradients, optimizer) bytes per parameter. "mixed": Rajbhandari et al.'s mixed-precision Adam,
# K = 12 (Megatron, DeepSpeed). "fp32": weights, gradients and Adam moments in fp32 with bf16 only in the
# matmuls (torch autocast, FSDP2's MixedPrecisionPolicy over fp32 shards): what scalenlp train keeps.
STATE_BYTES = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder; parameter counts come from the model built on meta."""
    name: str
    flavor: str | None  # named flavor (usable as model.flavor) or None for a custom shape
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    swiglu: bool
    dropout: bool
    tied: bool
    layer_params: int
    embedding_params: int  # token (+ learned position) embeddings, on the first stage
    head_params: int  # final norm + output projection, on the last stage (a tied one is held there too)
    total_params: int

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)


@dataclass(frozen=True)
class Workload:
    seq: int
    global_batch: int
    precision: str = "bf16"  # bf16 | fp32: the matmuls' precision
    states: str = "fp32"  # fp32 | mixed: how weights, gradients and optimizer state are kept (STATE_BYTES)
    flash_attention: bool = True  # scaled_dot_product_attention keeps no s×s scores (PyTorch's default)


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # params, grads, optimizer, activations, buffers, runtime (bytes, largest stage)
    memory_per_device_bytes: float
    model_flops_per_step: float
    hardware_flops_per_step: float  # with recomputation
    step_time_s: float
    tokens_per_sec: float
    tflops_per_device: float  # hardware FLOPs (counting recomputation, as Megatron reports)
    mfu: float  # model FLOPs / peak
    bubble_fraction: float
    time_breakdown_s: dict[str, float] = field(default_factory=dict)
    train_command: str | None = None  # filled in by the command
    fits: bool = True  # whether memory_per_device_bytes fits the device's memory (and the host's, offloaded)
    host_memory_per_device_bytes: float = 0.0  # offloaded states in host memory, per device (largest stage)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layout"] = asdict(self.layout)
        return out


# ---------------------------------------------------------------- model shapes

def model_shape(model: str, seq: int) -> ModelShape:
    """A named flavor, or ``key=value,...`` over the model.* shape keys ``scalenlp train`` takes
    (scalenlp.models.flavors.SHAPE_KEYS): ``flavor=llama-8b,layers=16``, or without a flavor at least
    ``hidden=H,layers=L,heads=A,vocab_size=V`` (``family=llama|gpt2`` sets norm, activation, positions and tying)."""
    from scalenlp.models.flavors import parse_shape, shape_args

    args = shape_args(parse_shape(model), seq)
    if seq > args.max_seq_len:
        raise UserError(f"--seq {seq} is longer than {model}'s max_seq_len {args.max_seq_len}; "
                        f"use --seq {args.max_seq_len} or less, or give the shape a larger max_seq_len")
    return _count(model, model if "=" not in model else None, args)


@functools.lru_cache(maxsize=64)
def _count_cached(name: str, flavor: str | None, key: tuple) -> ModelShape:
    from scalenlp.models.decoder import ModelArgs
    from scalenlp.models.flavors import build_model

    args = ModelArgs(**dict(key))
    model = build_model(args, device="meta")  # allocates nothing, whatever the size

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    embedding = count(model.tok_embeddings) + count(model.pos_embeddings)
    head = count(model.norm) + model.output.weight.numel()
    return ModelShape(name=name, flavor=flavor, hidden=args.dim, layers=args.n_layers, heads=args.n_heads,
                      kv_heads=args.n_kv_heads, ffn=args.ffn_dim, vocab=args.vocab_size,
                      swiglu=args.activation == "swiglu", dropout=args.dropout > 0, tied=args.tie_embeddings,
                      layer_params=count(model.layers["0"]), embedding_params=embedding, head_params=head,
                      total_params=model.num_params())


def _count(name: str, flavor: str | None, args) -> ModelShape:
    return _count_cached(name, flavor, tuple(sorted(asdict(args).items())))


def shape_of(name: str, args) -> ModelShape:
    """The cost model's view of a model built from ``args`` (a loaded checkpoint's ModelArgs)."""
    return _count(name, None, args)


# ---------------------------------------------------------------- memory

def model_state_bytes(params: float, zero: int, shard: int, states: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one device holding ``params`` before ZeRO sharding."""
    w, g, o = STATE_BYTES[states]
    n = shard if zero else 1
    return (w * params / (n if zero >= 3 else 1),
            g * params / (n if zero >= 2 else 1),
            o * params / (n if zero >= 1 else 1))


def activation_bytes_per_layer(shape: ModelShape, micro: int, seq: int, tp: int, sequence_parallel: bool,
                               recompute: str, precision: str, flash_attention: bool) -> float:
    """Bytes one layer keeps for its backward, for one microbatch (Korthikanti et al. 2022, term by term)."""
    e = ELEMENT_BYTES[precision]
    tokens = micro * seq
    outside_tp = tp if sequence_parallel else 1  # TP alone leaves norms, dropout and block inputs whole
    if recompute == "full":
        return e * tokens * shape.hidden / outside_tp
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    mask = 1 if shape.dropout else 0  # dropout keeps a one-byte mask
    # Norm inputs (2), attention input, MLP input, and the two dropout masks: unsharded by TP alone.
    outside = tokens * (4 * e * h + 2 * mask * h) / outside_tp
    qkv = e * tokens * (h + 2 * kv)  # Q, K for the scores and V for their product
    attn_out = e * tokens * h  # input of the output projection
    if flash_attention or recompute == "selective":
        scores = 4 * micro * shape.heads * seq if flash_attention else 0  # flash keeps its log-sum-exp rows
    else:
        scores = micro * shape.heads * seq * seq * (e + mask * (1 + e))  # softmax, dropout mask and output
    mlp = e * tokens * f * (4 if shape.swiglu else 2)  # gate, up, act(gate), product | pre- and post-GELU
    return outside + (qkv + attn_out + scores + mlp) / tp


@functools.lru_cache(maxsize=256)
def _split(layers: int, layer_cost: float, head_cost: float, stages: int) -> tuple[int, ...]:
    from scalenlp.parallel.pipeline import split_layers  # torch.distributed.pipelining: only when pipelining

    return tuple(len(run) for run in split_layers([layer_cost] * layers, head_cost, stages))


def layers_per_rank(shape: ModelShape, seq: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """Layers each pipeline rank holds, split as ``scalenlp train`` splits them (parallel.pipeline.split_layers,
    balancing matmul parameters + attention per layer against the output projection on the last stage), and
    summed over a rank's stages r, r + pp, ... under an interleaved schedule."""
    if pp == 1:
        return [shape.layers]
    linear = shape.hidden * (shape.hidden + 2 * shape.kv_dim) + shape.hidden ** 2 \
        + (3 if shape.swiglu else 2) * shape.hidden * shape.ffn
    counts = _split(shape.layers, linear + 2 * shape.hidden * seq, shape.vocab * shape.hidden, pp * stages_per_rank)
    return [sum(counts[rank::pp]) for rank in range(pp)]


def stage_params(shape: ModelShape, layout: Layout, stage: int, layers: int) -> float:
    params = layers * shape.layer_params
    if stage == 0:
        params += shape.embedding_params
    if stage == layout.pp - 1:
        # A tied output weight is the embedding itself on one stage, a second copy on the last of several.
        params += shape.head_params - (shape.vocab * shape.hidden if shape.tied and layout.pp == 1 else 0)
    # A vocabulary tp does not divide is split unevenly: count the rank with the most rows of each vocabulary matrix.
    vocab_matrices = (stage == 0) + (stage == layout.pp - 1 and not (shape.tied and layout.pp == 1))
    uneven = vocab_matrices * (largest_shard(shape.vocab, layout.tp) - shape.vocab / layout.tp) * shape.hidden
    return params / layout.tp + uneven


def _in_flight(layout: Layout, stage: int, microbatches: int) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak."""
    p, v = layout.pp, layout.stages_per_rank
    if p == 1:
        return 1
    if layout.schedule == "gpipe":
        return microbatches
    if layout.schedule in INTERLEAVED:
        return min(microbatches, (p - stage) * (1 + (p - 1) / (p * v)))
    return min(microbatches, p - stage)


def states_by_stage(shape: ModelShape, work: Workload, layout: Layout) -> list[tuple[int, float, tuple, float]]:
    """Per pipeline stage's rank: (layers, parameters, (weights, gradients, optimizer) bytes on the device, bytes in
    host memory). ZeRO shards the states; offload moves the rank's shards to host memory, ZeRO-2 still holding
    its gathered weights on the device from forward to backward."""
    out = []
    for stage, layers in enumerate(layers_per_rank(shape, work.seq, layout.pp, layout.stages_per_rank)):
        params = stage_params(shape, layout, stage, layers)
        weights, grads, optimizer = model_state_bytes(params, layout.zero, layout.dp_shard, work.states)
        if layout.offload:
            kept = weights if layout.zero == 2 else 0.0
            out.append((layers, params, (kept, 0.0, 0.0), weights - kept + grads + optimizer))
        else:
            out.append((layers, params, (weights, grads, optimizer), 0.0))
    return out


def memory_by_stage(shape: ModelShape, work: Workload, layout: Layout, device: DeviceSpec) -> list[dict[str, float]]:
    """Device bytes per pipeline stage by kind; with offload, the states moved to host memory are not among them
    (``states_by_stage``)."""
    e = ELEMENT_BYTES[work.precision]
    g_bytes = STATE_BYTES[work.states][1]
    microbatches = work.global_batch // (layout.dp * layout.microbatch)
    tokens = layout.microbatch * work.seq
    per_layer = activation_bytes_per_layer(shape, layout.microbatch, work.seq, layout.tp, layout.sequence_parallel,
                                           layout.recompute, work.precision, work.flash_attention)
    full_layer = activation_bytes_per_layer(shape, layout.microbatch, work.seq, layout.tp, layout.sequence_parallel,
                                            "none", work.precision, work.flash_attention)
    out = []
    for stage, (layers, params, (weights, grads, optimizer), _) in enumerate(states_by_stage(shape, work, layout)):
        in_flight = _in_flight(layout, stage, microbatches)
        activations = in_flight * layers * per_layer
        if layout.recompute == "full":
            activations += full_layer  # the layer being recomputed is whole during its backward
        if stage == 0:
            activations += in_flight * e * tokens * shape.hidden / (layout.tp if layout.sequence_parallel else 1)
        buffers = 0.0
        if stage == layout.pp - 1:
            # Logits, their fp32 log-softmax in the loss, and the logits' gradient.
            buffers += tokens * largest_shard(shape.vocab, layout.tp) * (2 * e + 4)
        if layout.zero <= 1 and layout.dp > 1 and layout.tp == layout.pp == 1:
            buffers += g_bytes * params  # torch DDP's gradient buckets are a copy of the gradients
        if layout.zero == 3:
            gathered = (2 * shape.layer_params + max(shape.embedding_params, shape.head_params)) / layout.tp
            buffers += gathered * (e + g_bytes)  # this layer and the prefetched next, unsharded
        out.append(dict(params=weights, grads=grads, optimizer=optimizer, activations=activations,
                        buffers=buffers, runtime=device.runtime_bytes))
    return out


# ---------------------------------------------------------------- time

def gemm_efficiency(dims: tuple[float, ...], device: DeviceSpec) -> float:
    efficiency = device.gemm_efficiency
    for d in dims:
        efficiency *= d / (d + device.gemm_half_dim)
    return efficiency


def _gemm_time(flops: float, dims: tuple[float, ...], peak: float, device: DeviceSpec, element_bytes: int) -> float:
    """Arithmetic at the shape's efficiency plus writing the result (``flops`` may cover several matmuls
    of this shape, e.g. every attention head). Writing the result counts where it is large for its
    arithmetic: eager attention's s×s scores, and on CPUs, where a fresh output's pages are touched
    for the first time; for a big projection on a GPU it is noise."""
    m, n, k = dims
    return flops / (peak * gemm_efficiency(dims, device)) + flops / (2 * k) * element_bytes / device.hbm_bw


def layer_matmuls(shape: ModelShape, micro: int, seq: int, tp: int) -> list[tuple[float, tuple]]:
    """Forward (flops, (m, n, k)) of each matmul of one layer on one tensor-parallel rank."""
    h, t, tokens = shape.hidden, tp, micro * seq
    head_dim = h // shape.heads
    mlp_in = (2 if shape.swiglu else 1) * shape.ffn
    return [
        (2 * tokens * h * (h + 2 * shape.kv_dim) / t, (tokens, (h + 2 * shape.kv_dim) / t, h)),  # QKV
        (2 * tokens * seq * h / t, (seq, seq, head_dim)),  # scores Q·Kᵀ, all heads
        (2 * tokens * seq * h / t, (seq, head_dim, seq)),  # scores · V
        (2 * tokens * h * h / t, (tokens, h, h / t)),  # output projection
        (2 * tokens * h * mlp_in / t, (tokens, mlp_in / t, h)),  # up (and gate)
        (2 * tokens * shape.ffn * h / t, (tokens, h, shape.ffn / t)),  # down
    ]


def forward_flops(shape: ModelShape, batch: int, seq: int) -> float:
    """Forward FLOPs of ``batch`` sequences through the whole model (attention counted without causal savings,
    as Narayanan et al. count it)."""
    layer = sum(f for f, _ in layer_matmuls(shape, batch, seq, 1))
    return shape.layers * layer + 2 * batch * seq * shape.hidden * shape.vocab


def step_flops(shape: ModelShape, work: Workload, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: forward + backward (2×), plus the recomputed forward."""
    model = 3 * forward_flops(shape, work.global_batch, work.seq)
    layer = layer_matmuls(shape, work.global_batch, work.seq, 1)
    if recompute == "full":
        extra = shape.layers * sum(f for f, _ in layer)
    elif recompute == "selective" and not work.flash_attention:
        extra = shape.layers * (layer[1][0] + layer[2][0])
    else:
        extra = 0.0
    return model, model + extra


def predict(shape: ModelShape, work: Workload, layout: Layout, device: DeviceSpec, gpus_per_node: int = 8) -> Prediction:
    """Memory and time of one step; assumes ``check_layout`` found nothing wrong with the degrees."""
    lay, e = layout, ELEMENT_BYTES[work.precision]
    if lay.offload and device.host_link_bw is None:
        raise UserError(f"--layout offload=true moves shards from a device to its host's memory, and {device.name} "
                        f"has no host link; drop offload, or plan for a GPU")
    peak = device.peak_flops(work.precision)
    microbatches = work.global_batch // (lay.dp * lay.microbatch)
    tokens = lay.microbatch * work.seq
    v = lay.stages_per_rank if lay.pp > 1 else 1

    # One layer, one microbatch: matmuls forward (1) + backward (2) + recomputed forward.
    mm = layer_matmuls(shape, lay.microbatch, work.seq, lay.tp)
    causal = 0.5 if work.flash_attention else 1.0  # flash skips the masked half of the scores
    times = [_gemm_time(f, dims, peak, device, e) * (causal if i in (1, 2) else 1.0) for i, (f, dims) in enumerate(mm)]
    if device.attention_flops and work.flash_attention:  # the fused kernel's measured rate (CPU)
        times[1] = times[2] = mm[1][0] * causal / device.attention_flops
    passes = 3 + (1 if lay.recompute == "full" else 0)
    matmul_s = passes * sum(times)
    if lay.recompute == "selective" and not work.flash_attention:
        matmul_s += times[1] + times[2]
    stored = activation_bytes_per_layer(shape, lay.microbatch, work.seq, lay.tp, lay.sequence_parallel, "none",
                                        work.precision, work.flash_attention)
    elementwise_s = device.elementwise_traffic * stored * passes / 3 / device.hbm_bw + OPS_PER_LAYER * device.op_overhead_s
    tp_bw = comms.group(1, lay.tp, gpus_per_node, device).bw
    collectives = 4 + (2 if lay.recompute == "full" else 0)
    hidden_reduce = comms.ring_time("all_reduce", e * tokens * shape.hidden, lay.tp, tp_bw, device.latency_s)
    tp_s = collectives * hidden_reduce
    # The ends, once per microbatch: the vocabulary-parallel embedding reduces its output (forward); the
    # output projection reduces its input's gradient (backward), and the vocabulary-parallel loss three
    # fp32 values per token (max logit, sum of exponentials, target logit).
    tp_first_s = hidden_reduce
    tp_last_s = hidden_reduce + 3 * comms.ring_time("all_reduce", 4 * tokens, lay.tp, tp_bw, device.latency_s)

    # The loss end: logits matmul (forward + backward) and the softmax over the vocabulary.
    logits_matmul_s = 3 * _gemm_time(2 * tokens * shape.hidden * shape.vocab / lay.tp,
                                     (tokens, shape.vocab / lay.tp, shape.hidden), peak, device, e)
    logits = tokens * shape.vocab / lay.tp
    if device.loss_s_per_logit is None:
        logits_elementwise_s = device.elementwise_traffic * logits * (2 * e + 4) / device.hbm_bw
    else:  # measured in fp32; lower-precision logits are also cast up, and their gradient down
        logits_elementwise_s = logits * (device.loss_s_per_logit + (2 * (e + 4) / device.hbm_bw if e < 4 else 0.0))
    if lay.tp > 1:  # scalenlp train's vocabulary-parallel loss (parallel.loss_parallel, on by default)
        logits_elementwise_s *= device.vocab_parallel_loss_factor

    # Pipeline: each of the v chunks of a stage receives activations and sends gradients once per microbatch.
    pp_bw = device.intra_node_bw if lay.tp * lay.dp < gpus_per_node else device.nic_bw
    p2p_bytes = e * tokens * shape.hidden / (lay.tp if lay.sequence_parallel else 1)
    p2p_s = 2 * v * (p2p_bytes / pp_bw + device.latency_s) if lay.pp > 1 else 0.0

    # Data parallel (scalenlp.plan.comms): rings over dp_shard (stride tp) and dp_replicate (stride tp·dp_shard),
    # unit by unit (a block, and the embedding and output ends), each gather hidden behind the previous unit's
    # compute only. DDP and ZeRO-1 reduce gradients once per step (no_sync while accumulating), during the last
    # backward; ZeRO-1 then gathers the updated weights. FSDP (ZeRO-2/3) gathers weights for every microbatch
    # (ZeRO-3 again for backward) and reduce-scatters gradients after each microbatch, or once per step under a
    # pipeline schedule, which syncs only on the last backward.
    w_bytes, g_bytes, _ = STATE_BYTES[work.states]
    shard = comms.group(lay.tp, lay.dp_shard, gpus_per_node, device)
    replicate = comms.group(lay.tp * lay.dp_shard, lay.dp_replicate, gpus_per_node, device)
    whole_dp = comms.group(lay.tp, lay.dp, gpus_per_node, device)
    lat = device.latency_s
    overlaps = device.overlaps_communication
    reduce_every_microbatch = lay.zero >= 2 and lay.pp == 1

    def host_copy(nbytes: float) -> float:  # an offloaded shard in or out over the host link
        return nbytes / lay.dp_shard / device.host_link_bw if lay.offload else 0.0

    def gather(params: float) -> float:
        if lay.zero >= 2:
            return (host_copy(w_bytes * params)
                    + comms.collective("all_gather", e * params, shard, device.all_gather_factor))
        return 0.0

    def reduction(params: float) -> float:
        if lay.zero >= 2:
            return (comms.collective("reduce_scatter", g_bytes * params, shard, device.reduce_scatter_factor)
                    + comms.collective("all_reduce", g_bytes * params / lay.dp_shard, replicate)
                    + host_copy(g_bytes * params))
        return comms.collective("all_reduce", g_bytes * params, whole_dp)

    def exposed(communication: float, compute_beside: float) -> float:
        return max(0.0, communication - compute_beside) if overlaps else communication

    per_stage = []  # (one microbatch slot, once-per-step tail) of each pipeline rank
    for stage, layers in enumerate(layers_per_rank(shape, work.seq, lay.pp, v)):
        first, last = stage == 0, stage == lay.pp - 1
        slot = dict(matmul=layers * matmul_s + (logits_matmul_s if last else 0.0),
                    elementwise=layers * elementwise_s + (logits_elementwise_s if last else 0.0),
                    tensor_parallel=layers * tp_s + (tp_first_s if first else 0.0) + (tp_last_s if last else 0.0),
                    pipeline_p2p=p2p_s)
        fsdp_units = lay.zero >= 2 and lay.dp_shard > 1
        unit_overhead = device.fsdp_unit_overhead_s if fsdp_units else 0.0
        if lay.tp > 1 or fsdp_units:
            units = layers + (stage in (0, lay.pp - 1))  # FSDP: a unit per block, and the root's
            linears = layers * LINEARS_PER_LAYER[shape.swiglu] + first + last  # + embedding, output
            slot["framework"] = units * unit_overhead + (linears * device.tp_linear_overhead_s if lay.tp > 1 else 0.0)
        params = stage_params(shape, lay, stage, layers)
        grads = g_bytes * params
        # The stage's units in forward order: (parameters on this rank, forward compute, backward compute).
        layer_compute = matmul_s + elementwise_s + tp_s + unit_overhead
        units_list = [(shape.layer_params / lay.tp, layer_compute / passes, layer_compute * (passes - 1) / passes)
                      ] * layers
        if first:  # the embedding: nothing computes before it, so its gather waits whole
            units_list.insert(0, (shape.embedding_params / lay.tp, 0.0, 0.0))
        if last:  # final norm and output projection (a tied one is the embedding itself without pipelining)
            head = (shape.head_params - (shape.vocab * shape.hidden if shape.tied and lay.pp == 1 else 0)) / lay.tp
            head_compute = logits_matmul_s + logits_elementwise_s
            units_list.append((head, head_compute / 3, head_compute * 2 / 3))
        unit_params = [u[0] for u in units_list]
        forward_compute = [u[1] for u in units_list]
        backward_compute = [u[2] for u in units_list][::-1]
        gathers = [gather(p) for p in unit_params]
        backward_gathers = gathers[::-1] if lay.zero == 3 else [0.0] * len(gathers)
        reductions = [reduction(p) for p in unit_params][::-1]
        no_reduction = [0.0] * len(gathers)
        forward_wait = comms.forward_exposed(gathers, forward_compute, overlaps)
        backward_wait = comms.backward_exposed(backward_gathers, no_reduction, backward_compute, overlaps)
        with_reduction = comms.backward_exposed(backward_gathers, reductions, backward_compute, overlaps)
        # Traffic that runs beside compute still costs it: NCCL's kernels take SMs and memory bandwidth from the
        # matmuls they overlap (device.overlap_contention of the hidden time; 0 where nothing overlaps).
        contention = device.overlap_contention if overlaps else 0.0
        microbatch_traffic = sum(gathers) + sum(backward_gathers)
        step_traffic = sum(reductions)
        if lay.zero >= 2:
            if reduce_every_microbatch:
                waits, step_sync = forward_wait + with_reduction, 0.0
                microbatch_traffic += step_traffic
            else:
                waits = forward_wait + backward_wait
                step_sync = with_reduction - backward_wait  # the last microbatch's backward also reduces
                step_sync += contention * max(0.0, step_traffic - step_sync)
            slot["data_parallel_exposed"] = waits + contention * max(0.0, microbatch_traffic - waits)
            if lay.dp_shard > 1:
                # FSDP copies each gathered shard in and the full parameters out of the gather buffer, and
                # the full gradients into the reduce-scatter buffer (read + write each).
                copies = (lay.zero - 1) * (e * params / lay.dp_shard + 2 * e * params) \
                    + (2 * grads if reduce_every_microbatch else 0.0)
                slot["fsdp_copies"] = copies / device.hbm_bw
        else:
            step_sync = with_reduction + contention * max(0.0, step_traffic - with_reduction)
            if lay.zero == 1:
                step_sync += comms.collective("all_gather", w_bytes * params, whole_dp, device.all_gather_factor)
        if shape.tied and lay.pp > 1 and stage in (0, lay.pp - 1):
            # The embedding and its copy on the last stage sum their gradients (this rank's shard) once per step,
            # between the two ends of the pipeline, after the backward: exposed.
            tied_shard = g_bytes * shape.vocab * shape.hidden / lay.tp / (lay.dp_shard if lay.zero >= 2 else 1)
            step_sync += comms.ring_time("all_reduce", tied_shard, 2, pp_bw, lat)
        optimizer_params = params / (lay.dp_shard if lay.zero else 1)
        tail = dict(grad_sync_exposed=step_sync,
                    optimizer=optimizer_params * (OPTIMIZER_TRAFFIC + g_bytes)
                    / (device.host_bw if lay.offload else device.hbm_bw))
        per_stage.append((slot, tail))

    # The slowest rank sets the pace of the m microbatches; the first microbatch's forward and the last one's
    # backward also pass through every other rank once (a 1/v chunk at a time when interleaved). For equal
    # stages this is the (p − 1)/(v·m) bubble; a light first stage (embeddings) shortens it.
    slot_times = [sum(s.values()) for s, _ in per_stage]
    slot = per_stage[slot_times.index(max(slot_times))][0]
    tail = max((t for _, t in per_stage), key=lambda t: sum(t.values()))
    breakdown = {k: microbatches * x for k, x in slot.items()}
    bubble_share = ZERO_BUBBLE_SHARE if lay.schedule == "zero_bubble" else 1.0
    breakdown["bubble"] = (sum(slot_times) - max(slot_times)) / v * bubble_share
    breakdown.update(tail)
    step_s = sum(breakdown.values())

    model_flops, hardware_flops = step_flops(shape, work, lay.recompute)
    n = lay.devices
    parts = max(memory_by_stage(shape, work, lay, device), key=lambda m: sum(m.values()))
    prediction = Prediction(
        layout=lay, memory=parts, memory_per_device_bytes=sum(parts.values()),
        host_memory_per_device_bytes=max(host for *_, host in states_by_stage(shape, work, lay)),
        model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops, step_time_s=step_s,
        tokens_per_sec=work.global_batch * work.seq / step_s,
        tflops_per_device=hardware_flops / step_s / n / 1e12, mfu=model_flops / step_s / n / peak,
        bubble_fraction=breakdown["bubble"] / (microbatches * max(slot_times)) if max(slot_times) else 0.0,
        time_breakdown_s=breakdown)
    prediction.fits = fits(prediction, device)
    return prediction


def fits(prediction: Prediction, device: DeviceSpec) -> bool:
    host = device.host_memory_bytes if device.host_memory_bytes is not None else math.inf
    return prediction.memory_per_device_bytes <= device.memory_bytes and prediction.host_memory_per_device_bytes <= host
