"""Initialisation by the published recipes (torchtitan's Llama, GPT-2's depth-scaled residuals), deterministic by
seed and run once on a model built on the meta device."""

from __future__ import annotations

import math

import pytest
import torch

from scalenlp.models.flavors import build_model, model_args


def _truncated_std(std: float, cutoff_sigmas: float) -> float:
    """Standard deviation of N(0, std²) truncated at ±cutoff_sigmas·std."""
    c = cutoff_sigmas
    pdf = math.exp(-c * c / 2) / math.sqrt(2 * math.pi)
    return std * math.sqrt(1 - 2 * c * pdf / math.erf(c / math.sqrt(2)))


def _assert_stats(param: torch.Tensor, std: float, name: str) -> None:
    x = param.detach().double()
    assert x.std().item() == pytest.approx(std, rel=0.03), name
    assert abs(x.mean().item()) < 4 * std / math.sqrt(x.numel()), name


def test_llama_init_follows_torchtitan_recipe():
    torch.manual_seed(0)
    dim, layers = 256, 4
    model = build_model(model_args("debug", vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                                   ffn_dim=768))
    _assert_stats(model.tok_embeddings.weight, 1.0, "tok_embeddings")
    _assert_stats(model.output.weight, _truncated_std(dim**-0.5, 3), "output")
    assert model.output.weight.abs().max().item() <= 3 * dim**-0.5
    for i, block in model.layers.items():
        depth_std = 0.02 / math.sqrt(2 * (int(i) + 1))
        for name in ("wq", "wk", "wv"):
            _assert_stats(getattr(block.attention, name).weight, 0.02, f"layer {i} {name}")
        _assert_stats(block.attention.wo.weight, depth_std, f"layer {i} wo")
        _assert_stats(block.feed_forward.w1.weight, 0.02, f"layer {i} w1")
        _assert_stats(block.feed_forward.w2.weight, depth_std, f"layer {i} w2")
        _assert_stats(block.feed_forward.w3.weight, depth_std, f"layer {i} w3")
        assert torch.equal(block.attention_norm.weight, torch.ones(dim))
    assert torch.equal(model.norm.weight, torch.ones(dim))


def test_gpt2_init_scales_residual_projections_by_depth():
    torch.manual_seed(0)
    layers = 4
    model = build_model(model_args("small", vocab_size=2048, n_layers=layers))
    assert model.output.weight is model.tok_embeddings.weight
    for name in ("tok_embeddings", "pos_embeddings"):
        _assert_stats(getattr(model, name).weight, 0.02, name)
    for i, block in model.layers.items():
        for module, std in ((block.attention.wq, 0.02), (block.feed_forward.w1, 0.02),
                            (block.attention.wo, 0.02 / math.sqrt(2 * layers)),
                            (block.feed_forward.w2, 0.02 / math.sqrt(2 * layers))):
            _assert_stats(module.weight, std, f"layer {i}")
            assert not module.bias.any()


def test_tied_llama_embedding_takes_the_output_init():
    torch.manual_seed(0)
    model = build_model(model_args("llama-1b", vocab_size=4096, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                                   ffn_dim=512, max_seq_len=64))
    assert model.output.weight is model.tok_embeddings.weight
    _assert_stats(model.output.weight, _truncated_std(256**-0.5, 3), "tied output")


def test_init_is_deterministic_by_seed_and_runs_once_on_a_meta_built_model():
    """build_model (meta, then to_empty + init_weights) gives the weights of the same seed again, and a model
    materialised and re-initialised by hand from the same seed equals it: the init is the only RNG use."""
    args = model_args("debug", vocab_size=97)
    torch.manual_seed(5)
    a = build_model(args)
    torch.manual_seed(5)
    b = build_model(args, "meta")
    b.to_empty(device="cpu")
    b.init_weights()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
