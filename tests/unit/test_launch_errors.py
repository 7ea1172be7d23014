"""`scalenlp train` refuses launch flags and parallel layouts that cannot work with one error line, in the launching
process, before it starts any other."""

from __future__ import annotations

import pytest

from scalenlp.cli import main
from train_helpers import TINY, main_train


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


@pytest.mark.parametrize("sets, nproc, expected", [
    (["parallel.pp=4"], 4, "4 pipeline stages but the model has only 2 layers"),
    (["parallel.tp=4"], 4, "tp=4 does not divide the model's 2 key/value heads"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "pp_microbatches=3 does not divide the per-rank batch 4"),
    (["parallel.tp=2", "parallel.pp=2"], 2, "= 4 does not divide the world size 2"),
])
def test_impossible_layout_is_one_error_line_before_launch(tmp_path, capsys, sets, nproc, expected):
    assert main_train(tmp_path / "run", *TINY, *sets, nproc=nproc) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "run").exists()
