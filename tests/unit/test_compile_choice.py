"""`--compile auto`: the decode step compiled where a stack of the model's layers measured at least MARGIN times as
fast compiled on this machine, timed once and cached per machine and model shape (the timing injected here); on
and off taken as asked; eager without timing where the compiled step is not supported; the start-up line says
which and why."""

from __future__ import annotations

import argparse

import pytest
import torch

from scalenlp.cli import main
from scalenlp.compress.quantized import Quantization
from scalenlp.engine import compile_choice
from scalenlp.engine.compile_choice import MARGIN, ROUNDS, choose_compile
from scalenlp.engine.config import EngineConfig
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs

CPU = torch.device("cpu")
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


class Timer:
    """A measurement seam that reports given step times (per round: batch 1, batch 16) and counts its calls."""

    def __init__(self, eager: list[float], compiled: list[float], compile_s: float = 12.0):
        self.timings = {"eager": [eager] * ROUNDS, "compiled": [compiled] * ROUNDS, "compile_s": compile_s}
        self.calls = 0

    def __call__(self, args, dtype, layers, device, quantize):
        self.calls += 1
        self.quantize = quantize
        assert layers >= compile_choice.MIN_LAYERS and device == CPU
        return self.timings


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SCALENLP_COMPILE", raising=False)  # tests/conftest.py sets it for every other test
    return tmp_path / "scalenlp"


def test_measured_once_then_read_from_the_cache(cache):
    timer = Timer(eager=[10e-3, 40e-3], compiled=[8e-3, 30e-3])  # 50 / 38 ms: 1.32x
    first = choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    [path] = cache.glob("compile-*.json")
    assert first.on and timer.calls == 1
    assert first.line().startswith("compile on: the decode step measured 1.32x as fast compiled")
    assert "8 and 30 against 10 and 40 ms a step; compiling them took 12 s" in first.reason
    assert f"measured now, cached in {path}" in first.reason
    second = choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    assert timer.calls == 1 and second.on and second.reason == first.reason.replace("measured now, cached", "cached")
    # Another dtype or other widths are another entry: the choice is per model shape.
    choose_compile("auto", CPU, ARGS, torch.bfloat16, measure=timer)
    choose_compile("auto", CPU, ModelArgs(dim=128, n_layers=2, n_heads=4), torch.float32, measure=timer)
    assert timer.calls == 3 and len(list(cache.glob("compile-*.json"))) == 3


def test_a_quantized_model_is_measured_quantized_and_cached_apart(cache):
    timer = Timer(eager=[10e-3, 40e-3], compiled=[8e-3, 30e-3])
    plain = choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    assert timer.quantize is None
    int4 = Quantization("int4", 32)
    quantized = choose_compile("auto", CPU, ARGS, torch.float32, quantize=int4, measure=timer)
    assert timer.calls == 2 and timer.quantize == int4 and quantized.on and plain.on
    assert len(list(cache.glob("compile-*-float32-int432-*.json"))) == 1 and len(list(cache.glob("compile-*.json"))) == 2


def test_int8dyn_stays_eager_and_refuses_compile_on(tiny_export, cache, monkeypatch, capsys):
    """int8dyn's per-token activation scales break the compiled graph: auto stays eager untimed, on is one line."""
    monkeypatch.setattr(compile_choice, "time_decode", never)
    argv = ["generate", "--checkpoint", str(tiny_export), "--prompt", "the", "--max-tokens", "2", "--device", "cpu",
            "--dtype", "float32", "--quantize", "int8dyn"]
    assert main([*argv, "--compile", "auto"]) == 0
    assert "compile off: the compiled decode step does not take int8dyn layers" in capsys.readouterr().err
    assert main([*argv, "--compile", "on"]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --compile on does not take int8dyn layers (their per-token activation scales break the compiled "
        "graph); drop --compile, or quantize with int8 or int4")


def test_the_stack_it_times_is_quantized_as_the_model_is(monkeypatch):
    """time_decode builds the layers it times with the model's quantized kernels (here without compiling: the
    compiled step is the engine's own, tested in test_engine)."""
    built = []
    monkeypatch.setattr(compile_choice, "WARMUP", 0)
    monkeypatch.setattr(compile_choice, "ROUNDS", 1)
    monkeypatch.setattr("scalenlp.engine.decoder_engine.compiled_step", lambda model: built.append(model) or model)
    timings = compile_choice.time_decode(ARGS, torch.float32, compile_choice.MIN_LAYERS, CPU, Quantization("int8"))
    assert len(timings["eager"]) == len(timings["compiled"]) == 1
    [model] = built
    assert {type(m).__name__ for m in model.modules()} >= {"Int8Linear"}


@pytest.mark.parametrize("eager_ms, compiled_ms, on", [
    ([10, 40], [10, 40], False),  # a tie: eager, no compile time spent
    ([10, 40], [10, 40 / MARGIN - 5], True),  # the sum of both steps decides, not batch 1 alone
    ([11.2, 44.8], [10, 40], True),  # 1.12x, just over MARGIN
    ([10, 40], [5, 50], False),  # a slower big batch outweighs a faster single row
])
def test_the_choice_follows_the_timing(cache, eager_ms, compiled_ms, on):
    timer = Timer([t / 1e3 for t in eager_ms], [t / 1e3 for t in compiled_ms])
    choice = choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    assert choice.on is on
    if not on:
        assert f"under the {MARGIN}x that pays for compiling" in choice.reason


def test_rounds_slowed_by_neighbours_do_not_decide(cache):
    timer = Timer(eager=[10e-3, 40e-3], compiled=[8e-3, 30e-3])
    timer.timings["compiled"] = [[0.5, 0.5]] * (ROUNDS - 1) + [[8e-3, 30e-3]]  # all but one round slowed down
    timer.timings["eager"][1] = [1.0, 1.0]
    choice = choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    assert choice.on and "1.32x" in choice.reason  # each mode's fastest round is what counts


@pytest.mark.parametrize("content", ["", "{", '{"speedup": 2}', '{"speedup": -1, "ms": {}, "compile_s": 1}',
                                     # a record of the step compiled with freezing, before it was cached
                                     '{"speedup": 2.96, "ms": {"eager": [52, 216], "compiled": [38, 53]}, '
                                     '"compile_s": 90}'])
def test_a_corrupt_or_outdated_cache_file_is_measured_again(cache, content):
    timer = Timer(eager=[10e-3, 40e-3], compiled=[8e-3, 30e-3])
    choose_compile("auto", CPU, ARGS, torch.float32, measure=timer)
    [path] = cache.glob("compile-*.json")
    path.write_text(content)
    assert choose_compile("auto", CPU, ARGS, torch.float32, measure=timer).on and timer.calls == 2


def never(*args):
    raise AssertionError("auto timed the decode step where it should not")


@pytest.mark.parametrize("requested, on", [("on", True), ("off", False)])
def test_on_and_off_are_taken_without_measuring(cache, requested, on):
    choice = choose_compile(requested, CPU, ARGS, torch.float32, measure=never)
    assert choice.on is on and choice.reason is None  # asked for: nothing to explain


@pytest.mark.parametrize("forced, on", [("on", True), ("off", False)])
def test_the_environment_decides_auto_without_measuring(cache, monkeypatch, forced, on):
    monkeypatch.setenv("SCALENLP_COMPILE", forced)
    assert choose_compile("auto", CPU, ARGS, torch.float32, measure=never).on is on


def test_auto_stays_eager_untimed_where_the_compiled_step_is_not_supported(cache):
    choice = choose_compile("auto", CPU, ARGS, torch.float32, unsupported="--tp", measure=never)
    assert not choice.on and "does not take --tp yet" in choice.reason
    choice = choose_compile("auto", torch.device("mps"), ARGS, torch.float32, measure=never)
    assert not choice.on and "not mps" in choice.reason


def test_a_stack_too_large_for_memory_is_not_timed(cache, monkeypatch):
    monkeypatch.setattr(compile_choice, "device_memory", lambda device: 2**20)
    choice = choose_compile("auto", CPU, ARGS, torch.float32, measure=never)
    assert not choice.on and "too large to time" in choice.reason


def test_the_flag_and_the_python_api():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser, names=("checkpoint", "compile"))
    parse = lambda *flags: EngineConfig.from_args(parser.parse_args(["--checkpoint", "m", *flags])).compile  # noqa: E731
    assert (parse(), parse("--compile"), parse("--compile", "off")) == ("auto", "on", "off")
    assert EngineConfig("m", compile=True).compile == "on" and EngineConfig("m", compile=False).compile == "off"
    with pytest.raises(UserError, match="^--compile must be one of auto, on, off, got 'yes'$"):
        EngineConfig("m", compile="yes").check()
    EngineConfig("m", tp=2).check()  # auto with --tp: eager, said at start-up, not refused
    with pytest.raises(UserError, match="not supported with --tp"):
        EngineConfig("m", tp=2, compile="on").check()


def test_generate_says_whether_it_compiled_and_why(tiny_export, cache, monkeypatch, capsys):
    monkeypatch.setattr(compile_choice, "time_decode", Timer(eager=[10e-3, 40e-3], compiled=[10e-3, 40e-3]))
    argv = ["generate", "--checkpoint", str(tiny_export), "--prompt", "the", "--max-tokens", "2", "--device", "cpu",
            "--dtype", "float32"]
    assert main(argv) == 0
    assert "compile" not in capsys.readouterr().err  # a terminal's default: off, as asked, nothing to explain
    argv += ["--compile", "auto"]
    assert main(argv) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compile ")]
    assert line.startswith("compile off: the decode step measured 1.00x as fast compiled")
    assert main([*argv, "--compile", "off"]) == 0
    assert "compile" not in capsys.readouterr().err
    monkeypatch.setattr(compile_choice, "time_decode", never)
    assert main([*argv, "--speculative-tokens", "2"]) == 0  # eager, untimed, and said
    assert "compile off: the compiled decode step does not take speculative decoding" in capsys.readouterr().err
