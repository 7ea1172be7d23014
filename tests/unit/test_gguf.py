"""GGUF in and out: the real SmolLM2 file gives transformers' logits and token ids, our files read back with
the same weights and tokenizer, and llama.cpp runs what we write."""

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, processors

from scalenlp.data.tokenizer import EOS, train_bpe
from scalenlp.errors import UserError
from scalenlp.loader import instantiate, load
from scalenlp.models.decoder import ModelArgs, Transformer, rope_tables
from scalenlp.models.gguf import _open, _rope_rows, _stored, dequantize, read_gguf, write_gguf
from scalenlp.models.packaged import packaged_model

torch.set_num_threads(1)

SMOLLM2 = packaged_model("smollm2")
Q, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "1 + 1 = 2, 12 * 12 = 144, and 3.14159"]
TEXTS = PROMPTS + ["  leading spaces,\ttabs\n\n\nand   runs  ", "héllo wörld, naïve café — 日本語 🤖 ok",
                   "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n", "don't I'M we'll 007 x2 2024-05-01",
                   "<|endoftext|><|im_end|>"]


@pytest.fixture(scope="module")
def smol(smollm2):
    """SmolLM2 (conftest's, read once) and its model."""
    return smollm2, instantiate(smollm2)


@pytest.fixture(scope="module")
def written(smol, tmp_path_factory):
    """SmolLM2 written back by write_gguf, once per weight type."""
    pre, model = smol
    folder = tmp_path_factory.mktemp("gguf")
    return {dtype: write_gguf(model, pre.tokenizer, pre.tokenizer_config, folder / f"smol-{dtype}.gguf", dtype)
            for dtype in ("f32", "f16", "q8_0")}


@pytest.fixture(scope="session")  # the widest scope, so that it comes before every other fixture a test asks for
def llama_cpp():
    """llama-cpp-python, or a skip: requested first, so that a test skips before the fixtures it would use are built."""
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not a scalenlp dependency; it checks that llama.cpp runs our GGUF")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A tokenizer trained here (GPT-2 split, no tokenizer config) with a model whose embedding table is padded
    past it and whose 80-wide rows are not whole Q8_0 blocks, written as q8_0."""
    tokenizer = train_bpe(TEXTS * 10, 300)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size() + 20, dim=64, ffn_dim=80, n_heads=4, n_kv_heads=2,
                     max_seq_len=64)
    path = tmp_path_factory.mktemp("own") / "own.gguf"
    return tokenizer, write_gguf(Transformer(args), tokenizer, {}, path, "q8_0"), args


@pytest.mark.slow  # transformers or the writer on the real 135M model: minutes on a 2-core CPU
def test_logits_equal_transformers(smol):
    from transformers import AutoModelForCausalLM  # heavy; only this test compares against it

    pre, model = smol
    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                              dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([pre.tokenizer.encode(prompt).ids])
        with torch.no_grad():
            torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow  # transformers or the writer on the real 135M model: minutes on a 2-core CPU
def test_tokenizer_equals_transformers(smollm2):
    from transformers import AutoTokenizer

    pre = smollm2
    hf = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    for text in TEXTS:
        ids = pre.tokenizer.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert pre.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert pre.tokenizer.get_vocab_size() == len(hf)
    config = pre.tokenizer_config
    assert (config["bos_token"], config["eos_token"]) == (hf.bos_token, hf.eos_token)
    assert config["chat_template"] == hf.chat_template and config["add_bos_token"] is False
    assert (pre.source, pre.path, pre.args.tie_embeddings) == ("gguf", SMOLLM2, True)


def test_f32_tensors_are_views_on_the_file(own):
    pre = read_gguf(own[1])
    mapped = []  # address ranges where the kernel maps the file
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(own[1])):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            mapped.append(range(start, end))
    f32 = [n for n, w in pre.state.items() if w.ndim == 1]  # the norms are F32 in a q8_0 file
    assert f32 and all(any(pre.state[n].data_ptr() in r for r in mapped) for n in f32)
    assert not any(pre.state["tok_embeddings.weight"].data_ptr() in r for r in mapped)  # Q8_0, dequantized


@pytest.mark.slow  # transformers or the writer on the real 135M model: minutes on a 2-core CPU
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_write_and_read_back(smol, written, dtype):
    pre, model = smol
    path = written[dtype]
    assert not path.with_name(path.name + ".tmp").exists()
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == dtype.upper()
    assert "output.weight" not in types  # tied, as in the source file
    original = gguf.GGUFReader(SMOLLM2)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "llama.attention.head_count_kv", "llama.rope.freq_base"):
        assert reader.get_field(key).contents() == original.get_field(key).contents(), key

    back = read_gguf(path)
    assert back.args == pre.args
    assert back.tokenizer.get_vocab() == pre.tokenizer.get_vocab()
    assert back.tokenizer_config == pre.tokenizer_config
    assert [back.tokenizer.encode(t).ids for t in TEXTS] == [pre.tokenizer.encode(t).ids for t in TEXTS]
    for name, w in pre.state.items():
        if dtype == "f32" or w.ndim == 1:  # norms stay F32 whatever the type
            assert torch.equal(back.state[name], w), name
        elif dtype == "f16":
            assert torch.equal(back.state[name], w.half().float()), name
        else:
            # Q8_0: blocks of 32 values q * d with d = max|w| / 127 stored as fp16 and q = round(w / d) in
            # [-127, 127]: off by at most d/2, plus 127 times d's fp16 rounding (2^-11 relative).
            step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) / 127
            err = (back.state[name] - w).reshape(*step.shape[:2], 32).abs()
            assert (err <= step * (0.5 + 127 * 2**-11) + 1e-8).all(), name
    if dtype == "f32":
        ids = torch.tensor([pre.tokenizer.encode(PROMPTS[0]).ids])
        with torch.no_grad():
            assert torch.equal(instantiate(back)(ids), model(ids))


def test_own_tokenizer_and_ragged_rows(own):
    tokenizer, path, args = own
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "F16"  # 80 % 32 != 0
    token_types = reader.get_field("tokenizer.ggml.token_type").contents()
    n = tokenizer.get_vocab_size()
    assert len(token_types) == args.vocab_size and set(token_types[n:]) == {gguf.TokenType.UNUSED}
    assert token_types[tokenizer.token_to_id(EOS)] == gguf.TokenType.CONTROL
    assert reader.get_field("tokenizer.ggml.pre").contents() == "gpt-2"
    back = read_gguf(path)
    assert back.tokenizer_config == {"bos_token": EOS, "eos_token": EOS, "add_bos_token": False}
    assert [back.tokenizer.encode(t).ids for t in TEXTS] == [tokenizer.encode(t).ids for t in TEXTS]


def test_llama_cpp_tokenizes_our_own_bpe_alike(llama_cpp, own):
    tokenizer, path, _ = own
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer.encode(text).ids, text


@pytest.mark.slow  # the writer on the real 135M model
def test_llama_cpp_runs_what_we_write(llama_cpp, smollm2, written):
    path = written["f16"]
    back = read_gguf(path)
    model, tokenizer = instantiate(back), back.tokenizer  # the f16 weights as float32: what llama.cpp multiplies
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False)
    assert llm.metadata["tokenizer.chat_template"] == smollm2.tokenizer_config["chat_template"]
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer.encode(text).ids, text
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt).ids
        theirs = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            theirs.append(token)
            if len(theirs) == 12:
                break
        ours = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(12):
                ours = torch.cat([ours, model(ours)[:, -1:].argmax(-1)], dim=1)
        assert ours[0, len(ids):].tolist() == theirs, prompt


@pytest.mark.parametrize("bias", [False, True])
def test_llama_cpp_logits_equal_ours(llama_cpp, smollm2, tmp_path, bias):
    """A random untied GQA model (with biases on every projection, or none): llama.cpp's float32 logits."""
    pre = smollm2
    # A tokenizer that starts every text with BOS: the file must say so, and llama.cpp must then add it too.
    tokenizer = Tokenizer.from_str(pre.tokenizer.to_str())
    bos = pre.tokenizer_config["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=pre.args.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     max_seq_len=64, bias=bias, rope_theta=500.0)
    model = Transformer(args).eval()
    with torch.no_grad():  # weights far from init, so that a misplaced row shows in the logits
        for p in model.parameters():
            p.normal_(0, 0.3) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    path = write_gguf(model, tokenizer, pre.tokenizer_config, tmp_path / "tiny.gguf", "f32")
    back = read_gguf(path)
    assert back.args == args and back.tokenizer_config["add_bos_token"] is True
    ids = tokenizer.encode(PROMPTS[2]).ids
    assert back.tokenizer.encode(PROMPTS[2]).ids == ids and ids[0] == tokenizer.token_to_id(bos)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0]
        assert torch.equal(instantiate(back)(torch.tensor([ids]))[0], ours)
    f32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache is f16 unless told otherwise
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True, type_k=f32, type_v=f32)
    assert llm.tokenize(PROMPTS[2].encode()) == ids
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)]))
    torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=0)


def _rope_scaled(tokenizer: Tokenizer, path: Path, rope_theta: float, rope_scaling: tuple) -> tuple[Transformer, Path]:
    """A random Llama with 16-wide heads (8 rotated pairs) and Llama 3.1 RoPE scaling, written as f32."""
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_heads=2, ffn_dim=64, max_seq_len=128,
                     rope_theta=rope_theta, rope_scaling=rope_scaling)
    model = Transformer(args).eval()
    return model, write_gguf(model, tokenizer, {}, path, "f32")


def _rope_freqs(reader: gguf.GGUFReader):
    return next(t for t in reader.tensors if t.name == "rope_freqs.weight")


# Over 32 original positions the 8 pairs turn 5.1, 1.6, 0.51, ... times at theta 10000 (one pair between Llama 3.1's
# low and high bands: its own edges 1 and 4 must fit) and 5.1, 2.9, 1.6, 0.91, 0.51, ... at theta 100 (four pairs
# between 0.5 and 3: the edges are solved from their divisors).
@pytest.mark.parametrize("rope_theta, rope_scaling", [(10000.0, (8.0, 1.0, 4.0, 32)), (100.0, (4.0, 0.5, 3.0, 32))])
def test_llama31_rope_scaling_round_trip(own, tmp_path, rope_theta, rope_scaling):
    model, path = _rope_scaled(own[0], tmp_path / "llama31.gguf", rope_theta, rope_scaling)
    reader = gguf.GGUFReader(path)
    assert reader.get_field("llama.rope.scaling.original_context_length").contents() == 32
    divisors = _rope_freqs(reader).data
    factor = rope_scaling[0]
    assert divisors.dtype == np.float32 and divisors.shape == (8,)
    assert (divisors == 1).any() and (divisors == factor).any() and ((divisors > 1) & (divisors < factor)).any()
    back = read_gguf(path)
    assert back.args == model.args and set(back.state) == set(model.state_dict())  # rope_freqs is no weight
    tokens = torch.randint(0, model.args.vocab_size, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(instantiate(back)(tokens), model(tokens), atol=1e-5, rtol=0)


def test_rope_freqs_give_scaling_relative_to_the_original_context(own, tmp_path):
    """Divisors fix the band edges only as ratios to the original context: a file that claims 8192 (as Llama 3.1
    files without the key are read) gets edges 256 times larger, and the same rotations."""
    model, path = _rope_scaled(own[0], tmp_path / "llama31.gguf", 100.0, (4.0, 0.5, 3.0, 32))
    gguf.GGUFReader(path, "r+").get_field("llama.rope.scaling.original_context_length").parts[-1][0] = 8192
    back = read_gguf(path)
    assert back.args.rope_scaling == (4.0, 128.0, 768.0, 8192)
    torch.testing.assert_close(rope_tables(back.args), rope_tables(model.args), atol=1e-5, rtol=0)


def test_rope_freqs_that_are_not_llama31_are_a_user_error(own, tmp_path):
    model, path = _rope_scaled(own[0], tmp_path / "odd.gguf", 10000.0, (8.0, 1.0, 4.0, 32))
    freqs = _rope_freqs(gguf.GGUFReader(path, "r+"))
    freqs.data[:] = np.random.default_rng(0).uniform(1, 8, 8)
    with pytest.raises(UserError, match="rope_freqs.weight holds RoPE frequency divisors that no Llama 3.1 scaling "
                                        r"\(factor, low/high frequency factors\) gives; only Llama 3.1-style") as e:
        read_gguf(path)
    assert "\n" not in str(e.value)
    freqs.data[:] = 1  # no pair scaled: plain RoPE
    assert read_gguf(path).args == replace(model.args, rope_scaling=())


def test_truncated_file_is_a_user_error(own, tmp_path):
    data = own[1].read_bytes()
    reader = gguf.GGUFReader(own[1])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    in_vocabulary, in_tensors = tokens.offset + sum(p.nbytes for p in tokens.parts) // 2, len(data) - 100
    assert 100 < tokens.offset < in_vocabulary < reader.data_offset < in_tensors
    for size in (100, in_vocabulary, in_tensors):  # inside the header, the vocabulary, the tensor data
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(UserError, match="truncated") as e:
            read_gguf(cut)
        assert "\n" not in str(e.value)


def _tiny_file(path: Path, arch: str, embedding: np.ndarray) -> Path:
    """A GGUF with Llama-style metadata for ``arch`` and only a token embedding."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (("embedding_length", 8), ("attention.head_count", 2), ("block_count", 1),
                       ("feed_forward_length", 16), ("context_length", 32)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_token_list([f"t{i}" for i in range(embedding.shape[0])])
    writer.add_tensor("token_embd.weight", embedding)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_and_type_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported; supported: llama"):
        read_gguf(_tiny_file(tmp_path / "gpt2.gguf", "gpt2", np.zeros((4, 8), np.float32)))
    with pytest.raises(UserError, match=r"type I8, which is not supported; supported: F32, F16, BF16, Q8_0"):
        read_gguf(_tiny_file(tmp_path / "i8.gguf", "llama", np.zeros((4, 8), np.int8)))


def test_write_refuses_what_gguf_cannot_express(own, tmp_path):
    tokenizer, _, args = own
    gpt2 = Transformer(ModelArgs(vocab_size=args.vocab_size, norm="layernorm", activation="gelu",
                                 position="learned", bias=True))
    with pytest.raises(UserError, match="GGUF export writes Llama's architecture"):
        write_gguf(gpt2, tokenizer, {}, tmp_path / "gpt2.gguf")
    # Llama-shaped but with Qwen2's q/k/v biases and a sliding window: llama.cpp's llama would drop both
    qwen = Transformer(ModelArgs(vocab_size=args.vocab_size, qkv_bias=True, sliding_window=8,
                                 local_layers=(0,), hf_type="qwen2"))
    with pytest.raises(UserError, match=r"options \['qkv_bias', 'sliding_window'\]; export it with --format hf"):
        write_gguf(qwen, tokenizer, {}, tmp_path / "qwen2.gguf")
    llama = Transformer(ModelArgs(vocab_size=args.vocab_size))
    with pytest.raises(UserError, match="choose one of f32, f16, q8_0"):
        write_gguf(llama, tokenizer, {}, tmp_path / "q4.gguf", "q4_0")
    assert not list(tmp_path.iterdir())


def test_export_command_writes_a_gguf_that_reads_back(tmp_path):
    """`scalenlp export --format gguf` from a run's export folder: the same logits after reading it back."""
    from infer_helpers import make_export
    from scalenlp.cli import main

    export = make_export(tmp_path / "run", "debug")
    assert main(["export", "--checkpoint", str(export), "--format", "gguf", "--type", "f32",
                 "--out", str(tmp_path / "m.gguf")]) == 0
    ours, theirs = load(export)[0], load(tmp_path / "m.gguf")[0]
    tokens = torch.randint(0, ours.args.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens), ours(tokens), atol=1e-5, rtol=1e-5)
    assert main(["export", "--checkpoint", str(export), "--format", "gguf", "--out", str(tmp_path / "m.bin")]) == 2



def _random_tensor(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> gguf.ReaderTensor:
    """A tensor as the gguf package's reader gives it (F16 typed, the others uint8 rows), of random bytes: every
    bit pattern of the scales and codes, infinities and NaNs among them."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    data = raw.view(np.float16) if kind == Q.F16 else raw
    return gguf.ReaderTensor(name="blk.0.attn_q.weight", tensor_type=kind, shape=np.array([cols, rows]),
                             n_elements=rows * cols, n_bytes=raw.size, data_offset=0, data=data, field=None)


def _same_bits(ours: torch.Tensor, theirs: np.ndarray | torch.Tensor) -> bool:
    """Bit for bit but for NaNs' payloads, which only have to be NaNs in the same places: torch's float16
    conversion quiets a signalling NaN, numpy's keeps its bits."""
    theirs = torch.as_tensor(theirs)
    nan = theirs.isnan()
    return ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours.isnan(), nan) and \
        torch.equal(ours.view(torch.int32)[~nan], theirs.view(torch.int32)[~nan])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf's numpy on NaN scales
@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K])
def test_dequantize_equals_gguf_bit_for_bit(kind, tmp_path):
    """Our dequantization (torch over the whole tensor; Q6_K stays on gguf's path) gives gguf.quants.dequantize's
    values bit for bit; rows reordered for RoPE before it give its rows reordered; a cut tensor is the UserError the
    gguf path gave, with gguf's own words for what is wrong."""
    t = _random_tensor(kind, 16, 512, np.random.default_rng(int(kind)))
    theirs = gguf.quants.dequantize(t.data, kind)
    assert _same_bits(dequantize(_stored(t, tmp_path), kind), theirs)
    reordered = _rope_rows(torch.from_numpy(theirs), 4, to_gguf=False)
    assert _same_bits(dequantize(_stored(t, tmp_path, heads=4), kind), reordered)

    expected = "(16, 512)"
    for cut in (t.data[:-1], t.data[:, :-1]):  # a row short; each row a byte (F16: a value) short
        try:
            reason = f"its data holds {gguf.quants.dequantize(cut, kind).shape} values, not {expected}"
        except ValueError as e:  # gguf refuses rows that are no whole number of blocks
            reason = str(e)
        with pytest.raises(UserError) as e:
            _stored(t._replace(data=cut), tmp_path)
        assert str(e.value) == f"{tmp_path}: cannot read tensor {t.name} ({reason}); the file is damaged or truncated"


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_metadata_arrays_read_as_ggufs_own_reader_reads_them(tmp_path, endian):
    """Arrays read whole (strings in one pass over their bytes) give what gguf's own item-by-item reader gives:
    contents, single items and slices, the number of items and the types; empty arrays and strings included."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    strings = ["", "a", "héllo wörld", "日本語 🤖", "Ġthe Ġcat", "\x00 nul", ""] * 50
    writer.add_array("strings", strings)
    writer.add_array("empty", [])
    writer.add_string("one string", "plain")
    for sub, values in ((V.INT32, [-3, 0, 7]), (V.FLOAT32, [0.5, -1e-5, 3.0]), (V.BOOL, [True, False]),
                        (V.UINT8, [0, 255]), (V.UINT64, [2**63, 1]), (V.FLOAT64, [1 / 3])):
        writer.add_key_value(f"array.{sub.name}", values, V.ARRAY, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours, theirs = _open(path).fields, gguf.GGUFReader(path).fields
    assert ours.keys() == theirs.keys()
    for key, field in theirs.items():
        assert ours[key].contents() == field.contents(), key
        assert len(ours[key].data) == len(field.data) and ours[key].types == field.types, key
        if len(field.data) > 3:
            assert ours[key].contents(3) == field.contents(3) and ours[key].contents(slice(1, 3)) == field.contents(slice(1, 3))
    assert ours["strings"].contents() == strings

