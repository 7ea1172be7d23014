"""Issue 16: initialisation by the published recipes, an MFU peak that holds still, and fused training
projections that compute as the unfused ones (their training parity on every layout is in
tests/test_parallel_layouts.py)."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from scalenlp.config import Config
from scalenlp.models import decoder as decoder_module
from scalenlp.models import loss as loss_module
from scalenlp.models.decoder import stack_projections
from scalenlp.models.flavors import build_model, model_args
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.parallel.parallelize import parallelize
from scalenlp.train.peak import peak_flops
from train_helpers import TINY, read_metrics, run_train, write_corpus


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


# -- MFU's peak ------------------------------------------------------------------------------------------

def test_measured_peak_is_cached_so_two_runs_divide_by_the_same_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = peak_flops(torch.device("cpu"), torch.float32)
    second = peak_flops(torch.device("cpu"), torch.float32)
    assert first.flops == second.flops > 0
    assert first.cache == second.cache and first.cache.parent == tmp_path / "scalenlp"
    assert "measured" in second.source and f"{torch.get_num_threads()} thread" in second.source


def test_peak_override_wins_and_mfu_never_exceeds_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    given = peak_flops(torch.device("cpu"), torch.float32, override_tflops=0.5)
    assert (given.flops, given.source) == (0.5e12, "training.peak_tflops")
    assert given.mfu(0.25e12) == (0.5, None)
    mfu, note = given.mfu(1e12)
    assert mfu == 1.0 and "above the peak" in note and given.flops == 0.5e12  # the user's figure stays

    measured = peak_flops(torch.device("cpu"), torch.float32)
    achieved = measured.flops * 1.5  # the cached figure was measured under load
    mfu, note = measured.mfu(achieved)
    assert mfu == 1.0 and "raised" in note
    again = peak_flops(torch.device("cpu"), torch.float32)
    assert again.flops == achieved and "raised" in again.source
    assert json.loads(measured.cache.read_text())["flops"] == achieved


# -- stacked q/k/v and gate/up -----------------------------------------------------------------------------

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


@pytest.mark.slow
def test_checkpoint_written_unstacked_resumes_stacked(tmp_path):
    """Stacking changes no parameter: a checkpoint of a run without it resumes with it, on the same losses."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    sets = [*TINY, f"data.path={corpus}", "training.steps=6", "checkpoint.every=3",
            "training.stack_projections=false"]
    full = tmp_path / "full"
    run_train(full, *sets)
    record = {r["step"]: r for r in read_metrics(full)}
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    shutil.rmtree(cut / "export")
    (cut / "metrics.jsonl").write_text("")
    run_train(cut, *sets[:-1], "training.stack_projections=true", "checkpoint.resume=true")
    resumed = read_metrics(cut)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for r in resumed:
        assert r["loss"] == pytest.approx(record[r["step"]]["loss"], rel=1e-5)


# -- the chunked loss ----------------------------------------------------------------------------------

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


@pytest.mark.slow  # compiling the blocks and the loss takes ~30-60 s here
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU backend needs a C++ compiler (g++)")
def test_compiled_loss_equals_eager(monkeypatch):
    """training.compile compiles the chunked loss too; loss and gradients stay the eager ones."""
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 97 * 10)  # 4 chunks, the last short
    calls = []
    compiled_loss = loss_module.compiled_linear_cross_entropy()
    monkeypatch.setattr(decoder_module, "compiled_linear_cross_entropy",
                        lambda: calls.append(1) or compiled_loss)
    torch.manual_seed(0)
    eager = build_model(model_args("debug", vocab_size=97, max_seq_len=16))
    cfg = Config()
    cfg.training.compile = True
    compiled = parallelize(copy.deepcopy(eager), ParallelDims(1, 1, 1, 1, 1), None, cfg)
    tokens, targets = torch.randint(0, 97, (2, 2, 16))
    targets[0, :3] = -100
    losses = [model(tokens, targets=targets) for model in (eager, compiled)]
    for loss in losses:
        loss.mul(0.5).backward()
    assert calls  # the compiled model's loss went through torch.compile
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_bf16_parameters_train_one_process_close_to_fp32(tmp_path):
    """training.param_dtype=bfloat16 wraps even one process in FSDP (bf16 compute, fp32 master weights)."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    sets = [*TINY, f"data.path={corpus}", "training.steps=4"]
    run_train(tmp_path / "fp32", *sets)
    run_train(tmp_path / "bf16", *sets, "training.param_dtype=bfloat16")
    fp32, bf16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "bf16")
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=2e-2)
    assert bf16[0]["loss"] != fp32[0]["loss"]  # computed in bf16 indeed
    assert "bf16" in bf16[0]["peak_source"] or "datasheet" in bf16[0]["peak_source"]
