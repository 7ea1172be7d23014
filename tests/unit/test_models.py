"""Model family, flavors, and the export format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer_helpers import paged_args
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.flavors import FLAVORS, build_model, model_args
from scalenlp.models.io import load_pretrained, save_pretrained


@pytest.mark.parametrize("flavor, params", [
    ("gpt2-124m", 124_439_808),      # GPT-2 small as published (tied embeddings, 1024 positions)
    ("llama-8b", 8_030_261_248),     # Llama 3 8B
    ("llama-70b", 70_553_706_496),   # Llama 3 70B
])
def test_published_parameter_counts_on_the_meta_device(flavor, params):
    model = build_model(FLAVORS[flavor], "meta")
    assert model.num_params() == params
    assert next(model.parameters()).device.type == "meta"


def test_flops_per_token_is_6n_plus_attention():
    args = FLAVORS["gpt2-124m"]
    model = build_model(args, "meta")
    n_matmul = 124_439_808 - 1024 * 768  # the position table does no matmul; the tied embedding does (output)
    assert model.num_params(exclude_embedding=True) == n_matmul
    assert model.flops_per_token(1024) == 6 * n_matmul + 12 * 12 * 12 * 64 * 1024


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_forward_is_causal_and_trains(flavor):
    torch.manual_seed(0)
    model = build_model(model_args(flavor, vocab_size=97))
    x = torch.randint(0, 97, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 97  # changing later tokens must not change earlier logits
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.equal(a[:, 8:], b[:, 8:])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(20):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first / 2


def test_gqa_tied_and_options_shape_the_weights():
    llama = build_model(model_args("debug", vocab_size=50))
    attn = llama.layers["0"].attention
    assert attn.wk.weight.shape[0] * 2 == attn.wq.weight.shape[0]  # 4 heads sharing 2 key/value heads
    assert llama.layers["0"].feed_forward.w3 is not None and llama.pos_embeddings is None
    gpt2 = build_model(model_args("debug-gpt2", vocab_size=50))
    assert gpt2.output.weight is gpt2.tok_embeddings.weight and gpt2.pos_embeddings is not None
    assert isinstance(gpt2.norm, torch.nn.LayerNorm) and isinstance(llama.norm, torch.nn.RMSNorm)


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_kv_cache_matches_the_full_forward(flavor):
    torch.manual_seed(0)
    model = build_model(model_args(flavor, vocab_size=97)).eval()
    x = torch.randint(0, 97, (3, 10))
    with torch.no_grad():
        full = model(x)
        # Blocks of 4 positions, each row's three in a shuffled order through the pool (block 0 left out).
        model.setup_kv_cache(10, 4)
        tables = torch.randperm(9).add(1).view(3, 3)
        pos = torch.arange(6).expand(3, 6)
        steps = [model(x[:, :6], pos, *paged_args(tables, pos, 4))]
        for t in range(6, 10):
            pos = torch.full((3, 1), t)
            steps.append(model(x[:, t:t + 1], pos, *paged_args(tables, pos, 4)))
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_lengths_are_clear():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        Transformer(ModelArgs(dim=30, n_heads=4))
    with pytest.raises(ValueError, match="not divisible by n_kv_heads"):
        Transformer(ModelArgs(n_heads=4, n_kv_heads=3))
    model = build_model(model_args("debug", vocab_size=20, max_seq_len=8))
    with pytest.raises(ValueError, match="longer than the model's max_seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(KeyError, match="unknown model flavor"):
        model_args("nope")


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_export_round_trip_and_damage(tmp_path, flavor):
    model = build_model(model_args(flavor, vocab_size=64)).eval()
    save_pretrained(model, tmp_path / "export")
    loaded = load_pretrained(tmp_path / "export")
    x = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    bf16 = load_pretrained(tmp_path / "export", dtype=torch.bfloat16)
    assert bf16.output.weight.dtype == torch.bfloat16
    (tmp_path / "export" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot read"):
        load_pretrained(tmp_path / "export")
    with pytest.raises(UserError, match="not an exported model"):
        load_pretrained(tmp_path)
