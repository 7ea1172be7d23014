"""Checkpoints reshard: save under one parallel layout, resume under another, and the loss curve
continues as the uninterrupted run's (through `scalenlp train`, DCP, gloo)."""

from __future__ import annotations

import shutil

import pytest

from train_helpers import TINY, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # multi-process runs of minutes: `make test-fast` leaves them out

LAYOUTS = {
    "single": (1, []),
    "ddp2": (2, ["parallel.data_parallel=ddp"]),
    "zero3x2": (2, ["parallel.data_parallel=zero3"]),
    "zero3x4": (4, ["parallel.data_parallel=zero3"]),
    "dp2xtp2": (4, ["parallel.data_parallel=zero3", "parallel.tp=2"]),
    "zero1 dp2xtp2": (4, ["parallel.data_parallel=zero1", "parallel.tp=2"]),
}


def train(run_dir, layout: str, *sets: str) -> None:
    """A run under one of LAYOUTS: through `scalenlp train --nproc N`, or in this process where N is 1."""
    nproc, keys = LAYOUTS[layout]
    if nproc == 1:
        train_here(run_dir, *sets, *keys)
    else:
        run_train(run_dir, *sets, *keys, nproc=nproc)


# A DCP checkpoint names whole tensors, whatever layout saved it: a pair proves that its saving layout writes the
# one-process checkpoint and that its resuming layout reads one. The pairs below, with test_tied_pipeline's
# resumes (a pp2 1f1b run resumed in one process, and the reverse: a pipeline saving and reading, its tied
# copies included) and test_lora_layouts' (DDP, ZeRO-3, TP and PP reading one process's checkpoint), cover each
# layout on both sides. (pp2 to single and ZeRO-1 x2 to pp2 were pairs here too, 87 s of the last CI's 215: the
# first is test_tied_pipeline's pp2 1f1b to single, whose model, tied, also splits a second copy across the
# stages; of the second, the saving side is "zero1 dp2xtp2" here (ZeRO-1 state sharded over two data-parallel
# ranks), the reading side test_tied_pipeline's single to pp2 1f1b.)
@pytest.mark.parametrize("saved, resumed", [("zero3x4", "dp2xtp2"), ("ddp2", "zero3x2"),
                                            ("zero1 dp2xtp2", "single")])
def test_resume_under_another_layout_continues_the_loss_curve(tmp_path, corpus, saved, resumed):
    sets = [*TINY, f"data.path={corpus}", "training.steps=6", "checkpoint.every=3", "checkpoint.keep=3",
            "checkpoint.export=false"]
    full = tmp_path / "full"
    train(full, saved, *sets)
    reference = {r["step"]: r for r in read_metrics(full)}

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    (cut / "metrics.jsonl").write_text("")
    train(cut, resumed, *sets, "checkpoint.resume=true")
    continued = read_metrics(cut)
    assert [r["step"] for r in continued] == [4, 5, 6]
    for r in continued:
        # Another layout sums in another order: equal up to float32 rounding, not bit for bit.
        assert r["loss"] == pytest.approx(reference[r["step"]]["loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(reference[r["step"]]["grad_norm"], rel=1e-4)
        assert r["lr"] == reference[r["step"]]["lr"]
