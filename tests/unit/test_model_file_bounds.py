"""Model files that ask for more than they hold are refused before anything is allocated, in one line naming the
field and the file, exit code 2 (issue 32, item 4): absurd counts, zero heads, dimensions that are not whole
numbers, an out-of-range BOS id, a list for model arguments, tensor offsets that wrap, overlap or leave the file,
weights or a KV cache larger than the device's memory. Then a seeded fuzzer over every file kind the loader reads."""

from __future__ import annotations

import json
import random
import struct
import time
import traceback
from pathlib import Path

import pytest

from model_files import copy_model, edit_json, gguf_places, patch_gguf, tiny_files
from scalenlp.cli import main
from scalenlp.models import memory
from scalenlp.models.limits import MAX_VOCAB, MAX_WIDTH


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return tiny_files(tmp_path_factory.mktemp("model_files"))


def command(checkpoint: Path, *flags: str) -> list[str]:
    """The command that loads ``checkpoint`` and uses it: a sentence embedding for an encoder, else two tokens."""
    if (checkpoint / "config.json").is_file() and "bert" in (checkpoint / "config.json").read_text():
        return ["embed", "--checkpoint", str(checkpoint), "--text", "hi", *flags]
    return ["generate", "--checkpoint", str(checkpoint), "--prompt", "hi", "--max-tokens", "2", *flags]


def refused(capsys, checkpoint: Path, *words: str, flags: tuple[str, ...] = ()) -> str:
    """The one error line the CLI gives for ``checkpoint`` (exit code 2), holding every one of ``words``."""
    rc = main(command(checkpoint, *flags))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def changed_json(files, tmp_path, kind: str, name: str, change) -> Path:
    model = copy_model(files[kind], tmp_path / kind)
    edit_json(model / name, change)
    return model


def changed_gguf(files, tmp_path, place: str, value: int) -> Path:
    model = copy_model(files["gguf"], tmp_path / "model")
    patch_gguf(model, place, value)
    return model


def test_the_untouched_files_load(files, capsys):
    for model in files.values():
        assert main(command(model)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("key, value, words", [
    ("num_hidden_layers", 10**9, ("num_hidden_layers=1,000,000,000", "2,048")),
    ("max_position_embeddings", 10**9, ("max_position_embeddings=1,000,000,000",)),
    ("num_attention_heads", 0, ("num_attention_heads=0", "at least 1")),
    ("hidden_size", "32", ("hidden_size='32'", "whole number")),
    ("intermediate_size", 64.5, ("intermediate_size=64.5", "whole number")),
    ("num_key_value_heads", 3, ("n_heads 4 is not divisible by n_kv_heads 3",)),
    ("rms_norm_eps", "tiny", ("norm_eps='tiny'", "finite number")),
])
def test_decoder_config_json(files, tmp_path, capsys, key, value, words):
    model = changed_json(files, tmp_path, "hf", "config.json", lambda c: c.update({key: value}))
    refused(capsys, model, "config.json", *words)


@pytest.mark.parametrize("key, value, words", [
    ("num_hidden_layers", 10**9, ("num_hidden_layers=1,000,000,000",)),
    ("hidden_size", "32", ("hidden_size='32'",)),
    ("num_attention_heads", 0, ("num_attention_heads=0",)),
    ("pad_token_id", 10**6, ("pad_token_id",)),
])
def test_encoder_config_json(files, tmp_path, capsys, key, value, words):
    model = changed_json(files, tmp_path, "encoder", "config.json", lambda c: c.update({key: value}))
    refused(capsys, model, "config.json", *words)


def test_encoder_with_a_billion_labels(files, tmp_path, capsys):
    def classifier(c):
        c.update(architectures=["BertForSequenceClassification"], num_labels=10**9)
        c.pop("id2label", None)
    refused(capsys, changed_json(files, tmp_path, "encoder", "config.json", classifier), "num_labels=1,000,000,000")


@pytest.mark.parametrize("change, words", [
    (lambda a: [a], ("model_args.json holds a JSON list",)),
    (lambda a: a.update(n_layers=10**9), ("n_layers=1,000,000,000",)),
    (lambda a: a.update(n_heads=0), ("n_heads=0",)),
    (lambda a: a.update(dim="32"), ("dim='32'",)),
    (lambda a: a.update(max_seq_len=10**9), ("max_seq_len=1,000,000,000",)),
    (lambda a: a.update(tie_embeddings="no"), ("tie_embeddings='no'",)),
    (lambda a: a.update(rope_theta=float("nan")), ("rope_theta=nan",)),
])
def test_model_args_json(files, tmp_path, capsys, change, words):
    refused(capsys, changed_json(files, tmp_path, "export", "model_args.json", change), "model_args.json", *words)


def test_token_ids_beyond_the_embeddings(files, tmp_path, capsys):
    # A BOS (or any token) the tokenizer numbers past the embedding table: refused at load, not in the first forward.
    def renumber(t):
        t["added_tokens"][0]["id"] = 10**6
        t["model"]["vocab"][t["added_tokens"][0]["content"]] = 10**6
    model = changed_json(files, tmp_path, "export", "tokenizer.json", renumber)
    refused(capsys, model, "token ids up to 1,000,000", "320 token embeddings")


@pytest.mark.parametrize("place, value, words", [
    ("llama.block_count", 2**31, ("llama.block_count=2,147,483,648",)),
    ("llama.context_length", 50_000_000, ("llama.context_length=50,000,000",)),
    ("llama.attention.head_count", 0, ("llama.attention.head_count=0",)),
    ("llama.embedding_length", 0, ("llama.embedding_length=0",)),
    ("tokenizer.ggml.bos_token_id", 10**6, ("tokenizer.ggml.bos_token_id=1000000", "320")),
    # Arrays that claim more items than the file has bytes for (the gguf package loops over each, growing).
    ("tokenizer.ggml.token_type#length", 2**40, ("token_type", "1,099,511,627,776")),
    ("tokenizer.ggml.tokens#length", 2**40, ("tokens", "1,099,511,627,776")),
    ("tensor:token_embd.weight:dim0", 2**40, ("token_embd.weight", "past its end")),
])
def test_gguf_metadata(files, tmp_path, capsys, place, value, words):
    refused(capsys, changed_gguf(files, tmp_path, place, value), "model.gguf", *words)


def test_gguf_version_the_reader_does_not_know(files, tmp_path, capsys):
    model = copy_model(files["gguf"], tmp_path / "model")
    with open(model, "r+b") as f:  # GGUF v1's counts are 32-bit: read as v3's they would misplace every field
        f.seek(4)
        f.write(struct.pack("<I", 1))
    refused(capsys, model, "GGUF version 1", "supported: 2, 3")


def test_gguf_tensor_offsets(files, tmp_path, capsys):
    places = gguf_places(files["gguf"])
    # Negative: 2^64 - 64 wraps below the data, where the gguf package read header bytes as weights.
    refused(capsys, changed_gguf(files, tmp_path / "negative", "tensor:blk.1.ffn_up.weight:offset", -64),
            "blk.1.ffn_up.weight", "past its end")
    refused(capsys, changed_gguf(files, tmp_path / "outside", "tensor:output_norm.weight:offset", 2**40),
            "output_norm.weight", "past its end")
    model = copy_model(files["gguf"], tmp_path / "overlap" / "model")
    at, _ = places["tensor:blk.0.attn_q.weight:offset"]
    with open(files["gguf"], "rb") as f:
        f.seek(at)
        first = struct.unpack("<Q", f.read(8))[0]
    patch_gguf(model, "tensor:blk.0.attn_k.weight:offset", first)
    refused(capsys, model, "overlap", "blk.0.attn_q.weight", "blk.0.attn_k.weight")


def test_weights_larger_than_the_machine(files, tmp_path, capsys):
    # Shapes within every count's range whose weights no machine has: priced before anything is allocated.
    model = changed_json(files, tmp_path, "export", "model_args.json",
                         lambda a: a.update(vocab_size=MAX_VOCAB, dim=MAX_WIDTH))
    refused(capsys, model, str(model), "parameters", "GiB", f"vocab_size={MAX_VOCAB}", f"dim={MAX_WIDTH}")


def test_kv_cache_larger_than_the_machine(files, tmp_path, capsys, monkeypatch):
    # A context of 65,536 positions in a machine of 8 MiB: the weights (100 KB) and RoPE tables (4 MiB) fit, the
    # default KV cache of eight such sequences (64 MiB) does not, and the message says how large a cache does.
    monkeypatch.setattr(memory, "device_memory", lambda device: 8 << 20)
    model = changed_gguf(files, tmp_path, "llama.context_length", 65536)
    line = refused(capsys, model, "KV cache of 524,288 positions", "--kv-cache-tokens")
    fit = int(line.split("--kv-cache-tokens ")[1].split()[0].replace(",", ""))
    assert main(command(model, "--kv-cache-tokens", str(fit))) == 0, capsys.readouterr().err
    assert main(command(model, "--kv-cache-tokens", str(fit + 1))) == 2


# ---------------------------------------------------------------------------------------------- the fuzzer

VALUES = [0, -1, 1, 3, 2**31, 2**32 + 1, 2**63, -(2**63), 10**9, 10**30, 0.5, -1e-9, 1e308, "", "x", "\ud800", None,
          True, [], {}, [0, 0], {"a": 1}]


def _paths(node, prefix=()):
    """Every place in a JSON document, as the keys and indexes that lead there."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _mutate_json(data, rng: random.Random):
    """``data`` with one place replaced by a value of the wrong kind or size, or removed."""
    path = rng.choice(list(_paths(data))[1:] or [()])
    if not path:
        return rng.choice(VALUES)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(VALUES)
    return data


def _fuzz_json(file: Path, rng: random.Random) -> None:
    edit_json(file, lambda data: _mutate_json(data, rng))


def _fuzz_safetensors(folder: Path, rng: random.Random) -> None:
    file = next(folder.glob("*.safetensors"))
    raw = file.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    if rng.random() < 0.25:  # the header's own length
        file.write_bytes(struct.pack("<Q", rng.choice([0, 7, size + 1, len(raw), 2**40, 2**64 - 1])) + raw[8:])
        return
    header = _mutate_json(json.loads(raw[8:8 + size]), rng)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def _fuzz_gguf(file: Path, rng: random.Random) -> None:
    places = gguf_places(file)
    size = file.stat().st_size
    roll = rng.random()
    if roll < 0.15:  # cut short
        file.write_bytes(file.read_bytes()[:rng.randrange(size)])
    elif roll < 0.3:  # a few bytes of the header scrambled
        data = bytearray(file.read_bytes())
        for _ in range(4):
            data[rng.randrange(8000)] = rng.randrange(256)
        file.write_bytes(bytes(data))
    else:
        offsets = [struct.unpack("<Q", file.read_bytes()[at:at + 8])[0] for p, (at, _) in places.items()
                   if p.endswith(":offset")]
        value = rng.choice([0, 1, 2**16, 2**31, 2**32 - 1, 2**40, 2**63, -1, -64, size, rng.choice(offsets)])
        patch_gguf(file, rng.choice(sorted(places)), value)


# (what is damaged, the model it starts from, how)
TARGETS = [("model_args.json", "export", lambda m, rng: _fuzz_json(m / "model_args.json", rng)),
           ("tokenizer.json", "export", lambda m, rng: _fuzz_json(m / "tokenizer.json", rng)),
           ("safetensors header", "export", _fuzz_safetensors),
           ("decoder config.json", "hf", lambda m, rng: _fuzz_json(m / "config.json", rng)),
           ("encoder config.json", "encoder", lambda m, rng: _fuzz_json(m / "config.json", rng)),
           ("gguf", "gguf", _fuzz_gguf)]
CASES = {"model_args.json": 20, "tokenizer.json": 20, "safetensors header": 16, "decoder config.json": 20,
         "encoder config.json": 16, "gguf": 60}


def _peak_rss() -> int:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS


@pytest.mark.slow  # 152 loads of damaged tiny models (most refused within 0.1 s); 20-30 s here under load
def test_fuzzed_model_files_end_in_one_line_or_a_result(files, tmp_path, capsys):
    """Every damaged file ends in exit code 0 or 2 (never a traceback), each within 10 s and 1 GB above the
    memory it started at: one seed, a fixed number of cases per file kind."""
    rng = random.Random(32)
    failures, outcomes = [], {0: 0, 2: 0}
    for n, (target, source, damage) in enumerate(TARGETS):
        for i in range(CASES[target]):
            model = copy_model(files[source], tmp_path / f"{n}-{i}" / "model")
            damage(model, rng)
            _reset_peak()
            start_rss, start = _peak_rss(), time.monotonic()
            try:
                rc = main(command(model))
            except BaseException:  # noqa: BLE001 - a traceback (or an exit) is what this test looks for
                rc = traceback.format_exc(limit=-3)
            seconds, grown = time.monotonic() - start, _peak_rss() - start_rss
            capsys.readouterr()
            if rc not in (0, 2) or seconds > 10 or grown > 2**30:
                failures.append(f"{target} #{i}: rc {rc}, {seconds:.1f} s, +{grown / 2**20:.0f} MiB")
            else:
                outcomes[rc] += 1
    assert not failures, "\n".join(failures)
    assert outcomes[2] > 100 and outcomes[0] > 5, outcomes  # most damage is refused; some is harmless
