"""scalenlp.native.NativeKernel: a kernel is built at most once per process, never where its switch is 0 or the CPU
lacks an instruction set it needs, and its tracing functions are registered once it loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


@pytest.mark.slow  # two builds: 7 s here, more under load than the fast tier's 10 s allows
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None,
                    reason="building a kernel needs a C++ compiler (g++) and ninja")
def test_a_build_killed_midway_does_not_stop_the_next_one(tmp_path):
    """A build interrupted (Ctrl-C during a first run) leaves torch's lock file in its folder, and torch's next
    build of it would wait for that file forever. The next build goes ahead (a hang fails here after 300 s)."""
    source = tmp_path / "k.cpp"
    source.write_text("extern \"C\" int scalenlp_test_kernel() { return 1; }\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "builds"), "PYTHONPATH": os.pathsep.join(sys.path)}
    script = ("import sys; from pathlib import Path; from scalenlp import native; "
              "print(native.load_native('scalenlp_test', Path(sys.argv[1])))")

    def build() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, str(source)], env=env, capture_output=True, text=True,
                              timeout=300)

    first = build()
    assert first.stdout.strip() == "True", first.stderr
    (folder,) = (tmp_path / "builds").iterdir()
    (folder / "lock").touch()  # what a killed build leaves
    source.write_text(source.read_text() + "extern \"C\" int scalenlp_test_kernel_2() { return 2; }\n")  # rebuild
    again = build()
    assert again.stdout.strip() == "True", again.stderr
    assert not (folder / "lock").exists()
