"""`--dtype auto` on a CPU: float32 or bf16, whichever ran a layer of the model's widths faster on this machine, timed
once and cached per machine; an explicit dtype is taken as it is; the start-up line says which and why."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from scalenlp.cli import main
from scalenlp.engine import dtype as dtype_module
from scalenlp.engine.dtype import DtypeChoice, LayerShapes, choose_dtype, time_layer
from scalenlp.hardware import time_rounds
from scalenlp.models.decoder import ModelArgs
from scalenlp.models.encoder import EncoderArgs

CPU = torch.device("cpu")
CPU_CANDIDATES, PREFILL_ROWS, ROUNDS = dtype_module.CPU_CANDIDATES, dtype_module.PREFILL_ROWS, dtype_module.ROUNDS
SHAPES = LayerShapes(dim=64, q_width=64, kv_width=32, ffn=128, gated=True, layers=2)


class Timer:
    """A measurement seam that reports given timings and counts its calls: per candidate, per round, (seconds of a
    one-row pass, seconds of a prefill)."""

    def __init__(self, **rounds: list[tuple[float, float]]):
        self.rounds, self.calls = rounds, 0

    def __call__(self, shapes: LayerShapes):
        self.calls += 1
        return self.rounds


def uniform(float32: tuple[float, float], bfloat16: tuple[float, float], rounds: int = ROUNDS) -> Timer:
    return Timer(float32=[float32] * rounds, bfloat16=[bfloat16] * rounds)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "scalenlp"


def test_measured_once_then_read_from_the_cache(cache):
    timer = uniform(float32=(1e-3, 10e-3), bfloat16=(2e-3, 20e-3))
    first = choose_dtype(CPU, "auto", SHAPES, timer)
    [path] = cache.glob("dtype-*.json")
    assert first.dtype == torch.float32 and timer.calls == 1
    assert f"measured now, cached in {path}" in first.reason and "2.00x as fast as bfloat16" in first.reason
    second = choose_dtype(CPU, "auto", SHAPES, timer)
    assert timer.calls == 1 and second.dtype == torch.float32
    assert second.reason == first.reason.replace("measured now, cached", "cached")
    # Other widths are another entry: the choice is per model shape.
    choose_dtype(CPU, "auto", LayerShapes(dim=128, q_width=128, kv_width=128, ffn=256, gated=True, layers=2), timer)
    assert timer.calls == 2 and len(list(cache.glob("dtype-*.json"))) == 2


MS = {"float32": [1.0, 10.0], "bfloat16": [2.0, 20.0]}


@pytest.mark.parametrize("content", ["{not json", "", json.dumps({"dtype": "float16", "speedup": 2.0}),
                                     json.dumps({"bfloat16_speedup": 0, "ms": MS}),
                                     json.dumps({"bfloat16_speedup": 2.0, "ms": {**MS, "float32": [1.0]}}),
                                     # measured before float32 was packed as the engine packs it now
                                     json.dumps({"bfloat16_speedup": 2.0, "ms": MS})])
def test_a_corrupt_or_outdated_cache_file_is_measured_again_and_rewritten(cache, content):
    choose_dtype(CPU, "auto", SHAPES, uniform(float32=(1e-3, 10e-3), bfloat16=(2e-3, 20e-3)))
    [path] = cache.glob("dtype-*.json")
    path.write_text(content)
    timer = uniform(float32=(4e-3, 40e-3), bfloat16=(1e-3, 10e-3))
    choice = choose_dtype(CPU, "auto", SHAPES, timer)
    assert timer.calls == 1 and choice.dtype == torch.bfloat16 and "measured now" in choice.reason
    assert json.loads(path.read_text())["bfloat16_speedup"] == 4.0
    assert choose_dtype(CPU, "auto", SHAPES, timer).dtype == torch.bfloat16 and timer.calls == 1


def test_the_choice_follows_the_timing(cache):
    bf16_faster = choose_dtype(CPU, "auto", SHAPES, uniform(float32=(3e-3, 30e-3), bfloat16=(1e-3, 10e-3)))
    assert bf16_faster.dtype == torch.bfloat16
    assert bf16_faster.line().startswith("dtype bfloat16: measured 3.00x as fast as float32 on this CPU")
    assert "1 against 3 ms a decode step, 10 against 30 ms a" in bf16_faster.reason


def test_decode_and_prefill_are_weighed_as_one_request(cache):
    """bf16 twice as fast at one row, slower at a prefill: the time of a request of PREFILL_ROWS prompt tokens and as
    many output tokens decides."""
    one, prefill = 1e-3, 1e-3 * PREFILL_ROWS  # float32's request: 2 units (a prefill, then as long decoding)
    decode_wins = uniform(float32=(one, prefill), bfloat16=(one / 2, prefill * 1.2))  # 0.5 + 1.2 units
    assert choose_dtype(CPU, "auto", SHAPES, decode_wins).dtype == torch.bfloat16
    wide = LayerShapes(dim=96, q_width=96, kv_width=96, ffn=96, gated=False, layers=2)
    prefill_wins = uniform(float32=(one, prefill), bfloat16=(one / 2, prefill * 2))  # 0.5 + 2 units
    assert choose_dtype(CPU, "auto", wide, prefill_wins).dtype == torch.float32


def test_bf16_is_chosen_only_when_its_gain_pays_for_its_rounding(cache):
    """bf16 rounds every value to 8 significant bits: a gain below BF16_MARGIN, which noise can decide, keeps float32,
    and the line says so."""
    margin = dtype_module.BF16_MARGIN
    slight = choose_dtype(CPU, "auto", SHAPES, uniform(float32=(1.05e-3, 10.5e-3), bfloat16=(1e-3, 10e-3)))
    assert slight.dtype == torch.float32
    assert slight.reason.startswith(f"bfloat16 measured only 1.05x as fast, under the {margin}x its coarser")
    other = LayerShapes(dim=128, q_width=128, kv_width=128, ffn=256, gated=True, layers=2)
    enough = choose_dtype(CPU, "auto", other, uniform(float32=(margin * 1e-3, margin * 1e-2), bfloat16=(1e-3, 1e-2)))
    assert enough.dtype == torch.bfloat16


def test_a_noisy_round_does_not_decide(cache):
    """A neighbour's burst in one round (bf16's half of it 20 times slower) moves the median of the rounds' ratios
    by nothing."""
    bf16_faster = [(1e-3, 10e-3)] * ROUNDS
    burst = [(20e-3, 200e-3)] + bf16_faster[1:]
    choice = choose_dtype(CPU, "auto", SHAPES, Timer(float32=[(2e-3, 20e-3)] * ROUNDS, bfloat16=burst))
    assert choice.dtype == torch.bfloat16 and "2.00x as fast as float32" in choice.reason


def test_a_cold_call_is_never_the_one_timed():
    """A pass's first call, and a candidate's first call since the other one ran (its caches, the cores' clocks then
    the other's), take a fixed 50 ms more, which timed would put bf16, twice as fast warm, near a tie. Each candidate
    warms up right before it is timed: the rounds hold the warm times, and the ratio is 2."""
    now, ran, last = [0.0], set(), [None]

    def timed_pass(name: str, seconds: float):
        def run():
            cold = (name, seconds) not in ran or last[0] != name
            now[0] += seconds + 50e-3 * cold
            ran.add((name, seconds))
            last[0] = name
        return run

    warm = {"float32": [2e-3, 20e-3], "bfloat16": [1e-3, 10e-3]}  # a one-row pass, a prefill
    timed = time_rounds({name: [timed_pass(name, s) for s in warm[name]] for name in CPU_CANDIDATES}, ROUNDS,
                        clock=lambda: now[0])
    assert timed == {name: [pytest.approx(warm[name])] * ROUNDS for name in CPU_CANDIDATES}
    record = dtype_module._record({name: [tuple(r) for r in rounds] for name, rounds in timed.items()})
    assert record["bfloat16_speedup"] == pytest.approx(2.0)


def test_an_explicit_dtype_is_taken_without_measuring(cache):
    timer = uniform(float32=(1e-3, 10e-3), bfloat16=(2e-3, 20e-3))
    for name in ("float32", "bfloat16", "float16"):
        assert choose_dtype(CPU, name, SHAPES, timer) == DtypeChoice(getattr(torch, name), None)
    assert timer.calls == 0 and not cache.exists()


def test_time_layer_times_both_candidates_in_every_round_and_leaves_the_rng_alone():
    torch.manual_seed(1)
    state = torch.get_rng_state()
    timings = time_layer(SHAPES)
    assert torch.equal(torch.get_rng_state(), state)
    assert set(timings) == set(CPU_CANDIDATES)
    assert all(len(rounds) == ROUNDS and all(one > 0 and prefill > 0 for one, prefill in rounds)
               for rounds in timings.values())
    encoder = time_layer(LayerShapes.of(EncoderArgs(dim=32, n_heads=4, ffn_dim=64, n_layers=2)))
    assert all(one == 0 and prefill > 0 for rounds in encoder.values() for one, prefill in rounds)  # no decode


def test_layer_shapes_are_the_products_the_engine_runs():
    smol = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536)
    shapes = LayerShapes.of(smol)
    assert shapes.products(fused=False) == [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536),
                                            (576, 1536), (1536, 576)]
    assert shapes.products(fused=True) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    halves = LayerShapes.of(smol, tp=3)  # column-parallel outputs and row-parallel inputs split; nothing packed
    assert halves.products(fused=False)[:4] == [(576, 192), (576, 64), (576, 64), (192, 576)] and not halves.packs
    gpt2 = LayerShapes.of(ModelArgs(dim=64, n_heads=4, ffn_dim=256, activation="gelu"))
    assert gpt2.products(fused=False)[4:] == [(64, 256), (256, 64)]


def test_decode_streams_copies_of_the_layer_up_to_the_model_or_past_the_cache(monkeypatch):
    monkeypatch.setattr(dtype_module, "_last_level_cache_bytes", lambda: 4 * 2**20)
    layer_bytes = 4 * sum(i * o for i, o in SHAPES.products(fused=False))
    assert dtype_module.streamed_copies(SHAPES) == 2  # the whole model fits in the cache, as it does when served
    deep = dataclasses.replace(SHAPES, layers=10**6)
    assert dtype_module.streamed_copies(deep) * layer_bytes >= 4 * 4 * 2**20 > (dtype_module.streamed_copies(deep) - 1) * layer_bytes


def test_generate_says_which_dtype_and_why(tiny_export, cache, capsys):
    argv = ["generate", "--checkpoint", str(tiny_export), "--prompt", "the", "--max-tokens", "2", "--device", "cpu"]
    assert main(argv) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dtype ")]
    [path] = cache.glob("dtype-*.json")
    assert line.split(":")[0] in ("dtype float32", "dtype bfloat16")
    assert "as fast as" in line and f"measured now, cached in {path}" in line
    assert main(argv) == 0 and f"cached in {path}" in capsys.readouterr().err
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert "dtype" not in capsys.readouterr().err  # asked for: nothing to explain


def test_float32_is_timed_packed_and_fused_as_the_engine_runs_it():
    """The engine packs every float32 linear (engine/packing.py): timing them plain priced float32's decode step
    1.2-1.4x too slow, and bf16 won the choice on a CPU where it was slower."""
    from scalenlp.engine.packing import PackedLinear, PanelLinear, panel_kernel

    with torch.no_grad():  # as time_layer builds them
        stack, _, _ = dtype_module._layers(SHAPES, torch.float32, 1)
    kind = PanelLinear if panel_kernel() else PackedLinear
    assert [type(p) for p in stack[0]] == [kind] * len(SHAPES.products(fused=True))
