"""`scalenlp serve`'s start-up line says which dtype `auto` chose and why: measured on this CPU the first time,
read from the cache the next."""

import os
import re

import pytest

from infer_helpers import serve_process


@pytest.mark.slow  # two servers, each in a new interpreter: 20-40 s here
def test_serve_says_which_dtype_and_why(tiny_export, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path)}
    outputs = []
    for _ in range(2):
        with serve_process(tiny_export, env=env) as (_, proc):
            pass
        outputs.append(proc.stdout.read().decode())
    [path] = (tmp_path / "scalenlp").glob("dtype-*.json")
    first, again = (re.search(r"^dtype (float32|bfloat16): .*measured .*x as fast.* on this CPU at this model's "
                              r"widths \(one layer's products, 1 thread: .*\)$", out, re.M) for out in outputs)
    assert first and again, outputs
    assert first[1] == again[1]
    assert first[0].endswith(f"; measured now, cached in {path})") and again[0].endswith(f"; cached in {path})")
