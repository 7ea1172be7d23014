"""Tagged sentences for token classification: read, check, label the first sub-token of each word, cut into windows.

Files: CoNLL-style columns (one word a line, the word first and its tag last, separated by tabs or else by
spaces; a blank line between sentences; ``-DOCSTART-`` lines are skipped) and ``.jsonl`` (one sentence an
object, ``{"tokens": [...], "tags": [...]}``). Tags are BIO (IOB2): ``O``, ``B-TYPE``, ``I-TYPE``. A sentence
that cannot be used (an I- tag out of BIO order, a line without a tag) is skipped and reported with its file
and line, so one bad sentence does not cost a run.

A word's tag goes on its first sub-token; its other sub-tokens, and the special tokens, carry IGNORE_INDEX
(the loss skips them), as transformers' token-classification recipe does. A sentence longer than a window is
cut into several windows, between words, so no word is lost (a single word longer than a window is cut
inside, its first sub-token still in the first piece): every word is scored exactly once.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from scalenlp.data.entities import OUTSIDE, bio_problem, split_tag
from scalenlp.data.labeled import IGNORE_LABEL, REPORT_ROWS, LabeledDataset
from scalenlp.data.sft import IGNORE_INDEX
from scalenlp.data.text import jsonl_rows, open_rows, text_problem
from scalenlp.errors import UserError

DOCSTART = "-DOCSTART-"


@dataclass
class TaggedSentences:
    """The usable sentences of one file, in file order."""
    path: Path
    words: list[list[str]]
    tags: list[list[str]]
    lines: list[int]  # the line of each sentence's first word

    def __len__(self) -> int:
        return len(self.words)


# One sentence as read: (the line of each word, words, tags, (line, why) of a problem found while reading).
_Sentence = tuple[list[int], list[str], list[str], tuple[int, str] | None]


def read_tagged(path: str | Path, log: Callable[[str], None] = print) -> TaggedSentences:
    """Every usable sentence of a CoNLL-style or ``.jsonl`` file; the others are reported through ``log``."""
    f = Path(path).expanduser()
    if not f.is_file():
        raise UserError(f"tagged data file {str(f)!r} does not exist; give a CoNLL-style file (word<TAB>tag a line, "
                        f"a blank line between sentences) or a .jsonl file of {{\"tokens\": [...], \"tags\": [...]}}")
    jsonl = f.suffix.lower() == ".jsonl"
    out = TaggedSentences(f, [], [], [])
    skipped: list[tuple[int, str]] = []
    for lines, words, tags, problem in (_jsonl_sentences if jsonl else _conll_sentences)(f):
        if problem is None and (order := bio_problem(tags)) is not None:
            position, why = order
            problem = (lines[position], f"word {position + 1}: {why}" if jsonl else why)
        if problem is not None:
            skipped.append(problem)
            continue
        out.words.append(words)
        out.tags.append(tags)
        out.lines.append(lines[0])
    if skipped:
        log(f"{f}: skipped {len(skipped)} sentence(s) that cannot be used:")
        for line, why in skipped[:REPORT_ROWS]:
            log(f"  {f}:{line}: {why}")
        if len(skipped) > REPORT_ROWS:
            log(f"  ... and {len(skipped) - REPORT_ROWS} more")
    if not out.words:
        raise UserError(f"{f} has no usable sentences; a CoNLL-style file holds a word and its BIO tag on each line "
                        f"and a blank line between sentences, a .jsonl file {{\"tokens\": [...], \"tags\": [...]}} "
                        f"objects")
    return out


def _conll_sentences(f: Path) -> Iterator[_Sentence]:
    lines: list[int] = []
    words: list[str] = []
    tags: list[str] = []
    problem = None
    with open_rows(f) as fh:
        for number, text in enumerate(fh, 1):
            text = text.rstrip("\r\n")
            if not text.strip() or text.startswith(DOCSTART):
                if words or problem:
                    yield lines, words, tags, problem
                lines, words, tags, problem = [], [], [], None
                continue
            if (why := text_problem(text, "the line")) is not None:
                problem = problem or (number, why)
                continue
            # A tab-separated file may hold words with spaces in them (WNUT's do not, others' might).
            fields = text.split("\t") if "\t" in text else text.split()
            if len(fields) < 2 or not fields[-1].strip():
                problem = problem or (number, "no tag after the word; each line holds a word and its tag")
                continue
            lines.append(number)
            words.append(fields[0])
            tags.append(fields[-1].strip())
    if words or problem:
        yield lines, words, tags, problem


def _jsonl_sentences(f: Path) -> Iterator[_Sentence]:
    for number, record, why in jsonl_rows(f):
        if why is not None:
            yield [], [], [], (number, why)
            continue
        if not isinstance(record, dict) or "tokens" not in record or "tags" not in record:
            yield [], [], [], (number, "not an object with \"tokens\" and \"tags\" lists")
            continue
        words, tags = record["tokens"], record["tags"]
        if not (isinstance(words, list) and isinstance(tags, list)
                and all(isinstance(x, str) for x in words + tags)):
            yield [], [], [], (number, "\"tokens\" and \"tags\" must be lists of strings")
        elif not words or len(words) != len(tags):
            yield [], [], [], (number, f"{len(words)} tokens and {len(tags)} tags; a sentence needs one tag per "
                                       f"token, and at least one token")
        else:
            yield [number] * len(words), words, tags, None


def tag_names(sentences: TaggedSentences) -> list[str]:
    """The training file's tag set, in logit order: O, then each type's B- and I- tags, types sorted."""
    tags = {tag for sentence in sentences.tags for tag in sentence} - {OUTSIDE}
    return [OUTSIDE] + sorted(tags, key=lambda tag: (split_tag(tag)[1], split_tag(tag)[0]))


def tag_ids(sentences: TaggedSentences, names: list[str], log: Callable[[str], None] = print) -> list[np.ndarray]:
    """Each sentence's tags as indices into ``names``. A tag training never saw (in an eval file) gets
    IGNORE_INDEX, one line per such tag says where it first is: the model cannot predict it, so its entities
    count as missed, and the rest of the file is scored as usual."""
    index = {name: i for i, name in enumerate(names)}
    unseen: dict[str, tuple[int, int]] = {}  # tag -> (first line, sentences)
    out = []
    for tags, line in zip(sentences.tags, sentences.lines):
        for tag in dict.fromkeys(t for t in tags if t not in index):
            first, count = unseen.get(tag, (line, 0))
            unseen[tag] = (first, count + 1)
        out.append(np.array([index.get(t, IGNORE_INDEX) for t in tags], dtype=np.int64))
    for tag, (line, count) in unseen.items():
        log(f"{sentences.path}:{line}: tag {tag!r} is not among the training data's tags ({count} sentence(s)); "
            f"the model cannot predict it, so its entities count as missed: train on data that has it")
    return out


def special_ends(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids the tokenizer puts before and after a text ([CLS] and [SEP] for BERT)."""
    probe = plain_tokenizer(tokenizer).encode("a")
    content = [i for i, special in enumerate(probe.special_tokens_mask) if not special]
    return probe.ids[:content[0]], probe.ids[content[-1] + 1:]


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that neither pads nor truncates (the checkpoint's tokenizer.json may do both): windows do that."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    return tok


def word_windows(word_ids: Sequence[int | None], room: int) -> list[tuple[int, int]]:
    """[start, end) slices of a text's sub-tokens (``word_ids``: each one's word), each at most ``room`` long
    and cut between words where a word fits; a word longer than ``room`` is cut in pieces of ``room``."""
    if room < 1:
        raise ValueError(f"a window of {room} tokens holds no text")
    n = len(word_ids)
    starts = [i for i in range(n) if i == 0 or word_ids[i] != word_ids[i - 1]]
    windows, start = [], 0
    while start < n:
        end = min(start + room, n)
        if end < n:
            # The last word start inside (start, end]; if none, one word fills the window and is cut.
            cut = starts[bisect.bisect_right(starts, end) - 1]
            end = cut if cut > start else end
        windows.append((start, end))
        start = end
    return windows


@dataclass
class TaggedDataset(LabeledDataset):
    """Windows as LabeledDataset rows, with a target per token (``targets``, flat like ``ids``). ``labels`` holds
    each row's own index, so that evaluation's filler rows (labelled IGNORE_LABEL) are told apart: their
    targets are all ignored."""
    targets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def collate(self, rows: np.ndarray, labels: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """(input_ids, attention_mask, token_type_ids, targets (rows, longest)), padded targets ignored."""
        input_ids, attention_mask, token_type_ids, _ = super().collate(rows, labels)
        targets = torch.full(input_ids.shape, IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(rows):
            if labels is None or labels[i] != IGNORE_LABEL:
                start, end = self.offsets[row], self.offsets[row + 1]
                targets[i, :end - start] = torch.from_numpy(self.targets[start:end])
        return input_ids, attention_mask, token_type_ids, targets


@dataclass
class TaggedWindows:
    """A file's sentences as windows: ``train`` targets the tag ids; ``slots`` (the same rows) targets, on each
    word's first sub-token, the word's place in ``gold`` (all sentences' tag ids one after another), so
    predictions find their word whichever rank scores the window."""
    train: TaggedDataset
    slots: TaggedDataset
    gold: np.ndarray
    sentence_starts: np.ndarray  # where each sentence's words begin in ``gold`` (and one past the last)
    lost_words: int  # words the tokenizer made no sub-token of (unscored: predicted O)


def tokenize_tagged(sentences: TaggedSentences, tags: list[np.ndarray], tokenizer: Tokenizer,
                    window: int) -> TaggedWindows:
    """Windows of at most ``window`` tokens (special tokens included) over every sentence."""
    prefix, suffix = special_ends(tokenizer)
    room = window - len(prefix) - len(suffix)
    if room < 1:
        raise UserError(f"a window of {window} tokens leaves no room for words next to the tokenizer's "
                        f"{len(prefix) + len(suffix)} special tokens; use training.seq_len >= "
                        f"{len(prefix) + len(suffix) + 1}")
    encodings = plain_tokenizer(tokenizer).encode_batch(sentences.words, is_pretokenized=True,
                                                        add_special_tokens=False)
    sentence_starts = np.concatenate([[0], np.cumsum([len(t) for t in tags])])
    ids: list[int] = []
    targets: list[int] = []
    slots: list[int] = []
    offsets = [0]
    lost = 0
    ends = [IGNORE_INDEX] * len(prefix), [IGNORE_INDEX] * len(suffix)
    for s, (e, sentence_tags) in enumerate(zip(encodings, tags)):
        word_ids = e.word_ids
        lost += len(sentence_tags) - len(set(word_ids))
        for start, end in word_windows(word_ids, room):
            ids += prefix + e.ids[start:end] + suffix
            first = [i for i in range(start, end) if i == 0 or word_ids[i] != word_ids[i - 1]]
            row_targets = [IGNORE_INDEX] * (end - start)
            row_slots = [IGNORE_INDEX] * (end - start)
            for i in first:
                row_targets[i - start] = int(sentence_tags[word_ids[i]])
                row_slots[i - start] = int(sentence_starts[s] + word_ids[i])
            targets += ends[0] + row_targets + ends[1]
            slots += ends[0] + row_slots + ends[1]
            offsets.append(len(ids))
    rows = len(offsets) - 1
    pad_id = (tokenizer.padding or {}).get("pad_id", 0)
    train = TaggedDataset(np.array(ids, dtype=np.int32), np.zeros(len(ids), dtype=np.int8), np.array(offsets),
                          np.arange(rows), pad_id, np.array(targets, dtype=np.int64))
    gold = np.concatenate(tags) if tags else np.zeros(0, dtype=np.int64)
    return TaggedWindows(train, dataclasses.replace(train, targets=np.array(slots, dtype=np.int64)), gold,
                         sentence_starts, lost)
