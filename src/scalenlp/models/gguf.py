"""GGUF files in and out, through the ``gguf`` package (llama.cpp's own Python reader, writer and
dequantizers): a Llama-architecture file <-> our Llama-shaped decoder plus its tokenizer.

Two layout facts drive the code. GGUF stores each 2-D weight as (out, in) rows, like ``nn.Linear``,
so only the names change, through gguf's own map from Hugging Face names to GGUF names. And llama.cpp
applies RoPE to interleaved pairs (x0, x1), (x2, x3), ... while we (like Hugging Face) rotate the two
halves of each head, so its converter reorders the rows of attn_q and attn_k within each head; reading
undoes that and writing redoes it.

Llama 3.1's RoPE scaling has no metadata of its own: llama.cpp's converter stores it as the tensor
rope_freqs.weight, one divisor per rotated pair (llama.cpp turns pair i by pos * inv_freq_i / divisor_i).
Writing computes those divisors; reading solves them back for our (factor, low, high, original) tuple.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import nn

from scalenlp.errors import UserError
from scalenlp.files import replacing_file
from scalenlp.models.decoder import ModelArgs, llama3_scaled, rope_inv_freq, rope_turns
from scalenlp.models.families import llama
from scalenlp.models.limits import check_count, read_from
from scalenlp.models.pretrained import Pretrained

ARCHITECTURES = ("llama",)
Q = gguf.GGMLQuantizationType
# What gguf.quants dequantizes and llama.cpp's Llama files use; the rest (ternary, i-quants) are rare here.
READ_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
WRITE_TYPES = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
               "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # kept raw too (Pretrained.blocks), for compress.quantized to map
GGUF_BLOCK = 32  # values in a block of each of BLOCK_TYPES
GGUF_INT4 = {"Q4_0": 2, "Q4_1": 4}  # the 4-bit block types -> bytes before the codes (d; d and m)
ROPE_FREQS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
# Llama 3.1's and 3.2's original context: the divisors fix only ratios to it, and llama.cpp's converter does not
# store it, so a file without rope.scaling.original_context_length is read as one of those models.
LLAMA31_ORIGINAL_CONTEXT = 8192
# tokenizer.ggml.pre names llama.cpp gives a byte-level BPE's pre-tokenization, and the same split in
# the tokenizers library: GPT-2's regex; SmolLM's, which first cuts every digit apart; Llama 3's, which keeps
# at most three digits together, a letter run with the one non-letter before it, and newlines apart from
# other whitespace. The Llama 3 pattern is spelled as llama.cpp's llama-vocab.cpp spells it.
_GPT2_SPLIT = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PROBE = "I'M don't 12345 x  \n\n  héllo!!?  日本 3.14"


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    # The regex finds the pieces; ByteLevel then only spells each piece's bytes, without splitting again.
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {  # the first name of each split is the one written
    "gpt-2": lambda: _GPT2_SPLIT,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _GPT2_SPLIT]),
    "llama-bpe": _llama3_split, "llama3": _llama3_split, "llama-v3": _llama3_split,
}
# tokenizer.ggml.model: the tokenizer kinds read (llama.cpp's names) and what each is.
TOKENIZER_KINDS = {"gpt2": "byte-level BPE: GPT-2, SmolLM, Llama 3", "llama": "SentencePiece: Llama 2, Mistral, Gemma"}
SPACE = "\u2581"  # SentencePiece's visible space, which stands for " " inside its pieces
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # SentencePiece's byte-fallback tokens


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _name_map(n_layers: int, bias: bool) -> dict[str, str]:
    """Our parameter name -> its GGUF tensor name, through Hugging Face's names (which gguf maps)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    return {ours: names.get_name(hf, try_suffixes=(".weight", ".bias")) for ours, hf in llama.llama_pairs(n_layers, bias)}


def _rope_rows(w: torch.Tensor, n_heads: int, to_gguf: bool) -> torch.Tensor:
    """Reorder the rows of each head between rotate-half order (ours) and llama.cpp's interleaved order."""
    half = w.shape[0] // n_heads // 2
    split = (n_heads, 2, half) if to_gguf else (n_heads, half, 2)
    return w.reshape(*split, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _permuted(name: str, args: ModelArgs) -> int | None:
    """The number of heads whose rows a GGUF file interleaves in this tensor, or None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    return None


# ---------------------------------------------------------------------------------------------- reading

def read_gguf(path: Path) -> Pretrained:
    """A GGUF file's Llama model, tokenizer and chat template. F32 tensors stay views on the file's memory
    map; quantized and half-precision ones are dequantized to float32 (the model runs in one dtype); Q4_0, Q4_1 and
    Q8_0 weights also keep their raw blocks (``Pretrained.blocks``), which ``--quantize`` may take as they are."""
    path = Path(path)
    reader = _open(path)
    args = _args(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[str, torch.Tensor]] = {}
    for ours, name in _name_map(args.n_layers, args.bias).items():
        if name not in tensors:
            if ours == "output.weight":
                continue  # no output projection: it is tied to the token embeddings
            raise UserError(f"{path} has no tensor {name}; it is not a complete Llama model")
        kind = tensors[name].tensor_type
        raw = _stored(tensors[name], path, _permuted(ours, args))
        state[ours] = dequantize(raw, kind)
        if kind in BLOCK_TYPES and raw.ndim == 2:
            blocks[ours] = (kind.name, raw)
    args.tie_embeddings = "output.weight" not in state
    expected = (args.vocab_size, args.dim)
    if tuple(state["tok_embeddings.weight"].shape) != expected:
        raise UserError(f"{path}: token_embd.weight has shape {tuple(state['tok_embeddings.weight'].shape)}, "
                        f"not (vocab, dim) = {expected}; the file's metadata does not match its tensors")
    tokenizer, tokenizer_config = _tokenizer(reader, path)
    return Pretrained(args, state, tokenizer, tokenizer_config, "gguf", path, blocks=blocks)


def read_tokenizer(path: Path) -> tuple[Tokenizer, dict]:
    """Only a GGUF file's tokenizer and its config (BOS, EOS, add_bos_token, chat template), as ``read_gguf``
    gives them."""
    return _tokenizer(_open(Path(path)), Path(path))


class _Reader(gguf.GGUFReader):
    """The gguf package's reader over a plain array view of its memory map, reading metadata arrays whole. Every
    slice of an ``np.memmap`` is another memmap, finalized in Python: SmolLM2's 49k-word vocabulary and gguf's
    dequantizer's row groups made ~2 million of them, two thirds of the 27 s its read once took here. The view
    keeps the map (its base) alive. ``strings``: ``_check_layout``'s string arrays, found once for both."""

    def __init__(self, path: Path, mode: str, strings: dict[int, tuple[list[int], list[int], int]]):
        self.strings = strings
        super().__init__(path, mode)

    def _build_fields(self, offs: int, count: int) -> int:
        self.data = self.data.view(np.ndarray)  # the first thing read after the magic number and counts
        return super()._build_fields(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        """A non-empty array of scalars or strings in one piece (``_Array``); every other value as the gguf package
        reads it, which takes an array item by item (two numpy views a string)."""
        if raw_type != V.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind, n, begin = int(item[0]), int(count[0]), orig_offs + 12
        if n == 0 or (kind != V.STRING and kind not in SCALAR_BYTES):
            return super()._get_field_parts(orig_offs, raw_type)  # empty: typed [ARRAY] alone, as the package has it
        if kind == V.STRING:
            spans = self.strings.get(begin) or _string_spans(self.data, begin, n, count.dtype.str[0])
            if spans is None:  # _check_layout refuses such a file first; this reader trusts nothing it did not check
                raise ValueError(f"the string array at byte {orig_offs:,} runs past the end of the file")
            starts, ends, end = spans
            values = [self.data[begin:end], np.array(starts) - begin, np.array(ends) - begin]
        else:
            values = [self._get(begin, self.gguf_scalar_to_np[V(kind)], n)]
            end = begin + values[0].nbytes
            if len(values[0]) < n:
                raise ValueError(f"the array at byte {orig_offs:,} runs past the end of the file")
        return end - orig_offs, [item, count, *values], [2] * n, [V.ARRAY, V(kind)]

    def _push_field(self, field: gguf.ReaderField, skip_sum: bool = False) -> int:
        ours = len(field.types) == 2 and field.types[0] == V.ARRAY != field.types[1]  # what the above read whole
        return super()._push_field(_Array(*field) if ours else field, skip_sum)


class _Array(gguf.ReaderField):
    """A metadata array as ``_Reader`` reads it. Scalars: the last part holds them all. Strings: the last three
    parts are the array's bytes (length prefixes included) and each string's start and end in them. Each item of
    ``data`` names the part after the count (the values, or the bytes), so that ``len(data)`` is the array's length
    as the package has it. ``contents`` gives what the package's does, the strings decoded in one pass and as
    strictly (invalid UTF-8 raises)."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> list | int | float | str:
        if self.types[-1] != V.STRING:
            return self.parts[-1].tolist()[index_or_slice]
        data, starts, ends = self.parts[-3:]
        text = data.tobytes()
        return [text[a:b].decode("utf-8") for a, b in zip(starts.tolist(), ends.tolist())][index_or_slice]


def _string_spans(buf, at: int, n: int, order: str) -> tuple[list[int], list[int], int] | None:
    """Where each of ``n`` strings (a uint64 length in byte order ``order``, then its bytes) from byte ``at`` of
    ``buf`` lies: their starts, their ends and the end of the last; None where one runs past ``buf``'s end. Each
    string's place depends on every length before it, so this is one loop, but of plain integers: the gguf package
    makes two numpy views of each string, and SmolLM2's 49k-token vocabulary and merges cost it seconds."""
    length = struct.Struct(order + "Q").unpack_from
    size, starts, ends = len(buf), [0] * n, [0] * n
    for i in range(n):
        if at + 8 > size:
            return None
        starts[i] = at + 8
        at = ends[i] = at + 8 + length(buf, at)[0]
    return (starts, ends, at) if at <= size else None


def _open(path: Path) -> gguf.GGUFReader:
    strings = _check_layout(path)
    try:
        # Copy-on-write: the arrays are writable (torch wants that) but nothing ever reaches the file.
        return _Reader(path, "c", strings)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError... on a damaged or cut file
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated, "
                        f"download or export it again") from None


# Bytes of each scalar metadata type, as the gguf package reads them.
SCALAR_BYTES = {t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
V = gguf.GGUFValueType
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp's tensors have at most four dimensions


class _Cursor:
    """A walk over a GGUF file's header in which every read is checked against the file's end."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.at = data, path, 0
        self.order = "<"
        self.strings: dict[int, tuple[list[int], list[int], int]] = {}  # each string array's spans, by its start

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.at:
            raise UserError(f"{self.path}: {what} runs past the end of the {len(self.data):,}-byte file; it is "
                            f"damaged or truncated, download or export it again")
        self.at += n
        return self.data[self.at - n:self.at]

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, least_bytes: int) -> int:
        """A uint64 count of items, each at least ``least_bytes`` long: more than the rest of the file holds is
        refused before anything loops over it."""
        n = self.number("Q", what)
        if n * least_bytes > len(self.data) - self.at:
            raise UserError(f"{self.path}: {what} is {n:,}, more than the {len(self.data) - self.at:,} bytes left in "
                            f"the file can hold; the file is damaged")
        return n

    def string(self, what: str) -> str:
        return self.take(self.count(f"the length of {what}", 1), what).decode("utf-8", "replace")

    def value(self, kind: int, what: str) -> int | None:
        """Step over one metadata value of type ``kind``; a scalar integer's value is returned."""
        if kind in SCALAR_BYTES:
            raw = self.take(SCALAR_BYTES[kind], what)
            return int.from_bytes(raw, "little" if self.order == "<" else "big") if kind == V.UINT32 else None
        if kind == V.STRING:
            self.string(what)
        elif kind == V.ARRAY:
            item = self.number("I", f"the item type of {what}")
            if item not in SCALAR_BYTES and item != V.STRING:
                raise UserError(f"{self.path}: {what} is an array of type {item}, which GGUF files do not hold")
            n = self.count(f"the length of {what}", SCALAR_BYTES.get(item, 8))
            spans = _string_spans(self.data, self.at, n, self.order) if item == V.STRING else None
            if spans is not None:
                self.strings[self.at] = spans
                self.at = spans[2]
            elif item == V.STRING:  # one runs past the end: the checked walk finds which, and says so
                for _ in range(n):
                    self.string(what)
            else:
                self.take(n * SCALAR_BYTES[item], what)
        else:
            raise UserError(f"{self.path}: {what} has type {kind}, which is not a GGUF type; the file is damaged")
        return None


def _check_layout(path: Path) -> dict[int, tuple[list[int], list[int], int]]:
    """Walk the file's header before the gguf package reads it, which trusts it: a count larger than the file
    (it loops over it, growing), a tensor whose offset wraps below the data (read as header bytes) or that
    overlaps another or ends past the file (read as another tensor's bytes, or short). Each is one UserError.
    Returns where the strings of each string array lie (``_string_spans``), by the array's first byte."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, path)
            _check_header(cursor)
            return cursor.strings
    except (OSError, ValueError) as e:  # unreadable, or empty (mmap refuses a zero-length file)
        raise UserError(f"{path} is not a readable GGUF file ({e}); download or export it again") from None


def _check_header(c: _Cursor) -> None:
    if c.take(4, "the magic number") != b"GGUF":
        raise UserError(f"{c.path} is not a GGUF file (it does not start with GGUF)")
    version = c.number("I", "the version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        c.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
        raise UserError(f"{c.path} is GGUF version {version}, which is not supported; supported: "
                        f"{', '.join(map(str, gguf.gguf_reader.READER_SUPPORTED_VERSIONS))} (convert it again)")
    tensors = c.count("the tensor count", 8 + 4 + 8 + 4 + 8)  # name length, dims, one dim, type, offset
    keys = c.count("the metadata count", 8 + 4 + 1)  # key length, type, the smallest value
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(keys):
        key = c.string(f"metadata key {i}")
        found = c.value(c.number("I", f"the type of {key}"), key)
        if key == "general.alignment" and found:
            alignment = found
    spans = []
    for i in range(tensors):
        name = c.string(f"the name of tensor {i}")
        dims = c.number("I", f"the dimension count of {name}")
        if not 1 <= dims <= MAX_DIMS:
            raise UserError(f"{c.path}: tensor {name} has {dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        shape = [c.number("Q", f"the shape of {name}") for _ in range(dims)]
        kind = c.number("I", f"the type of {name}")
        offset = c.number("Q", f"the offset of {name}")
        try:
            block, size = gguf.GGML_QUANT_SIZES[Q(kind)]
        except (ValueError, KeyError):
            raise UserError(f"{c.path}: tensor {name} has type {kind}, which is not a GGML type") from None
        if min(shape) < 1 or shape[0] % block:
            raise UserError(f"{c.path}: tensor {name} has shape {shape}, which {Q(kind).name} blocks of {block} "
                            f"values do not tile; the file is damaged")
        spans.append((offset, offset + math.prod(shape) // block * size, name))
    start = c.at + (-c.at % alignment if alignment and not alignment & (alignment - 1) else 0)
    end = len(c.data) - start
    previous = (0, 0, "")
    for begin, stop, name in sorted(spans):
        if stop > end:
            raise UserError(f"{c.path}: tensor {name} lies at bytes {begin:,}..{stop:,} of the data, past its end at "
                            f"{end:,} (an offset out of the file, or one that wrapped below zero); the file is damaged")
        if begin < previous[1]:
            raise UserError(f"{c.path}: tensors {previous[2]} and {name} overlap in the file (bytes {begin:,}.."
                            f"{previous[1]:,}); the file is damaged")
        previous = (begin, stop, name)


def _args(reader: gguf.GGUFReader, path: Path) -> ModelArgs:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def meta(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise UserError(f"{path} lacks the metadata key {arch}.{key}; it is not a complete {arch} model")
        return value

    def count(key: str, field: str, default=None) -> int:
        with read_from(str(path)):
            return check_count(field, meta(key, default), f"{arch}.{key}")

    dim, heads = count("embedding_length", "dim"), count("attention.head_count", "n_heads")
    # differs from dim // heads where heads were pruned
    head_dim = count("attention.key_length", "dim", dim // heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if meta(key, head_dim) != head_dim:
            raise UserError(f"{path}: {arch}.{key}={meta(key)} differs from the head size {head_dim}; "
                            f"such models are not supported")
    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise UserError(f"{path}: RoPE scaling {scaling!r} is not supported; only plain RoPE")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    with read_from(str(path)):  # a float key holding a string, a shape that cannot be built
        args = ModelArgs(vocab_size=count("vocab_size", "vocab_size", len(tokens.data) if tokens is not None else 0),
                         dim=dim, n_layers=count("block_count", "n_layers"), n_heads=heads,
                         n_kv_heads=count("attention.head_count_kv", "n_kv_heads", heads),
                         ffn_dim=count("feed_forward_length", "ffn_dim"),
                         max_seq_len=count("context_length", "max_seq_len"),
                         norm_eps=_decimal(meta("attention.layer_norm_rms_epsilon")),
                         rope_theta=_decimal(meta("rope.freq_base", 10000.0)),
                         bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
                         fixed_head_dim=head_dim if head_dim != dim // heads else 0, **llama.SHAPE)
        args.check()
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        original = count("rope.scaling.original_context_length", "max_seq_len", LLAMA31_ORIGINAL_CONTEXT)
        args.rope_scaling = _rope_scaling(dequantize(_stored(freqs, path), freqs.tensor_type), args, original, path)
    return args


def _rope_divisors(args: ModelArgs) -> torch.Tensor:
    """rope_freqs.weight's values for ``args.rope_scaling``: plain RoPE's speed over the scaled one, per pair
    (in float64, so that only the file's float32 rounds them)."""
    plain = rope_inv_freq(args).double()
    return plain / llama3_scaled(plain, *args.rope_scaling)


def _rope_scaling(divisors: torch.Tensor, args: ModelArgs, original: int, path: Path) -> tuple:
    """Llama 3.1's (factor, low_freq_factor, high_freq_factor, original) that gives these divisors, or ()
    for all ones. Pairs slower than ``low`` turns per original context divide by ``factor``, so the largest
    divisor is it; between ``low`` and ``high`` turns, 1/divisor = keep + (1 - keep) / factor with keep linear
    in turns, so two or more such pairs give ``low`` and ``high`` (as ratios to ``original``). Whatever the
    solution, it must reproduce every divisor."""
    half = args.head_dim // 2
    if divisors.shape != (half,):
        raise UserError(f"{path}: {ROPE_FREQS} has shape {tuple(divisors.shape)}, not ({half},), one divisor per "
                        f"rotated pair of the {args.head_dim}-wide heads; the file is not a valid Llama model")
    d = divisors.double()
    if (d == 1).all():
        return ()
    wrong = UserError(f"{path}: {ROPE_FREQS} holds RoPE frequency divisors that no Llama 3.1 scaling (factor, "
                      f"low/high frequency factors) gives; only Llama 3.1-style divisors are supported")
    if not (d.isfinite().all() and (d >= 1).all()):
        raise wrong
    factor = _round(d.max().item())
    candidates = [(1.0, 4.0)]  # Llama 3.1's own, exact where they fit
    turns = rope_turns(rope_inv_freq(args).double(), original)
    band = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
    if band.sum() >= 2:
        keep = (1 / d[band] - 1 / factor) / (1 - 1 / factor)  # = (turns - low) / (high - low)
        slope, intercept = np.polyfit(turns[band].numpy(), keep.numpy(), 1)
        candidates.append((_round(-intercept / slope), _round((1 - intercept) / slope)))
    for low, high in candidates:
        scaling = (factor, low, high, original)
        if 0 < low < high and torch.allclose(_rope_divisors(replace(args, rope_scaling=scaling)), d, rtol=1e-4,
                                             atol=0):
            return scaling
    raise wrong


def _round(x: float) -> float:
    """A value solved from float32 divisors, to 6 significant digits: 8.0 rather than 7.9999995."""
    return float(f"{x:.6g}")


def _decimal(x: float) -> float:
    """The shortest decimal a float32 metadata value rounds from: GGUF stores 1e-5 as 9.99999974e-06."""
    return float(str(np.float32(x)))


def _stored(t, path: Path, heads: int | None = None) -> torch.Tensor:
    """Tensor ``t``'s data as the file holds it (a view on the memory map, F32 and F16 typed, the rest uint8 rows),
    checked against its shape; with ``heads``, its rows reordered from llama.cpp's order to ours (``_rope_rows``).
    Blocks run along each row, so a quantized tensor's rows reorder whole, and reordering them before dequantizing
    copies the stored bytes instead of the float32 weight."""
    if t.tensor_type not in READ_TYPES:
        raise UserError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which is not supported; supported: "
                        f"{', '.join(q.name for q in READ_TYPES)} (requantize the file with llama-quantize)")
    try:
        held = t.data.shape if t.tensor_type in (Q.F32, Q.F16) else \
            gguf.quants.quant_shape_from_byte_shape(t.data.shape, t.tensor_type)
        expected = tuple(reversed(t.shape.tolist()))
        if held != expected:  # a file cut short inside the tensor data gives short arrays
            raise ValueError(f"its data holds {held} values, not {expected}")
    except ValueError as e:
        raise UserError(f"{path}: cannot read tensor {t.name} ({e}); the file is damaged or truncated") from None
    raw = torch.from_numpy(t.data)
    return raw if heads is None else _rope_rows(raw, heads, to_gguf=False)


def dequantize(raw: torch.Tensor, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A tensor's float32 values from its stored data (``_stored``'s); F32 is returned as it is. F16, BF16 and
    ``BLOCK_TYPES`` are computed here over the whole tensor at once, with gguf's numpy dequantizer's float32
    arithmetic (each value one product of its block's scale and code, Q4_1's plus its minimum), so bit for bit
    the same values; the rest (Q5 and the K-quants) go through gguf.quants, which works on groups of 16 rows."""
    if kind == Q.F32:
        return raw
    if kind in (Q.F16, Q.BF16):
        return (raw if kind == Q.F16 else raw.view(torch.bfloat16)).float()
    if kind not in BLOCK_TYPES:
        return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), kind))
    shape = gguf.quants.quant_shape_from_byte_shape(raw.shape, kind)
    # In place on the codes' float32 copy, each step rounded on its own as numpy's are (no fused multiply-add).
    if kind == Q.Q8_0:
        blocks = raw.reshape(-1, 2 + GGUF_BLOCK)
        values = blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0))
    else:
        d, m, q = q4_blocks(kind.name, raw)
        values = q.float().sub_(8).mul_(d) if m is None else q.float().mul_(d).add_(m)
    return values.reshape(shape)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes ``at`` and ``at`` + 1 of each block (rows of uint8), as float32 (blocks, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def q4_blocks(kind: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A Q4_0 or Q4_1 tensor's stored blocks (uint8 rows) as (d, m, codes), one row per block in order: float32 d
    and m (Q4_1's minimum; None for Q4_0), each (blocks, 1), and the 4-bit codes q, uint8 (blocks, 32). Byte j of
    a block holds value j in its low nibble and value j + 16 in its high one; a value is d * (q - 8) or d * q + m."""
    head = GGUF_INT4[kind]
    blocks = raw.reshape(-1, head + GGUF_BLOCK // 2)
    codes = blocks[:, head:]
    return _half(blocks, 0), _half(blocks, 2) if kind == "Q4_1" else None, torch.cat([codes & 15, codes >> 4], dim=1)


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> tuple[Tokenizer, dict]:
    """A ``Tokenizer`` that gives the ids llama.cpp gives for the file's vocabulary, and its config."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in TOKENIZER_KINDS:
        raise UserError(f"{path}: tokenizer model {kind!r} is not supported; supported: "
                        f"{', '.join(f'{k} ({what})' for k, what in TOKENIZER_KINDS.items())}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{path}: tokenizer.ggml.tokens is not a list of strings; the file's vocabulary is damaged")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        i = _field(reader, f"tokenizer.ggml.{key}")
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
            raise UserError(f"{path}: tokenizer.ggml.{key}={i!r} is not the id of one of its {len(tokens):,} "
                            f"tokens; the file's vocabulary is damaged")
    types = _field(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UserError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; "
                        f"the file's vocabulary is damaged")
    tokenizer = _byte_level(reader, path, tokens) if kind == "gpt2" else _sentencepiece(reader, path, tokens, types)
    # llama.cpp matches control, unknown and user-defined tokens whole in the text before any splitting.
    special = (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)
    tokenizer.add_tokens([AddedToken(t, special=k in special, normalized=False) for t, k in zip(tokens, types)
                          if k in (*special, gguf.TokenType.USER_DEFINED)])
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    config: dict = {key: tokens[i] for key, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    # Without the flag llama.cpp starts SentencePiece texts with BOS, byte-level ones not.
    add = {"bos": _field(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None,
           "eos": _field(reader, "tokenizer.ggml.add_eos_token", False) and eos is not None}
    config["add_bos_token"] = bool(add["bos"])
    if any(add.values()):  # llama.cpp then adds them to every text; so does encode()
        ends = [(tokens[i], i) for i, on in ((bos, add["bos"]), (eos, add["eos"])) if on]
        single = " ".join([*([tokens[bos]] if add["bos"] else []), "$A", *([tokens[eos]] if add["eos"] else [])])
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=ends)
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config


def _byte_level(reader: gguf.GGUFReader, path: Path, tokens: list[str]) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) with the file's merges and named pre-tokenization."""
    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise UserError(f"{path}: tokenizer pre-tokenization {pre!r} is not supported; supported: "
                        f"{', '.join(PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(reader: gguf.GGUFReader, path: Path, tokens: list[str], types: list[int]) -> Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a BPE with byte fallback. Spaces become ▁, and one ▁ starts
    the text and follows each special token (tokenizer.ggml.add_space_prefix, on unless the file says otherwise:
    Gemma's is off). Then, as SentencePiece's BPE does, two neighbouring pieces merge while their concatenation
    is a token, the highest-scoring first; a character no token covers becomes its UTF-8 bytes' <0xNN> tokens.
    The text stays one piece (no pre-tokenizer): SentencePiece merges across the whole of it, too."""
    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise UserError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token "
                        f"({len(tokens)}); the file has {'none' if scores is None else len(scores)}")
    unk = _field(reader, "tokenizer.ggml.unknown_token_id",
                 next((i for i, k in enumerate(types) if k == gguf.TokenType.UNKNOWN), None))
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, sentencepiece_merges(tokens, scores, types),
                                     unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _field(reader, "tokenizer.ggml.add_space_prefix", True):
        # A normalizer, not pre_tokenizers.Metaspace, which adds no ▁ before a text that starts with a space
        # (" a" -> "▁a", where SentencePiece and llama.cpp give "▁▁a").
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
        steps.append(decoders.Strip(" ", 1, 0))  # the added space, which the text did not have
    else:
        tokenizer.normalizer = spaces
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece's merge order as a BPE merge list: each normal token, cut in two at every place where both
    halves are tokens, ranked by the token's score (best first; ties by token id, then the shorter left half)."""
    ids = {t: i for i, t in enumerate(tokens)}
    cuts = [(-scores[i], i, cut) for i, (t, k) in enumerate(zip(tokens, types)) if k == gguf.TokenType.NORMAL
            for cut in range(1, len(t)) if t[:cut] in ids and t[cut:] in ids]
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in sorted(cuts)]


# ---------------------------------------------------------------------------------------------- writing

def write_gguf(model: nn.Module, tokenizer: Tokenizer, tokenizer_config: dict, out_path: str | Path,
               dtype: str = "f16") -> Path:
    """Our Llama-shaped decoder and its byte-level BPE tokenizer as one GGUF file llama.cpp runs. Weights
    are ``dtype`` (f32, f16 or q8_0); norms and biases stay F32, as llama.cpp's converter keeps them.
    Written to a temporary name, then renamed: a crash leaves no half-written file under ``out_path``."""
    args = model.args
    if not llama.matches(args):  # the other families' options (biases, q/k norms, windows...) have no place in it
        shape = {k: getattr(args, k) for k in llama.SHAPE}
        options = sorted(k for k in llama.OPTIONS if getattr(args, k))
        raise UserError(f"GGUF export writes Llama's architecture: it needs {llama.SHAPE} and none of "
                        f"{', '.join(llama.OPTIONS)}; this model has {shape}, options {options or 'none'}; "
                        f"export it with --format hf instead")
    if dtype not in WRITE_TYPES:
        raise UserError(f"GGUF weight type {dtype!r} is not supported; choose one of {', '.join(WRITE_TYPES)}")
    qtype, file_type = WRITE_TYPES[dtype]
    out = Path(out_path)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])  # the file is named once it is written
    writer.add_name(out.stem)
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    if args.rope_scaling:
        writer.add_rope_scaling_orig_ctx_len(int(args.rope_scaling[3]))
        writer.add_tensor(ROPE_FREQS, _rope_divisors(args).float().numpy())
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, tokenizer, tokenizer_config, args.vocab_size)
    state = model.state_dict()
    for ours, name in _name_map(args.n_layers, args.bias).items():
        if ours == "output.weight" and args.tie_embeddings:
            continue  # llama.cpp reuses token_embd.weight when output.weight is absent
        w = state[ours].detach().to("cpu", torch.float32)
        heads = _permuted(ours, args)
        if heads is not None:
            w = _rope_rows(w, heads, to_gguf=True)
        data, raw = _encode(w.numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=raw)
    try:
        with replacing_file(out) as tmp:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    except OSError as e:
        raise UserError(f"cannot write {out}: {e}") from None
    return out


def _encode(w: np.ndarray, qtype) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Vectors stay F32; a matrix whose rows do not fill whole quantization blocks falls back to F16."""
    if w.ndim == 1 or qtype == Q.F32:
        return w, Q.F32
    if qtype == Q.Q8_0 and w.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        qtype = Q.F16
    return gguf.quants.quantize(w, qtype), qtype


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: Tokenizer, config: dict, vocab_size: int) -> None:
    from scalenlp.data.tokenizer import find_eos_token_id

    spec = json.loads(tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise UserError(f"GGUF export supports BPE tokenizers (byte-level as GPT-2's, SmolLM's and Llama 3's, or "
                        f"SentencePiece-style as Llama 2's); this one is a {spec['model']['type']} model")
    space_prefix = _space_prefix(tokenizer) if spec["model"].get("byte_fallback") else None
    if space_prefix is None and spec.get("normalizer") is not None:
        raise UserError("GGUF export supports byte-level BPE tokenizers without a normalizer (GPT-2, SmolLM, "
                        "Llama 3, scalenlp's own) and SentencePiece-style ones with byte fallback; this one has a "
                        f"normalizer and no byte fallback ({tokenizer.normalizer!r}); export it with --format hf")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise UserError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embeddings; "
                        f"they do not belong together")
    added = tokenizer.get_added_tokens_decoder()
    # Ids the tokenizer never produces (an embedding table padded past the vocabulary) still need a
    # token in llama.cpp, which sizes its vocabulary from this list.
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = (gguf.TokenType.NORMAL if i not in added else
                    gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in spec["model"]["merges"]]
    if space_prefix is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_name(tokenizer))
        writer.add_token_merges([" ".join(m) for m in merges])
    else:
        _write_sentencepiece(writer, tokens, types, ["".join(m) for m in merges], spec["model"].get("unk_token"),
                             space_prefix)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    ids = Pretrained(None, {}, tokenizer, config)
    eos = ids.token_id("eos_token")
    eos = find_eos_token_id(tokenizer) if eos is None else eos
    bos = ids.token_id("bos_token")
    if eos is not None:
        writer.add_eos_token_id(eos)
    if bos is not None or eos is not None:  # GPT-2 style: without a BOS of its own, BOS is the EOS token
        writer.add_bos_token_id(eos if bos is None else bos)
    # Whether BOS starts every text is the tokenizer's own behaviour (its post-processor), whatever the config says.
    writer.add_add_bos_token(bos is not None and tokenizer.encode("a").ids[0] == bos)
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def _write_sentencepiece(writer: gguf.GGUFWriter, tokens: list[str], types: list[int], merged: list[str],
                         unk: str | None, space_prefix: bool) -> None:
    """A SentencePiece-style BPE as llama.cpp's "llama" vocabulary, which has scores instead of merges: a token
    scores minus the rank of its first merge (``merged``: each merge's token, in rank order), so that llama.cpp's
    best-score-first merging (and ``_sentencepiece``) takes them in the same order. <0xNN> tokens are marked as
    bytes, which llama.cpp needs for byte fallback."""
    ids = {t: i for i, t in enumerate(tokens)}
    scores = [0.0] * len(tokens)
    for rank in reversed(range(len(merged))):
        scores[ids[merged[rank]]] = -float(rank + 1)
    for i, token in enumerate(tokens):
        if types[i] == gguf.TokenType.NORMAL and BYTE_TOKEN.fullmatch(token):
            types[i] = gguf.TokenType.BYTE
    if unk is not None and unk in ids:
        types[ids[unk]] = gguf.TokenType.UNKNOWN
        writer.add_unk_token_id(ids[unk])
    writer.add_tokenizer_model("llama")
    writer.add_token_scores(scores)
    writer.add_add_space_prefix(space_prefix)


def _space_prefix(tokenizer: Tokenizer) -> bool:
    """Whether a SentencePiece-style tokenizer starts texts with ▁ (llama.cpp's add_space_prefix), judged by what it
    does to texts with and without a leading space: llama.cpp turns each space into ▁, keeps the text whole, and adds
    one ▁ before any text, or none before any."""
    def seen(text: str) -> list[str]:
        text = tokenizer.normalizer.normalize_str(text) if tokenizer.normalizer else text
        return [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)] if tokenizer.pre_tokenizer else [text]

    probes = ("a b", " a  b\nc")
    for prefix in (True, False):
        if all(seen(text) == [SPACE * prefix + text.replace(" ", SPACE)] for text in probes):
            return prefix
    raise UserError(f"GGUF export of a SentencePiece-style tokenizer needs spaces turned into {SPACE} on the whole "
                    f"text and one {SPACE} added before every text or none, as llama.cpp does; this one makes "
                    f"{[seen(text) for text in probes]!r} of {probes!r} (transformers' Metaspace adds none before a "
                    f"leading space); export it with --format hf")


def _pre_name(tokenizer: Tokenizer) -> str:
    """llama.cpp knows a pre-tokenization by name only: name ours by what it does to a text on which the
    known ones differ (digit runs, contractions, whitespace runs, punctuation, non-ASCII letters)."""
    splits = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(PROBE)] if tokenizer.pre_tokenizer else None
    for name, make in PRE_TOKENIZERS.items():
        if splits == [piece for piece, _ in make().pre_tokenize_str(PROBE)]:
            return name
    raise UserError(f"GGUF export supports byte-level BPE tokenizers that split text as llama.cpp's "
                    f"{', '.join(PRE_TOKENIZERS)} pre-tokenizers do; this one splits differently "
                    f"({tokenizer.pre_tokenizer!r})")
