"""Hugging Face families under several processes: a Qwen3 (per-head q/k norms, whose one weight each rank sees
through its own heads) and a Gemma 2 (post-norms, soft-caps, a sliding window on alternate layers) fine-tuned
under ZeRO-3 and under tensor and sequence parallelism on 2 ranks train like one process, step by step."""

from __future__ import annotations

import copy

import pytest
import torch

from scalenlp.models.decoder import ModelArgs
from scalenlp.models.flavors import build_model
from scalenlp.testing.ranks import spawn_ranks
from train_helpers import FINETUNE, make_hf_decoder, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # two two-process runs a family, 40-90 s each here under load


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_family_trains_like_one_process(tmp_path, corpus, transformers, model_type):
    folder = tmp_path / "hf"
    make_hf_decoder(folder, model_type, corpus)
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={folder}", "training.steps=2", "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, layout in [("zero3", ["parallel.data_parallel=zero3"]),
                         ("tp2-sp", ["parallel.tp=2", "parallel.sequence_parallel=true"])]:
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


def test_tensor_parallel_inference_with_every_option():
    """Sharded on 2 ranks, a model with every family option gives one process's logits, in a forward of the whole
    sequence and through the KV cache (a prefill, then decode steps past the window)."""
    spawn_ranks(_sharded_inference, 2)


def _sharded_inference(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from scalenlp.parallel.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = build_model(ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                      max_seq_len=32, **EVERY_OPTION)).eval()
    with torch.no_grad():
        for p in reference.parameters():  # zero-initialised offsets and biases would hide their sharding
            p.add_(torch.randn_like(p) * 0.1)
    sharded = copy.deepcopy(reference)
    apply_tp(sharded, mesh["tp"], sequence_parallel=False)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(sharded(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
        for model in (reference, sharded):
            model.setup_kv_cache(2, 32)
        steps = [torch.arange(10)] + [torch.tensor([t]) for t in range(10, 16)]
        for pos in steps:
            at = pos.unsqueeze(0).expand(2, -1)
            torch.testing.assert_close(sharded(tokens[:, pos], input_pos=at), reference(tokens[:, pos], input_pos=at),
                                       rtol=1e-5, atol=1e-5)
