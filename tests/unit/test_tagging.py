"""Token classification's data and scores, without a model: entity spans and scores against the seqeval package,
BIO order checks, CoNLL and JSONL files (bad sentences reported by file and line, the rest used), tags on each
word's first sub-token as transformers' recipe puts them, and windows that lose no word."""

from __future__ import annotations

import random

import numpy as np
import pytest

from scalenlp.data.entities import bio_problem, entity_scores, entity_spans, text_entities
from scalenlp.data.sft import IGNORE_INDEX
from scalenlp.data.tags import read_tagged, tag_ids, tag_names, tokenize_tagged, word_windows
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.errors import UserError
from scalenlp.models.packaged import packaged_model

seqeval_metrics = pytest.importorskip("seqeval.metrics")

HAND_MADE = [
    # gold, predicted
    (["B-PER", "I-PER", "O", "B-LOC"], ["B-PER", "I-PER", "O", "B-LOC"]),
    (["B-PER", "I-PER", "O", "B-LOC"], ["B-PER", "O", "O", "B-ORG"]),  # a short span and a wrong type
    (["O", "B-ORG", "I-ORG", "I-ORG"], ["O", "I-ORG", "I-ORG", "I-ORG"]),  # I- after O begins an entity
    (["B-LOC", "B-LOC", "O"], ["B-LOC", "I-LOC", "O"]),  # two entities predicted as one
    (["B-PER", "O", "O"], ["I-LOC", "I-PER", "O"]),  # I- of another type begins another entity
    (["O", "O", "O"], ["O", "O", "O"]),
    (["B-creative-work", "I-creative-work"], ["B-creative-work", "I-creative-work"]),  # a type with a dash
]


def assert_like_seqeval(gold, predicted):
    ours = entity_scores(gold, predicted)
    theirs = seqeval_metrics.classification_report(gold, predicted, output_dict=True, zero_division=0)
    assert ours["precision"] == pytest.approx(seqeval_metrics.precision_score(gold, predicted, zero_division=0))
    assert ours["recall"] == pytest.approx(seqeval_metrics.recall_score(gold, predicted, zero_division=0))
    assert ours["f1"] == pytest.approx(seqeval_metrics.f1_score(gold, predicted, zero_division=0))
    assert ours["entities"] == theirs["micro avg"]["support"]
    kinds = {k for k in theirs if not k.endswith(" avg")}
    assert set(ours["types"]) == kinds
    for kind in kinds:
        for ours_key, their_key in (("precision", "precision"), ("recall", "recall"), ("f1", "f1-score"),
                                    ("entities", "support")):
            assert ours["types"][kind][ours_key] == pytest.approx(theirs[kind][their_key]), (kind, ours_key)


def test_entity_scores_equal_seqeval_on_hand_made_sequences():
    gold, predicted = zip(*HAND_MADE)
    assert_like_seqeval(list(gold), list(predicted))
    for pair in HAND_MADE[:5]:  # one sentence at a time too: sentences do not run into each other
        assert_like_seqeval([pair[0]], [pair[1]])
    assert entity_scores(*zip(*HAND_MADE[:1]))["f1"] == 1.0


def test_entity_scores_equal_seqeval_on_random_sequences():
    rng = random.Random(0)
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-creative-work", "I-creative-work"]
    gold = [[rng.choice(tags) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    # Predictions: gold with a few tags changed, so that many entities match and some do not.
    predicted = [[rng.choice(tags) if rng.random() < 0.2 else t for t in sentence] for sentence in gold]
    assert_like_seqeval(gold, predicted)


def test_entity_spans():
    assert entity_spans(["B-PER", "I-PER", "O", "B-LOC", "I-LOC", "I-LOC"]) == [("PER", 0, 1), ("LOC", 3, 5)]
    assert entity_spans(["I-PER", "I-PER", "B-PER", "I-LOC"]) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 3, 3)]
    assert entity_spans(["O", "O"]) == []


def test_bio_order():
    assert bio_problem(["B-PER", "I-PER", "O", "B-LOC"]) is None
    assert bio_problem(["O", "I-PER"]) == (1, "tag 'I-PER' follows 'O'; an I- tag continues a B- or I- tag of its "
                                              "own type")
    assert bio_problem(["B-LOC", "I-PER"])[0] == 1
    assert bio_problem(["I-PER"])[0] == 0
    assert bio_problem(["B-PER", "PER"]) == (1, "tag 'PER' is not O, B-TYPE or I-TYPE")
    assert bio_problem(["B-"])[0] == 0


def test_conll_files(tmp_path):
    f = tmp_path / "train.conll"
    lines = ["-DOCSTART- -X- O O", "",  # CoNLL-2003's document marker
             "EU NNP B-NP B-ORG", "rejects VBZ B-VP O", "German JJ B-NP B-MISC", "", "  ",
             "Peter\tB-PER", "Blackburn\tI-PER", "\t",  # WNUT's sentence breaks hold a tab
             "He\tO", "met\tO", "Smith\tI-PER", "",  # out of BIO order: skipped
             "lonely-word", "",  # no tag: skipped
             "Paris\tB-LOC"]
    f.write_bytes("\r\n".join(lines).encode())
    logged = []
    sentences = read_tagged(f, logged.append)
    assert sentences.words == [["EU", "rejects", "German"], ["Peter", "Blackburn"], ["Paris"]]
    assert sentences.tags == [["B-ORG", "O", "B-MISC"], ["B-PER", "I-PER"], ["B-LOC"]]
    assert sentences.lines == [3, 8, 17]
    assert logged == [f"{f}: skipped 2 sentence(s) that cannot be used:",
                      f"  {f}:13: tag 'I-PER' follows 'O'; an I- tag continues a B- or I- tag of its own type",
                      f"  {f}:15: no tag after the word; each line holds a word and its tag"]
    assert tag_names(sentences) == ["O", "B-LOC", "B-MISC", "B-ORG", "B-PER", "I-PER"]


def test_jsonl_files_and_tags_training_never_saw(tmp_path):
    f = tmp_path / "dev.jsonl"
    f.write_text('{"tokens": ["Paul", "ran"], "tags": ["B-PER", "O"]}\n'
                 'not json\n'
                 '{"tokens": ["a"], "tags": ["O", "O"]}\n'
                 '{"tokens": ["in", "Rome"], "tags": ["O", "I-LOC"]}\n'
                 '{"tokens": ["Acme", "Corp"], "tags": ["B-ORG", "I-ORG"]}\n')
    logged = []
    sentences = read_tagged(f, logged.append)
    assert sentences.words == [["Paul", "ran"], ["Acme", "Corp"]]
    assert logged[1:] == [f"  {f}:2: not valid JSON (Expecting value)",
                          f"  {f}:3: 1 tokens and 2 tags; a sentence needs one tag per token, and at least one token",
                          f"  {f}:4: word 2: tag 'I-LOC' follows 'O'; an I- tag continues a B- or I- tag of its own "
                          f"type"]
    logged.clear()
    ids = tag_ids(sentences, ["O", "B-PER"], logged.append)
    assert [list(i) for i in ids] == [[1, 0], [IGNORE_INDEX, IGNORE_INDEX]]
    assert logged == [f"{f}:5: tag 'B-ORG' is not among the training data's tags (1 sentence(s)); the model cannot "
                      f"predict it, so its entities count as missed: train on data that has it",
                      f"{f}:5: tag 'I-ORG' is not among the training data's tags (1 sentence(s)); the model cannot "
                      f"predict it, so its entities count as missed: train on data that has it"]
    empty = tmp_path / "empty.conll"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="has no usable sentences"):
        read_tagged(empty, logged.append)


def test_windows_cut_between_words_and_lose_nothing():
    #            w0 w0 w1 w2 w2 w2 w2 w2 w3
    word_ids = [0, 0, 1, 2, 2, 2, 2, 2, 3]
    assert word_windows(word_ids, 4) == [(0, 3), (3, 7), (7, 9)]  # w2 is longer than the window: cut inside
    assert word_windows(word_ids, 9) == [(0, 9)]
    assert word_windows(word_ids, 5) == [(0, 3), (3, 8), (8, 9)]
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.randint(1, 5) for _ in range(rng.randint(1, 15))]
        ids = [w for w, n in enumerate(lengths) for _ in range(n)]
        room = rng.randint(1, 8)
        windows = word_windows(ids, room)
        assert [s for s, _ in windows[1:]] == [e for _, e in windows[:-1]] and windows[0][0] == 0
        assert windows[-1][1] == len(ids) and all(0 < e - s <= room for s, e in windows)
        for s, _ in windows:  # a window starts a word unless the word before it did not fit in one window
            assert s == 0 or ids[s] != ids[s - 1] or lengths[ids[s]] > room


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(packaged_model("minilm"))


def test_tags_on_first_sub_tokens_as_transformers_puts_them(tmp_path, tokenizer):
    from transformers import PreTrainedTokenizerFast

    f = tmp_path / "t.conll"
    f.write_text("Unbelievably\tO\nJohannesburg\tB-LOC\nrocks\tO\n@paulwalk\tB-PER\n\nhi\tO\n")
    sentences = read_tagged(f)
    names = tag_names(sentences)
    windows = tokenize_tagged(sentences, tag_ids(sentences, names), tokenizer, 64)
    # transformers' run_ner: is_split_into_words, the label on each word's first token, -100 elsewhere.
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    for row, (words, tags) in enumerate(zip(sentences.words, sentences.tags)):
        enc = hf(words, is_split_into_words=True, truncation=False, padding=False)
        expected, before = [], None
        for w in enc.word_ids():
            expected.append(IGNORE_INDEX if w is None or w == before else names.index(tags[w]))
            before = w
        batch = windows.train.collate(np.array([row]))
        assert batch[0][0].tolist() == enc["input_ids"]
        assert batch[3][0].tolist() == expected
    assert windows.lost_words == 0


def test_long_sentences_become_windows_that_score_every_word_once(tmp_path, tokenizer):
    rng = random.Random(2)
    vocab = ["Johannesburg", "is", "a", "city", "supercalifragilistic", "rocks", "Paul", "x"]
    lines = []
    for _ in range(6):
        for i in range(rng.randint(1, 30)):
            lines.append(f"{rng.choice(vocab)}\t{'B-LOC' if i % 4 == 0 else 'O'}")
        lines.append("")
    f = tmp_path / "long.conll"
    f.write_text("\n".join(lines))
    sentences = read_tagged(f)
    ids = tag_ids(sentences, tag_names(sentences))
    whole = tokenize_tagged(sentences, ids, tokenizer, 512)
    for window in (3, 5, 12):
        cut = tokenize_tagged(sentences, ids, tokenizer, window)
        assert cut.train.lengths.max() <= window and len(cut.train) > len(sentences)
        slots = cut.slots.targets[cut.slots.targets >= 0]
        assert sorted(slots) == list(range(len(cut.gold)))  # every word exactly once
        firsts = cut.train.targets[cut.slots.targets >= 0]
        assert list(firsts) == list(cut.gold[slots])  # with its own tag
        # The same sub-tokens as the whole sentences, less the special tokens around each window.
        content = cut.train.ids[cut.train.targets != IGNORE_INDEX]
        assert list(content) == list(whole.train.ids[whole.train.targets != IGNORE_INDEX])
    with pytest.raises(UserError, match="use training.seq_len >= 3"):
        tokenize_tagged(sentences, ids, tokenizer, 2)


def test_text_entities_group_words_by_their_first_sub_token():
    labels = ["O", "B-PER", "I-PER", "B-LOC"]
    text = "Jo Blogg went to Paris"
    # tokens: jo | blo ##gg | went | to | par ##is
    offsets = [(0, 2), (3, 6), (6, 8), (9, 13), (14, 16), (17, 20), (20, 22)]
    word_ids = [0, 1, 1, 2, 3, 4, 4]
    probs = np.array([[0.1, 0.8, 0.1, 0.0], [0.1, 0.1, 0.6, 0.2], [0.9, 0.0, 0.1, 0.0],  # ##gg says O: ignored
                      [0.7, 0.1, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1], [0.3, 0.0, 0.0, 0.7], [0.9, 0.0, 0.0, 0.1]])
    found = text_entities(text, offsets, word_ids, probs, labels)
    assert [(e["type"], e["text"], e["start"], e["end"]) for e in found] == [("PER", "Jo Blogg", 0, 8),
                                                                              ("LOC", "Paris", 17, 22)]
    assert found[0]["score"] == pytest.approx((0.8 + 0.6) / 2) and found[1]["score"] == pytest.approx(0.7)
