"""Classification scores: accuracy and macro-F1 from a confusion matrix of counts.

Ranks add up their confusion matrices and score the sum, so the scores are those of the whole eval set
whatever its split over data-parallel ranks (a mean of per-rank F1s, or of per-rank accuracies over shares of
different sizes, would not be).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Counts (num_classes, num_classes), true label by row, prediction by column; negative labels (rows that
    only fill a batch) are left out."""
    keep = labels >= 0
    flat = labels[keep].long() * num_classes + predictions[keep].long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def all_reduce_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of every rank's counts in ``group`` (the data-parallel ranks), on every rank of it."""
    if dist.is_available() and dist.is_initialized():
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    return counts


def classification_scores(counts: torch.Tensor) -> dict[str, float]:
    """Accuracy, and the macro-F1 over the classes that occur as a label or a prediction (as scikit-learn's
    f1_score(average="macro") does: a class absent from both says nothing about the model)."""
    counts = counts.double()
    total = counts.sum()
    if total == 0:
        raise ValueError("no scored rows: the confusion matrix is empty")
    true_pos = counts.diagonal()
    labelled, predicted = counts.sum(1), counts.sum(0)
    present = (labelled + predicted) > 0
    f1 = 2 * true_pos[present] / (labelled[present] + predicted[present])
    return {"accuracy": (true_pos.sum() / total).item(), "macro_f1": f1.mean().item()}
