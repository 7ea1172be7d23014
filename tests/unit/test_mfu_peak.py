"""MFU's peak: measured once per machine and cached, so that two runs divide by the same figure; a user's figure
wins; MFU never exceeds one."""

from __future__ import annotations

import json

import torch

from scalenlp.train.peak import peak_flops


def test_measured_peak_is_cached_so_two_runs_divide_by_the_same_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = peak_flops(torch.device("cpu"), torch.float32)
    second = peak_flops(torch.device("cpu"), torch.float32)
    assert first.flops == second.flops > 0
    assert first.cache == second.cache and first.cache.parent == tmp_path / "scalenlp"
    assert "measured" in second.source and f"{torch.get_num_threads()} thread" in second.source


def test_peak_override_wins_and_mfu_never_exceeds_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    given = peak_flops(torch.device("cpu"), torch.float32, override_tflops=0.5)
    assert (given.flops, given.source) == (0.5e12, "training.peak_tflops")
    assert given.mfu(0.25e12) == (0.5, None)
    mfu, note = given.mfu(1e12)
    assert mfu == 1.0 and "above the peak" in note and given.flops == 0.5e12  # the user's figure stays

    measured = peak_flops(torch.device("cpu"), torch.float32)
    achieved = measured.flops * 1.5  # the cached figure was measured under load
    mfu, note = measured.mfu(achieved)
    assert mfu == 1.0 and "raised" in note
    again = peak_flops(torch.device("cpu"), torch.float32)
    assert again.flops == achieved and "raised" in again.source
    assert json.loads(measured.cache.read_text())["flops"] == achieved
