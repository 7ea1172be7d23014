"""profile.steps=A-B under `scalenlp train --nproc 2`: a Chrome trace per rank with its collectives and matmuls."""

from __future__ import annotations

import pytest

from train_helpers import TINY, assert_traced, run_train


@pytest.mark.slow  # two training processes: ~45 s here
def test_each_rank_traces_its_collectives_and_matmuls(tmp_path, corpus):
    run_train(tmp_path / "run", *TINY, f"data.path={corpus}", "training.steps=6", "profile.steps=3-5",
              "checkpoint.export=false", nproc=2)
    traces = tmp_path / "run" / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.json", "rank1.json"]
    for trace in traces.iterdir():
        assert_traced(trace, range(3, 6), collectives=True)
