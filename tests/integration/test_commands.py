"""The `scalenlp` command in a process of its own, as a user runs it: a byte that is not UTF-8 among the
arguments is one error line and exit code 2."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each starts the command in a new interpreter (torch imported there): 13-27 s here


def test_generate_invalid_utf8_argv_is_one_error_line(tiny_export):
    """The real thing: bytes that are not UTF-8 on the command line of a new process."""
    r = subprocess.run([sys.executable, "-m", "scalenlp.cli", "generate", "--checkpoint", str(tiny_export),
                        "--prompt", b"caf\xe9"], capture_output=True)
    assert r.returncode == 2 and r.stderr.startswith(b"error: --prompt is not valid Unicode"), r.stderr
    assert r.stderr.count(b"\n") == 1
