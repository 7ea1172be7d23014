"""Stacked q/k/v and gate/up projections (training.stack_projections) compute what the separate ones do, keep no
more for backward, and change no parameter (their parity on every parallel layout:
tests/integration/test_parallel_parity.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from scalenlp.config import load_config
from scalenlp.models import decoder as decoder_module
from scalenlp.models.decoder import stack_projections
from scalenlp.models.flavors import build_model, model_args
from scalenlp.train.trainer import train
from train_helpers import TINY, read_metrics


def test_stacked_projections_compute_what_the_separate_ones_do():
    torch.manual_seed(0)
    for flavor in ("debug", "debug-gpt2"):  # grouped-query SwiGLU; biased GELU
        model = build_model(model_args(flavor, vocab_size=97, max_seq_len=16))
        tokens = torch.randint(0, 97, (2, 16))
        grads = []
        for enabled in (True, False):
            stack_projections(model, enabled)
            model.zero_grad()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (fused_loss, fused), (loss, plain) = grads
        torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
        for name in plain:
            torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_swiglu_gradients_are_autograds():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(decoder_module.swiglu, (gate, up))
    torch.testing.assert_close(decoder_module.swiglu(gate, up), F.silu(gate) * up)


def test_rmsnorm_gradients_are_autograds():
    """Training's RMSNorm (keeping x and 1/rms, its backward written over its temporaries) against torch's; a
    frozen weight (LoRA's) gets no gradient computed."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)  # in float32, as it computes (no gradcheck in float64)
    weight = torch.randn(8, requires_grad=True)
    grad = torch.randn(2, 5, 8)
    got, want = ([*torch.autograd.grad(norm(x, weight, 1e-5), (x, weight), grad)]
                 for norm in (decoder_module._RMSNorm.apply, lambda x, w, eps: F.rms_norm(x, (8,), w, eps)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    x.grad = None
    out = decoder_module._RMSNorm.apply(x, weight.detach(), 1e-5)
    assert out.grad_fn.name() == "_RMSNormBackward"
    out.sum().backward()
    assert x.grad is not None


def test_rope_gradients_are_autograds():
    """Training's RoPE (one output allocated, its gradient the rotation back) against the op-by-op form it
    replaces, which inference keeps."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(1, 5, 1, 4, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    assert torch.autograd.gradcheck(decoder_module.apply_rope, (x, cos, sin))
    assert decoder_module.apply_rope(x, cos, sin).grad_fn.name() == "_RopeBackward"
    x1, x2 = x.chunk(2, dim=-1)
    torch.testing.assert_close(decoder_module.apply_rope(x, cos, sin), x * cos + torch.cat([-x2, x1], dim=-1) * sin)


def _saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages a training forward keeps for backward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, targets=tokens)
    return sum(kept.values())


def test_a_block_keeps_what_its_backward_needs_and_no_more():
    """Per layer, in (tokens x width) fp32 tensors: each norm's input and output, the RoPE'd q and k, v and the
    attention's output (wo reads it in place), gate and up, the MLP's product into w2; after the layers the final
    norm's input and the loss's two gradients. Stacking adds only its stacked weights. Before: stacking's views of
    one product kept q, k and v whole with v, autograd's SwiGLU kept silu(gate) as well, and torch's
    composed RMSNorm the normalised input, in all 4 narrow and 1 wide tensor more per layer."""
    layers, vocab, dim, ffn, B, T = 2, 96, 64, 128, 2, 32
    torch.manual_seed(0)
    model = build_model(model_args("debug", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=4,
                                   ffn_dim=ffn, max_seq_len=T))
    tokens = torch.randint(0, vocab, (B, T))
    narrow, wide = B * T * dim * 4, B * T * ffn * 4
    want = layers * (8 * narrow + 3 * wide) + 2 * narrow + vocab * dim * 4
    small = 8 * 1024  # token ids, RoPE tables, each norm's 1/rms, the attention's log-sum-exp: 7.75 KiB here
    stack_projections(model, False)
    plain = _saved_activation_bytes(model, tokens)
    stack_projections(model, True)
    stacked = _saved_activation_bytes(model, tokens)
    assert want <= plain <= want + small, (plain - want) / narrow
    assert stacked - plain == layers * (3 * dim * dim + 2 * ffn * dim) * 4


def test_checkpoint_written_unstacked_resumes_stacked(tmp_path, corpus):
    """Stacking changes no parameter: a checkpoint of a run without it resumes with it, on the same losses."""
    torch.set_num_threads(1)
    sets = [*TINY, f"data.path={corpus}", "training.steps=6", "checkpoint.every=3", "checkpoint.export=false"]
    full = tmp_path / "full"
    train(load_config(None, [*sets, "training.stack_projections=false"]), full)
    record = {r["step"]: r for r in read_metrics(full)}
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    (cut / "metrics.jsonl").write_text("")
    train(load_config(None, [*sets, "training.stack_projections=true", "checkpoint.resume=true"]), cut)
    resumed = read_metrics(cut)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for r in resumed:
        assert r["loss"] == pytest.approx(record[r["step"]]["loss"], rel=1e-5)
