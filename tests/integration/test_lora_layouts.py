"""LoRA under every layout, 2 processes on gloo: DDP, ZeRO-3 (FSDP2 sharding the frozen base with the adapters),
tensor parallelism (adapters sharded as the layer they wrap) and pipeline parallelism each resume the one-process
run's adapter checkpoint, train its next steps with its losses and gradient norms, and save adapters that export to
its merged model. QLoRA (an NF4 base) under DDP, ZeRO-3, tensor and pipeline parallelism trains with the
one-process run's losses (under TP, of one process whose base was quantized shard by shard, as TP's ranks do),
and ZeRO-3 resumes its checkpoint. In-process LoRA tests: tests/unit/test_lora.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from scalenlp.loader import load
from train_helpers import FINETUNE, checkpoint_keys, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # one two-process run a layout: 30-60 s each here under load

LAYOUTS = {"ddp": ["parallel.data_parallel=ddp"], "zero3": ["parallel.data_parallel=zero3"], "tp2": ["parallel.tp=2"],
           "pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus, hf_llama):
    """The one-process reference: four LoRA steps (rank 4 on every linear), a checkpoint every two."""
    run = tmp_path_factory.mktemp("lora_single") / "run"
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", "lora.rank=4", "lora.alpha=8",
            "training.steps=4", "checkpoint.every=2", "training.device=cpu"]
    train_here(run, *sets)
    return run, sets


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_resumes_the_adapters_and_trains_like_one_process(tmp_path, single, layout):
    reference, sets = single
    run = tmp_path / layout
    shutil.copytree(reference / "checkpoints" / "step-2", run / "checkpoints" / "step-2")
    run_train(run, *sets, *LAYOUTS[layout], "checkpoint.resume=true", nproc=2)
    expected, got = read_metrics(reference)[2:], read_metrics(run)
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), layout
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), layout
    ours, theirs = load(run)[0].state_dict(), load(reference)[0].state_dict()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=f"{layout}: {name}")


@pytest.fixture(scope="module")
def qlora_single(tmp_path_factory, corpus, hf_llama):
    """The one-process QLoRA reference: three steps over an NF4 base, a checkpoint at the second."""
    run, sets = tmp_path_factory.mktemp("qlora_single") / "run", qlora_sets(corpus, hf_llama)
    train_here(run, *sets)
    return run, sets


def qlora_sets(corpus, hf_llama) -> list[str]:
    return [*FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", "lora.rank=4", "lora.quantize_base=nf4",
            "training.steps=3", "checkpoint.every=2", "checkpoint.export=false", "training.device=cpu"]


@pytest.fixture(scope="module")
def qlora_single_by_tp_shards(tmp_path_factory, corpus, hf_llama):
    """The one-process QLoRA reference for tensor parallelism over 2 ranks, whose ranks each quantize their own
    shard: the base quantized the same way, shard by shard (column-parallel linears by rows, row-parallel ones
    by columns), and held dequantized in bf16, which computes as the NF4 tensor does (bf16 products)."""
    import scalenlp.compress.nf4 as nf4
    from scalenlp.parallel.tensor_parallel import split_dim

    whole = nf4.quantize_nf4

    @torch.no_grad()
    def by_shards(model, names):
        for name in names:
            layer = model.get_submodule(name)
            pieces = []
            for piece in layer.weight.chunk(2, split_dim(name)):
                holder = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False))
                holder[0].weight = torch.nn.Parameter(piece.contiguous())
                whole(holder, ["0"])
                pieces.append(holder[0].weight.get_original_weight())
            layer.weight = torch.nn.Parameter(torch.cat(pieces, split_dim(name)), requires_grad=False)

    run, sets = tmp_path_factory.mktemp("qlora_single_tp") / "run", qlora_sets(corpus, hf_llama)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nf4, "quantize_nf4", by_shards)
        train_here(run, *sets)
    return run, sets


@pytest.mark.parametrize("layout", ["ddp", "pp2", "zero3", "tp2"])
def test_qlora_under_a_layout_trains_like_one_process(tmp_path, request, layout):
    """Every rank builds the NF4 base alike from model.init: DDP keeps it whole, pipeline stages hold their
    blocks' weights, ZeRO-3 splits each NF4 weight into row shards of whole scale groups (gathered per use, never
    trained), TP ranks hold their shards of it. DDP and PP train from the start; ZeRO-3 and TP continue the
    one-process run's step-2 checkpoint (one run showing both its step and its resume: from the start they
    matched steps 1-3 alike). Each saves adapters only.
    The base computes in bf16, whose rounding differs between a batch of 4 and two of 2 (or two micro-batches):
    the third step's loss moved by 2-3e-5 relative here, so the tolerance is 1e-4 (a gradient not averaged over
    the ranks moves it by far more). Under TP each rank quantizes its shard (blocks and scales of its own), so
    the reference quantizes so too; its row-parallel layers sum two bf16 partial products, rounded each, where
    one process rounds one: the losses moved by up to 1.5e-4 and the gradient norms by 1.2e-3 here, so those
    tolerances are 5e-4 and 5e-3 (the same sums in float32 matched to 1e-7; an input gradient not summed over
    the ranks moves the gradient norm by 40%)."""
    tp = layout == "tp2"
    reference, sets = request.getfixturevalue("qlora_single_by_tp_shards" if tp else "qlora_single")
    run, resume = tmp_path / layout, layout in ("zero3", "tp2")
    if resume:
        shutil.copytree(reference / "checkpoints" / "step-2", run / "checkpoints" / "step-2")
    run_train(run, *sets, *LAYOUTS[layout], *(["checkpoint.resume=true"] if resume else []), nproc=2)
    expected, got = read_metrics(reference), read_metrics(run)
    assert [r["step"] for r in got] == ([3] if resume else [1, 2, 3])
    for a, b in zip(expected[-len(got):], got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-4 if tp else 1e-4), layout
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-3 if tp else 1e-3), layout
    keys = {k for k in checkpoint_keys(run / "checkpoints" / "step-3") if k.startswith("model.")}
    assert keys and all(".lora_" in k for k in keys), keys
