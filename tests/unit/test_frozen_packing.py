"""lora.pack_frozen=auto (train/frozen_packing.py): packs where the packed products measured at least MARGIN as
fast, weighing each shape by how many linears have it; measures once per machine and shape, then reads the cache;
SCALENLP_PACK_FROZEN decides without timing. The trainer's use of it: tests/unit/test_lora.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from scalenlp.train import frozen_packing
from scalenlp.train.frozen_packing import MARGIN, ROUNDS, choose_packing, time_products

SHAPES = Counter({(576, 576): 60, (576, 1536): 60, (576, 49152): 1})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SCALENLP_PACK_FROZEN", raising=False)  # tests/conftest.py sets it for every other test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "scalenlp"


def timing(plain: list[float], packed: list[float]):
    """A measure that returns these seconds per shape (in sorted shape order) in every round, and counts calls."""
    def measure(shapes, rows):
        measure.calls.append((shapes, rows))
        return {"plain": [plain] * ROUNDS, "packed": [packed] * ROUNDS}
    measure.calls = []
    return measure


def test_packs_where_the_step_measured_faster_packed_each_shape_weighed_by_its_linears(cache):
    # Packed is faster on the one head and slower on the 120 block linears: the step is slower packed.
    slower = timing(plain=[1e-3, 2e-3, 100e-3], packed=[1.1e-3, 2.2e-3, 90e-3])
    choice = choose_packing(SHAPES, 128, slower)
    plain_ms, packed_ms = 60 * 1 + 60 * 2 + 100, 60 * 1.1 + 60 * 2.2 + 90
    assert not choice.on
    assert choice.reason.startswith(f"measured {plain_ms / packed_ms:.2f}x as fast packed, under the {MARGIN}x")
    assert f"{packed_ms:.1f} ms packed against {plain_ms:.1f} ms plain" in choice.reason
    assert slower.calls == [([(576, 576), (576, 1536), (576, 49152)], 128)]
    [path] = cache.glob("pack-frozen-*.json")
    assert json.loads(path.read_text())["speedup"] == pytest.approx(plain_ms / packed_ms)
    # Measured once: the next start reads the cache, and says so.
    again = choose_packing(SHAPES, 128, timing([1.0] * 3, [1.0] * 3))
    assert again.on == choice.on and "measured now" in choice.reason and "measured now" not in again.reason
    # Another row count or another model's shapes is another figure.
    faster = timing(plain=[1e-3, 2e-3, 100e-3], packed=[0.9e-3, 1.8e-3, 90e-3])
    assert choose_packing(SHAPES, 64, faster).on and len(faster.calls) == 1
    assert len(list(cache.glob("pack-frozen-*.json"))) == 2


def test_a_tie_is_not_worth_a_second_copy_and_large_steps_are_timed_at_max_rows(cache):
    tie = timing([1e-3] * 3, [1e-3 / (MARGIN - 0.01)] * 3)
    assert not choose_packing(SHAPES, 8192, tie).on
    assert tie.calls[0][1] == frozen_packing.MAX_ROWS


def test_a_cached_figure_that_is_not_one_is_measured_again(cache):
    choose_packing(SHAPES, 128, timing([1e-3] * 3, [2e-3] * 3))
    [path] = cache.glob("pack-frozen-*.json")
    path.write_text('{"speedup": "fast"}')
    assert choose_packing(SHAPES, 128, timing([2e-3] * 3, [1e-3] * 3)).on


@pytest.mark.parametrize("forced", ["on", "off"])
def test_the_environment_decides_without_timing(cache, monkeypatch, forced):
    monkeypatch.setenv("SCALENLP_PACK_FROZEN", forced)
    never = timing([], [])
    choice = choose_packing(SHAPES, 128, never)
    assert choice.on == (forced == "on") and choice.reason == f"SCALENLP_PACK_FROZEN={forced}" and not never.calls


def test_the_real_timing_runs_each_shape_plain_and_packed():
    torch.set_num_threads(1)
    timed = time_products([(32, 48), (48, 32)], 16)
    assert set(timed) == {"plain", "packed"}
    assert all(len(rounds) == ROUNDS and all(len(r) == 2 and min(r) > 0 for r in rounds) for rounds in timed.values())
