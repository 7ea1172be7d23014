"""Parallel layouts in one process: pipeline stage splits, activation checkpointing, compiled blocks and loss, the
layout checks that refuse a layout before any process group, and one process training alike with its projections
stacked or one by one (every layout against one process: tests/integration/test_parallel_parity.py)."""

from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scalenlp.config import Config, ConfigError
from scalenlp.models import decoder as decoder_module
from scalenlp.models import loss as loss_module
from scalenlp.models.flavors import build_model, model_args
from scalenlp.parallel.mesh import ParallelDims
from scalenlp.parallel.parallelize import apply_ac, check_layout, parallelize
from scalenlp.parallel.pipeline import layer_costs, split_layers, stage_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import parity  # noqa: E402  (the parity harness is shared with the benchmark script)

torch.set_num_threads(1)


def test_split_layers_is_contiguous_balanced_and_charges_the_head_to_the_last_stage():
    assert split_layers([1.0] * 8, 0.0, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_layers([1.0] * 8, 0.0, 8) == [[i] for i in range(8)]
    # A head as costly as four layers leaves the last stage with fewer layers.
    assert split_layers([1.0] * 8, 4.0, 2) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    # Every stage holds at least one layer, whatever the costs.
    assert split_layers([1.0, 100.0, 1.0], 0.0, 3) == [[0], [1], [2]]


def test_stage_modules_partition_the_model_under_the_same_parameter_names():
    model = build_model(model_args("debug", vocab_size=96, n_layers=4, max_seq_len=16))
    costs, head = layer_costs(model, seq_len=16)
    assert len(costs) == 4 and head == 96 * 64
    layers = split_layers(costs, head, 2)
    parts = [stage_module(model, ids, first=s == 0, last=s == 1) for s, ids in enumerate(layers)]
    names = [set(p.state_dict()) for p in parts]
    assert not names[0] & names[1] and names[0] | names[1] == set(model.state_dict())
    tokens = torch.randint(0, 96, (2, 16))
    torch.testing.assert_close(parts[1](parts[0](tokens)), model(tokens))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients_and_names(mode):
    torch.manual_seed(0)
    reference = build_model(model_args("debug", vocab_size=96, max_seq_len=16))
    checkpointed = copy.deepcopy(reference)
    apply_ac(checkpointed, mode)
    tokens = torch.randint(0, 96, (2, 16))
    for model in (reference, checkpointed):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for p, q in zip(reference.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def _cfg(**parallel) -> Config:
    cfg = Config()
    cfg.training.global_batch_size = 8
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("parallel, world, message", [
    (dict(tp=3), 3, "tp=3 does not divide the model's 4 attention heads"),
    (dict(tp=4), 4, "tp=4 does not divide the model's 2 key/value heads"),
    (dict(pp=4), 4, "4 pipeline stages but the model has only 2 layers"),
    (dict(pp=2, pp_stages_per_rank=2, pp_schedule="interleaved_1f1b"), 2, "only 2 layers"),
    (dict(pp=2, pp_microbatches=3), 2, "pp_microbatches=3 does not divide the per-rank batch 8"),
    (dict(pp=2, pp_stages_per_rank=2, pp_schedule="1f1b"), 2, "need an interleaved schedule"),
    (dict(offload=True), 2, "offload"),
])
def test_impossible_layouts_are_one_config_error(parallel, world, message):
    cfg = _cfg(**parallel)
    dims = ParallelDims.from_config(cfg.parallel, world)
    with pytest.raises(ConfigError, match=message):
        check_layout(model_args("debug"), dims, cfg)


def test_tied_embeddings_can_be_pipelined_and_degrees_must_fill_the_world():
    cfg = _cfg(pp=2)
    # Pipelined, a tied embedding becomes two synchronised copies (tests/integration/test_tied_pipeline.py).
    check_layout(model_args("debug-gpt2"), ParallelDims.from_config(cfg.parallel, 2), cfg)
    with pytest.raises(ConfigError, match="= 4 but there are 3 devices"):
        ParallelDims.from_config(_cfg(tp=2, dp_shard=2).parallel, 3)


def test_one_process_trains_alike_with_projections_stacked_and_one_by_one():
    stacked = parity.reference(steps=5)
    separate = parity.train({"training.stack_projections": False}, 1, 5)
    assert separate["loss"] == pytest.approx(stacked["loss"], rel=1e-5, abs=0)
    assert separate["grad_norm"] == pytest.approx(stacked["grad_norm"], rel=1e-4)


@pytest.mark.slow  # compiling the blocks and the loss takes ~30-60 s here
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU backend needs a C++ compiler (g++)")
def test_compiled_blocks_and_loss_match_eager(monkeypatch):
    """training.compile compiles every block and the chunked loss; the loss, the gradients and the parameter names
    stay the eager ones."""
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 97 * 10)  # 4 chunks, the last short
    calls = []
    compiled_loss = loss_module.compiled_linear_cross_entropy()
    monkeypatch.setattr(decoder_module, "compiled_linear_cross_entropy",
                        lambda: calls.append(1) or compiled_loss)
    torch.manual_seed(0)
    eager = build_model(model_args("debug", vocab_size=97, max_seq_len=16))
    cfg = Config()
    cfg.training.compile = True
    compiled = parallelize(copy.deepcopy(eager), ParallelDims(1, 1, 1, 1, 1), None, cfg)
    tokens, targets = torch.randint(0, 97, (2, 2, 16))
    targets[0, :3] = -100
    losses = [model(tokens, targets=targets) for model in (eager, compiled)]
    for loss in losses:
        loss.mul(0.5).backward()
    assert calls  # the compiled model's loss went through torch.compile
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
