"""scalenlp's CPU causal-attention kernel (models/cpu_attention.cpp): exact against a float64 reference, forward
and all three gradients, on the shapes it takes; the decoder trains alike with it and with PyTorch's SDPA; it
steps aside where it does not apply."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from scalenlp.models import cpu_attention
from scalenlp.models.decoder import ModelArgs, Transformer

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel is built on first use: needs g++")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_attention.available(), "the CPU attention kernel did not build (see the warning above)"


def reference(q, k, v, dout):
    """SDPA in float64: the forward and the gradients of (out * dout).sum()."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return (out, *torch.autograd.grad(out, (q64, k64, v64), dout.double()))


@pytest.mark.parametrize("B, H, H_kv, S, D", [
    (2, 4, 4, 37, 16),    # length not a multiple of any tile
    (1, 2, 2, 1, 16),     # one token
    (1, 4, 2, 130, 32),   # grouped-query attention, 2 query heads per key/value head
    (2, 3, 1, 100, 32),   # multi-query
    (1, 2, 2, 257, 32),   # crosses several block edges
])
def test_forward_and_gradients_match_float64(B, H, H_kv, S, D):
    torch.manual_seed(0)
    # (B, S, H, D) storage viewed as (B, H, S, D), as the decoder makes them
    q = torch.randn(B, S, H, D).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, S, H_kv, D).transpose(1, 2).requires_grad_() for _ in range(2))
    out = cpu_attention.causal_attention(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = reference(q, k, v, dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), expected):
        assert got.shape == want.shape and got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=name)


def test_contiguous_inputs_and_odd_strides_give_the_same_result():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 70, 16) for _ in range(3))  # (B, H, S, D) contiguous
    padded = torch.randn(2, 4, 70, 40)[..., 3:19]  # rows with a gap: only the head dimension is contiguous
    padded.copy_(v)
    torch.testing.assert_close(cpu_attention.causal_attention(q, k, padded), cpu_attention.causal_attention(q, k, v),
                               atol=0, rtol=0)
    torch.testing.assert_close(cpu_attention.causal_attention(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_registered_op_passes_torch_opcheck():
    """Its fake (shape) functions and autograd registration, as torch.compile relies on them."""
    q = torch.randn(1, 2, 33, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 33, 16, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.scalenlp_cpu.causal_attention.default, (q, k, v))


def test_bfloat16_is_computed_in_float32_and_rounded_back():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 50, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = cpu_attention.causal_attention(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    wide_out = cpu_attention.causal_attention(*wide)
    wide_grads = torch.autograd.grad(wide_out, wide, dout.float())
    for got, want in zip((out, *grads), (wide_out, *wide_grads)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.bfloat16(), atol=0, rtol=0)


def test_applies_only_to_cpu_floats_without_dropout_and_known_head_sizes():
    q = torch.randn(1, 2, 8, 16)
    assert cpu_attention.usable(q, q, 0.0)
    assert cpu_attention.usable(q.bfloat16(), q.bfloat16(), 0.0)
    assert not cpu_attention.usable(q.double(), q.double(), 0.0)
    assert not cpu_attention.usable(q, q, 0.1)
    for head in (64, 128):  # SDPA is as fast there
        assert not cpu_attention.usable(torch.randn(1, 2, 8, head), torch.randn(1, 2, 8, head), 0.0)
    assert not cpu_attention.usable(q, torch.randn(1, 2, 9, 16), 0.0)  # a KV cache longer than the queries


# Compiled: Inductor compiles the forward and backward, ~30 s here without its cache.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_decoder_trains_alike_with_the_kernel_and_with_sdpa(monkeypatch, compiled):
    """One training step of a small GQA decoder: the loss and every gradient with the kernel equal SDPA's."""
    args = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=96)
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, 128, (2, 96))
    calls = []
    kernel = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or kernel(*a))

    def step():
        model.zero_grad()
        forward = torch.compile(model) if compiled else model
        loss = forward(tokens, targets=tokens)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = step()
    assert calls, "the decoder's training forward did not use the kernel"
    torch._dynamo.reset()
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    sdpa_loss, sdpa_grads = step()
    torch.testing.assert_close(loss, sdpa_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, sdpa_grads[name], atol=1e-5, rtol=1e-4, msg=name)
