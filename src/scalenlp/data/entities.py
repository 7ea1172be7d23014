"""Entities from BIO tags, and entity-level scores as seqeval computes them.

A tag is ``O``, ``B-TYPE`` (an entity of TYPE begins) or ``I-TYPE`` (it goes on). Decoding follows seqeval's
default mode (that of the CoNLL evaluation script), which also reads sequences a model may predict but a
data file may not hold: an ``I-TYPE`` after ``O`` or after another type begins a new entity. transformers'
token-classification pipeline groups words the same way, so training's scores, `scalenlp tag` and
``/v1/tag`` all see the same entities.

Scores are exact-match: an entity counts as found only when a predicted one has the same type, first and
last word. Precision, recall and F1 per type and micro-averaged over all entities; 0 where a ratio has
nothing to divide by, as seqeval's ``zero_division`` default reports it (after its warning).

Training, serving and the CLI all import this module: it is plain Python, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

OUTSIDE = "O"
# An entity: (type, first word, last word), words counted from 0 within the sentence.
Span = tuple[str, int, int]


def split_tag(tag: str) -> tuple[str, str]:
    """(prefix, type) of a tag: ("B", "person") for "B-person", ("O", "") for "O"."""
    if tag == OUTSIDE:
        return OUTSIDE, ""
    prefix, _, kind = tag.partition("-")
    return prefix, kind


def entity_spans(tags: Sequence[str]) -> list[Span]:
    """The entities of one sentence's tags: a B- begins one, an I- continues the entity before it when that
    has the same type and begins one otherwise, anything else ends it."""
    spans: list[Span] = []
    start, kind = -1, ""
    for i, tag in enumerate(tags):
        prefix, tag_kind = split_tag(tag)
        continues = prefix == "I" and start >= 0 and tag_kind == kind
        if start >= 0 and not continues:
            spans.append((kind, start, i - 1))
            start, kind = -1, ""
        if prefix in ("B", "I") and not continues:
            start, kind = i, tag_kind
    if start >= 0:
        spans.append((kind, start, len(tags) - 1))
    return spans


def bio_problem(tags: Sequence[str]) -> tuple[int, str] | None:
    """(position, why) of the first tag that breaks BIO order (an I- that follows neither a B- nor an I- of its
    type, or a tag that is none of O, B-TYPE, I-TYPE); None when the sentence is well formed."""
    before = OUTSIDE
    for i, tag in enumerate(tags):
        prefix, kind = split_tag(tag)
        if prefix not in ("O", "B", "I") or prefix != "O" and not kind:
            return i, f"tag {tag!r} is not O, B-TYPE or I-TYPE"
        if prefix == "I" and split_tag(before)[1] != kind:
            return i, f"tag {tag!r} follows {before!r}; an I- tag continues a B- or I- tag of its own type"
        before = tag
    return None


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _prf(found: int, predicted: int, gold: int) -> dict[str, float]:
    precision, recall = _ratio(found, predicted), _ratio(found, gold)
    return {"precision": precision, "recall": recall, "f1": _ratio(2 * precision * recall, precision + recall)}


def entity_counts(gold: Iterable[Sequence[str]], predicted: Iterable[Sequence[str]]
                  ) -> dict[str, tuple[int, int, int]]:
    """Per type: (entities found exactly, entities predicted, gold entities), over sentence pairs."""
    found: Counter = Counter()
    guessed: Counter = Counter()
    true: Counter = Counter()
    for gold_tags, predicted_tags in zip(gold, predicted, strict=True):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(f"a sentence of {len(gold_tags)} gold tags has {len(predicted_tags)} predicted ones")
        gold_spans, predicted_spans = set(entity_spans(gold_tags)), set(entity_spans(predicted_tags))
        true.update(kind for kind, _, _ in gold_spans)
        guessed.update(kind for kind, _, _ in predicted_spans)
        found.update(kind for kind, _, _ in gold_spans & predicted_spans)
    return {kind: (found[kind], guessed[kind], true[kind]) for kind in sorted(true | guessed)}


def entity_scores(gold: Iterable[Sequence[str]], predicted: Iterable[Sequence[str]]) -> dict:
    """Micro-averaged ``precision``, ``recall``, ``f1``, the number of gold entities (``entities``), and per type
    a dict of the same under ``types``: seqeval's classification_report, as numbers."""
    counts = entity_counts(gold, predicted)
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    types = {kind: {**_prf(*c), "entities": c[2]} for kind, c in counts.items()}
    return {**_prf(*totals), "entities": totals[2], "types": types}


def text_entities(text: str, offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None],
                  probs, labels: Sequence[str]) -> list[dict]:
    """The entities of one text from its sub-tokens' character ``offsets``, their words (``word_ids``) and their
    tag probabilities (``probs``, tokens x labels, an array), as transformers' pipeline reads them with
    aggregation_strategy="first": a word takes the likeliest tag of its first sub-token, scored by that tag's
    probability; words group into entities as ``entity_spans`` does; an entity's score is its words' mean."""
    words: list[list] = []  # [first character, end character, tag, score]
    for i, word in enumerate(word_ids):
        if word is None:
            continue
        if i > 0 and word == word_ids[i - 1] and words:
            words[-1][1] = offsets[i][1]
            continue
        best = int(probs[i].argmax())
        words.append([offsets[i][0], offsets[i][1], labels[best], float(probs[i][best])])
    out = []
    for kind, first, last in entity_spans([w[2] for w in words]):
        start, end = words[first][0], words[last][1]
        score = sum(w[3] for w in words[first:last + 1]) / (last - first + 1)
        out.append({"type": kind, "text": text[start:end], "start": start, "end": end, "score": score})
    return out
