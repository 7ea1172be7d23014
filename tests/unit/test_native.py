"""scalenlp.native.NativeKernel: a kernel is built at most once per process, never where its switch is 0 or the CPU
lacks an instruction set it needs, and its tracing functions are registered once it loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalenlp import native
from scalenlp.native import NativeKernel


@pytest.fixture
def builds(monkeypatch):
    """The names load_native was asked to build; each build succeeds unless its name says "broken"."""
    asked = []

    def load(name, source):
        asked.append(name)
        return "broken" not in name

    monkeypatch.setattr(native, "load_native", load)
    monkeypatch.setattr(native, "cpu_model", lambda: "model name: Test CPU flags: sse2 avx2 fma")
    return asked


def test_built_once_and_registered_once(builds):
    registered = []
    kernel = NativeKernel("k", Path("k.cpp"), "SCALENLP_TEST_KERNEL", needs=("avx2", "fma"),
                          register=lambda: registered.append(1))
    assert kernel() and kernel() and kernel.built
    assert builds == ["k"] and registered == [1]


def test_a_kernel_that_does_not_build_is_not_registered_nor_tried_again(builds):
    registered = []
    kernel = NativeKernel("broken", Path("k.cpp"), "SCALENLP_TEST_KERNEL", register=lambda: registered.append(1))
    assert not kernel() and not kernel()
    assert builds == ["broken"] and registered == []


@pytest.mark.parametrize("switch, needs", [("0", ()), ("1", ("avx512f",))], ids=["switched off", "CPU lacks it"])
def test_not_built_where_switched_off_or_the_cpu_lacks_an_instruction_set(builds, monkeypatch, switch, needs):
    monkeypatch.setenv("SCALENLP_TEST_KERNEL", switch)
    kernel = NativeKernel("k", Path("k.cpp"), "SCALENLP_TEST_KERNEL", needs=needs)
    assert kernel() is False and builds == []
