"""benchmarks/serve_vs_peers.py: its prompts and one small run against `scalenlp serve` alone (vLLM unset)."""

import json
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_vs_peers  # noqa: E402

SIZES = Namespace(min_requests=3, short_tokens=8, shared_tokens=24, long_tokens=48)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A debug decoder as a Hugging Face folder whose tokenizer has no special tokens: every token it generates
    decodes to text, which the benchmark's client needs to see a first token."""
    from infer_helpers import make_export
    from scalenlp.cli import main as cli

    root = tmp_path_factory.mktemp("peers")
    assert cli(["export", "--checkpoint", str(make_export(root / "export", special=None)), "--format", "hf",
                "--out", str(root / "hf")]) == 0
    return root / "hf"


@pytest.fixture(scope="module")
def prompts(hf_folder):
    return serve_vs_peers.Prompts(hf_folder)


def test_prompts_are_cut_at_the_asked_length_and_repeat_only_the_shared_system_prompt(prompts):
    length = lambda text: len(prompts.tokenizer.encode(text).ids)  # noqa: E731
    short, longs = serve_vs_peers.cell_requests(prompts, SIZES, "mixed", 8, 0)
    assert len(short) == 8 and len(longs) == 2  # C requests (at least min_requests), C/4 long ones
    assert all(abs(length(p) - 8) <= 2 for p in short) and all(abs(length(p) - 48) <= 2 for p in longs)
    assert len(set(short)) == len(short)
    # the same cell of another round: no prompt in common, so no prefix cache carries over between rounds
    again, _ = serve_vs_peers.cell_requests(prompts, SIZES, "mixed", 8, 1)
    assert not set(again) & set(short)
    assert serve_vs_peers.cell_requests(prompts, SIZES, "mixed", 8, 0)[0] == short  # every server gets the same
    shared = [serve_vs_peers.cell_requests(prompts, SIZES, "shared", 2, r)[0] for r in (0, 1)]
    system = os.path.commonprefix(shared[0] + shared[1])
    assert abs(length(system) - 24) <= 2
    assert len({p[len(system):] for requests in shared for p in requests}) == 2 * SIZES.min_requests
    lone, none = serve_vs_peers.cell_requests(prompts, SIZES, "short", 1, 0)
    assert len(lone) == SIZES.min_requests and none == []


@pytest.mark.parametrize("argv, message", [(["--concurrency", "1,x"], "comma-separated list of whole numbers"),
                                           (["--workloads", "short,long"], "unknown workload 'long'"),
                                           (["--tokens", "0"], "--tokens must be 1 or more"),
                                           (["--rounds", "-1"], "must be 0 (skip that part) or more")])
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve_vs_peers.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_vllm_python_without_vllm_is_refused_before_any_server_starts(hf_folder, tmp_path):
    with pytest.raises(SystemExit, match=r"cannot import vllm \(No such file or directory\); give --vllm-python"):
        serve_vs_peers.main(["--hf-folder", str(hf_folder), "--vllm-python", str(tmp_path / "python"),
                             "--workdir", str(tmp_path)])
    assert not (tmp_path / "scalenlp.log").exists()


@pytest.mark.slow
def test_a_small_run_against_scalenlp_serve_reports_every_cell(hf_folder, tmp_path, capsys):
    concurrency, workloads = [1, 3], ["short", "shared", "mixed"]
    code = serve_vs_peers.main(["--hf-folder", str(hf_folder), "--vllm-python", "", "--workdir", str(tmp_path),
                                "--rounds", "2", "--concurrency", "1,3", "--tokens", "5", "--short-tokens", "8",
                                "--shared-tokens", "24", "--long-tokens", "48", "--long-gap", "0.05",
                                "--min-requests", "2", "--decode-rounds", "0", "--scalenlp-args", "--max-seq-len 128"])
    out = capsys.readouterr().out
    assert code == 0 and "vLLM: skipped" in out
    cells = json.loads(out.strip().splitlines()[-1])["serve_vs_peers"]
    assert set(cells) == {f"scalenlp {w} C={c}" for w in workloads for c in concurrency}
    for row in cells.values():
        assert row["tok_s"] > 0 and 0 < row["ttft_med_ms"] <= row["ttft_p90_ms"]
        assert 0 < row["tpot_med_ms"] <= row["tpot_p90_ms"]
    assert sum(line.startswith("| ") for line in out.splitlines()) == 1 + len(cells)  # the header, a row per cell
