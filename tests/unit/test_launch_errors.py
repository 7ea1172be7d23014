"""`scalenlp train` refuses launch flags that cannot work with one error line, before starting any process."""

from __future__ import annotations

import pytest

from scalenlp.cli import main


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "add --max-restarts"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1"], "write it as 2:3"),
    (["--nnodes", "two"], "N or MIN:MAX"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-last-call", "5"], "an elastic --nnodes MIN:MAX"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--set", "training.global_batch_size=6"], "divisible"),
    # 6 fits the 2 processes of one machine, not the 4 of two: an elastic job must fit both.
    (["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "--set", "training.global_batch_size=6"],
     "by the 4 data-parallel ranks"),
])
def test_bad_launch_flags_are_one_error_line(capsys, flags, expected):
    assert main(["train", "--nproc", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err
