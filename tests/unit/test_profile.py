"""profile.steps=A-B: a Chrome trace of exactly those steps, checked in one process (several ranks:
tests/integration/test_profile_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from scalenlp.config import ConfigError, load_config
from scalenlp.train.profile import StepProfiler
from train_helpers import TINY, assert_traced, main_train


@pytest.mark.parametrize("steps", ["5-3", "0-2", "x-3", "2-", "3-7", "", " "])
def test_a_bad_range_is_one_config_error(steps):
    sets = ["training.steps=6", f"profile.steps={steps}"]
    if not steps.strip():  # empty profiles nothing
        assert load_config(None, sets).profile.steps == steps
        return
    with pytest.raises(ConfigError, match=r"^profile.steps=.* 1 <= FIRST <= LAST <= training.steps \(6\), e.g. 3-5$"):
        load_config(None, sets)


def test_the_cli_answers_a_bad_range_with_one_error_line(tmp_path, capsys):
    assert main_train(tmp_path / "run", "training.steps=4", "profile.steps=3-5") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: profile.steps=") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_one_process_traces_the_requested_steps_up_to_the_last(tmp_path, corpus):
    torch.set_num_threads(1)
    assert main_train(tmp_path / "run", *TINY, f"data.path={corpus}", "training.steps=3", "profile.steps=2-3",
                      "checkpoint.export=false") == 0
    assert [p.name for p in (tmp_path / "run" / "traces").iterdir()] == ["rank0.json"]
    assert_traced(tmp_path / "run" / "traces" / "rank0.json", range(2, 4), collectives=False)


def test_a_run_resumed_past_the_range_traces_nothing_and_says_so(tmp_path):
    said = []
    profiler = StepProfiler((1, 2), 2, tmp_path / "traces" / "rank0.json", torch.device("cpu"), said.append)
    for n in (3, 4):
        with profiler.step(n):
            torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    profiler.close()
    assert said == ["profile.steps=1-2: this run resumed at step 2, past step 1; nothing is traced"]
    assert not (tmp_path / "traces").exists()


def test_a_run_resumed_just_before_the_range_traces_it_without_warm_up(tmp_path):
    trace = tmp_path / "traces" / "rank0.json"
    profiler = StepProfiler((2, 3), 1, trace, torch.device("cpu"), print)
    for n in (2, 3, 4):
        with profiler.step(n):
            torch.mm(torch.ones(4, 4), torch.ones(4, 4))
        assert trace.exists() == (n == 4)  # written when step 4 begins
    profiler.close()
    assert_traced(trace, range(2, 4), collectives=False)
