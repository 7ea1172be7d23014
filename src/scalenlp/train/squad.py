"""Exact match and F1 as SQuAD's official evaluation script computes them, so that the figures compare with
published ones.

Both compare normalised answers: lower case, punctuation removed, the articles a/an/the removed, runs of white
space made one space. F1 is over the bags of words of the prediction and a reference; each question takes its
best score over its reference answers, and the totals are percentages over questions. An unanswerable question
(SQuAD v2.0) has the empty string as its one reference: only the empty prediction scores on it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, in the script's order: lower case, punctuation, articles, white space."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str) -> float:
    """Word-overlap F1 of two answers; when either is empty after normalisation, 1 if both are, else 0."""
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not wanted:
        return float(predicted == wanted)
    same = sum((Counter(predicted) & Counter(wanted)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(wanted)
    return 2 * precision * recall / (precision + recall)


def question_scores(prediction: str, references: Sequence[str]) -> tuple[float, float]:
    """(exact match, F1) of one prediction: the best over its references ([""] when it has none)."""
    references = list(references) or [""]
    return max(exact_match(prediction, r) for r in references), max(f1(prediction, r) for r in references)


def squad_scores(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """exact_match and f1 in percent over the questions, as the official script reports them."""
    if not predictions:
        raise ValueError("no questions to score")
    totals = [question_scores(p, r) for p, r in zip(predictions, references, strict=True)]
    return {"exact_match": 100 * sum(t[0] for t in totals) / len(totals),
            "f1": 100 * sum(t[1] for t in totals) / len(totals)}
