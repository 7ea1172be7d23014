"""The chunked loss (the output projection and cross-entropy a few tokens at a time) equals cross-entropy over
the full logits (compiled: tests/unit/test_parallelize.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scalenlp.models import loss as loss_module
from scalenlp.models.flavors import build_model, model_args


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])  # untied; tied embeddings (one weight, two uses)
def test_chunked_loss_equals_cross_entropy_over_full_logits(flavor, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 97 * 10)  # 10 tokens a chunk: 4 chunks, the last short
    torch.manual_seed(0)
    model = build_model(model_args(flavor, vocab_size=97, max_seq_len=16))
    tokens, targets = torch.randint(0, 97, (2, 2, 16))
    targets[0, :3] = -100  # ignored targets (SFT's prompt tokens) count for nothing
    chunked = model(tokens, targets=targets)
    chunked.mul(0.5).backward()  # the incoming gradient scales both gradients
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")
    full.mul(0.5).backward()
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products, fp32 loss
        got = model(tokens, targets=targets)
        want = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten(), reduction="sum")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)


def test_the_chunked_loss_traces_into_one_graph():
    """training.compile compiles the loss whole: a branch on the data (as "are any targets ignored?" once was)
    would break the graph, and dynamo then runs the whole function eagerly."""
    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(97, 8)
    targets = torch.randint(0, 97, (12,))
    targets[:3] = -100
    explained = torch._dynamo.explain(loss_module.linear_cross_entropy)(hidden, weight, targets)
    assert not explained.break_reasons, explained.break_reasons[0].reason
