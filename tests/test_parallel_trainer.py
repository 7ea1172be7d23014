"""The trainer (`scalenlp train`) under parallel layouts: same losses as one process, and layout
errors reported before any process starts."""

from __future__ import annotations

import pytest

from train_helpers import TINY, error_lines, read_evaluations, read_metrics, run_train, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def test_pipeline_and_2d_layouts_train_like_one_process(tmp_path, corpus):
    sets = [*TINY, f"data.path={corpus}", "training.steps=4", "training.eval_every=2", "checkpoint.export=false"]
    run_train(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, nproc, layout in [
        ("pp2", 2, ["parallel.pp=2", "parallel.pp_microbatches=2", "parallel.pp_schedule=gpipe"]),
        ("dp2xtp2", 4, ["parallel.tp=2", "parallel.data_parallel=zero2", "parallel.sequence_parallel=true",
                        "training.micro_batch_size=1"]),
    ]:
        run_train(tmp_path / name, *sets, *layout, nproc=nproc)
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
        assert len(read_evaluations(tmp_path / name)) == 2, name


@pytest.mark.slow  # a multi-process run: `make test` runs it, `make test-fast` leaves it out
def test_tensor_parallel_gpt2_family_trains_like_one_process(tmp_path, corpus):
    # GPT-2 options leave some parameters plain tensors under TP (the learned position table,
    # LayerNorms): the optimizer must keep them apart from the DTensors. An odd vocabulary shards unevenly
    # (the first rank holds one row more) and still trains like one process: scalenlp.layout lets tp skip it.
    sets = [*TINY, f"data.path={corpus}", "training.steps=3", "model.flavor=debug-gpt2", "model.vocab_size=401",
            "checkpoint.export=false"]
    run_train(tmp_path / "single", *sets)
    run_train(tmp_path / "tp2", *sets, "parallel.tp=2", nproc=2)
    for a, b in zip(read_metrics(tmp_path / "single"), read_metrics(tmp_path / "tp2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("sets, nproc, expected", [
    (["parallel.pp=4"], 4, "4 pipeline stages but the model has only 2 layers"),
    (["parallel.tp=4"], 4, "tp=4 does not divide the model's 2 key/value heads"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "pp_microbatches=3 does not divide the per-rank batch 4"),
    (["parallel.tp=2", "parallel.pp=2"], 2, "= 4 does not divide the world size 2"),
])
def test_impossible_layout_is_one_error_line_before_launch(tmp_path, corpus, sets, nproc, expected):
    proc = run_train(tmp_path / "run", *TINY, f"data.path={corpus}", *sets, nproc=nproc, check=False)
    assert proc.returncode == 2
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
