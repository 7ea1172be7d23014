"""Quantization: each quantized linear against its float version within the error its rounding allows,
quantize -> save -> load giving bitwise the same outputs as quantizing at load, the bad-input lines, and
quantized models served through the engine (a real SmolLM2 among them) and by a Ray Serve replica's backend.
(Sharded over two processes: integration/test_tensor_parallel_serving.py.)"""

from __future__ import annotations

import json
import pickle
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from infer_helpers import quantizable_decoder, train_tokenizer
from scalenlp.cli import main
from scalenlp.compress import quantized
from scalenlp.compress.quantized import (
    INT4_NATIVE,
    INT8_NATIVE,
    METHODS,
    QUANTIZATION,
    Int4Linear,
    Int8DynamicLinear,
    Int8Linear,
    Quantization,
    QuantizedLinear,
    empty_linear,
    int4_from_gguf,
    quantize_weight,
    unpack_int4,
)
from scalenlp.engine.config import METHOD_CHOICES, EngineConfig
from scalenlp.engine.llm import LLM
from scalenlp.engine.packing import PackedInt8Linear, pack_linears
from scalenlp.engine.sampling import SamplingParams
from scalenlp.loader import instantiate, load, read
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.io import save_pretrained
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.limits import ServeLimits

torch.set_num_threads(1)
U_BF16 = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, round to nearest
U_FP32 = 2.0 ** -24
ATEN_INT4, ATEN_INT8 = "aten._weight_int4pack_mm_for_cpu", "aten._weight_int8pack_mm"


@pytest.fixture(params=["scalenlp", "aten"])
def native(request, monkeypatch) -> bool:
    """Runs the test on scalenlp's int4 and int8 CPU kernels and on PyTorch's; whether scalenlp's run."""
    if request.param == "aten":
        monkeypatch.setattr(quantized.lowbit_kernels_available, "built", False)
        return False
    if not quantized.lowbit_kernels_available():
        pytest.skip("scalenlp's int4 and int8 kernels need an x86 CPU with AVX2 and a C++ compiler")
    return True


def active_kernels() -> tuple[str, str]:
    """The (int4, int8) kernels a CPU model gets here."""
    return (INT4_NATIVE, INT8_NATIVE) if quantized.lowbit_kernels_available() else (ATEN_INT4, ATEN_INT8)


def block_steps(x: torch.Tensor) -> torch.Tensor:
    """scalenlp's kernels' activation rounding step for each element of ``x``: a 128th of max |x| / 127 over its
    block of 32 inputs (two int8 parts)."""
    steps = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / (127 * 128)
    return steps.expand(*x.shape[:-1], -1, 32).flatten(-2)


def quantized_copy(linear: nn.Linear, spec: Quantization) -> QuantizedLinear:
    """``linear`` quantized through the same path the loader takes: stored tensors, an empty module, assign."""
    module = empty_linear(spec, linear)
    state = quantize_weight(spec, linear.weight.detach())
    if linear.bias is not None:
        state["bias"] = linear.bias.detach()
    module.load_state_dict(state, assign=True)
    module.prepare()
    return module


def dequantized(module: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight the module multiplies by, float32; each weight's rounding step)."""
    if isinstance(module, Int4Linear):
        g = module.group_size
        scales, zeros = module.scales_and_zeros.float().transpose(0, 1).unbind(-1)
        # The state's weight, rebuilt from the kernel's layout (memory holds that one alone).
        q = unpack_int4(module.state_dict()["weight"]).view(module.out_features, -1, g).float()
        w = ((q - 8) * scales[..., None] + zeros[..., None]).view(module.out_features, -1)
        return w, scales.repeat_interleave(g, dim=1)
    scales = module.scales.float()
    return module.weight.float() * scales[:, None], scales[:, None].expand(-1, module.in_features)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """infer_helpers.quantizable_decoder, tied: read, never written."""
    return quantizable_decoder(tmp_path_factory.mktemp("decoder"))


def activation_steps(x: torch.Tensor, spec: Quantization) -> torch.Tensor:
    """int8dyn's activation rounding step for each token of ``x``: symmetric per token (max |x| over 127), or for
    a single token on CPU, fbgemm's asymmetric 7-bit range (max - min, zero included, over 127 levels)."""
    if x.numel() == x.shape[-1]:
        return (x.max().clamp(min=0) - x.min().clamp(max=0)) / 127
    return x.abs().amax(dim=-1, keepdim=True) / 127


@pytest.mark.parametrize("spec", [Quantization("int8"), Quantization("int4", 32), Quantization("int4", 64),
                                  Quantization("int4", 128), Quantization("int8dyn")], ids=lambda s: s.describe())
def test_each_quantized_linear_is_within_its_rounding_bound(spec, native):
    """Bounds, element by element. int8 rounds to the nearest step, leaving each weight within half a step of the
    original (the test checks that first: it is what the stored scales promise); int4 picks each group's grid by
    its squared error, which must then be no larger than the plain min/max grid's. Then, for y = x W^T and the
    weights' rounding e = W - W_q:
    - weight-only: |y - y_q| <= sum_k |x_k e_k| plus bf16 roundings relative to
      sum_k |x_k w_k|: the activations cast to bf16, the weights dequantized in bf16, the output rounded to
      bf16 (3 u), and float32 accumulation (K u_fp32);
    - int8dyn: also the activations' own rounding, half their step times sum_k |w_k|; products are exact in
      int32, the rescale is float32. scalenlp's int4 and int8 kernels likewise, their step per block of 32 inputs,
      and no bf16 roundings (they take float32 activations and dequantize in float32).
    Checked on a batch of tokens and on one token (a decode step, which int8dyn sends to another kernel). int4 and
    int8 on both CPU kernels (the fixture); int8dyn has PyTorch's alone."""
    if spec.method == "int8dyn" and native:
        pytest.skip("int8dyn runs PyTorch's kernels whichever the weight-only ones are: checked once")
    torch.manual_seed(0)
    K, N = 512, 192
    linear = nn.Linear(K, N, bias=True)
    nn.init.normal_(linear.weight, std=0.05)
    module = quantized_copy(linear, spec)
    w_q, step = dequantized(module)
    w = linear.weight.detach()
    rounding = (w - w_q).abs()
    if spec.method == "int4":
        groups = w.view(N, -1, spec.group_size)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low) / 15
        min_max = (torch.round((groups - low) / scale) * scale + low - groups).square().sum(-1)
        assert (rounding.square().view(N, -1, spec.group_size).sum(-1) <= min_max * (1 + 2 ** -6)).all()
    else:
        assert (rounding <= step / 2 * (1 + 1e-6)).all()

    for x in (torch.randn(4, 3, K), torch.randn(1, 1, K)):
        y, y_q = linear(x).detach(), module(x)
        assert y_q.shape == y.shape and y_q.dtype == x.dtype
        magnitude = x.abs() @ w_q.abs().T
        assert (module.kernel in (INT4_NATIVE, INT8_NATIVE)) is native or spec.method == "int8dyn"
        bf16 = 0 if spec.method == "int8dyn" or native else 3 * U_BF16
        bound = x.abs() @ rounding.T + (K * U_FP32 + bf16) * magnitude
        variance = (x ** 2) @ (rounding ** 2).T
        if spec.method == "int8dyn":
            x_step = activation_steps(x, spec)
            bound = bound + x_step / 2 * w_q.abs().sum(dim=1) + 4 * U_FP32 * magnitude
            variance = variance + x_step ** 2 / 12 * w_q.square().sum(dim=1)
        elif native:
            x_step = block_steps(x)
            bound = bound + (x_step / 2) @ w_q.abs().T + 4 * U_FP32 * magnitude
            variance = variance + (x_step ** 2 / 12) @ w_q.square().T
        error = (y - y_q).abs()
        assert (error <= bound).all(), f"worst excess {(error - bound).max():.3g}"
        if x.shape[0] > 1:
            # The worst case adds every rounding with the same sign; over random inputs the weights' roundings
            # add up to a root-mean-square error of sqrt(sum_k x_k^2 e_k^2) per output (plus the activations'
            # share for int8dyn, uniform within half their step). The measured error has that size: the kernels
            # add no rounding of their own beyond the stored weights'.
            ratio = (error.square().mean() / variance.mean()).sqrt()
            assert 0.9 < ratio < 1.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scalenlp_kernels_are_the_exact_products_of_their_roundings(dtype, native):
    """scalenlp's int4 and int8 kernels against their own arithmetic redone in float64: activations rounded per
    block of 32 to (d / 128)(128 q1 + q2), q1 = round(x / d), d = max |x| / 127, q2 the remainder's 128ths; weights
    dequantized in float32 from their bf16 scales (and zeros). Equal up to float32 sums, for every int4 group size,
    output counts that are not a multiple of the kernels' 4-row tile, one and many rows (threads split rows), a
    block of zeros."""
    if not native:
        pytest.skip("PyTorch's kernels round otherwise: test_each_quantized_linear_is_within_its_rounding_bound")
    torch.manual_seed(0)
    cases = [(Quantization("int4", 32), (37, 96), 1), (Quantization("int4", 64), (64, 128), 5),
             (Quantization("int4", 128), (130, 256), 33), (Quantization("int8"), (37, 96), 1),
             (Quantization("int8"), (66, 256), 33)]
    for spec, (N, K), M in cases:
        module = quantized_copy(nn.Linear(K, N, bias=False), spec)
        assert module.kernel == (INT4_NATIVE if spec.method == "int4" else INT8_NATIVE)
        w_q, _ = dequantized(module)
        x = torch.randn(M, K).to(dtype)
        x[0, :32] = 0
        blocks = x.float().unflatten(-1, (-1, 32))
        inv = torch.where(blocks.abs().amax(-1, keepdim=True) > 0, 127 / blocks.abs().amax(-1, keepdim=True), 0)
        coarse = torch.round(blocks * inv)
        fine = torch.round((blocks * inv - coarse) * 128)
        x_hat = ((128 * coarse + fine) * torch.where(inv > 0, 1 / (inv * 128).double(), 0)).flatten(-2)
        expected = x_hat @ w_q.double().T
        y = module(x)
        assert y.dtype == dtype
        tolerance = (K + 2) * U_FP32 * (x_hat.abs() @ w_q.abs().double().T)
        if dtype == torch.bfloat16:
            tolerance = tolerance + U_BF16 * expected.abs()  # the output, rounded to x's dtype
        assert ((y.double() - expected).abs() <= tolerance).all()


def test_int8_packed_for_cpu_inference_computes_what_the_int8_kernel_does(decoder, capsys, native):
    """The engine's packing fuses int8 projections that share an input (exactly: scales stack with their rows).
    On PyTorch's kernels it runs the output projection on the CPU int4 kernel as two 4-bit halves, whose products
    are the int8 kernel's exactly; only the order of float32 sums differs, so the two bf16 outputs differ by at
    most a rounding of each. Where scalenlp's int8 kernel runs (faster than the halves), nothing is split."""
    torch.manual_seed(0)
    K = 576  # SmolLM2's width: the halves' scales come per group of 64 inputs
    parts = [quantized_copy(nn.Linear(K, n), Quantization("int8")) for n in (576, 192, 192)]
    fused = Int8Linear.stacked(parts)
    for x in (torch.randn(4, 3, K), torch.randn(1, 1, K)):
        y = fused(x)
        assert torch.equal(y, torch.cat([p(x) for p in parts], dim=-1))
        if not native:
            magnitude = x.abs() @ dequantized(fused)[0].abs().T
            assert ((PackedInt8Linear(fused)(x) - y).abs() <= 2 * U_BF16 * y.abs() + 2 * K * U_FP32 * magnitude).all()

    model = instantiate(read(decoder), dtype=torch.bfloat16, quantize=Quantization("int8"))
    tokens = torch.randint(0, 320, (2, 9))
    expected = model(tokens).float()
    pack_linears(model)
    for block in model.layers.values():  # q/k/v and gate/up fused, still on the int8 kernel
        assert type(block.attention.wqkv) is Int8Linear and type(block.feed_forward.w13) is Int8Linear
    halves = sum(isinstance(m, PackedInt8Linear) for m in model.modules())
    if native:
        assert halves == 0 and model.output.kernel == INT8_NATIVE
    else:
        assert halves == 1 and isinstance(model.output, PackedInt8Linear)  # the output projection alone
        assert "int8 output projection packed for CPU inference" in capsys.readouterr().err
    assert (model(tokens).float() - expected).abs().max() < 0.02 * expected.abs().max()


def test_int4_projections_fuse_on_scalenlps_kernel_alone(decoder, native):
    """Packing fuses int4 q/k/v and gate/up where they run on scalenlp's kernel (the stored layout stacks with its
    scales and zeros: the same logits, bit for bit); on PyTorch's kernel, whose layout does not stack, it leaves
    them as they are."""
    model = instantiate(read(decoder), dtype=torch.float32, quantize=Quantization("int4", 32))
    tokens = torch.randint(0, 320, (2, 9))
    expected = model(tokens)
    pack_linears(model)
    for block in model.layers.values():
        assert (block.attention.wqkv is not None) is native and (block.feed_forward.w13 is not None) is native
    if native:
        assert torch.equal(model(tokens), expected)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_map_onto_int4_without_rounding_their_codes(kind, native):
    """A GGUF Q4_0/Q4_1 weight taken as it is: the codes the module multiplies by, with the file's own d and m
    in float32, give gguf's dequantized weight bit for bit; the kernel's weight differs only by d and m + 8d
    rounded to bf16; and the outputs stay within those roundings plus the kernel's own: PyTorch's bf16 arithmetic,
    or scalenlp's int8 activations."""
    rng = np.random.default_rng(0)
    K, N = 256, 64
    w = (rng.standard_normal((N, K)) * 0.05 + 0.01).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    w_file = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    head = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(N, K // 32, head + 16)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if kind == "Q4_1" else None

    module = empty_linear(Quantization("int4", 32), nn.Linear(K, N, bias=False))
    weight, scales_and_zeros = int4_from_gguf(kind, torch.from_numpy(raw))
    module.load_state_dict({"weight": weight, "scales_and_zeros": scales_and_zeros}, assign=True)
    assert module.prepare() == (INT4_NATIVE if native else ATEN_INT4)
    q = unpack_int4(module.state_dict()["weight"]).view(N, K // 32, 32).float()
    exact = d[..., None] * q + m[..., None] if kind == "Q4_1" else d[..., None] * (q - 8)
    assert torch.equal(exact.view(N, K), w_file)

    w_q, _ = dequantized(module)
    zeros = (m + 8 * d).abs() if kind == "Q4_1" else 0  # Q4_0's zero is exact
    step = ((8 * d.abs() + zeros) * U_BF16).repeat_interleave(32, dim=1)  # |q - 8| <= 8 times d's rounding
    assert ((w_q - w_file).abs() <= step).all()
    x = torch.randn(5, K)
    error = (module(x) - x @ w_file.T).abs()
    if native:
        bound = x.abs() @ step.T + (block_steps(x) / 2) @ w_q.abs().T + (K + 4) * U_FP32 * (x.abs() @ w_q.abs().T)
    else:
        bound = x.abs() @ step.T + (K * U_FP32 + 3 * U_BF16) * (x.abs() @ w_q.abs().T)
    assert (error <= bound).all(), f"worst excess {(error - bound).max():.3g}"


def test_a_gguf_models_q4_blocks_are_taken_as_they_are_at_load(tmp_path, capsys):
    """Through the loader: a Llama whose linears are Q4_1 blocks runs int4 group 32 on the file's codes, so its
    logits stay as close to the dequantized model as bf16 allows; group 64 rounds the dequantized weights again.
    The load line says which was done and why (a Q8_0 output projection under int8: its block scales do not fit)."""
    pre = read(quantizable_decoder(tmp_path, tie=False))

    def as_gguf(key: str, kind) -> None:
        raw = gguf.quants.quantize(pre.state[key].numpy(), kind)
        pre.state[key] = torch.from_numpy(gguf.quants.dequantize(raw, kind))
        pre.blocks[key] = (kind.name, torch.from_numpy(raw))

    for key, w in pre.state.items():
        if w.ndim == 2 and key != "tok_embeddings.weight":
            as_gguf(key, gguf.GGMLQuantizationType.Q4_1)
    tokens = torch.randint(0, 320, (2, 16))
    reference = instantiate(pre, dtype=torch.float32)
    expected = reference(tokens)
    errors = {}
    for group in (32, 64):
        model = instantiate(pre, dtype=torch.float32, quantize=Quantization("int4", group))
        # int4 keeps the output projection int8, and the embedding table is int8: their rounding would hide the
        # blocks' own.
        model.output, model.tok_embeddings = reference.output, reference.tok_embeddings
        errors[group] = (model(tokens) - expected).abs().max() / expected.abs().max()
    assert errors[32] < errors[64] / 4
    as_gguf("output.weight", gguf.GGMLQuantizationType.Q8_0)
    instantiate(pre, dtype=torch.float32, quantize=Quantization("int8"))
    err = capsys.readouterr().err.splitlines()
    int8_output = "1 Q4_1 linears dequantized and rounded to int8 again (int8 has no layout of their own)"
    assert err[0] == f"int4 (group 32) from GGUF: 14 linears take the file's Q4_1 blocks as they are; {int8_output}"
    int4, int8 = active_kernels()
    assert err[1] == f"int4 (group 32): {int4} on 14 linears, {int8} on 1 linears"
    assert err[2] == ("int4 (group 64) from GGUF: 14 Q4_1 linears dequantized and rounded to int4 (group 64) again "
                      f"(--group-size 32 would take them as they are); {int8_output}")
    assert err[4] == ("int8 from GGUF: 14 Q4_1 linears dequantized and rounded to int8 again (int8 has no layout of "
                      "their own); 1 Q8_0 linears dequantized and rounded to int8 again (int8 keeps one scale per "
                      "output channel, and Q8_0's scale per 32 inputs does not fit it)")


def tiny_classifier(root):
    """A random BERT classifier with a pooler (whose input is a strided view); its 3-class head fits no tile of
    PyTorch's int4 kernels."""
    torch.manual_seed(0)
    model = Encoder(EncoderArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64,
                                task="classification", labels=["a", "b", "c"], pooler=True))
    return save_pretrained(model, root / "export", train_tokenizer(root / "tok.json"))


@pytest.mark.parametrize("method", ["int8", "int4", "int8dyn"])
def test_quantize_save_load_round_trips_bitwise(tmp_path, decoder, method, capsys):
    export = decoder
    assert main(["quantize", "--checkpoint", str(export), "--method", method, "--group-size", "32",
                 "--out", str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / QUANTIZATION).read_text())["method"] == method
    spec = Quantization(method, 32 if method == "int4" else None)
    at_load = instantiate(read(export), dtype=torch.float32, quantize=spec)
    saved, pre = load(tmp_path / "q", dtype=torch.float32)
    assert pre.quantization == spec
    tokens = torch.randint(0, 320, (2, 9))
    assert torch.equal(at_load(tokens), saved(tokens))
    # The tied projection is quantized on its own, in int8 under int4 too.
    assert type(saved.output) is (Int8DynamicLinear if method == "int8dyn" else Int8Linear)
    # The embedding table is stored once, as that int8 projection, and looked up there.
    assert saved.tok_embeddings.weight is saved.output.weight
    assert not any(k.startswith("tok_embeddings.") for k in load_file(tmp_path / "q" / "model.safetensors"))
    assert sum(isinstance(m, QuantizedLinear) for m in saved.modules()) == 2 * 7 + 1
    kernels = f"on 14 linears, {active_kernels()[1]} on 1 linears" if method == "int4" else "on 15 linears"
    assert kernels in capsys.readouterr().err  # the line saying which kernel runs


def test_an_export_with_a_floating_embedding_table_loads_as_a_new_one(tmp_path):
    """Quantized exports written before embeddings were quantized hold the float table: untied, it is rounded at
    load to what a new export stores; tied, the output projection's int8 copy is used as a new export does."""
    for tie in (False, True):
        (tmp_path / str(tie)).mkdir()
        export = quantizable_decoder(tmp_path / str(tie), tie=tie)
        assert main(["quantize", "--checkpoint", str(export), "--method", "int8", "--out", str(tmp_path / "q")]) == 0
        new, _ = load(tmp_path / "q", dtype=torch.float32)
        weights = tmp_path / "q" / "model.safetensors"
        state = load_file(weights)
        assert ("tok_embeddings.scales" in state) is not tie  # untied: the table in int8, with a scale per row
        state["tok_embeddings.weight"] = read(export).state["tok_embeddings.weight"]
        state.pop("tok_embeddings.scales", None)
        save_file(state, weights)
        old, _ = load(tmp_path / "q", dtype=torch.float32)
        tokens = torch.randint(0, 320, (2, 9))
        assert torch.equal(old(tokens), new(tokens))
        shutil.rmtree(tmp_path / "q")


def test_an_encoder_quantizes_and_a_head_no_kernel_tiles_falls_back(tmp_path, capsys, native):
    """The 3-class head: scalenlp's int4 kernel takes any number of outputs; without it, the head falls back to
    dequantizing its weight."""
    export = tiny_classifier(tmp_path)
    float_model, _ = load(export, dtype=torch.float32)
    model, _ = load(export, dtype=torch.float32, quantize=Quantization("int4", 64))
    head = INT4_NATIVE if native else "dequantize-then-matmul"
    assert type(model.classifier) is Int4Linear and model.classifier.kernel == head
    assert f"{head} on {14 if native else 1} linears" in capsys.readouterr().err
    ids = torch.randint(5, 320, (3, 12))
    p, p_q = (m(ids, torch.ones_like(ids)).softmax(-1) for m in (float_model, model))
    assert (p - p_q).abs().max() < 0.05
    assert main(["classify", "--checkpoint", str(export), "--quantize", "int8", "--text", "hello"]) == 0
    assert f"int8: {INT8_NATIVE if native else ATEN_INT8} on" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--method", "int4", "--group-size", "128"], "--group-size 128 does not divide the input width 64 of "
                                                  "layers.0.attention.wq; use 32 or 64 for this model"),
    (["--method", "int4", "--group-size", "48"], "--group-size 48 is not one of 32, 64, 128"),
])
def test_quantize_bad_input_is_one_line(tmp_path, decoder, capsys, argv, says):
    export = decoder
    assert main(["quantize", "--checkpoint", str(export), "--out", str(tmp_path / "q"), *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {says}\n"


def test_a_quantized_checkpoint_is_not_quantized_again_exported_or_trained(tmp_path, decoder, capsys):
    export = decoder
    q = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(export), "--method", "int8", "--out", str(q)]) == 0
    capsys.readouterr()
    cases = [
        (["quantize", "--checkpoint", str(q), "--method", "int4", "--out", str(tmp_path / "q2")],
         f"{q} is already quantized (int8); quantize its floating-point original"),
        (["generate", "--checkpoint", str(q), "--quantize", "int4", "--prompt", "hi"],
         f"{q} is already quantized (int8); load it without --quantize, or quantize its floating-point original"),
        (["generate", "--checkpoint", str(export), "--tp", "2", "--quantize", "int4", "--prompt", "hi"],
         "--tp 2 leaves each rank 32 of the 64 inputs of the attention output projection, which --group-size 64 "
         "does not divide; use a smaller group size, fewer ranks, or int8"),
        (["export", "--checkpoint", str(q), "--format", "hf", "--out", str(tmp_path / "hf")],
         f"{q} is quantized (int8); export its floating-point original"),
        (["train", "--run-dir", str(tmp_path / "run"), "--set", f"model.init={q}", "--set", "training.steps=1"],
         f"model.init={q} is quantized (int8); fine-tune its floating-point original, then quantize the result"),
    ]
    for argv, says in cases:
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"error: {says}"


def test_eval_quantized_close_to_float(tmp_path, decoder, capsys):
    export = decoder
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    figures = {}
    for extra in ([], ["--quantize", "int8"]):
        assert main(["eval", "--checkpoint", str(export), "--data", str(text), "--seq", "64", "--json", *extra]) == 0
        figures[bool(extra)] = json.loads(capsys.readouterr().out)["perplexity"]
    assert figures[True] == pytest.approx(figures[False], rel=0.01)


def test_cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("GPU missing: the CUDA kernels (tinygemm int4, int8 weight-only, _int_mm) need one")
    torch.manual_seed(0)
    linear = nn.Linear(512, 256).cuda()
    x = torch.randn(5, 512, device="cuda")
    for spec, kernel in [(Quantization("int8"), "aten._weight_int8pack_mm"),
                         (Quantization("int4", 64), "aten._weight_int4pack_mm"),
                         (Quantization("int8dyn"), "torch._int_mm")]:
        module = quantized_copy(linear, spec)
        assert module.kernel == kernel
        assert (module(x) - linear(x)).abs().max() < 0.05 * linear(x).abs().max()


QUESTIONS = {"What is the capital of France?": "Paris", "What is the capital of Germany?": "Berlin",
             "Who wrote Hamlet?": "Shakespeare", "What is 2+2?": "4"}


@pytest.mark.slow  # loads and quantizes a 135M-parameter model
# int4 at group 32 takes the packaged file's own Q4_1 codes; group 64 rounds those 4-bit weights again (+20%
# perplexity on WikiText-2). Greedy answers near a tie flip with rounding details: on this file, with int4 on
# scalenlp's kernel (WikiText-2 perplexity 19.02, against 19.03 on PyTorch's), France's capital comes out as
# llama.cpp answers it on the same file, wrongly. So one answer of the four may be wrong.
@pytest.mark.parametrize("method, group_size", [("int8", 64), ("int4", 32)])
def test_quantized_smollm2_answers_through_the_engine(method, group_size):
    with LLM(packaged_model("smollm2"), quantize=method, group_size=group_size, max_batch=4) as llm:
        # The engine's packing runs an int8 output projection as two 4-bit halves (PackedInt8Linear).
        assert isinstance(llm.engine.model.output, (Int8Linear, Int4Linear, Int8DynamicLinear, PackedInt8Linear))
        answers = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                           SamplingParams(max_tokens=16, temperature=0))
    assert sum(expected in a for expected, a in zip(QUESTIONS.values(), answers)) >= 3, answers


def test_the_command_lists_the_methods_the_models_module_has():
    assert METHOD_CHOICES == METHODS


def test_a_quantized_replica_answers_as_the_local_engine(decoder):
    """`serve --replicas` with --quantize: the config a Ray Serve replica receives (pickled) builds its backend, the
    replica's own, quantized at load, and it answers as a local engine does. Built here, in this process: Ray itself
    runs replicas in integration/test_ray_serve.py (float) and test_ray_serve_encoders.py."""
    from scalenlp.serving.cluster import EngineReplica

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(decoder, dtype="float32", quantize="int4", group_size=32) as llm:
        expected = llm.generate(["the quick brown fox"], params)
    config = EngineConfig(decoder, dtype="float32", device="cpu", max_batch=2, quantize="int4", group_size=32)
    backend = EngineReplica.local_backend(pickle.loads(pickle.dumps(config)), ServeLimits(), "m")
    try:
        # 7 a block, or 4 where q/k/v and gate/up fuse (on scalenlp's kernel)
        fused = active_kernels()[0] == INT4_NATIVE
        assert sum(isinstance(m, Int4Linear) for m in backend.engine.model.modules()) == 2 * (4 if fused else 7)
        assert backend.engine.generate(["the quick brown fox"], params) == expected
    finally:
        backend.engine.stop()
