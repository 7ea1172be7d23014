"""Fine-tuning from pretrained weights under several processes: ZeRO-3, tensor- and pipeline-parallel runs start
from the checkpoint's weights and train like one process, and chat fine-tuning weighs every assistant token alike
under every layout (one process, in this one, is the reference; the rest: tests/unit/test_fine_tuning.py)."""

from __future__ import annotations

import json

import pytest

from train_helpers import FINETUNE, SFT, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # three two-process runs a test: 60-100 s each here under load


def test_layouts_start_from_the_same_weights(tmp_path, corpus, hf_llama):
    """ZeRO-3, tensor- and pipeline-parallel fine-tunes from a Hugging Face folder (tied embeddings: the
    pipeline's two copies must both come from the checkpoint) train like one process."""
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", "training.steps=3",
            "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, layout in [("zero3", ["parallel.data_parallel=zero3"]), ("tp2", ["parallel.tp=2"]),
                         ("pp2", ["parallel.pp=2", "parallel.pp_schedule=gpipe"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = read_metrics(tmp_path / name)
        assert len(got) == len(single), name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name




def test_sft_layouts_weigh_every_assistant_token_alike(tmp_path, chats, hf_llama):
    """Micro-batches and ranks hold different numbers of assistant tokens: the loss, the gradients and
    the held-out loss are the mean over all of them under every layout, as in one process."""
    sets = [*SFT, f"data.path={chats}", f"model.init={hf_llama}", "training.steps=3", "training.eval_every=3",
            "training.global_batch_size=8", "checkpoint.export=false"]
    train_here(tmp_path / "single", *sets)
    single = (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()
    for name, layout in [("zero3-accum", ["parallel.data_parallel=zero3", "training.micro_batch_size=2"]),
                         ("tp2", ["parallel.tp=2"]),
                         ("pp2", ["parallel.pp=2", "parallel.pp_microbatches=4", "parallel.pp_schedule=1f1b"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert len(got) == len(single), name
        for a, b in zip(map(json.loads, single), map(json.loads, got)):
            for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("val_loss", 1e-5)):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=rel), (name, key)


