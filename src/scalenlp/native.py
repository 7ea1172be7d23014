"""scalenlp's C++ kernels, each built on first use (``torch.utils.cpp_extension``, -march=native) and loaded once
per process; the build is cached per machine, keyed by this CPU's model. Where one cannot be built (no compiler,
no ninja, a CPU without the instructions it is written for) or its switch turns it off, the caller runs PyTorch's
own operators instead."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
from collections.abc import Callable, Collection
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cpu_model() -> str:
    """This CPU's model and instruction sets (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))


def load_native(name: str, source: Path) -> bool:
    """Build (or load the cached build of) the C++ operators in ``source`` as the extension ``name``; False,
    with one warning line, where that fails (no compiler, no ninja, no headers)."""
    from torch.utils import cpp_extension

    # -march=native code must not be loaded on another CPU from a shared cache: the name carries the CPU.
    tag = hashlib.sha1((cpu_model() + torch.__version__).encode()).hexdigest()[:10]
    # ATen's parallel_for is inlined into the kernel: under an OpenMP build of torch it is an `omp parallel`
    # region, which without -fopenmp compiles to one thread.
    openmp = ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
    extension = f"{name}_{tag}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / extension
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "scalenlp.lock", "a") as held:
            # One build at a time among processes (xdist workers, ranks), under a lock the OS takes back if its
            # holder dies. torch's own lock file stays behind when a build is killed (Ctrl-C during the first
            # run), and every later build then waits for it forever; with ours held, such a file is a dead build's.
            fcntl.flock(held, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            cpp_extension.load(name=extension, sources=[str(source)], is_python_module=False,
                               extra_cflags=["-O3", "-march=native", "-fno-math-errno", *openmp],
                               extra_ldflags=openmp, build_directory=str(folder), verbose=False)
    except Exception as exc:  # the caller falls back to PyTorch's own operators
        log.warning("scalenlp's kernel %s did not build (%s); using PyTorch's operators instead", source.name,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    return True


class NativeKernel:
    """The operators of ``source``, built as the extension ``name`` on the first call, which says whether they
    loaded (every later call answers the same; ``built`` holds the answer). False without building where the
    environment variable ``switch`` is 0 or the CPU lacks one of the instruction sets ``needs`` (its
    /proc/cpuinfo flags). ``register``, called once they load, gives torch.compile what it needs to trace them
    (fake functions, autograd)."""

    def __init__(self, name: str, source: Path, switch: str, needs: Collection[str] = (),
                 register: Callable[[], None] | None = None):
        self.name, self.source, self.switch, self.needs, self.register = name, source, switch, set(needs), register
        self.built: bool | None = None

    def __call__(self) -> bool:
        if self.built is None:
            self.built = (os.environ.get(self.switch, "1") != "0" and self.needs <= set(cpu_model().split())
                          and load_native(self.name, self.source))
            if self.built and self.register is not None:
                self.register()
        return self.built
