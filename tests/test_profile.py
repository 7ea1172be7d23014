"""profile.steps=A-B: a Chrome trace per rank of exactly those steps, communication and compute visible."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from scalenlp.config import ConfigError, load_config
from scalenlp.train.profile import StepProfiler
from train_helpers import TINY, error_lines, run_train, write_corpus

COLLECTIVE = re.compile(r"^(gloo|nccl):|^c10d::")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def assert_traced(trace: Path, wanted: range, collectives: bool) -> None:
    """The trace holds training steps ``wanted``, each in one profiler iteration, and every matmul and
    collective in it falls inside those iterations."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    iterations = [span(e) for e in events if e["name"].startswith("ProfilerStep#")]
    steps = {int(e["name"].split()[1]): span(e) for e in events if re.fullmatch(r"step \d+", e["name"])}
    assert sorted(steps) == list(wanted) and len(iterations) == len(wanted)
    for start, end in steps.values():
        assert sum(a <= start and end <= b for a, b in iterations) == 1
    compute = [e for e in events if e["name"] in MATMUL]
    comm = [e for e in events if COLLECTIVE.match(e["name"])]
    assert compute and (comm if collectives else not comm)
    for e in compute + comm:
        assert any(a <= e["ts"] <= b for a, b in iterations), e


@pytest.mark.parametrize("steps", ["5-3", "0-2", "x-3", "2-", "3-7", "", " "])
def test_a_bad_range_is_one_config_error(steps):
    sets = ["training.steps=6", f"profile.steps={steps}"]
    if not steps.strip():  # empty profiles nothing
        assert load_config(None, sets).profile.steps == steps
        return
    with pytest.raises(ConfigError, match=r"^profile.steps=.* 1 <= FIRST <= LAST <= training.steps \(6\), e.g. 3-5$"):
        load_config(None, sets)


def test_the_cli_answers_a_bad_range_with_one_error_line(tmp_path):
    proc = run_train(tmp_path / "run", "training.steps=4", "profile.steps=3-5", check=False)
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_one_process_traces_the_requested_steps_up_to_the_last(tmp_path, corpus):
    run_train(tmp_path / "run", *TINY, f"data.path={corpus}", "training.steps=3", "profile.steps=2-3",
              "checkpoint.export=false")
    assert [p.name for p in (tmp_path / "run" / "traces").iterdir()] == ["rank0.json"]
    assert_traced(tmp_path / "run" / "traces" / "rank0.json", range(2, 4), collectives=False)


@pytest.mark.slow  # two training processes
def test_each_rank_traces_its_collectives_and_matmuls(tmp_path, corpus):
    run_train(tmp_path / "run", *TINY, f"data.path={corpus}", "training.steps=6", "profile.steps=3-5",
              "checkpoint.export=false", nproc=2)
    traces = tmp_path / "run" / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.json", "rank1.json"]
    for trace in traces.iterdir():
        assert_traced(trace, range(3, 6), collectives=True)


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
