"""The planner: published formulas reproduced exactly, published throughputs predicted, the CLI's answers."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

import pytest

from scalenlp.cli import main
from scalenlp.config import load_config
from scalenlp.hardware import get_device
from scalenlp.layout import Layout
from scalenlp.models.flavors import build_model, model_args, shape_args
from scalenlp.parallel.pipeline import layer_costs, split_layers
from scalenlp.plan.calibrate import A100_ROWS, H100_ROWS, best_layout, llama3_row, megatron_row, predicted_tflops
from scalenlp.plan.cost import (
    Workload,
    activation_bytes_per_layer,
    layers_per_rank,
    model_shape,
    model_state_bytes,
    predict,
    stage_params,
    step_flops,
)
from scalenlp.plan.search import check_layout


def gpt(hidden, layers, heads, seq=2048, vocab=51200):
    return model_shape(f"hidden={hidden},layers={layers},heads={heads},ffn={4 * hidden},vocab_size={vocab},"
                       "family=gpt2,dropout=0.1", seq)


# ---------------------------------------------------------------- exact reproductions

def test_zero_paper_example_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, Figure 1: 7.5B parameters, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB."""
    per_stage = [sum(model_state_bytes(7.5e9, zero, 64, "mixed")) / 1e9 for zero in (0, 1, 2, 3)]
    assert [round(x, 1) for x in per_stage] == [120.0, 31.4, 16.6, 1.9]


def test_fp32_training_keeps_4_4_8_bytes_per_parameter():
    assert model_state_bytes(1000, 0, 8, "fp32") == (4000, 4000, 8000)
    assert model_state_bytes(1000, 3, 8, "fp32") == (500, 500, 1000)


@pytest.mark.parametrize("hidden,layers,heads,batch", [(2304, 24, 24, 512), (25600, 128, 160, 3072)])
def test_flops_are_narayanan_eq3(hidden, layers, heads, batch):
    s, V, B, h, l = 2048, 51200, batch, hidden, layers
    shape = gpt(h, l, heads)
    model, hardware = step_flops(shape, Workload(seq=s, global_batch=B), "full")
    eq3 = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    no_recompute = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert hardware == pytest.approx(eq3, rel=1e-12)
    assert model == pytest.approx(no_recompute, rel=1e-12)


def test_parameter_counts_come_from_the_model_definition():
    shape = model_shape("llama-8b", 2048)
    assert shape.total_params == build_model(model_args("llama-8b"), device="meta").num_params()
    # Megatron's count for its GPT: 12lh^2 (1 + 13/(12h) + (V + s)/(12lh)), plus the final LayerNorm.
    h, l, V, s = 2304, 24, 51200, 2048
    assert gpt(h, l, 24).total_params == round(12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))) + 2 * h


def test_activations_are_korthikanti_per_layer():
    """Korthikanti et al. 2022, Table 2, for a GPT layer with dropout, 16-bit activations, no flash attention."""
    shape = gpt(2304, 24, 24)
    s, b, h, a, t = 2048, 4, 2304, 24, 8

    def acts(tp, sp, recompute):
        return activation_bytes_per_layer(shape, b, s, tp, sp, recompute, "bf16", flash_attention=False)

    assert acts(1, False, "none") == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert acts(t, False, "none") == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert acts(t, True, "none") == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
    assert acts(t, True, "selective") == pytest.approx(s * b * h * 34 / t)
    assert acts(t, False, "full") == pytest.approx(2 * s * b * h)
    assert acts(t, True, "full") == pytest.approx(2 * s * b * h / t)


def _frictionless(device_name="a100-80gb"):
    """A device whose compute and memory traffic take no time, so that predicted time is communication."""
    return dataclasses.replace(get_device(device_name), peak_flops_bf16=math.inf, hbm_bw=math.inf, latency_s=0.0)


def test_zero3_moves_one_and_a_half_times_the_bytes_of_ddp():
    shape, work = model_shape("gpt2-124m", 1024), Workload(seq=1024, global_batch=8, states="mixed")
    device = _frictionless()
    ddp = predict(shape, work, Layout(dp_replicate=8, microbatch=1), device)
    zero3 = predict(shape, work, Layout(dp_shard=8, zero=3, microbatch=1), device)
    assert zero3.time_breakdown_s["data_parallel_exposed"] == pytest.approx(
        1.5 * ddp.time_breakdown_s["grad_sync_exposed"])


def test_data_parallel_traffic_hides_behind_compute_only_where_the_device_overlaps_them():
    shape, work = model_shape("gpt2-124m", 1024), Workload(seq=1024, global_batch=8)
    gpu = dataclasses.replace(get_device("a100-80gb"), overlap_contention=0.0)  # hidden traffic costs nothing
    cpu_like = dataclasses.replace(gpu, overlaps_communication=False)  # gloo: the same cores compute and send
    for layout in (Layout(dp_replicate=8, microbatch=1), Layout(dp_shard=8, zero=3, microbatch=1)):
        hidden, exposed = predict(shape, work, layout, gpu), predict(shape, work, layout, cpu_like)
        # The same layout's communication alone: compute and memory traffic take no time.
        alone = predict(shape, work, layout, dataclasses.replace(cpu_like, peak_flops_bf16=math.inf, hbm_bw=math.inf))
        key = "grad_sync_exposed" if layout.zero == 0 else "data_parallel_exposed"
        # An A100's compute hides all but what nothing computes beside: the first gather and the last reduction (here
        # the tied embedding, a third of the model).
        assert 0 < hidden.time_breakdown_s[key] < 0.5 * alone.time_breakdown_s[key]
        assert exposed.time_breakdown_s[key] == pytest.approx(alone.time_breakdown_s[key])
        assert exposed.step_time_s == pytest.approx(hidden.step_time_s - hidden.time_breakdown_s[key]
                                                    + alone.time_breakdown_s[key])


def test_tensor_parallel_moves_8bsh_per_layer_per_microbatch():
    shape, device = model_shape("llama-8b", 4096), _frictionless()
    work = Workload(seq=4096, global_batch=4)
    t, b = 8, 2
    p = predict(shape, work, Layout(dp_replicate=1, tp=t, microbatch=b, sequence_parallel=True), device, 8)
    elements = 8 * b * 4096 * shape.hidden * (t - 1) / t
    microbatches = 4 // b
    expected = elements * 2 * shape.layers * microbatches / device.intra_node_bw
    # Plus the ends: an all-reduce of b·s·h at the embedding and at the output projection's input gradient,
    # and three of b·s fp32 values in the vocabulary-parallel loss (bf16 elements are 2 bytes).
    ring = 2 * (t - 1) / t
    ends = microbatches * (2 * ring * b * 4096 * shape.hidden * 2 + 3 * ring * b * 4096 * 4) / device.intra_node_bw
    assert p.time_breakdown_s["tensor_parallel"] == pytest.approx(expected + ends)


def test_pipeline_bubble_is_p_minus_1_over_m_divided_by_v():
    # A small vocabulary: the layers split evenly and the output projection is negligible, so the stages are equal.
    shape = model_shape("hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab_size=256", 2048)
    work, device = Workload(seq=2048, global_batch=64), get_device("h100-sxm")
    plain = predict(shape, work, Layout(dp_replicate=2, pp=4, microbatch=2), device)
    interleaved = predict(shape, work, Layout(dp_replicate=2, pp=4, microbatch=2, schedule="interleaved_1f1b",
                                              stages_per_rank=2), device)
    assert plain.bubble_fraction == pytest.approx(3 / 16, rel=0.01)
    assert interleaved.bubble_fraction == pytest.approx(3 / 32, rel=0.01)
    assert interleaved.step_time_s < plain.step_time_s


def test_pipeline_of_unequal_stages_follows_the_slowest_and_splits_as_training_does():
    shape, work, device = model_shape("llama-8b", 2048), Workload(seq=2048, global_batch=64), get_device("h100-sxm")
    # The 128k-vocabulary output projection weighs ~2.4 layers: the last stage gets fewer layers, exactly as
    # scalenlp train splits the real model; the first stage (embeddings only) is then the lightest.
    model = build_model(model_args("llama-8b"), "meta")
    for pp, v in ((4, 1), (4, 2), (8, 1)):
        trained = [len(run) for run in split_layers(*layer_costs(model, 2048), pp * v)]
        assert layers_per_rank(shape, 2048, pp, v) == [sum(trained[r::pp]) for r in range(pp)]
    assert layers_per_rank(shape, 2048, 4)[-1] < 8
    plain = predict(shape, work, Layout(dp_replicate=2, pp=4, microbatch=2), device)
    assert 0.8 * 3 / 16 < plain.bubble_fraction < 3 / 16
    # GPipe keeps every microbatch's activations; 1F1B at most p of them.
    gpipe = predict(shape, work, Layout(dp_replicate=2, pp=4, microbatch=2, schedule="gpipe"), device)
    assert gpipe.memory["activations"] > 3 * plain.memory["activations"]


# ---------------------------------------------------------------- published throughput, one calibrated model

@pytest.mark.parametrize("row", [
    megatron_row(2304, 24, 24, 1, 1, 32, 512, 137),
    megatron_row(6144, 48, 40, 8, 1, 256, 1024, 135),
    megatron_row(12288, 96, 80, 8, 8, 1536, 2304, 148),
    megatron_row(25600, 160, 128, 8, 64, 3072, 3072, 163),
], ids=["1.7B", "18.4B", "145.6B", "1008B"])
def test_megatron_table1_held_out_rows_within_15_percent(row):
    device = get_device(row.device)
    assert predicted_tflops(row, device) == pytest.approx(row.tflops_per_gpu, rel=0.15)


def test_llama3_8192_h100_row_within_15_percent():
    row, device = llama3_row(8192, 430), get_device("h100-sxm")
    layout = best_layout(row, device)
    assert (layout.tp, layout.pp, layout.dp) == (8, 16, 64)
    shape = model_shape(row.model, row.seq)
    p = predict(shape, Workload(seq=8192, global_batch=2048, states="mixed"), layout, device)
    assert p.tflops_per_device == pytest.approx(430, rel=0.15)
    assert p.mfu == pytest.approx(0.43, rel=0.15)


@pytest.mark.parametrize("row", A100_ROWS + H100_ROWS, ids=lambda r: r.source)
def test_calibration_rows_are_matched(row):
    """The rows the constants were fitted on (scalenlp.plan.calibrate) stay matched: the shipped constants
    are what that fit printed."""
    assert predicted_tflops(row, get_device(row.device)) == pytest.approx(row.tflops_per_gpu, rel=0.08)


# ---------------------------------------------------------------- the command

def run_cli(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_ranks_fitting_layouts_with_runnable_train_lines(capsys):
    # Two nodes of two GPUs: a search of a few hundred layouts (two nodes of eight take ten times as long).
    code, out, _ = run_cli(capsys, "--model", "llama-8b", "--seq", "4096", "--global-batch", "256",
                           "--devices", "4", "--gpus-per-node", "2", "--device", "h100-sxm", "--top", "5", "--json")
    assert code == 0
    result = json.loads(out)
    layouts = result["layouts"]
    assert len(layouts) == 5
    speeds = [p["tokens_per_sec"] for p in layouts]
    assert speeds == sorted(speeds, reverse=True)
    assert result["rejected"]  # e.g. tp=16 does not divide kv_heads=8: counted, not dropped silently
    for p in layouts:
        assert p["memory_per_device_bytes"] <= 80 * 2**30
        assert p["memory_per_device_bytes"] == pytest.approx(sum(p["memory"].values()))
        for key in ("params", "grads", "optimizer", "activations"):
            assert p["memory"][key] > 0
        for key in ("model_flops_per_step", "step_time_s", "tokens_per_sec", "tflops_per_device", "mfu",
                    "bubble_fraction"):
            assert key in p
        words = shlex.split(p["train_command"])
        assert words[:6] == ["scalenlp", "train", "--nproc", "2", "--nnodes", "2"]
        overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        cfg = load_config(overrides=overrides)  # every key and value is one the trainer accepts
        lay = p["layout"]
        assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp_shard, cfg.parallel.dp_replicate) == \
            (lay["tp"], lay["pp"], lay["dp_shard"], lay["dp_replicate"])
        assert cfg.training.global_batch_size == 256 and cfg.training.seq_len == 4096
        assert cfg.model.flavor == "llama-8b"


def test_single_layout_prediction_and_human_output(capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-8b", "--seq", "8192", "--global-batch", "512", "--devices", "16",
                           "--layout", "tp=8,dp_shard=2,zero=3,microbatch=2,recompute=full,sp=true")
    assert code == 0
    assert "dp_shard=2 tp=8" in out and "zero=3" in out and "MFU" in out
    assert "--set parallel.data_parallel=zero3" in out and "--set training.activation_checkpointing=full" in out


@pytest.mark.parametrize("layout,reason", [
    ("tp=16", "would span nodes"),
    ("tp=3", "does not divide"),
    ("tp=2,dp_replicate=3", "dp_replicate*dp_shard*tp*pp = 3*1*2*1 = 6 but there are 16 devices"),
    ("pp=4,microbatch=64", "2 microbatches per step cannot fill 4 pipeline stages"),
    ("dp_replicate=16,offload=true", "offload moves FSDP's shards to host memory"),
    ("dp_shard=16,zero=3,offload=yes", "offload='yes': expected true or false"),
])
def test_a_layout_that_cannot_work_says_why(capsys, layout, reason):
    code, _, err = run_cli(capsys, "--model", "llama-8b", "--seq", "8192", "--global-batch", "512", "--devices", "16",
                           "--layout", layout)
    assert code == 2
    assert err.startswith("error: ") and reason in err


def test_nothing_fits_names_the_smallest_device_count(capsys):
    # A 12B Llama on A100s whose hosts take no offloaded states: found by doubling past 2 devices, then bisecting.
    plan = ["--model", "flavor=llama-8b,layers=48", "--seq", "4096", "--global-batch", "64", "--device", "a100-80gb",
            "--device-spec", "host_memory_bytes=1e9", "--top", "1"]
    code, _, err = run_cli(capsys, *plan, "--devices", "1")
    assert code == 1
    smallest = int(err.split("smallest device count that fits is ")[1].split()[0])
    assert smallest > 2
    code, out, _ = run_cli(capsys, *plan, "--devices", str(smallest))
    assert code == 0 and "#1 " in out
    assert run_cli(capsys, *plan, "--devices", str(smallest - 1))[0] == 1  # and one device fewer is too few


def test_device_overrides_and_bad_input(capsys):
    args = ["--model", "llama-8b", "--seq", "8192", "--global-batch", "512", "--devices", "16",
            "--layout", "tp=8,dp_shard=2,zero=3,microbatch=1,sp=true", "--json"]
    base = json.loads(run_cli(capsys, *args)[1])
    slower = json.loads(run_cli(capsys, *args, "--device-spec", "peak_flops_bf16=400e12")[1])
    assert slower["step_time_s"] > base["step_time_s"]
    assert run_cli(capsys, *args, "--device-spec", "warp=9")[0] == 2
    assert run_cli(capsys, "--model", "nope", "--seq", "8", "--global-batch", "8", "--devices", "1")[0] == 2
    assert run_cli(capsys, "--model", "hidden=64,layers=2,heads=3,vocab_size=100", "--seq", "8", "--global-batch", "8",
                   "--devices", "1")[0] == 2


def test_custom_shape_plans_with_a_train_line_of_model_keys(capsys):
    code, out, _ = run_cli(capsys, "--model", "hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab_size=128256",
                           "--seq", "8192", "--global-batch", "512", "--devices", "4", "--top", "1", "--json")
    assert code == 0
    words = shlex.split(json.loads(out)["layouts"][0]["train_command"])
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    assert "model.flavor=" in overrides and "model.kv_heads=8" in overrides  # the shape alone, as model.* keys
    cfg = load_config(overrides=overrides)
    # The trainer reads those keys into the model that was planned.
    assert build_model(shape_args(cfg.model, cfg.training.seq_len), "meta").num_params() == \
        json.loads(out)["parameters"]
    assert json.loads(out)["parameters"] == model_shape("llama-8b", 8192).total_params


def test_host_overheads_count_per_fsdp_unit_and_tp_linear():
    shape, work = model_shape("debug", 128), Workload(seq=128, global_batch=16, precision="fp32")
    device = dataclasses.replace(_frictionless(), peak_flops_fp32=math.inf, fsdp_unit_overhead_s=1.0,
                                 tp_linear_overhead_s=10.0)
    zero3 = predict(shape, work, Layout(dp_shard=2, zero=3, microbatch=4), device, 2)
    assert zero3.time_breakdown_s["framework"] == pytest.approx(2 * (shape.layers + 1))  # 2 microbatches
    tp = predict(shape, work, Layout(tp=2, microbatch=16), device, 2)
    assert tp.time_breakdown_s["framework"] == pytest.approx(10.0 * (7 * shape.layers + 2))  # SwiGLU: 7 per block
    assert "framework" not in predict(shape, work, Layout(dp_replicate=2, microbatch=8), device, 2).time_breakdown_s


def test_measured_gather_and_scatter_factors_scale_fsdp_traffic():
    shape, work = model_shape("gpt2-124m", 1024), Workload(seq=1024, global_batch=8, states="mixed")
    layout = Layout(dp_shard=8, zero=3, microbatch=1)
    base = _frictionless()
    slow = dataclasses.replace(base, all_gather_factor=2.0, reduce_scatter_factor=3.0)
    exposed = [predict(shape, work, layout, d).time_breakdown_s["data_parallel_exposed"] for d in (base, slow)]
    # ZeRO-3 per microbatch: two all-gathers and one reduce-scatter of equal ring time.
    assert exposed[1] == pytest.approx(exposed[0] * (2 * 2.0 + 3.0) / 3)


def test_tied_embedding_copies_sum_their_gradients_between_the_pipeline_ends():
    work = Workload(seq=1024, global_batch=8, states="mixed")
    tied, untied = (dataclasses.replace(model_shape("gpt2-124m", 1024), tied=t) for t in (True, False))
    device, layout = _frictionless(), Layout(pp=2, microbatch=1)
    extra = (predict(tied, work, layout, device).time_breakdown_s["grad_sync_exposed"]
             - predict(untied, work, layout, device).time_breakdown_s["grad_sync_exposed"])
    # One all-reduce of the bf16 vocab x hidden gradient over the two end ranks (one node): 2 · (1/2) · bytes / bandwidth.
    assert extra == pytest.approx(2 * tied.vocab * tied.hidden / device.intra_node_bw)


def test_vocabulary_parallel_loss_costs_its_measured_factor():
    shape, work = model_shape("debug", 128), Workload(seq=128, global_batch=16, precision="fp32")
    base = dataclasses.replace(_frictionless(), peak_flops_fp32=math.inf, hbm_bw=1e9)
    elementwise = [predict(shape, work, Layout(tp=2, microbatch=16),
                           dataclasses.replace(base, vocab_parallel_loss_factor=f), 2).time_breakdown_s["elementwise"]
                   for f in (1.0, 3.0)]
    logits = base.elementwise_traffic * 16 * 128 * shape.vocab / 2 * 12 / base.hbm_bw  # fp32 logits, their fp32 loss
    assert elementwise[1] - elementwise[0] == pytest.approx(2 * logits)


def test_measured_attention_rate_and_loss_time_replace_the_formulas():
    shape, work = model_shape("debug", 128), Workload(seq=128, global_batch=16, precision="fp32")
    base = dataclasses.replace(_frictionless(), peak_flops_fp32=math.inf, hbm_bw=math.inf, op_overhead_s=0.0)
    timed = predict(shape, work, Layout(microbatch=16), dataclasses.replace(base, attention_flops=1e9,
                                                                          loss_s_per_logit=1e-9), 1).time_breakdown_s
    # Two score matmuls per layer, forward + backward (3 passes), the masked half skipped: 2·3·(2·B·s·s·h)/2 FLOPs.
    assert timed["matmul"] == pytest.approx(shape.layers * 3 * 2 * 16 * 128 * 128 * shape.hidden / 1e9)
    assert timed["elementwise"] == pytest.approx(16 * 128 * shape.vocab * 1e-9)


def test_layouts_the_trainer_refuses_are_refused():
    work = Workload(seq=128, global_batch=16)
    tied = check_layout(model_shape("small", 128), work, Layout(pp=2, dp_replicate=1, microbatch=8), 2, 8)
    assert tied == []  # the trainer pipelines tied embeddings as two synchronised copies
    zero1_tp = check_layout(model_shape("debug", 128), work, Layout(dp_shard=2, zero=1, tp=2, microbatch=8), 4, 8)
    assert zero1_tp == []  # the trainer runs ZeRO-1 beside TP and PP


def test_an_uneven_vocabulary_is_planned_with_the_largest_shard():
    shape = model_shape("gpt2-124m", 1024)  # vocabulary 50257: the first tp rank holds 25129 rows
    assert check_layout(shape, Workload(seq=1024, global_batch=8), Layout(tp=2, microbatch=8), 2, 8) == []
    extra = stage_params(shape, Layout(tp=2), 0, shape.layers) - stage_params(shape, Layout(), 0, shape.layers) / 2
    assert extra == pytest.approx((25129 - 50257 / 2) * shape.hidden)  # one tied matrix, half a row more


def test_zero_bubble_leaves_a_third_of_the_interleaved_bubble():
    shape, work = model_shape("llama-8b", 4096), Workload(seq=4096, global_batch=64)
    bubbles = {schedule: predict(shape, work, Layout(dp_replicate=2, pp=4, microbatch=2, schedule=schedule,
                                                      stages_per_rank=2), get_device("h100-sxm")).time_breakdown_s
               for schedule in ("interleaved_1f1b", "zero_bubble")}
    assert bubbles["zero_bubble"]["bubble"] == pytest.approx(bubbles["interleaved_1f1b"]["bubble"] / 3)
    assert bubbles["zero_bubble"]["matmul"] == bubbles["interleaved_1f1b"]["matmul"]
