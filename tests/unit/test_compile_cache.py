"""The compiled decode step's artifacts kept between starts (engine/compile_cache.py): the file is named by what the
graph is built for; a damaged, stale or foreign file is reported and compiled past, never trusted; a start after
one that compiled takes the step from the file alone (Inductor's own cache folder emptied), with the same tokens."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine import compile_cache
from scalenlp.engine.compile_cache import MAGIC, artifacts_path, load, step_key
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.io import load_pretrained

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "scalenlp"


def tiny(dtype=torch.float32, **args):
    return Transformer(ModelArgs(**{"dim": 32, "n_layers": 1, "n_heads": 4, "ffn_dim": 64, **args})).to(dtype)


def test_the_file_is_named_by_what_the_graph_is_built_for(cache):
    key = step_key(tiny(), torch.float32, 64, 16)
    assert key == step_key(tiny(), torch.float32, 64, 16)  # another instance, other weights: the same graph
    others = [step_key(tiny(torch.bfloat16), torch.bfloat16, 64, 16), step_key(tiny(), torch.bfloat16, 64, 16),
              step_key(tiny(n_layers=2), torch.float32, 64, 16), step_key(tiny(rope_theta=5e5), torch.float32, 64, 16),
              step_key(tiny(), torch.float32, 128, 16), step_key(tiny(), torch.float32, 64, 32)]
    assert len({key, *others}) == 1 + len(others)
    path = artifacts_path(key, CPU, torch.float32)
    assert path.parent == cache and path.name.startswith("compiled-step-") and path.suffix == ".bin"
    assert f"-{torch.get_num_threads()}t-float32-" in path.name
    assert len({path, *(artifacts_path(k, CPU, torch.float32) for k in others)}) == 1 + len(others)


def write(path, header: bytes, payload: bytes) -> None:
    path.write_bytes(MAGIC + header + b"\n" + payload)


def header(key: str, payload: bytes) -> bytes:
    return json.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest()}).encode()


def test_damaged_stale_and_foreign_files_are_reported_not_loaded(cache):
    key = step_key(tiny(), torch.float32, 64, 16)
    path = artifacts_path(key, CPU, torch.float32)
    assert load(path, key) == (False, None)  # none yet: nothing to say
    cache.mkdir()
    cases = {
        b"not a cache file at all": "could not be loaded (ValueError: not a compiled-step cache file)",
        MAGIC + b'{"key": ': "could not be loaded (ValueError: truncated)",
        MAGIC + b"{not json\npayload": "could not be loaded (JSONDecodeError",
    }
    for data, said in cases.items():
        path.write_bytes(data)
        loaded, why = load(path, key)
        assert not loaded and why.startswith(said)
    write(path, header(step_key(tiny(n_layers=2), torch.float32, 64, 16), b"x"), b"x")
    assert load(path, key) == (False, "was written for another model or KV cache")
    write(path, header(key, b"the payload written"), b"the payload damaged")
    assert load(path, key) == (False, "is damaged (its checksum does not match)")
    # A checksum that matches over bytes PyTorch cannot read: refused, not raised.
    write(path, header(key, b"\x80\x04not a pickle"), b"\x80\x04not a pickle")
    loaded, why = load(path, key)
    assert not loaded and (why == "was refused by this PyTorch" or why.startswith("could not be loaded"))


@pytest.mark.slow  # two real compiles of a 2-layer model and one from the cache: about a minute here
def test_a_second_start_compiles_from_the_cached_artifacts(cache, tiny_export, tmp_path, monkeypatch):
    monkeypatch.delenv("SCALENLP_COMPILE", raising=False)
    tokenizer = load_tokenizer(tiny_export)
    prompts = ["hello", "the quick brown fox jumps over the lazy dog " * 3]

    def run(compile: bool, inductor_dir: str, new_process: bool = True) -> tuple[list[str], Engine]:
        # As a new process: Inductor's own on-disk cache emptied, and Dynamo's in-memory one; only our file can serve.
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / inductor_dir))
        if new_process:
            torch._dynamo.reset()
        engine = Engine(load_pretrained(tiny_export), tokenizer, max_batch=2, eos_id=find_eos_token_id(tokenizer),
                        compile=compile).start()
        try:
            return engine.generate(prompts, GREEDY), engine
        finally:
            engine.stop()

    expected, _ = run(False, "eager")
    cold_texts, cold = run(True, "cold")
    [path] = cache.glob("compiled-step-*.bin")
    written = path.read_bytes()
    assert cold.compile_line == f"compiled the decode step in {cold.compile_seconds:.0f} s; cached for later " \
                                f"starts in {path}"
    again_texts, again = run(True, "cold", new_process=False)  # a second engine of the same process
    assert again.compile_line.endswith(f" s from the artifacts cached in {path}") and again_texts == expected
    assert path.read_bytes() == written
    warm_texts, warm = run(True, "warm")
    assert warm.compile_line.endswith(f"s from the artifacts cached in {path}")
    assert cold_texts == warm_texts == expected
    path.write_bytes(written[:-100] + bytes(100))  # the payload's last bytes lost
    damaged_texts, damaged = run(True, "damaged")
    assert damaged.compile_line.endswith(f"s (the cache file {path} is damaged (its checksum does not match): not "
                                         f"used); cached for later starts in {path}")
    assert damaged_texts == expected
    # The key of the model as the engine ran it (packed: the kinds of its layers are part of the key).
    assert compile_cache.load(path, step_key(damaged.model, torch.float32,
                                             damaged.blocks.capacity + 1, damaged.blocks.block_size))[0]
    assert not compile_cache.load(path, step_key(load_pretrained(tiny_export), torch.float32,
                                                 damaged.blocks.capacity + 1, damaged.blocks.block_size))[0]
