"""Classification scores over several ranks are those of the whole evaluation set: the confusion counts are
summed over the ranks, not the per-rank scores averaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalenlp.data.labeled import IGNORE_LABEL
from scalenlp.testing.ranks import spawn_ranks
from scalenlp.train.scores import all_reduce_counts, classification_scores, confusion_matrix

LABELS = torch.tensor([0, 0, 1, 1, 2, 2, IGNORE_LABEL])
PREDICTIONS = torch.tensor([0, 1, 1, 1, 2, 0, 2])
SHARES = (slice(0, 2), slice(2, None))  # shares of different sizes


def _reduce_counts(rank, world, out):
    counts = all_reduce_counts(confusion_matrix(PREDICTIONS[SHARES[rank]], LABELS[SHARES[rank]], 3))
    torch.save(counts, out / f"rank{rank}.pt")


@pytest.mark.slow  # two processes: 20-50 s here under load
def test_scores_over_ranks_are_those_of_the_whole_set(tmp_path):
    spawn_ranks(_reduce_counts, 2, tmp_path)
    whole = classification_scores(confusion_matrix(PREDICTIONS, LABELS, 3))
    for rank in range(2):
        assert classification_scores(torch.load(tmp_path / f"rank{rank}.pt")) == whole
    per_rank = [classification_scores(confusion_matrix(PREDICTIONS[s], LABELS[s], 3)) for s in SHARES]
    assert np.mean([s["macro_f1"] for s in per_rank]) != pytest.approx(whole["macro_f1"])  # why counts are summed
