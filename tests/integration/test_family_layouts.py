"""Hugging Face families under several processes. Through the trainer: a Gemma 3 folder (per-head (1 + w) q/k
norms, whose one weight each rank sees through its own heads; post-norms; local layers with their own RoPE base)
fine-tuned with model.init under tensor + sequence parallelism on 2 ranks trains like one process, step by step.
In one launch of 2 ranks: a model with every family option has one process's loss and gradients under ZeRO-3 and
under TP + SP, and one process's logits when sharded for inference (KV cache included).

(The Gemma 3 fine-tune also ran under ZeRO-3, a second 2-process run: ZeRO-3 shards every parameter along its
first dimension whatever it belongs to, and its numerics on every Gemma option are test_every_option's; ZeRO-3
through the trainer from model.init is test_fine_tuning_layouts' and test_lora_layouts'. Under TP, where each
rank's heads read their own rows of a q/k norm, the folder's run stays.)"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from infer_helpers import paged_args
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.flavors import build_model
from scalenlp.testing.ranks import spawn_ranks
from train_helpers import FINETUNE, make_hf_decoder, read_metrics, run_train, train_here

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks.parity, the layouts' config harness

pytestmark = pytest.mark.slow  # two-process runs: 30-100 s a test here under load


def test_family_trains_like_one_process(tmp_path, corpus, transformers):
    folder = tmp_path / "hf"
    make_hf_decoder(folder, "gemma3_text", corpus)
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={folder}", "training.steps=2", "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, layout in [("tp2-sp", ["parallel.tp=2", "parallel.sequence_parallel=true"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = read_metrics(tmp_path / name)
        assert len(got) == len(single) == 2, name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name


# Every option the families brought, on one small model: a window on layer 0 with its own RoPE base, soft-caps,
# (1 + w) q/k, pre- and post-norms, GeGLU, a scaled embedding and score scale.
EVERY_OPTION = dict(qk_norm=True, norm_offset=1.0, post_norms=True, activation="geglu", sliding_window=4,
                    local_layers=(0,), rope_local_theta=100.0, attn_softcap=2.0, logit_softcap=3.0, embed_scale=8.0,
                    attn_scale=0.2, qkv_bias=True)


def test_every_option_on_two_ranks_computes_as_one_process():
    """One launch of 2 ranks for two checks on a model with every family option. Training: under ZeRO-3 (each rank
    half the batch) and under TP 2 with sequence parallelism, the loss and every gradient are one process's.
    Inference, sharded: one process's logits for the whole sequence and through the KV cache (a prefill, then
    decode steps past the window)."""
    spawn_ranks(_every_option_checks, 2)


def _every_option_checks(rank, world):
    _layouts_match_one_process(rank, world)
    _sharded_inference(rank, world)


def every_option_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                  max_seq_len=32, **EVERY_OPTION))
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised offsets and biases would hide their sharding
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _layouts_match_one_process(rank, world):
    import torch.distributed as dist
    from benchmarks import parity
    from torch.distributed.tensor import DTensor

    from scalenlp.parallel.mesh import ParallelDims, build_mesh
    from scalenlp.parallel.parallelize import loss_context, parallelize
    from scalenlp.train.loss import cross_entropy

    tokens = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(1))
    reference = every_option_model()
    cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    for layout in (dict(data_parallel="zero3"), dict(tp=2, sequence_parallel=True)):
        cfg = parity.make_config(layout)
        dims = ParallelDims.from_config(cfg.parallel, world)
        model = parallelize(every_option_model(), dims, build_mesh(dims), cfg)
        batch = tokens.chunk(world)[rank] if layout.get("data_parallel") else tokens  # ZeRO-3: half each
        with loss_context(dims, cfg):
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
        if layout.get("data_parallel"):
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        reference_loss = cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:])
        torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-5, atol=0, msg=str(layout))
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")


def _sharded_inference(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from scalenlp.parallel.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    reference = every_option_model().eval()
    sharded = copy.deepcopy(reference)
    apply_tp(sharded, mesh["tp"], sequence_parallel=False)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(sharded(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
        for model in (reference, sharded):
            model.setup_kv_cache(5, 8)
        tables = torch.tensor([[3, 1], [2, 4]])
        steps = [torch.arange(10)] + [torch.tensor([t]) for t in range(10, 16)]
        for pos in steps:
            at = pos.unsqueeze(0).expand(2, -1)
            paged = paged_args(tables, at, 8)
            torch.testing.assert_close(sharded(tokens[:, pos], at, *paged), reference(tokens[:, pos], at, *paged),
                                       rtol=1e-5, atol=1e-5)
