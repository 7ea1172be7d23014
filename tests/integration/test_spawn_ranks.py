"""The multi-process harness: results of every rank come back, and a failing rank fails the caller."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from scalenlp.testing.ranks import spawn_ranks

pytestmark = pytest.mark.slow  # spawns processes: 8-14 s a test here


def _sum_ranks(rank, world, out):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    torch.save(total, out / f"rank{rank}.pt")


def _fail(rank, world):
    # Every rank: one failing alone would leave the other in the harness's barrier until spawn kills it (30 s).
    raise ValueError(f"rank {rank} failed on purpose")


def test_every_rank_runs_in_one_group(tmp_path):
    spawn_ranks(_sum_ranks, 2, tmp_path)
    assert [torch.load(tmp_path / f"rank{r}.pt").item() for r in range(2)] == [3.0, 3.0]


def test_a_failing_rank_fails_the_caller():
    # The harness ends finished ranks with os._exit(0): a rank that raised must not end that way.
    with pytest.raises(ProcessRaisedException, match="rank [01] failed on purpose"):
        spawn_ranks(_fail, 2)
