"""Extractive question answering data: SQuAD files read, questions and contexts cut into windows, and logits
turned back into answers in the context's text.

Files: SQuAD's JSON (v1.1, and v2.0 with unanswerable questions, ``is_impossible`` or an empty answer list) and
JSONL, one question a line: ``question``, ``context``, ``answers`` as ``{"text": [...], "answer_start": [...]}``
(the Hugging Face datasets layout) or a list of ``{"text", "answer_start"}`` objects, and an optional ``id``.
A question that cannot be used (an answer whose text is not at its ``answer_start`` in the context, a question
that leaves no room for its context in a window) is reported with file and line and left out; the rest are used.

Windows follow the reference recipe (transformers' run_qa): ``[CLS] question [SEP] context [SEP]``, the context
cut into windows of at most ``max_len`` tokens overlapping by ``stride`` tokens (the tokenizers library's
truncation with ``only_second``), so each token carries its character span in the context (offsets). A window
that holds the whole answer is labelled with its first and last token; one that does not points both at the
first token ([CLS]), where the model learns "not in this window".

Post-processing lives here, not under train/, because serving needs it too: the ``n_best`` highest start and
end logits of every window, pairs that lie in the context, in order and at most ``max_answer_len`` tokens long,
ranked by the sum of their logits over all windows of a question; with ``allow_empty`` (SQuAD v2.0) the empty
answer wins when the lowest [CLS] score of any window is above the best span's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Encoding, Tokenizer

from scalenlp.data.labeled import REPORT_ROWS, LabeledDataset
from scalenlp.data.sources import _decode_error, _open_text
from scalenlp.data.text import jsonl_rows, parse_json, text_problem
from scalenlp.errors import UserError

QA_FORMATS = (".json", ".jsonl")
# Token offset of a token outside the context (the question, special tokens, padding): no characters.
NO_SPAN = -1


@dataclass
class QAExample:
    """One question about one context; ``answers`` are (text, start character) pairs, empty if unanswerable."""
    id: str
    question: str
    context: str
    answers: list[tuple[str, int]]
    line: int


@dataclass
class Answer:
    """A predicted answer: its text, its characters ``context[start:end]`` and its probability (the span's start
    and end probabilities within its window); the empty answer has start = end = 0."""
    text: str
    start: int
    end: int
    score: float


# -- reading ----------------------------------------------------------------------------------------------------

def read_qa(path: str | Path, log: Callable[[str], None] = print) -> list[QAExample]:
    """Every usable question of a SQuAD .json or a .jsonl file; unusable ones are reported through ``log``."""
    f = Path(path).expanduser()
    if not f.is_file():
        raise UserError(f"question-answering data file {str(f)!r} does not exist; give a SQuAD .json or a .jsonl "
                        f"file")
    if f.suffix.lower() not in QA_FORMATS:
        raise UserError(f"{f}: unsupported file type {f.suffix or '(no extension)'!r} for question answering; use "
                        f"SQuAD's .json or a .jsonl file of question, context and answers")
    skipped: list[tuple[int, str]] = []
    rows = _squad_rows(f, skipped) if f.suffix.lower() == ".json" else _jsonl_rows(f, skipped)
    examples = []
    for example in rows:
        problem = answer_problem(example)
        if problem:
            skipped.append((example.line, problem))
        else:
            examples.append(example)
    report_skipped(f, skipped, log)
    if not examples:
        raise UserError(f"{f} has no usable questions (each needs a question, a context and answers found in it)")
    return examples


def report_skipped(f: Path, skipped: list[tuple[int, str]], log: Callable[[str], None]) -> None:
    """One line per skipped question (the first few, then a count), each with the file and line."""
    if not skipped:
        return
    log(f"{f}: skipped {len(skipped)} question(s) that cannot be used:")
    for line, why in sorted(skipped)[:REPORT_ROWS]:
        log(f"  {f}:{line}: {why}")
    if len(skipped) > REPORT_ROWS:
        log(f"  ... and {len(skipped) - REPORT_ROWS} more")


def answer_problem(example: QAExample) -> str | None:
    """Why ``example`` cannot be used, or None."""
    texts = [("question", example.question), ("context", example.context)]
    for what, text in texts + [("answer", text) for text, _ in example.answers]:
        if (problem := text_problem(text, f"the {what}")) is not None:
            return f"question {example.id!r}: {problem}"
    if not example.question.strip() or not example.context.strip():
        return f"question {example.id!r}: empty {'question' if not example.question.strip() else 'context'}"
    for text, start in example.answers:
        if example.context[start:start + len(text)] != text:
            found = example.context.find(text)
            hint = f" (it is at {found})" if found >= 0 else " (it is not in the context at all)"
            return (f"question {example.id!r}: answer {text!r} is not at answer_start {start} of its context"
                    f"{hint}; fix answer_start")
    return None


def _read(f: Path) -> str:
    try:
        with _open_text(f) as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise _decode_error(f, e) from None


ANSWERS_LAYOUT = 'answers must be {"text": [...], "answer_start": [...]} or a list of {"text", "answer_start"} objects'


def _squad_rows(f: Path, skipped: list[tuple[int, str]]) -> Iterator[QAExample]:
    raw = _read(f)
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise UserError(f"{f}: {e}; a .json file must be SQuAD's layout") from None
    try:
        articles = doc["data"]
        qas = [(p["context"], qa) for article in articles for p in article["paragraphs"] for qa in p["qas"]]
    except (KeyError, TypeError) as e:
        raise UserError(f"{f} is not in SQuAD's layout ({{\"data\": [{{\"paragraphs\": [{{\"context\", \"qas\"}}]}}]}}"
                        f", missing {e}); use SQuAD JSON or .jsonl") from None
    # JSON parsing keeps no positions: a question's line is where its id is next written after the last one's.
    cursor, line = 0, 1
    for n, (context, qa) in enumerate(qas):
        if not isinstance(qa, dict):
            skipped.append((line, f"question {n} is not an object"))
            continue
        qid = str(qa.get("id", n))
        at = raw.find(json.dumps(qid), cursor)
        if at >= 0:
            line += raw.count("\n", cursor, at)
            cursor = at
        try:
            answers = _answer_pairs([] if qa.get("is_impossible") else qa.get("answers", []))
        except (KeyError, TypeError, ValueError):
            skipped.append((line, f"question {qid!r}: {ANSWERS_LAYOUT}"))
            continue
        question = qa.get("question", "")
        if not isinstance(question, str) or not isinstance(context, str):
            skipped.append((line, f"question {qid!r}: question and context must be strings"))
            continue
        yield QAExample(qid, question, context, answers, line)


def _jsonl_rows(f: Path, skipped: list[tuple[int, str]]) -> Iterator[QAExample]:
    for line, record, problem in jsonl_rows(f):
        if problem is not None:
            skipped.append((line, problem))
            continue
        missing = [k for k in ("question", "context", "answers") if not isinstance(record, dict) or k not in record]
        if missing:
            skipped.append((line, f"no {', '.join(map(repr, missing))} field; each line needs question, context "
                                  f"and answers"))
            continue
        try:
            answers = _answer_pairs(record["answers"])
        except (KeyError, TypeError, ValueError):
            skipped.append((line, ANSWERS_LAYOUT))
            continue
        if not isinstance(record["question"], str) or not isinstance(record["context"], str):
            skipped.append((line, "question and context must be strings"))
            continue
        yield QAExample(str(record.get("id", line)), record["question"], record["context"], answers, line)


def _answer_pairs(answers) -> list[tuple[str, int]]:
    """(text, start) pairs from either answer layout."""
    if isinstance(answers, dict):
        texts, starts = answers["text"], answers["answer_start"]
        if len(texts) != len(starts):
            raise ValueError("as many texts as starts")
        answers = [{"text": t, "answer_start": s} for t, s in zip(texts, starts)]
    return [(str(a["text"]), int(a["answer_start"])) for a in answers]


# -- windows ----------------------------------------------------------------------------------------------------

class Windower:
    """Cuts (question, context) pairs into windows of at most ``max_len`` tokens, the context's overlapping by
    ``stride`` tokens (the tokenizers library's truncation of the second sequence), unpadded."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, stride: int):
        self.max_len, self.stride = max_len, stride
        self.windows = Tokenizer.from_str(tokenizer.to_str())  # copies: truncation and padding are set on them
        self.windows.no_padding()
        self.windows.enable_truncation(max_len, stride=stride, strategy="only_second")
        self.plain = Tokenizer.from_str(tokenizer.to_str())
        self.plain.no_padding()
        self.plain.no_truncation()
        self.specials = self.plain.num_special_tokens_to_add(True)

    def __call__(self, questions: Sequence[str], contexts: Sequence[str]) -> list[list[Encoding] | str]:
        """Each pair's windows, or why it has none: a question so long that a window holds no more than
        ``stride`` tokens of context (the windows could not advance)."""
        out: list[list[Encoding] | str] = []
        fits = []
        for q in questions:
            question = len(self.plain.encode(q, add_special_tokens=False).ids)
            room = self.max_len - question - self.specials
            if room <= self.stride:
                out.append(f"the question is {question} tokens long, which leaves {max(room, 0)} tokens of a "
                           f"{self.max_len}-token window for its context, not more than the {self.stride} tokens "
                           f"windows overlap by (data.doc_stride); shorten the question, or train with a longer "
                           f"training.seq_len or a smaller data.doc_stride")
            else:
                out.append([])
                fits.append(len(out) - 1)
        encodings = self.windows.encode_batch([(questions[i], contexts[i]) for i in fits])
        for i, e in zip(fits, encodings):
            out[i] = [e, *e.overflowing]
        return out


def char_spans(encoding: Encoding) -> np.ndarray:
    """(tokens, 2) character spans of the context for each token of a window; NO_SPAN outside the context."""
    spans = np.full((len(encoding.ids), 2), NO_SPAN, dtype=np.int32)
    for i, (seq, offset) in enumerate(zip(encoding.sequence_ids, encoding.offsets)):
        if seq == 1:
            spans[i] = offset
    return spans


def answer_tokens(spans: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """The first and last token of characters [start, end) in a window, or (0, 0) when the window does not hold
    all of them."""
    inside = np.flatnonzero(spans[:, 0] != NO_SPAN)
    if len(inside) == 0 or spans[inside[0], 0] > start or spans[inside[-1], 1] < end:
        return 0, 0
    # The first token ending after the answer's first character, the last starting before its end.
    first = inside[np.argmax(spans[inside, 1] > start)]
    last = inside[len(inside) - 1 - np.argmax(spans[inside[::-1], 0] < end)]
    return int(first), int(last)


@dataclass
class QAWindows:
    """The windows of a list of questions: tokens (as a LabeledDataset whose labels are (start, end) token
    pairs), each window's question index and each token's character span in its context."""
    data: LabeledDataset
    example: np.ndarray
    spans: list[np.ndarray]
    examples: list[QAExample] = field(repr=False)

    def __len__(self) -> int:
        return len(self.example)


def make_windows(examples: list[QAExample], tokenizer: Tokenizer, max_len: int, stride: int, path: Path | str,
                 log: Callable[[str], None] = print) -> QAWindows:
    """Every window of ``examples`` labelled with its first answer's tokens; questions without windows are
    reported (file and line) and left out."""
    encoded = Windower(tokenizer, max_len, stride)([e.question for e in examples], [e.context for e in examples])
    kept, windows, skipped = [], [], []
    for example, result in zip(examples, encoded):
        if isinstance(result, str):
            skipped.append((example.line, f"question {example.id!r}: {result}"))
            continue
        kept.append(example)
        windows.extend((len(kept) - 1, w) for w in result)
    report_skipped(Path(path), skipped, log)
    if not kept:
        raise UserError(f"{path}: no question fits a window of training.seq_len={max_len} tokens with "
                        f"data.doc_stride={stride}")
    spans = [char_spans(w) for _, w in windows]
    labels = np.zeros((len(windows), 2), dtype=np.int64)
    for i, ((n, _), s) in enumerate(zip(windows, spans)):
        if kept[n].answers:
            text, start = kept[n].answers[0]
            labels[i] = answer_tokens(s, start, start + len(text))
    lengths = np.fromiter((len(w.ids) for _, w in windows), dtype=np.int64, count=len(windows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.fromiter((t for _, w in windows for t in w.ids), dtype=np.int32, count=int(offsets[-1]))
    type_ids = np.fromiter((t for _, w in windows for t in w.type_ids), dtype=np.int8, count=int(offsets[-1]))
    pad_id = (tokenizer.padding or {}).get("pad_id", 0)
    example = np.fromiter((n for n, _ in windows), dtype=np.int64, count=len(windows))
    return QAWindows(LabeledDataset(ids, type_ids, offsets, labels, pad_id), example, spans, kept)


# -- answers from logits ----------------------------------------------------------------------------------------

def best_answer(start_logits: Sequence[torch.Tensor], end_logits: Sequence[torch.Tensor],
                spans: Sequence[np.ndarray], context: str, n_best: int = 20, max_answer_len: int = 30,
                allow_empty: bool = False) -> Answer:
    """The answer to one question from its windows' start and end logits (each (tokens,), padding cut off) and
    their tokens' character spans."""
    best: tuple[float, int, int, int] | None = None  # (logit sum, window, first token, last token)
    null = None
    for w, (start, end, span) in enumerate(zip(start_logits, end_logits, spans)):
        start, end = start.float(), end.float()
        null_score = (start[0] + end[0]).item()
        null = null_score if null is None else min(null, null_score)
        starts = torch.topk(start, min(n_best, len(start))).indices.tolist()
        ends = torch.topk(end, min(n_best, len(end))).indices.tolist()
        for s in starts:
            if span[s, 0] == NO_SPAN:
                continue
            for e in ends:
                if span[e, 0] == NO_SPAN or e < s or e - s + 1 > max_answer_len:
                    continue
                score = (start[s] + end[e]).item()
                if best is None or score > best[0]:
                    best = (score, w, s, e)
    if best is None or allow_empty and null > best[0]:
        w = 0 if best is None else best[1]
        return Answer("", 0, 0, _probability(start_logits[w], end_logits[w], spans[w], 0, 0))
    _, w, s, e = best
    first, last = int(spans[w][s, 0]), int(spans[w][e, 1])
    return Answer(context[first:last], first, last, _probability(start_logits[w], end_logits[w], spans[w], s, e))


def _probability(start: torch.Tensor, end: torch.Tensor, span: np.ndarray, s: int, e: int) -> float:
    """P(start = s) · P(end = e) within one window, over its context tokens and the first token."""
    allowed = torch.from_numpy(span[:, 0] != NO_SPAN)
    allowed[0] = True
    p_start = torch.softmax(start.float().masked_fill(~allowed, float("-inf")), 0)[s]
    p_end = torch.softmax(end.float().masked_fill(~allowed, float("-inf")), 0)[e]
    return (p_start * p_end).item()
