"""The planner at cluster scale: published fully sharded runs, communication by topology, layouts that do not fit."""

from __future__ import annotations

import dataclasses
import math

import pytest

from scalenlp.hardware import get_device
from scalenlp.layout import Layout
from scalenlp.plan import comms
from scalenlp.plan.calibrate import FSDP_FIT, FSDP_HELD_OUT, FSDP_MISSES, sharded_tokens_per_gpu
from scalenlp.plan.cost import Workload, model_shape, predict


@pytest.mark.parametrize("run", FSDP_HELD_OUT, ids=lambda r: r.source)
def test_held_out_fully_sharded_runs_within_20_percent(run):
    assert sharded_tokens_per_gpu(run) == pytest.approx(run.published_tokens_per_gpu(), rel=0.20)


@pytest.mark.parametrize("run, miss", FSDP_MISSES, ids=[r.source for r, _ in FSDP_MISSES])
def test_fully_sharded_runs_the_model_misses_stay_documented(run, miss):
    """The published runs predicted more than 20% off are kept with the size of their miss: a change to the model
    that moves one fails here, and the row then joins FSDP_HELD_OUT (or its documented miss is updated)."""
    assert sharded_tokens_per_gpu(run) / run.published_tokens_per_gpu() - 1 == pytest.approx(miss, abs=0.05)


@pytest.mark.parametrize("run", FSDP_FIT, ids=lambda r: r.source)
def test_fully_sharded_fit_rows_stay_matched(run):
    assert sharded_tokens_per_gpu(run) == pytest.approx(run.published_tokens_per_gpu(), rel=0.10)


def test_a_ring_across_nodes_runs_at_its_rails_and_pays_the_network_step():
    a100 = get_device("a100-80gb")
    inside = comms.group(1, 8, 8, a100)
    assert (inside.bw, inside.latency) == (a100.intra_node_bw, a100.latency_s)
    # Every GPU of 4 nodes: 8 rings, one per NIC, each crossing 3 node boundaries out of 31 steps.
    across = comms.group(1, 32, 8, a100)
    assert across.bw == 8 * a100.nic_bw
    assert across.latency == pytest.approx((28 * a100.latency_s + 3 * a100.nic_latency_s) / 31)
    # One rank per node (tensor parallelism fills the node): one NIC, every step crosses the network.
    strided = comms.group(8, 32, 8, a100)
    assert (strided.bw, strided.latency) == (a100.nic_bw, a100.nic_latency_s)


def _frictionless():
    return dataclasses.replace(get_device("a100-80gb"), peak_flops_bf16=math.inf, hbm_bw=math.inf, latency_s=0.0,
                               nic_latency_s=0.0)


def test_zero3_moves_three_times_the_bf16_weights_per_gpu_per_step():
    """Two all-gathers of the bf16 weights and a reduce-scatter of bf16 gradients, each (n − 1)/n of the bytes
    through a ring of 64 GPUs (8 nodes) at 8 NICs' bandwidth."""
    shape, device = model_shape("llama-8b", 2048), _frictionless()
    work = Workload(seq=2048, global_batch=64, states="mixed")
    p = predict(shape, work, Layout(dp_shard=64, zero=3, microbatch=1), device)
    bf16_weights = 2 * shape.total_params
    expected = 3 * bf16_weights * 63 / 64 / (8 * device.nic_bw)
    assert p.time_breakdown_s["data_parallel_exposed"] == pytest.approx(expected, rel=1e-9)


def test_a_gather_hides_behind_the_previous_layer_not_the_whole_step():
    # Traffic per layer is 3 units, compute 2: one unit per layer waits; the first gather waits whole.
    assert comms.forward_exposed([3.0] * 4, [2.0] * 4, True) == 3.0 + 3 * 1.0
    # The whole step's compute (8) exceeds the whole traffic (12)? No: a whole-step bound would hide 8 of 12.
    assert comms.forward_exposed([1.0] * 4, [2.0] * 4, True) == 1.0
    # Backward: the link carries the next gather and the previous reduction while a unit computes.
    assert comms.backward_exposed([1.0] * 3, [1.0] * 3, [1.5] * 3, True) == 1.0 + 1.0 + 0.5
    assert comms.backward_exposed([1.0] * 3, [1.0] * 3, [1.5] * 3, False) == 6.0


def test_zero3_on_1536_a100s_with_one_sequence_each_waits_on_its_network():
    """The issue's example: 175B, ZeRO-3 over 1,536 A100s, one 2,048-token sequence per GPU per step. Each layer's
    3.6 GB gather takes as long as that layer's forward (1,535 ring steps, 192 crossing nodes), so the traffic
    no longer hides; with a slower network it dominates."""
    shape = model_shape("hidden=12288,layers=96,heads=96,vocab_size=51200", 2048)
    work = Workload(seq=2048, global_batch=1536, states="mixed")
    layout = Layout(dp_shard=1536, zero=3, microbatch=1, recompute="full")
    a100 = get_device("a100-80gb")
    p = predict(shape, work, layout, a100)
    communication = p.time_breakdown_s["data_parallel_exposed"]
    assert communication > 0.1 * p.step_time_s
    assert p.tflops_per_device < 0.65 * a100.peak_flops_bf16 / 1e12
    half_network = predict(shape, work, layout, dataclasses.replace(a100, nic_bw=a100.nic_bw / 2))
    assert half_network.time_breakdown_s["data_parallel_exposed"] > 1.9 * communication


def test_llama3_405b_on_16384_h100s_is_planned_with_tensor_and_pipeline_parallelism():
    """Sequence 8,192 and 16M tokens per batch (2,048 sequences), as Meta trained it: pure ZeRO-3 over thousands of
    ranks waits on its network every layer, so the first layouts combine TP within a node and PP across nodes.
    The search keeps one sequence per microbatch and full recomputation (what its five best layouts choose when
    free to; a third of the candidates, a fifth of the time), and chooses every degree, ZeRO stage and schedule."""
    from scalenlp.plan.calibrate import LLAMA3_405B
    from scalenlp.plan.search import search

    shape, work = model_shape(LLAMA3_405B, 8192), Workload(seq=8192, global_batch=2048, states="mixed")
    ranked = search(shape, work, get_device("h100-sxm"), 16384, 8, fixed={"microbatch": 1, "recompute": "full"}).ranked
    for p in ranked[:5]:
        assert p.layout.tp > 1 and p.layout.pp > 1, p.layout.describe()
    pure_zero3 = predict(shape, work, Layout(dp_shard=2048, tp=8, zero=3, microbatch=1, recompute="full",
                                             sequence_parallel=True), get_device("h100-sxm"))
    assert pure_zero3.tokens_per_sec < 0.8 * ranked[0].tokens_per_sec


def test_a_layout_that_does_not_fit_is_predicted_and_says_what_would(capsys):
    import json

    from scalenlp.cli import main
    from scalenlp.hardware import GiB

    args = ["plan", "--model", "llama-8b", "--seq", "8192", "--global-batch", "512", "--devices", "16",
            "--layout", "dp_replicate=16,microbatch=32"]
    assert main([*args, "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] is False and answer["memory_per_device_bytes"] > 80 * GiB
    assert answer["step_time_s"] > 0 and answer["memory"]["activations"] > 0
    assert answer["would_fit"]
    for remedy in answer["would_fit"]:  # each names a --layout change whose prediction fits
        assert remedy["memory_per_device_bytes"] <= 80 * GiB
        fixed = main(["plan", *args[1:-1], remedy["layout"].replace(" ", ","), "--json"])
        out = json.loads(capsys.readouterr().out)
        assert fixed == 0 and out["fits"] is True, remedy
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "does not fit: 1,716" in out and "fits with " in out


def test_a_search_lists_only_layouts_that_fit():
    from scalenlp.plan.search import search

    shape, work = model_shape("llama-8b", 8192), Workload(seq=8192, global_batch=64)
    result = search(shape, work, get_device("h100-sxm"), 8, 8)
    assert result.ranked and all(p.fits for p in result.ranked)
    assert result.rejected["out of memory (more than the 80.0 GiB of a device)"] > 0


def test_offload_keeps_the_states_on_the_host_and_copies_each_shard_over_its_link():
    """parallel.offload: no weights, gradients or optimizer state on the GPU; each of ZeRO-3's two gathers copies its
    bf16 shard in and each reduce-scatter its gradient shard out over the host link; Adam streams host memory."""
    shape, work = model_shape("llama-8b", 4096), Workload(seq=4096, global_batch=16, states="mixed")
    resident, offload = (Layout(dp_shard=16, zero=3, microbatch=1, recompute="full", offload=o) for o in (False, True))
    h100 = get_device("h100-sxm")
    on_gpu, on_host = predict(shape, work, resident, h100), predict(shape, work, offload, h100)
    assert on_host.memory["params"] == on_host.memory["grads"] == on_host.memory["optimizer"] == 0
    assert on_gpu.memory["optimizer"] > 0 and on_host.memory["activations"] == on_gpu.memory["activations"]
    assert on_host.time_breakdown_s["optimizer"] == pytest.approx(
        on_gpu.time_breakdown_s["optimizer"] * h100.hbm_bw / h100.host_bw)
    # With only the host link costing anything and nothing overlapped, the traffic is the copies: 2 + 2 + 2 bytes
    # per parameter of this rank's shard.
    link_only = dataclasses.replace(_frictionless(), intra_node_bw=math.inf, nic_bw=math.inf,
                                    overlaps_communication=False)
    copies = predict(shape, work, offload, link_only).time_breakdown_s["data_parallel_exposed"]
    assert copies == pytest.approx(6 * shape.total_params / 16 / link_only.host_link_bw)


def test_offload_is_planned_as_the_trainer_runs_it_and_needs_a_host_link(capsys):
    from scalenlp.cli import main
    from scalenlp.errors import UserError

    assert main(["plan", "--model", "debug", "--seq", "64", "--global-batch", "8", "--devices", "2",
                 "--layout", "dp_shard=2,zero=3,offload=true"]) == 0
    out = capsys.readouterr().out
    assert "zero=3 recompute=none offload=true" in out and "--set parallel.offload=true" in out
    no_host = dataclasses.replace(get_device("h100-sxm"), host_link_bw=None)  # as the measured CPU device has none
    with pytest.raises(UserError, match="has no host link; drop offload"):
        predict(model_shape("debug", 64), Workload(seq=64, global_batch=8),
                Layout(dp_shard=2, zero=3, microbatch=4, offload=True), no_host)


_LLAMA2_70B = "hidden=8192,layers=80,heads=64,kv_heads=8,ffn=28672,vocab_size=32000"


def test_the_search_offloads_only_where_nothing_fits_on_the_device_and_the_host_holds_the_states():
    """Llama 2 70B's mixed-precision states (1.1 TB) fit 8 A100s only offloaded: the search finds those layouts,
    each one whose every recomputation choice does not fit on the device alone, and none whose host shards exceed
    the host's 256 GiB per GPU (HSDP's 2 replicas would hold 280 GB each)."""
    from scalenlp.plan.search import search

    shape, work, a100 = model_shape(_LLAMA2_70B, 4096), Workload(seq=4096, global_batch=8, states="mixed"), \
        get_device("a100-80gb")
    result = search(shape, work, a100, 8, 8, fixed={"tp": 1, "pp": 1})
    assert [p.layout for p in result.ranked] == [Layout(dp_shard=8, zero=3, microbatch=1, recompute="full",
                                                        offload=True)]
    assert result.rejected["out of host memory, offloaded (more than 256 GiB per device)"] > 0
    ranked = search(shape, work, a100, 8, 8).ranked
    assert ranked and all(p.layout.offload for p in ranked)  # nothing fits without it
    for p in ranked:
        assert p.host_memory_per_device_bytes <= a100.host_memory_bytes
        on_device = [dataclasses.replace(p.layout, offload=False, recompute=r) for r in ("none", "selective", "full")]
        assert not any(predict(shape, work, layout, a100).fits for layout in on_device)


def test_a_layout_that_fits_only_offloaded_is_told_so(capsys):
    from scalenlp.cli import main

    base = ["plan", "--model", _LLAMA2_70B, "--seq", "4096", "--global-batch", "8", "--devices", "8",
            "--device", "a100-80gb", "--states", "mixed", "--layout"]
    assert main([*base, "dp_shard=8,zero=3,recompute=full"]) == 1
    out = capsys.readouterr().out
    assert "GiB per device, a a100-80gb has 80.00 GiB" in out
    assert "fits with offload=true: " in out
    assert main([*base, "dp_replicate=2,dp_shard=4,zero=3,recompute=full,offload=true"]) == 1
    assert "GiB of host memory per device, a a100-80gb's host has 256.00 GiB" in capsys.readouterr().out
