"""One layout check: the trainer (config keys), the sharded server (--tp) and the planner (--layout) give the
same answer, in the same words, for the same layout of the same model."""

from __future__ import annotations

import pytest

from scalenlp.config import ConfigError, load_config
from scalenlp.engine.sharded import check_tp
from scalenlp.errors import UserError
from scalenlp.layout import SCHEDULES, Layout
from scalenlp.models.flavors import model_args
from scalenlp.parallel.pipeline import SCHEDULES as SCHEDULE_CLASSES
from scalenlp.plan.cost import Workload, model_shape
from scalenlp.plan.search import check_layout
from scalenlp.train.trainer import validate_run

SEQ = 64

# (layout, flavor, global batch, what the answer must contain: None where the layout runs). "debug" has 4 heads,
# 2 key/value heads, an MLP of 176 and 2 layers; "small" 4 layers; gpt2-124m a vocabulary of 50257.
CASES = [
    (Layout(tp=2, microbatch=8), "gpt2-124m", 8, None),  # an uneven vocabulary shards (first ranks hold one more row)
    (Layout(tp=2, dp_shard=2, zero=2, microbatch=4, sequence_parallel=True), "debug", 8, None),
    (Layout(tp=3, microbatch=8), "debug", 8, "tp=3 does not divide the model's 4 attention heads"),
    (Layout(tp=4, microbatch=8), "debug", 8, "tp=4 does not divide the model's 2 key/value heads"),
    (Layout(pp=2, microbatch=4, schedule="2f2b"), "debug", 8, "pipeline schedule '2f2b' is not one of"),
    (Layout(pp=2, microbatch=2, schedule="1f1b", stages_per_rank=2), "small", 8,
     "2 pipeline stages per rank (v) need an interleaved schedule"),
    (Layout(pp=2, microbatch=2, schedule="zero_bubble", stages_per_rank=2), "small", 8, None),
    (Layout(pp=2, microbatch=2, schedule="interleaved_1f1b", stages_per_rank=1), "debug", 8, None),
    (Layout(pp=2, microbatch=8, schedule="1f1b"), "debug", 8, "1 microbatches per step cannot fill 2 pipeline stages"),
    (Layout(pp=2, microbatch=8, schedule="gpipe"), "debug", 8, None),  # gpipe runs one microbatch through 2 stages
    (Layout(pp=2, microbatch=2, schedule="interleaved_1f1b", stages_per_rank=2), "small", 10,
     "5 microbatches per step into m // pp = 2 rounds, which must divide them"),
    (Layout(pp=4, microbatch=2), "debug", 8, "4 pipeline stages but the model has only 2 layers"),
    (Layout(dp_replicate=2, microbatch=4, offload=True), "debug", 8, "offload moves FSDP's shards to host memory"),
    (Layout(zero=3, microbatch=8, offload=True), "debug", 8, "zero2 or zero3 data parallelism over more than one"),
]


def planner_answer(layout: Layout, flavor: str, global_batch: int) -> str | None:
    found = check_layout(model_shape(flavor, SEQ), Workload(seq=SEQ, global_batch=global_batch), layout,
                         layout.devices, gpus_per_node=layout.devices)  # one node
    return "; ".join(message for _, message in found) or None


def trainer_answer(layout: Layout, flavor: str, global_batch: int) -> str | None:
    """What `scalenlp train` says before launching, given the layout as config keys."""
    keys = {"model.flavor": flavor, "model.vocab_size": model_args(flavor).vocab_size, "training.seq_len": SEQ,
            "training.global_batch_size": global_batch, **layout.to_config(global_batch)}
    try:
        validate_run(load_config(overrides=[f"{k}={v}" for k, v in keys.items()]), layout.devices)
    except ConfigError as e:
        return str(e)
    return None


def server_answer(layout: Layout, flavor: str) -> str | None:
    try:
        check_tp(model_args(flavor), layout.tp)
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("layout, flavor, global_batch, expected", CASES,
                         ids=[f"{f}:{lay.describe()}" for lay, f, _, _ in CASES])
def test_trainer_server_and_planner_give_the_same_answer(layout, flavor, global_batch, expected):
    planner = planner_answer(layout, flavor, global_batch)
    assert trainer_answer(layout, flavor, global_batch) == planner
    if layout.dp == layout.pp == 1 and not (layout.sequence_parallel or layout.offload):  # the server's: tp alone
        assert server_answer(layout, flavor) == planner
    if expected is None:
        assert planner is None
    else:
        assert expected in planner and "\n" not in planner


def test_config_and_layout_convert_both_ways():
    for layout, _flavor, global_batch, expected in CASES:
        if expected is None:
            keys = {"training.global_batch_size": global_batch, **layout.to_config(global_batch)}
            cfg = load_config(overrides=[f"{k}={v}" for k, v in keys.items()])
            assert Layout.from_config(cfg, layout.devices) == layout


def test_offload_converts_both_ways():
    layout = Layout(dp_shard=2, zero=3, microbatch=4, offload=True)  # runs on GPUs only, so not among CASES
    keys = {"training.global_batch_size": 8, **layout.to_config(8)}
    assert Layout.from_config(load_config(overrides=[f"{k}={v}" for k, v in keys.items()]), 2) == layout


def test_one_list_of_schedules():
    assert set(SCHEDULE_CLASSES) == set(SCHEDULES)  # the trainer runs each schedule the check accepts
