"""Multiple-choice tasks scored the way lm-evaluation-harness scores them, so that a figure can be set beside
published ones.

A task file holds one question per line: ``{"context": str, "choices": [str, ...], "answer": index or choice
text}``. Each choice is a continuation ``delimiter + choice`` of the context (lm-eval's ``target_delimiter``, a
space by default); its log-likelihood is the summed log-probability of its tokens given the context's. Reported:

- ``acc``: the answer is the choice of highest log-likelihood;
- ``acc_norm``: ... of highest log-likelihood per character of the choice (lm-eval's ``acc_norm``: longer choices
  are not penalised for having more tokens to pay for);
- ``acc_bytes``: ... per UTF-8 byte of the choice (lm-eval's ``acc_bytes``; equal to ``acc_norm`` on ASCII);

each with its standard error over questions (the sample standard deviation over sqrt(n), as lm-eval prints it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from scalenlp.data.chat import end_of_text_id, special_token
from scalenlp.data.text import jsonl_rows
from scalenlp.errors import UserError

# An evaluation is one batch job of prefills and short answers: compiling the decode step (a minute or more of
# start-up) never pays it back, so its engine stays eager whatever --compile auto would measure.
EVAL_COMPILE = "off"
ROW_FORMAT = '{"context": "...", "choices": ["...", "..."], "answer": index or choice text}'


@dataclass
class Question:
    context: str
    choices: list[str]
    answer: int  # index into choices
    line: int  # in the task file, for reports


@dataclass
class MultipleChoiceResult:
    acc: float
    acc_stderr: float | None  # None for a single question
    acc_norm: float
    acc_norm_stderr: float | None
    acc_bytes: float
    acc_bytes_stderr: float | None
    questions: int
    continuations: int  # log-likelihoods computed: one per choice
    seconds: float
    # Per question: its line, answer, the three predictions and every choice's log-likelihood.
    details: list[dict] = field(default_factory=list, repr=False)


def read_questions(path: str | Path) -> list[Question]:
    """The task file's questions; a line that is not one ends it all with UserError "FILE:LINE: what is wrong",
    since a score over a silently smaller set could not be compared with anyone's."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--tasks {str(path)!r} is not a file; pass a JSONL file with one {ROW_FORMAT} per line")
    questions = []
    for lineno, row, problem in jsonl_rows(file):
        try:
            if problem is not None:
                raise ValueError(problem)
            questions.append(_question(row, lineno))
        except ValueError as e:
            raise UserError(f"{file}:{lineno}: not a multiple-choice question ({e}); each line needs "
                            f"{ROW_FORMAT}") from None
    if not questions:
        raise UserError(f"--tasks {file} holds no questions; write one {ROW_FORMAT} per line")
    return questions


def _question(row, lineno: int) -> Question:
    if not isinstance(row, dict):
        raise ValueError("a line must be a JSON object")
    missing = [key for key in ("context", "choices", "answer") if key not in row]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    context, choices, answer = row["context"], row["choices"], row["answer"]
    if not isinstance(context, str):
        raise ValueError("context must be a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a list of at least two non-empty strings")
    if isinstance(answer, str):
        if answer not in choices:
            raise ValueError(f"answer {answer!r} is none of the choices")
        answer = choices.index(answer)
    elif isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"answer must be a choice's text or its index, 0 to {len(choices) - 1}, got {answer!r}")
    return Question(context, choices, answer, lineno)


def encode_pair(tokenizer, context: str, continuation: str, prefix_id: int | None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval splits them: white space ending the context moves to the
    continuation (byte-level BPE joins a space to the word after it, so " Paris" is one token where "Paris"
    after a lone space token is not), and the continuation is whatever encoding the whole adds to encoding
    the context, so that its tokens are those the model would read. An empty context becomes ``prefix_id``
    (the start-of-text token, else the end-of-text one), the token every document follows in training."""
    stripped = context.rstrip()
    continuation, context = context[len(stripped):] + continuation, stripped
    if not context:
        ids = tokenizer.encode(continuation, add_special_tokens=False).ids
        if prefix_id is None:
            raise UserError("this tokenizer has no start- or end-of-text token to stand for an empty context; "
                            "give every question a context")
        return ([prefix_id], ids) if ids[0] != prefix_id else (ids[:1], ids[1:])
    context_ids = tokenizer.encode(context).ids
    return context_ids, tokenizer.encode(context + continuation).ids[len(context_ids):]


def prefix_token_id(tokenizer, tokenizer_config: dict) -> int | None:
    """The token an empty context stands for: the start-of-text token, else the end-of-text one (lm-eval's
    ``prefix_token_id``)."""
    bos = special_token(tokenizer_config, "bos_token")
    bos_id = tokenizer.token_to_id(bos) if bos is not None else None
    return bos_id if bos_id is not None else end_of_text_id(tokenizer, tokenizer_config)


def score(engine, questions: list[Question], delimiter: str = " ") -> MultipleChoiceResult:
    """Every choice of every question scored through ``engine.loglikelihood`` in one call (the engine batches
    them), and the accuracies."""
    start = time.perf_counter()
    prefix = prefix_token_id(engine.tokenizer, engine.tokenizer_config)
    pairs = [encode_pair(engine.tokenizer, q.context, delimiter + choice, prefix)
             for q in questions for choice in q.choices]
    scores = iter(engine.loglikelihood(pairs))
    right: dict[str, list[bool]] = {"acc": [], "acc_norm": [], "acc_bytes": []}
    details = []
    for q in questions:
        lls = [next(scores)[0] for _ in q.choices]
        picks = {"acc": _best(lls),
                 "acc_norm": _best([ll / len(c) for ll, c in zip(lls, q.choices)]),
                 "acc_bytes": _best([ll / len(c.encode("utf-8")) for ll, c in zip(lls, q.choices)])}
        for metric, pick in picks.items():
            right[metric].append(pick == q.answer)
        details.append({"line": q.line, "answer": q.answer, "pred": picks["acc"], "pred_norm": picks["acc_norm"],
                        "pred_bytes": picks["acc_bytes"], "loglikelihoods": lls})
    figures = {}
    for metric, hits in right.items():
        figures[metric], figures[f"{metric}_stderr"] = _mean_and_stderr(hits)
    return MultipleChoiceResult(**figures, questions=len(questions), continuations=len(pairs),
                                seconds=time.perf_counter() - start, details=details)


def _best(values: list[float]) -> int:
    """The index of the largest value, the first on a tie (numpy's argmax, which lm-eval uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean_and_stderr(hits: list[bool]) -> tuple[float, float | None]:
    n = len(hits)
    mean = sum(hits) / n
    if n < 2:
        return mean, None
    variance = sum((h - mean) ** 2 for h in hits) / (n - 1)
    return mean, math.sqrt(variance / n)
