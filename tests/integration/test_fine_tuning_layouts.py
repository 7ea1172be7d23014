"""Fine-tuning from pretrained weights under several processes: ZeRO-3, tensor- and pipeline-parallel runs start
from the checkpoint's weights and train like one process, and chat fine-tuning weighs every assistant token alike
under every layout (one process, in this one, is the reference; the rest: tests/unit/test_fine_tuning.py).

One test proves both: its runs start from model.init (a Hugging Face Llama with tied embeddings, whose pipeline
copies must both come from the checkpoint), so a layout that started from other weights, or a stage whose copy
did not, would miss one process's first loss. (A second test ran the language-modelling task from the same
folder under the same three layouts, 38 s here and 42 s in CI, to check the start only: the weights are read
alike whatever the task; and language modelling from model.init under a layout is test_family_layouts' Gemma 3
under ZeRO-3 and TP + SP, test_lora_layouts' QLoRA under DDP and PP from the start.)"""

from __future__ import annotations

import json

import pytest

from train_helpers import SFT, run_train, train_here

pytestmark = pytest.mark.slow  # three two-process runs: 40-100 s here under load


def test_sft_layouts_weigh_every_assistant_token_alike(tmp_path, chats, hf_llama):
    """Micro-batches and ranks hold different numbers of assistant tokens: the loss, the gradients and
    the held-out loss are the mean over all of them under every layout, as in one process. Every run starts from
    the Hugging Face folder (model.init): the first step's loss and gradient norm also show that each layout, and
    each pipeline stage's copy of the tied embedding, starts from its weights."""
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
