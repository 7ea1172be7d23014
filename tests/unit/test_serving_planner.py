"""`scalenlp plan --serve`: memory per device, latency from the cost model, targets, and one-line refusals. (A plan
for this machine's CPU, measured with two processes: integration/test_serving_planner_measures_cpu.py.)"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from scalenlp.cli import main
from scalenlp.hardware import get_device
from scalenlp.plan import measure
from scalenlp.plan.calibrate import SERVING_FIT, SERVING_HELD_OUT, served_latency
from scalenlp.plan.cost import model_shape
from scalenlp.plan.serving import (
    decode_time,
    host_time,
    kv_bytes_per_token,
    max_batch,
    plan_serving,
    prefill_time,
    weight_bytes,
)


def test_kv_cache_and_weights_per_device():
    shape = model_shape("llama-8b", 8192)
    # Llama 3 8B: 32 layers x 8 KV heads x 128 dims, K and V, bf16: 128 KiB per token, split by TP.
    assert kv_bytes_per_token(shape, 1) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(shape, 4) == 32 * 1024
    # Quantized, tensor parallelism splits the blocks only: the int8 embedding and output tables stay whole.
    whole = (8 * weight_bytes(shape, "int4", 8) - weight_bytes(shape, "int4", 1)) / 7  # W(tp) = blocks / tp + whole
    assert whole == pytest.approx(2 * shape.vocab * shape.hidden + 2 * shape.hidden)  # + the final norm in bf16
    h100 = get_device("h100-sxm")
    free = h100.memory_bytes - h100.runtime_bytes - weight_bytes(shape, "bf16")
    assert max_batch(shape, h100, 8192, 1, "bf16") == int(free // (8192 * 128 * 1024 + 4 * shape.vocab))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # untied; tied, with learned positions
def test_quantized_weight_bytes_are_those_scalenlp_quantize_writes(method, family):
    from scalenlp.compress.quantized import linears_of, quantization_of, quantize_embedding, quantize_state
    from scalenlp.models.flavors import build_model, parse_shape, shape_args

    # Wide enough that what the planner leaves out (scales per output channel, biases) is under 2%.
    spec = f"hidden=512,layers=2,heads=4,ffn=1024,vocab_size=512,family={family}"
    model = build_model(shape_args(parse_shape(spec), 64))
    tied = model.args.tie_embeddings
    assert tied == (family == "gpt2")
    state = quantize_embedding(quantize_state(model.state_dict(), linears_of(model), quantization_of(method), tied),
                               tied)
    written = sum(t.numel() * t.element_size() for t in state.values())
    assert weight_bytes(model_shape(spec, 64), method, precision="fp32") == pytest.approx(written, rel=0.02)


def test_decode_at_batch_one_streams_the_weights():
    """Every weight but the token embeddings, of which a step looks up one row a sequence; tied, the table is the
    output projection too and streams once."""
    shape, h100 = model_shape("llama-70b", 4096), get_device("h100-sxm")
    one = decode_time(shape, h100, 1, 100, 1, "bf16", "bf16")
    host = shape.layers * h100.decode_layer_overhead_s  # kernel launches, fitted on lmdeploy's rows
    lookup = 2 * shape.vocab * shape.hidden
    cache = 100 * kv_bytes_per_token(shape, 1)
    assert one == pytest.approx((weight_bytes(shape, "bf16") - lookup + cache) / h100.hbm_bw + host, rel=1e-6)
    tied = model_shape("hidden=2048,layers=16,heads=16,vocab_size=128256,family=gpt2", 1024)
    assert tied.tied
    host = tied.layers * h100.decode_layer_overhead_s
    cache = 100 * kv_bytes_per_token(tied, 1)
    assert decode_time(tied, h100, 1, 100, 1, "bf16", "bf16") == pytest.approx(
        (weight_bytes(tied, "bf16") + cache) / h100.hbm_bw + host, rel=1e-6)
    int4 = decode_time(shape, h100, 1, 100, 1, "bf16", "int4")
    assert weight_bytes(shape, "int4") / h100.hbm_bw <= int4 < one
    # Twice the batch reads the same weights: far less than twice the time while memory-bound.
    assert decode_time(shape, h100, 2, 100, 1, "bf16", "bf16") < 1.1 * one


def test_targets_pick_the_fewest_devices_that_carry_the_rate(capsys):
    shape, h100 = model_shape("llama-8b", 4096), get_device("h100-sxm")
    layouts = plan_serving(shape, h100, 16, 8, 4096, 2048, rate=5.0, ttft_ms=500, tpot_ms=30)
    assert layouts and [s.devices for s in layouts] == sorted(s.devices for s in layouts)
    for s in layouts:
        assert s.ttft_s <= 0.5 and s.tpot_s <= 0.030 and s.batch <= s.max_batch
        assert s.tokens_per_sec / 2048 >= 5.0  # requests per second carried
    tight = plan_serving(shape, h100, 16, 8, 4096, 2048, rate=5.0, ttft_ms=500, tpot_ms=3)
    assert tight == []  # no decode step of an 8B model streams its weights in 3 ms from one H100's HBM... or TP 8
    code = main(["plan", "--serve", "--model", "llama-8b", "--devices", "8", "--context", "4096",
                 "--concurrency", "32", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["layouts"]
    for s in out["layouts"]:
        assert s["devices"] <= 8 and s["batch"] * s["replicas"] >= 32 and s["kv_per_device"] > 0


def test_each_sequence_adds_the_engines_measured_host_time():
    """The engine's per-sequence costs (measured on a CPU) grow a step with its batch, decode and prefill alike, by
    exactly what was measured: per layer and per step for each sequence, and the sampler over each row's logits."""
    shape, h100 = model_shape("llama-1b", 2048), get_device("h100-sxm")
    costly = dataclasses.replace(h100, decode_layer_sequence_overhead_s=2e-6, decode_sequence_overhead_s=3e-5,
                                 sample_s_per_logit=1e-9)
    per_sequence = shape.layers * 2e-6 + 3e-5 + shape.vocab * 1e-9

    def decode(device, batch, kv=512):
        return decode_time(shape, device, batch, kv, 1, "bf16", "bf16")

    for batch in (1, 4, 16):
        added = batch * per_sequence
        assert host_time(shape, costly, batch, 1) - host_time(shape, h100, batch, 1) == pytest.approx(added)
        assert decode(costly, batch) - decode(h100, batch) == pytest.approx(added)
        prefill = [prefill_time(shape, d, batch, 512, 1, "bf16") for d in (costly, h100)]
        assert prefill[0] - prefill[1] == pytest.approx(added)
    # Attention over the cache takes its own rate where one was measured: slower, a long cache's step grows.
    assert decode(dataclasses.replace(h100, decode_attention_flops=1e9), 16, 2048) > 2 * decode(h100, 16, 2048)


def test_engine_overheads_recovers_the_four_figures(monkeypatch):
    """The calibration's arithmetic: step times that follow layers · (l0 + b · l1) + s0 + b · s1 give back l0, l1,
    s0 and s1 (the engine itself is replaced by that law here; the slow test below times the real one)."""
    l0, l1, s0, s1 = 4e-4, 2e-5, 6e-4, 5e-5
    monkeypatch.setattr(measure, "_debug_engine",
                        lambda layers, batch, dtype, new: types.SimpleNamespace(layers=layers, stop=lambda: None))
    monkeypatch.setattr(measure, "_tpot", lambda e, b, new: e.layers * (l0 + b * l1) + s0 + b * s1)
    figures = measure.engine_overheads(torch.float32)
    assert figures == pytest.approx(dict(decode_layer_overhead_s=l0, decode_layer_sequence_overhead_s=l1,
                                         decode_step_overhead_s=s0, decode_sequence_overhead_s=s1))


def test_prefill_traffic_charges_what_a_layer_adds_beyond_its_arithmetic(monkeypatch):
    """The calibration's arithmetic: first-token times that grow by T per layer, of which A is the layer's linears
    and attention and H its host time, give the elementwise traffic at which the prefill model charges each layer
    of that model exactly T - A - H beyond them (the engine and its timings are replaced by that law here)."""
    from scalenlp.models.flavors import model_args
    from scalenlp.plan.cost import shape_of

    T, A, bandwidth, batch, prompt = 3e-3, 1e-3, 10e9, 16, 64
    overheads = dict(decode_layer_overhead_s=4e-4, decode_layer_sequence_overhead_s=1e-5)
    probes = []

    def engine(layers, batch, dtype, new, prompt, **widths):
        probes.append(model_args("debug", n_layers=layers, **widths))
        return types.SimpleNamespace(layers=layers, stop=lambda: None, model=types.SimpleNamespace(args=probes[-1]))

    monkeypatch.setattr(measure, "_debug_engine", engine)
    monkeypatch.setattr(measure, "_ttft", lambda e, b, p: 0.01 + e.layers * T)
    monkeypatch.setattr(measure, "_layer_arithmetic", lambda model, dtype, b, p: A)
    traffic = measure.prefill_elementwise_traffic(torch.bfloat16, overheads, bandwidth, batch, prompt)
    shape = shape_of("probe", probes[-1])
    device = dataclasses.replace(get_device("a100-80gb"), hbm_bw=bandwidth)
    charged = [prefill_time(shape, dataclasses.replace(device, elementwise_traffic=x), batch, prompt, 1, "bf16")
               for x in (traffic, 0.0)]
    assert (charged[0] - charged[1]) / shape.layers == pytest.approx(T - A - 4e-4 - batch * 1e-5)


@pytest.mark.slow
def test_engine_costs_are_measured_here():
    """Through the real engine: three layers cost more than one, so a layer's cost at one sequence (its overhead
    plus what that sequence adds) is positive. (How it splits between the two, and the per-step figures, are small
    differences that a shared machine's load can drive to 0: CI once read the overhead as 0 with batch 4;
    benchmarks/serve_plan_vs_measured.py checks them.)"""
    figures = measure.engine_overheads(torch.float32, batch=4, layers=3, new=8)
    assert figures["decode_layer_overhead_s"] + figures["decode_layer_sequence_overhead_s"] > 0
    assert all(v >= 0 for v in figures.values())
    assert measure.decode_attention_rate(torch.float32) > 0 and measure.sample_time_per_logit(torch.float32) > 0


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-8b", "--devices", "1", "--context", "9000", "--concurrency", "1"],
     "--context 9000 is longer than llama-8b's max_seq_len 8192; use --context 8192 or less"),
    (["--model", "llama-70b", "--devices", "1", "--context", "4096", "--concurrency", "1"],
     "use --devices 2 (tensor parallelism 2) or --quantize int8"),
    (["--model", "llama-8b", "--devices", "1", "--context", "4096"], "--serve needs --concurrency K"),
])
def test_bad_serving_input_is_one_line_that_says_what_works(capsys, argv, message):
    assert main(["plan", "--serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("run", SERVING_HELD_OUT, ids=lambda r: r.source.split("static inference, ")[1])
def test_published_gpu_serving_rows_held_out_within_25_percent(run):
    ttft, tpot = served_latency(run)
    assert tpot == pytest.approx(run.tpot_s, rel=0.25)
    if run.ttft_s is not None:
        assert ttft == pytest.approx(run.ttft_s, rel=0.25)


@pytest.mark.parametrize("run", SERVING_FIT, ids=lambda r: r.source.split("static inference, ")[1])
def test_serving_fit_rows_stay_matched(run):
    assert served_latency(run)[1] == pytest.approx(run.tpot_s, rel=0.15)
