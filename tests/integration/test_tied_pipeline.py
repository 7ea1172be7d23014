"""Pipeline parallelism with tied input/output embeddings (GPT-2 style flavors), through `scalenlp train`.

The first stage's embedding and the last stage's output projection are two copies of the one tied
weight whose gradients are summed after every backward (pipeline.py): losses and gradient norms
must follow the single-process run, the copies must stay bit-identical, and checkpoints must
reshard between a pipelined run and one process in both directions.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scalenlp.models.io import load_pretrained
from train_helpers import TINY, read_evaluations, read_metrics, run_train, train_here

pytestmark = pytest.mark.slow  # multi-process runs of minutes: `make test-fast` leaves them out

# Six steps, a checkpoint and an evaluation every three: a resume at 3 continues for three steps. (Ten, every five,
# checked nothing more: a copy that drifts or a misplaced gradient shows in the first steps.)
LAST, HALF = 6, 3
STEPS = [f"training.steps={LAST}", f"checkpoint.every={HALF}", "checkpoint.keep=2"]
GPT2 = [*TINY, "model.flavor=debug-gpt2", *STEPS, f"training.eval_every={HALF}", "training.eval_batches=2"]
# Two stages per rank need four layers: the small GPT-2 flavor (tied, learned positions) has them.
SMALL = [*TINY, "model.flavor=small", *STEPS, "checkpoint.export=false"]
PP2_1F1B = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2"]
PP2_INTERLEAVED = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
                   "parallel.pp_microbatches=4"]
TP2_PP2 = [*PP2_1F1B, "parallel.tp=2"]
ZERO3_DP2_PP2 = [*PP2_1F1B, "parallel.data_parallel=zero3"]
# Four stages: the copies' ranks (pp ranks 0 and 3) get a group of their own; the middle ranks hold none.
PP4 = ["parallel.pp=4", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Run folders by name, each trained once on first use (one process in this one)."""
    root = tmp_path_factory.mktemp("tied")
    plans = {
        "single": (1, GPT2), "pp2 1f1b": (2, [*GPT2, *PP2_1F1B]), "tp2 x pp2": (4, [*GPT2, *TP2_PP2]),
        "zero3 dp2 x pp2": (4, [*GPT2, *ZERO3_DP2_PP2]),
        "single small": (1, SMALL), "pp2 interleaved small": (2, [*SMALL, *PP2_INTERLEAVED]),
        "pp4 small": (4, [*SMALL, *PP4]),
    }
    done = {}

    def get(name: str):
        if name not in done:
            nproc, sets = plans[name]
            run_dir = root / name.replace(" ", "_")
            if nproc == 1:
                train_here(run_dir, *sets, f"data.path={corpus}")
            else:
                run_train(run_dir, *sets, f"data.path={corpus}", nproc=nproc)
            done[name] = run_dir
        return done[name]
    return get


def _assert_follows(got: list[dict], reference: list[dict], loss_rel: float = 1e-4) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for r, ref in zip(got, reference):
        assert r["loss"] == pytest.approx(ref["loss"], rel=loss_rel), r["step"]
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), r["step"]
        assert r["lr"] == ref["lr"]


def _checkpoint(run_dir, step: int, tmp_path) -> dict:
    """A DCP checkpoint read back whole, by state key ("model", "optim")."""
    out = tmp_path / f"step-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step}", out)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("layout, reference", [("pp2 1f1b", "single"), ("pp2 interleaved small", "single small"),
                                               ("tp2 x pp2", "single"), ("zero3 dp2 x pp2", "single"),
                                               ("pp4 small", "single small")])
def test_pipelined_tied_model_trains_like_one_process(runs, layout, reference):
    """Every step's loss and gradient norm (the tied weight counted once) within 1e-4 of one process."""
    ref = read_metrics(runs(reference))
    _assert_follows(read_metrics(runs(layout)), ref)
    assert len(ref) == LAST and ref[-1]["loss"] < ref[0]["loss"]  # a moving optimisation, not a flat line


@pytest.mark.parametrize("layout", ["pp2 1f1b", "pp2 interleaved small", "tp2 x pp2", "zero3 dp2 x pp2", "pp4 small"])
def test_tied_copies_stay_identical_on_their_ranks(runs, layout, tmp_path):
    """After the last step, the first stage's embedding and the last stage's output projection (saved by
    different ranks, gathered from their TP / FSDP shards) are bit-identical, and so is their Adam state."""
    state = _checkpoint(runs(layout), LAST, tmp_path)
    model, optim = state["model"], state["optim"]
    assert torch.equal(model["tok_embeddings.weight"], model["output.weight"])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(optim[f"state.tok_embeddings.weight.{key}"], optim[f"state.output.weight.{key}"]), key
    first = _checkpoint(runs(layout), HALF, tmp_path)["model"]
    assert not torch.equal(first["output.weight"], model["output.weight"])  # the copies did train


def test_pipelined_tied_model_evaluates_and_exports_like_one_process(runs):
    """Held-out loss under pp2 follows one process, and the exported model is tied again."""
    evals = {name: read_evaluations(runs(name)) for name in ("single", "pp2 1f1b")}
    assert [r["step"] for r in evals["pp2 1f1b"]] == [HALF, LAST]
    for r, ref in zip(evals["pp2 1f1b"], evals["single"]):
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)
    exported, reference = (load_pretrained(runs(name) / "export") for name in ("pp2 1f1b", "single"))
    assert exported.output.weight is exported.tok_embeddings.weight
    tokens = torch.arange(16).unsqueeze(0)
    torch.testing.assert_close(exported(tokens), reference(tokens), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("saved, resumed", [("pp2 1f1b", "single"), ("single", "pp2 1f1b")])
def test_tied_checkpoint_resumes_under_the_other_layout(runs, corpus, tmp_path, saved, resumed):
    """Save halfway under one layout, resume under the other: the steps after it continue the saved run's curve
    (one process keys the tied weight's Adam state by its embedding name only; the last stage reads it)."""
    cut = tmp_path / "cut"
    shutil.copytree(runs(saved), cut)
    shutil.rmtree(cut / "checkpoints" / f"step-{LAST}")
    (cut / "metrics.jsonl").write_text("")
    sets = [*GPT2, f"data.path={corpus}", "checkpoint.resume=true", "checkpoint.export=false"]
    if resumed == "pp2 1f1b":
        run_train(cut, *sets, *PP2_1F1B, nproc=2)
    else:
        train_here(cut, *sets)
    reference = [r for r in read_metrics(runs(saved)) if r["step"] > HALF]
    # Another layout sums in another order: equal up to float32 rounding, not bit for bit.
    _assert_follows(read_metrics(cut), reference, loss_rel=1e-5)
