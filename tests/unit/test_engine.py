"""Engine: KV cache against a no-cache forward, continuous batching against one-at-a-time,
seeds, stop strings, sampling settings, queue bound."""

import gc
import sys
import threading
from pathlib import Path

import pytest
import torch

from infer_helpers import make_export, quantizable_decoder, run_request
from scalenlp.compress.prune import prune
from scalenlp.compress.quantized import Quantization, build_quantized, quantization_of
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine import packing
from scalenlp.engine.decoder_engine import Engine, QueueFull, RequestError
from scalenlp.engine.packing import PackedLinear, PanelLinear, can_pack, pack_linears, packed, packed_linear_by_number
from scalenlp.engine.sampling import SamplingBatch, SamplingParams, sample, uniform_from
from scalenlp.errors import UserError
from scalenlp.loader import instantiate, read
from scalenlp.models.io import load_pretrained, save_pretrained

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["debug", "debug-gpt2"])
def export(request, tmp_path_factory):
    """The session's tiny export (a Llama), and a GPT-2 (biases, learned positions) built alike; read, never written."""
    if request.param == "debug":
        return request.getfixturevalue("tiny_export")
    return make_export(tmp_path_factory.mktemp(request.param), request.param)


def start_engine(export, dtype=torch.float32, **kw):
    tok = load_tokenizer(export)
    return Engine(load_pretrained(export, dtype=dtype), tok, eos_id=find_eos_token_id(tok), **kw).start()


@pytest.fixture
def engine(export):
    e = start_engine(export, max_batch=4)
    yield e
    e.stop()


def ids_of(engine, prompts, params):
    """Generated token ids per prompt, submitted together (one continuous batch)."""
    outs = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def cb(i):
        def f(d):
            outs[i].extend(d.token_ids)
            if d.finish_reason:
                done[i].set()
        return f

    engine.submit_many([(engine.encode(p), params) for p in prompts], [cb(i) for i in range(len(prompts))])
    for d in done:
        assert d.wait(120)
    return outs


def test_kv_cache_greedy_matches_no_cache_forward(engine, export):
    model = load_pretrained(export)  # a separate copy without a cache: full causal forward each token
    prompt = "the quick brown"
    tokens = engine.encode(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            logits = model(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
    assert ids_of(engine, [prompt], GREEDY)[0] == tokens[len(engine.encode(prompt)):]


def test_continuous_batching_matches_one_at_a_time(engine):
    prompts = ["hello", "the quick brown fox jumps", "a model that is trained on", "continuous", "x y z",
               "hello world, this is"]
    alone = [ids_of(engine, [p], GREEDY)[0] for p in prompts]
    # Six requests on four slots with different lengths and max_tokens: rows join and leave mid-run.
    together = ids_of(engine, prompts, GREEDY)
    assert together == alone
    mixed = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 12, 7, 12, 1, 9)]
    outs = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    engine.submit_many([(engine.encode(p), m) for p, m in zip(prompts, mixed)],
                       [lambda d, i=i: (outs[i].extend(d.token_ids), d.finish_reason and done[i].set())
                        for i in range(len(prompts))])
    for d in done:
        assert d.wait(120)
    assert outs == [a[:m.max_tokens] for a, m in zip(alone, mixed)]


def test_seed_reproduces_and_differs(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = ids_of(engine, ["the quick", "hello", "the quick"], params)
    b = ids_of(engine, ["the quick"], params)
    assert a[0] == a[2] == b[0]  # same seed, same tokens, whatever shares the batch
    other = ids_of(engine, ["the quick"], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0] != a[0]


def test_stop_string_truncates(engine):
    prompt = "the quick brown fox"
    full = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1, seed=1, ignore_eos=True))[0]
    # A 3-character stop string whose first occurrence is past the start of the text.
    at = next(i for i in range(2, len(full) - 3) if full.find(full[i:i + 3]) == i)
    stop = full[at:at + 3]
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1, seed=1, stop=["\x00never", stop],
                                                   ignore_eos=True))[0]
    assert out == full[:at]


def test_max_tokens_and_context_checks(engine):
    with pytest.raises(RequestError, match="maximum context length"):
        engine.submit(engine.encode("hello"), SamplingParams(max_tokens=1000), lambda d: None)
    with pytest.raises(RequestError, match="temperature"):
        engine.submit(engine.encode("hello"), SamplingParams(temperature=-1), lambda d: None)
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], SamplingParams(), lambda d: None)


def test_queue_bound(export):
    e = start_engine(export, max_batch=1, max_queue=2)
    try:
        long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        with pytest.raises(QueueFull):
            e.submit_many([(e.encode("hi"), long)] * 3, [lambda d: None] * 3)
        assert e.num_waiting == 0  # all or none
    finally:
        e.stop()


def test_logprobs_are_log_softmax(engine, export):
    model = load_pretrained(export)
    deltas = []
    done = threading.Event()
    engine.submit(engine.encode("hello"), SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                  lambda d: (deltas.append(d), d.finish_reason and done.set()))
    assert done.wait(60)
    with torch.no_grad():
        expected = model(torch.tensor([engine.encode("hello")]))[0, -1].log_softmax(-1)
    assert deltas[0].logprobs[0] == pytest.approx(expected.max().item(), abs=1e-4)
    assert len(deltas[0].top_logprobs[0]) == 3


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0]] * 4000)
    steps = torch.arange(4000)
    base = dict(temperature=torch.ones(4000), seed=torch.full((4000,), 3), step=steps, logprobs=-1, any_sampled=True)
    top1 = sample(logits, SamplingBatch(top_k=torch.ones(4000, dtype=torch.long), top_p=torch.ones(4000),
                                        any_truncated=True, **base))[0]
    assert set(top1.tolist()) == {0}
    top2 = sample(logits, SamplingBatch(top_k=torch.full((4000,), 2), top_p=torch.ones(4000), any_truncated=True,
                                        **base))[0]
    assert set(top2.tolist()) == {0, 1}
    nucleus = sample(logits, SamplingBatch(top_k=torch.zeros(4000, dtype=torch.long), top_p=torch.full((4000,), 0.5),
                                           any_truncated=True, **base))[0]
    assert set(nucleus.tolist()) == {0}  # token 0 alone holds ~0.7 of the mass
    free = sample(logits, SamplingBatch(top_k=torch.zeros(4000, dtype=torch.long), top_p=torch.ones(4000),
                                        any_truncated=False, **base))[0]
    share = (free == 0).float().mean().item()
    assert abs(share - logits[0].softmax(-1)[0].item()) < 0.03  # the draw follows the distribution


def test_counter_based_uniforms_are_uniform():
    u = uniform_from(torch.full((20000,), 11), torch.arange(20000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.histc(u.float(), bins=10, min=0, max=1).min() > 1800


@pytest.mark.slow  # Inductor compiles the decode step: 25-35 s here for the first dtype, 6-8 s for the second
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_step_matches_eager(tiny_export, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the compiled step's cache file: not the user's folder
    export = tiny_export
    # A prompt of 40 tokens holds 3 blocks, the others 1: block tables of widths 1 to 4 as the outputs grow.
    prompts = ["hello", "the quick brown", "a", "the quick brown fox jumps over the lazy dog " * 4]
    eager = start_engine(export, max_batch=4, dtype=dtype)  # bf16 on CPU: oneDNN-packed weights
    try:
        expected = [ids_of(eager, [p], GREEDY)[0] for p in prompts]
    finally:
        eager.stop()
    # As in a new process: a graph an earlier test compiled for this model would serve it (Engine._compile_now).
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = start_engine(export, max_batch=4, compile=True, dtype=dtype)
    try:
        assert compiled.compile_seconds > 0  # compiled at start-up, before any request
        alone = ids_of(compiled, prompts[:1], GREEDY)  # batch 1, then 3
        got = alone + ids_of(compiled, prompts[1:], GREEDY)
        encoded = [compiled.encode(p) for p in prompts]
    finally:
        compiled.stop()
    # One graph for every batch size and block-table width (sizes of 1 are not specialised: see compiled_step).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    if dtype == torch.float32:
        assert got == expected
        return
    # In bf16, compiled kernels round differently from eager ones, and a random model's top two logits are
    # sometimes closer than that rounding: greedy paths may part there. What must hold is that every token the
    # compiled step picks is the float32 model's best within the bf16 model's own distance from float32, the
    # tokens before it taken as given (a wrong cache or position would pick tokens far from the best).
    reference, rounded = load_pretrained(export), load_pretrained(export, dtype=torch.bfloat16)
    assert all(got)
    with torch.no_grad():
        for prompt_ids, out in zip(encoded, got):
            seq = torch.tensor([prompt_ids + out[:-1]])
            exact, approx = reference(seq)[0], rounded(seq)[0].float()
            tolerance = (approx - exact).abs().max()
            picked = exact[len(prompt_ids) - 1:]  # the logits each generated token was chosen from
            shortfall = picked.max(-1).values - picked.gather(-1, torch.tensor(out)[:, None])[:, 0]
            assert (shortfall <= 2 * tolerance).all(), (shortfall.max(), tolerance)


@pytest.mark.slow  # Inductor compiles the decode step of each quantized model
@pytest.mark.parametrize("method", ["int4", "int8"])  # int8dyn breaks the graph: refused (test_compile_choice)
def test_compiled_quantized_decode_step_matches_eager(method, tmp_path, monkeypatch):
    """Quantized linears (the int4 kernel, the int8 output projection as 4-bit halves) inside the compiled step
    (``--compile auto`` measures quantized models now): the same greedy tokens as the eager step."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    pre, spec = read(quantizable_decoder(tmp_path / "model")), quantization_of(method, 32)
    prompts = ["hello", "the quick brown", "the quick brown fox jumps over the lazy dog " * 4]
    got = {}
    for compile in (False, True):
        torch._dynamo.reset()
        model = instantiate(pre, quantize=spec)
        with torch.no_grad():
            model.norm.weight.mul_(8.0)  # spread the logits: greedy choices not decided by rounding noise
        engine = Engine(model, pre.tokenizer, max_batch=4, compile=compile).start()
        assert (engine.compile_seconds > 0) == compile
        try:
            got[compile] = [ids_of(engine, [p], GREEDY)[0] for p in prompts[:1]] + ids_of(engine, prompts[1:], GREEDY)
        finally:
            engine.stop()
    assert got[True] == got[False] and all(got[True])


needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU's oneDNN has no bf16 kernels, so the engine does not pack weights here")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5),
                                             pytest.param(torch.bfloat16, 0.02, marks=needs_onednn_bf16)])
@pytest.mark.parametrize("flavor", ["debug-gpt2", "debug"])
def test_fused_and_packed_projections_compute_the_same_logits(tmp_path, flavor, dtype, tolerance):
    export = make_export(tmp_path, flavor, logit_scale=1.0)
    plain, packed = load_pretrained(export, dtype=dtype), load_pretrained(export, dtype=dtype)
    assert pack_linears(packed) > 0
    tokens = torch.randint(0, plain.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = plain(tokens).float(), packed(tokens).float()
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()  # rounding, summed in another order


def test_ending_a_threads_openmp_workers_leaves_parallel_products_right():
    # Engine.start ends the starting thread's OpenMP workers (hardware.release_openmp_workers) so that the loop's
    # own spin; that thread's next parallel region starts new ones, and other threads keep theirs.
    from scalenlp.hardware import release_openmp_workers

    a, b = torch.randn(256, 512), torch.randn(512, 384)
    expected = (a.double() @ b.double()).float()
    close = dict(rtol=1e-4, atol=1e-4)  # float32 sums of 512 products, against float64
    torch.testing.assert_close(a @ b, expected, **close)  # a parallel region: this thread has workers now
    gomp = sys.platform == "linux" and "libgomp" in Path("/proc/self/maps").read_text()
    assert release_openmp_workers() == gomp  # GNU OpenMP (PyTorch's on Linux) is asked; others are left alone
    products = []
    worker = threading.Thread(target=lambda: products.append(a @ b))
    worker.start()
    worker.join()
    for got in products + [a @ b]:
        torch.testing.assert_close(got, expected, **close)


@pytest.mark.slow  # Inductor compiles two 2-layer steps: about 30 s here
def test_compiled_steps_of_two_models_of_one_shape_keep_their_own_weights():
    # compiled_step skips Dynamo's guards on the model's modules, parameters included: sound only because each
    # step is a function of its own model. Two models of one class and shapes with different weights, and one
    # with a layer fewer, compiled in one process: each step must give its own model's logits.
    from scalenlp.engine.compile_choice import _step_inputs
    from scalenlp.engine.decoder_engine import compiled_step
    from scalenlp.models.flavors import build_model, model_args

    block, inputs = 16, _step_inputs(2, 16)
    models = []
    for seed, layers in ((0, 2), (1, 2), (2, 1)):
        torch.manual_seed(seed)
        model = build_model(model_args("debug", vocab_size=320, n_layers=layers)).eval()
        model.setup_kv_cache(2 * 4 + 1, block, torch.float32)
        models.append(model)
    with torch.no_grad():
        expected = [model(*inputs) for model in models]
        steps = [compiled_step(model) for model in models]
        got = [step(*inputs) for step in steps] + [steps[0](*inputs)]
    assert not torch.allclose(expected[0], expected[1])
    for out, want in zip(got, expected + expected[:1]):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_a_compiled_step_finds_each_packed_weight_by_its_number(dtype, native, monkeypatch):
    """Under torch.compile a packed linear is an opaque operator given its weight's number (engine/packing.py), found
    in C++ (packed_linear.cpp) or, where that does not build, in Python: it computes the eager forward's product,
    and the number of a layer dropped is forgotten with it."""
    if native and not packing.native_lookup():
        pytest.skip("packed_linear.cpp did not build here (a warning said why)")
    monkeypatch.setattr(packing.native_lookup, "built", native)
    by_number = torch.ops.scalenlp_packed.linear if native else packed_linear_by_number
    packed = PackedLinear(torch.nn.Linear(64, 48).to(dtype))
    other = PackedLinear(torch.nn.Linear(64, 48).to(dtype))
    x = torch.randn(3, 64, dtype=dtype)
    assert torch.equal(by_number(x, packed.number, packed.bias, 48), packed(x))
    assert not torch.equal(packed(x), other(x))
    number = packed.number
    del packed
    gc.collect()
    if native:
        with pytest.raises(RuntimeError, match=f"no weight is kept under number {int(number)}"):
            by_number(x, number, None, 48)
    else:
        assert int(number) not in packing._PACKED
    assert torch.equal(by_number(x, other.number, other.bias, 48), other(x))


needs_panels = pytest.mark.skipif(not packing.panel_kernel(), reason="panel_linear.cpp needs an x86 CPU with AVX2 and "
                                  "FMA, and a compiler (a warning said why it did not build)")


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])  # the one-row path, each block of 1-6 rows, several blocks
@pytest.mark.parametrize(("n_in", "n_out", "bias"), [(64, 48, True), (70, 50, False), (33, 17, True), (576, 960, False)])
def test_panel_products_equal_the_exact_ones(n_in, n_out, bias, rows):
    """scalenlp's float32 product on weights in panels of 16 output rows (panel_linear.cpp): the float64 product
    to float32 rounding, for outputs that fill the last panel or not, odd inputs, with a bias and without."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(n_in, n_out, bias=bias)
    layer = packed(linear)
    assert type(layer) is PanelLinear and layer.panels.shape == (-(-n_out // 16), n_in, 16)
    x = torch.randn(2, rows, n_in)
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double() if bias else None)
    got = layer(x)
    assert got.shape == (2, rows, n_out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=2e-6 * exact.abs().max().item())
    torch.testing.assert_close(layer(x[:, :1].transpose(0, 1)), got[:, :1].transpose(0, 1))  # a strided input


@needs_panels
def test_panel_products_compile_as_an_operator_and_can_be_turned_off(monkeypatch):
    """A compiled graph calls the panel product as an operator on its panels (an input like any buffer) and gets the
    eager result; SCALENLP_PANEL_LINEAR=0 leaves float32 to oneDNN's packed weights; bf16 always takes those."""
    layer = packed(torch.nn.Linear(96, 40))
    step = torch.compile(lambda x: torch.relu(layer(x)) * 2, fullgraph=True)
    x = torch.randn(3, 96)
    assert torch.equal(step(x), torch.relu(layer(x)) * 2)
    monkeypatch.setattr(packing.panel_kernel, "built", None)
    monkeypatch.setenv("SCALENLP_PANEL_LINEAR", "0")
    assert type(packed(torch.nn.Linear(96, 40))) is PackedLinear
    monkeypatch.setattr(packing.panel_kernel, "built", True)
    if packing.onednn_bf16():
        assert type(packed(torch.nn.Linear(96, 40).to(torch.bfloat16))) is PackedLinear


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
@pytest.mark.parametrize("flavor", ["debug-gpt2", "debug"])  # biases; grouped-query attention (q/k/v fused unequal)
def test_packed_weights_match_plain_ones(tmp_path, flavor, dtype):
    """Every linear packed (q/k/v and SwiGLU's gate/up fused first): float32 in scalenlp's panels (oneDNN's packed
    layout for 32 rows where those do not build), bf16 for oneDNN for 1 row."""
    export = make_export(tmp_path, flavor)
    tok = load_tokenizer(export)
    plain = load_pretrained(export, dtype=dtype)
    engine = Engine(load_pretrained(export, dtype=dtype), tok, max_batch=2).start()
    try:
        panels = dtype == torch.float32 and packing.panel_kernel()
        assert type(engine.model.output) is (PanelLinear if panels else PackedLinear)
        assert not any(type(m) is torch.nn.Linear for m in engine.model.modules())  # all packed
        assert all(block.attention.wqkv is not None for block in engine.model.layers.values())
        assert all((block.feed_forward.w13 is not None) == (flavor == "debug")  # SwiGLU's w1/w3 fused too
                   for block in engine.model.layers.values())
        tokens = engine.encode("the quick brown")
        n = len(tokens)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                tokens.append(int(plain(torch.tensor([tokens]))[0, -1].argmax()))
        assert ids_of(engine, ["the quick brown"], GREEDY)[0] == tokens[n:]
    finally:
        engine.stop()


# Budget 16, second step: 15 prompt tokens (one goes to the decoding request) as chunks of 4, 10 and 1, which
# padding_groups puts in three forwards, cheapest first; the 1-token one has a single position, which the hook
# below takes for a decode and does not record.
@pytest.mark.parametrize("budget,expected_prefills", [(16, [(10, 6), (4,), (10,), (9,)]), (64, [(10, 10, 10, 10)])])
def test_token_budget_limits_prefill(export, budget, expected_prefills):
    """Prompt tokens computed per prefill forward (each row's count): at most the budget less one per decoding
    request in a step, a prompt that does not fit being cut into chunks that continue next step."""
    e = start_engine(export, max_batch=4, token_budget=budget, prefix_caching=False)
    prefills = []
    e.model.register_forward_pre_hook(lambda m, args, kwargs: prefills.append(tuple((kwargs["logits_at"] + 1).tolist()))
                                      if args[0].shape[1] > 1 else None, with_kwargs=True)
    try:
        ids = [list(range(40 + i * 10, 50 + i * 10)) for i in range(4)]  # 10 tokens each: two exceed 16
        done = [threading.Event() for _ in ids]
        e.submit_many([(x, GREEDY) for x in ids], [lambda d, i=i: d.finish_reason and done[i].set() for i in range(4)])
        for d in done:
            assert d.wait(120)
        assert prefills == expected_prefills
    finally:
        e.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engines_built_one_after_another_on_one_model_generate_as_on_a_fresh_one(export, dtype):
    """The KV cache and the packed weights live in the model: the next engine on it finds q/k/v
    already fused, and must still size its cache (here a different size) and generate the same text."""
    tok = load_tokenizer(export)
    prompts = ["the quick brown", "hello world", "a model"]
    fresh = Engine(load_pretrained(export, dtype=dtype), tok, max_batch=2).start()
    try:
        expected = fresh.generate(prompts, GREEDY)
    finally:
        fresh.stop()
    model = load_pretrained(export, dtype=dtype)
    packs = can_pack(model)
    for max_batch in (2, 3):
        engine = Engine(model, tok, max_batch=max_batch).start()
        try:
            assert all((block.attention.wqkv is not None) == packs for block in model.layers.values())
            assert engine.generate(prompts, GREEDY) == expected
            with pytest.raises(UserError, match=r"stop\(\) that engine first"):  # both would write one cache
                Engine(model, tok)
        finally:
            engine.stop()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_a_packed_model_refuses_pruning_quantization_and_saving_in_one_line(export, tmp_path, dtype):
    model = load_pretrained(export, dtype=dtype)
    Engine(model, load_tokenizer(export)).stop()  # packs the weights; never started
    with pytest.raises(UserError, match="packed for inference .*prune the model as loaded"):
        prune(model, "magnitude", 0.5)
    with pytest.raises(UserError, match="quantize the model as loaded"):
        build_quantized(model.args, model.state_dict(), Quantization("int8"), quantize=True)
    with pytest.raises(UserError, match="no .* as when an Engine packs it for inference; save the model as loaded"):
        save_pretrained(model, tmp_path / "saved")  # its state dict holds no linear weights
    assert not (tmp_path / "saved").exists()


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_streamed_text_is_the_decoded_sequence_less_the_prompt(tiny_export, kind):
    """Concatenated deltas equal decode(prompt + output) less decode(prompt), also for a SentencePiece decoder,
    which drops the space before a sequence's first word: decoded token by token, every word ran together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from infer_helpers import SENTENCES
    from scalenlp.models.flavors import build_model, model_args

    tok = load_tokenizer(tiny_export)
    if kind == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>"]))
    torch.manual_seed(0)  # a model whose every token id is one of the tokenizer's
    engine = Engine(build_model(model_args("debug", vocab_size=tok.get_vocab_size())), tok, eos_id=None).start()
    try:
        prompt = tok.encode("the quick brown fox").ids
        text, ids, _ = run_request(engine, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    full, head = tok.decode(prompt + ids), tok.decode(prompt)
    assert full.startswith(head) and text == full[len(head):]
    if kind == "sentencepiece":  # words stay apart, not run together
        words = [tok.id_to_token(i) for i in ids if tok.id_to_token(i).startswith("\u2581")]
        assert text.count(" ") == len(words) >= 3, (text, words)
