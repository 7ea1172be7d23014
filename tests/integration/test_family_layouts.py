"""Hugging Face families under several processes: a Qwen3 (per-head q/k norms, whose one weight each rank sees
through its own heads) and a Gemma 2 (post-norms, soft-caps, a sliding window on alternate layers) fine-tuned
under ZeRO-3 and under tensor and sequence parallelism on 2 ranks train like one process, step by step."""

from __future__ import annotations

import pytest

from train_helpers import FINETUNE, make_hf_decoder, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # two two-process runs a family, 40-90 s each here under load


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_family_trains_like_one_process(tmp_path, corpus, transformers, model_type):
    folder = tmp_path / "hf"
    make_hf_decoder(folder, model_type, corpus)
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={folder}", "training.steps=2", "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, layout in [("zero3", ["parallel.data_parallel=zero3"]),
                         ("tp2-sp", ["parallel.tp=2", "parallel.sequence_parallel=true"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = read_metrics(tmp_path / name)
        assert len(got) == len(single) == 2, name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
