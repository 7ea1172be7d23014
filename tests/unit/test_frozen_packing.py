"""lora.pack_frozen=auto (train/frozen_packing.py): each shape takes its fastest layout among those the run allows,
where its products measured at least MARGIN as fast as plain (each shape weighed by how many linears have it);
measures once per machine and shape, then reads the cache; SCALENLP_PACK_FROZEN decides without timing. The
trainer's use of it: tests/unit/test_lora.py."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from scalenlp.models.frozen import available_layouts, run_layouts
from scalenlp.train import frozen_packing
from scalenlp.train.frozen_packing import MARGIN, ROUNDS, choose_packing, copy_bytes, time_products

SHAPES = Counter({(576, 576): 60, (576, 1536): 60, (576, 49152): 1})


COMPILED = run_layouts(torch.float32, compile=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SCALENLP_PACK_FROZEN", raising=False)  # tests/conftest.py sets it for every other test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "scalenlp"


def timing(plain: list[float], onednn: list[float], transposed: list[float] | None = None,
           mkl: list[float] | None = None):
    """A measure that returns these seconds per shape (in sorted shape order) in every round (transposed and mkl as
    plain unless given), and counts calls."""
    def measure(shapes, rows, counts, dtype=torch.float32):
        measure.calls.append((shapes, rows, counts))
        return {"plain": [plain] * ROUNDS, "onednn": [onednn] * ROUNDS, "transposed": [transposed or plain] * ROUNDS,
                "mkl": [mkl or plain] * ROUNDS}
    measure.calls = []
    return measure


def test_each_shape_takes_its_fastest_layout_where_it_pays(cache):
    # oneDNN is faster on the head, the transposed copy on q/o; gate/up gain too little in any to pay.
    measure = timing(plain=[1e-3, 2e-3, 100e-3], onednn=[1.1e-3, 1.98e-3, 90e-3], transposed=[0.9e-3, 2e-3, 120e-3],
                     mkl=[0.95e-3, 1.99e-3, 95e-3])
    choice = choose_packing(SHAPES, 128, measure=measure)
    assert choice.layouts == {(576, 576): "transposed", (576, 49152): "onednn"}
    plain_ms, held_ms = 60 * 1 + 60 * 2 + 100, 60 * 0.9 + 60 * 2 + 90
    assert choice.reason.startswith(f"measured {plain_ms / held_ms:.2f}x as fast (the frozen products of a step, "
                                    f"128 rows: {held_ms:.1f} ms against {plain_ms:.1f} ms plain; 576x576 transposed "
                                    f"1.11x, 576x1536 plain (onednn 1.01x), 576x49152 onednn 1.11x; measured now, ")
    assert measure.calls == [([(576, 576), (576, 1536), (576, 49152)], 128, [60, 60, 1])]
    [path] = cache.glob("pack-frozen-*.json")
    assert json.loads(path.read_text())["ms"]["onednn"] == pytest.approx([60 * 1.1, 60 * 1.98, 90])
    # Measured once: the next start reads the cache, and says so.
    again = choose_packing(SHAPES, 128, measure=timing([1.0] * 3, [0.1] * 3))
    assert again.layouts == choice.layouts and "measured now" not in again.reason
    # training.compile allows the transposed copy and MKL's packed W: from the same cached figures.
    assert choose_packing(SHAPES, 128, COMPILED, measure=measure).layouts == {(576, 576): "transposed",
                                                                               (576, 49152): "mkl"}
    # Another row count or another model's shapes is another figure.
    slower = timing(plain=[1e-3, 2e-3, 100e-3], onednn=[1.1e-3, 2.2e-3, 110e-3])
    none = choose_packing(SHAPES, 64, measure=slower)
    assert none.layouts == {} and len(slower.calls) == 1
    assert none.reason.startswith(f"no layout of onednn, transposed, mkl at least {MARGIN}x as fast as plain")
    assert len(list(cache.glob("pack-frozen-*.json"))) == 2


def test_a_tie_is_not_worth_a_second_copy_and_large_steps_are_timed_at_max_rows(cache):
    tie = timing([1e-3] * 3, [1e-3 / (MARGIN - 0.01)] * 3, [1e-3 / (MARGIN - 0.02)] * 3)
    assert choose_packing(SHAPES, 8192, measure=tie).layouts == {}
    assert tie.calls[0][1] == frozen_packing.MAX_ROWS


def test_the_copies_fit_a_memory_budget_the_most_time_per_byte_first(cache, monkeypatch):
    # MKL's packed W faster on every shape: q/o save 12 ms for 76 MiB of copies, gate/up 24 ms for 203 MiB, the
    # output projection 20 ms for 108 MiB. A budget of 200 MiB holds the output projection's and q/o's.
    measure = timing(plain=[1e-3, 2e-3, 100e-3], onednn=[2e-3, 4e-3, 200e-3], mkl=[0.8e-3, 1.6e-3, 80e-3])
    choice = choose_packing(SHAPES, 128, measure=measure, budget=200 * 2**20)
    assert choice.layouts == {(576, 576): "mkl", (576, 49152): "mkl"}
    assert "576x1536 plain (mkl 1.25x; its copy would pass the memory budget, 200 MiB)" in choice.reason
    assert choose_packing(SHAPES, 128, measure=measure, budget=None).layouts == dict.fromkeys(SHAPES, "mkl")
    none = choose_packing(SHAPES, 128, measure=measure, budget=0)
    assert none.layouts == {} and none.reason.startswith("no layout's copy fits the memory budget (")
    # The budget: half the memory the machine has available (Linux's MemAvailable), shared by its processes; none
    # where it is unknown.
    assert 0 < frozen_packing.available_memory() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(frozen_packing, "available_memory", lambda: 8 * 2**30)
    assert frozen_packing.memory_budget(2) == 2 * 2**30
    monkeypatch.setattr(frozen_packing, "available_memory", lambda: None)
    assert frozen_packing.memory_budget(1) is None


def test_a_cached_figure_that_is_not_one_is_measured_again(cache):
    choose_packing(SHAPES, 128, measure=timing([1e-3] * 3, [2e-3] * 3))
    [path] = cache.glob("pack-frozen-*.json")
    path.write_text('{"speedup": 0.9, "ms": {"plain": 1.0, "packed": 1.1}}')  # before the layouts had names
    assert choose_packing(SHAPES, 128, measure=timing([2e-3] * 3, [1e-3] * 3)).layouts == dict.fromkeys(SHAPES,
                                                                                                        "onednn")
    # One timed before the mkl layout was added: measured again, so that a layout this PyTorch has is weighed.
    record = json.loads(path.read_text())
    del record["ms"]["mkl"]
    path.write_text(json.dumps(record))
    faster = timing([2e-3] * 3, [1.5e-3] * 3, mkl=[1e-3] * 3)
    assert choose_packing(SHAPES, 128, measure=faster).layouts == dict.fromkeys(SHAPES, "mkl") and faster.calls


@pytest.mark.parametrize("forced", ["onednn", "transposed", "mkl", "off"])
def test_the_environment_decides_without_timing(cache, monkeypatch, forced):
    monkeypatch.setenv("SCALENLP_PACK_FROZEN", forced)
    never = timing([], [])
    choice = choose_packing(SHAPES, 128, measure=never)
    assert choice.layouts == ({} if forced == "off" else dict.fromkeys(SHAPES, forced)) and not never.calls
    assert choice.reason == f"SCALENLP_PACK_FROZEN={forced}"


def test_the_environment_cannot_force_a_layout_the_run_cannot_take(cache, monkeypatch):
    # training.compile's layouts: oneDNN's packed weights would fail in Inductor; the base stays plain, with why.
    monkeypatch.setenv("SCALENLP_PACK_FROZEN", "onednn")
    never = timing([], [])
    choice = choose_packing(SHAPES, 128, COMPILED, measure=never)
    assert choice.layouts == {} and not never.calls
    assert COMPILED == ("transposed", "mkl")
    assert choice.reason == "SCALENLP_PACK_FROZEN=onednn is not among this run's layouts: transposed, mkl"


def test_under_autocast_the_copies_cast_once_are_timed_apart_and_cost_their_dtypes_bytes(cache):
    # bf16: plain is the weight cast by autocast every step; the cast copy saves that on every shape, oneDNN's
    # packing of it more on q/o and the head; MKL's layout is float32's.
    bf16 = run_layouts(torch.bfloat16, compile=False)
    assert bf16 == tuple(name for name in ("onednn", "transposed", "cast") if name in available_layouts(torch.bfloat16))
    assert run_layouts(torch.bfloat16, compile=True) == ("transposed", "cast")

    def measure(shapes, rows, counts):
        measure.calls += 1
        return {"plain": [[2e-3, 4e-3, 200e-3]] * ROUNDS, "cast": [[1e-3, 2e-3, 50e-3]] * ROUNDS,
                "onednn": [[0.8e-3, 2.5e-3, 40e-3]] * ROUNDS, "transposed": [[1.1e-3, 2.2e-3, 60e-3]] * ROUNDS}
    measure.calls = 0
    layouts = ("onednn", "transposed", "cast")
    choice = choose_packing(SHAPES, 128, layouts, measure=measure, dtype=torch.bfloat16)
    assert choice.layouts == {(576, 576): "onednn", (576, 1536): "cast", (576, 49152): "onednn"}
    [path] = cache.glob("pack-frozen-*.json")
    assert "-128rows-bfloat16-576x576x60-" in path.name
    # float32's figure is another: measured apart (and with no cast layout), not read from bf16's.
    assert choose_packing(SHAPES, 128, measure=timing([1e-3] * 3, [2e-3] * 3)).layouts == {}
    assert len(list(cache.glob("pack-frozen-*.json"))) == 2 and measure.calls == 1
    # A bf16 copy costs 2 bytes a weight (oneDNN's and the transposed layout hold two), a float32 one 4 (oneDNN's
    # two in place of the weight). q/o save 72 ms for 76 MiB, gate/up 120 ms for 101 MiB, the head 160 ms for
    # 108 MiB: a budget of 120 MiB holds the head's copies alone.
    assert copy_bytes((576, 1536), 60, "cast", torch.bfloat16) == 2 * 576 * 1536 * 60
    assert copy_bytes((576, 576), 60, "onednn", torch.bfloat16) == 4 * 576 * 576 * 60
    assert copy_bytes((576, 576), 60, "onednn", torch.float32) == copy_bytes((576, 576), 60, "mkl", torch.float32)
    assert copy_bytes((576, 576), 60, "mkl", torch.float32) == 4 * 576 * 576 * 60
    budgeted = choose_packing(SHAPES, 128, layouts, measure=measure, budget=120 * 2**20, dtype=torch.bfloat16)
    assert budgeted.layouts == {(576, 49152): "onednn"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_timing_runs_each_shape_plain_and_in_each_layout(dtype):
    torch.set_num_threads(1)
    timed = time_products([(32, 48), (48, 32)], 16, [3, 1], dtype)
    assert set(timed) == {"plain", *available_layouts(dtype)}
    assert ("mkl" in timed) == (dtype == torch.float32 and torch.backends.mkl.is_available())
    assert ("cast" in timed) == (dtype == torch.bfloat16)
    assert all(len(rounds) == ROUNDS and all(len(r) == 2 and min(r) > 0 for r in rounds) for rounds in timed.values())


def test_the_trainer_takes_rank_0s_choice_for_every_ranks_shapes(cache, monkeypatch):
    """Several processes: rank 0 decides for the shapes any rank holds (a pipeline stage holds its own) and the
    others take its decision, which they do not time (the collectives stand in for two ranks here; the real ones
    run in tests/integration/test_lora_layouts.py)."""
    import types

    from scalenlp.train import trainer

    stage0, stage1 = Counter({(576, 576): 30, (576, 1536): 30}), Counter({(576, 576): 30, (576, 49152): 1})
    sent = {}

    def all_gather_object(into, shapes):
        into[:] = [stage0, stage1]

    def broadcast_object_list(box, src):
        assert src == 0
        sent.setdefault("choice", box[0])  # what rank 0 holds; the other rank gets it
        box[0] = sent["choice"]

    monkeypatch.setattr(trainer.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(trainer.dist, "broadcast_object_list", broadcast_object_list)
    measure = timing(plain=[1e-3, 2e-3, 100e-3], onednn=[1.1e-3, 1.98e-3, 90e-3], transposed=[0.9e-3, 2e-3, 120e-3])
    monkeypatch.setattr(frozen_packing, "time_products", measure)
    decide = trainer.Trainer._one_packing_choice
    first = decide(types.SimpleNamespace(world=2, is_main=True), stage0, 128, ("onednn", "transposed"), torch.float32)
    assert [calls[0] for calls in measure.calls] == [sorted(SHAPES)]  # both stages' shapes, timed once
    assert first.layouts == {(576, 576): "transposed", (576, 49152): "onednn"}
    other = decide(types.SimpleNamespace(world=2, is_main=False), stage1, 128, ("onednn", "transposed"), torch.float32)
    assert other is first and len(measure.calls) == 1
