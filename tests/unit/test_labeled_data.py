"""Labelled data for classification: reading untidy files, labels, tokenizing, bucketed per-rank batches, scores
(summed over ranks: tests/integration/test_classification_scores_over_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scalenlp.config import Config
from scalenlp.data.labeled import (
    IGNORE_LABEL,
    LabeledLoader,
    eval_batches,
    label_ids,
    label_names,
    read_labeled,
    tokenize_labeled,
)
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.errors import UserError
from scalenlp.models.packaged import packaged_model
from scalenlp.train.scores import classification_scores, confusion_matrix
from train_helpers import SHARED_DATA

torch.set_num_threads(1)

SST2 = SHARED_DATA / "sst2"
needs_sst2 = pytest.mark.skipif(not (SST2 / "train.tsv").is_file(), reason="../shared/data/sst2 is not here")


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return load_tokenizer(packaged_model("minilm"))


def read(path, log=None, **fields):
    lines = [] if log is None else log
    fields = {"text_field": "text", "label_field": "label", **fields}
    return read_labeled(path, log=lines.append, **fields)


def data_lines(path: Path) -> list[bytes]:
    """The non-blank lines after the header, as bytes (line endings untouched)."""
    return [line for line in path.read_bytes().splitlines()[1:] if line.strip()]


# -- reading ------------------------------------------------------------------------------------------

@needs_sst2
def test_sst2_train_and_dev_load_despite_crlf_and_different_headers():
    assert (SST2 / "train.tsv").read_bytes().split(b"\n")[0].endswith(b"\r")  # the files are as the test assumes
    assert not (SST2 / "dev.tsv").read_bytes().split(b"\n")[0].endswith(b"\r")
    log = []
    train, dev = read(SST2 / "train.tsv", log), read(SST2 / "dev.tsv", log)
    assert log == []  # every row of both files is usable
    for f, examples in ((SST2 / "train.tsv", train), (SST2 / "dev.tsv", dev)):
        rows = [line.rstrip(b"\r").split(b"\t") for line in data_lines(f)]
        assert len(examples) == len(rows)
        assert examples.texts[0] == rows[0][1].decode() and examples.texts[-1] == rows[-1][1].decode()
        assert not any(t.endswith("\r") for t in examples.texts)
        assert examples.lines[:2] == [2, 3]
    assert label_names(train.labels) == ["0", "1"]
    assert sorted(set(dev.labels)) == ["0", "1"]


def test_line_endings_and_text_column_names_do_not_change_what_is_read(tmp_path):
    rows = ["label\t{name}", "1\ta fine film", "0\ta dull one", "1\tgood"]
    (tmp_path / "crlf.tsv").write_bytes("\r\n".join(rows).format(name="sentence").encode() + b"\r\n")
    (tmp_path / "lf.tsv").write_bytes("\n".join(rows).format(name="content").encode())
    (tmp_path / "cr.tsv").write_bytes("\r".join(rows).format(name="text").encode() + b"\r")
    read_back = [read(tmp_path / name) for name in ("crlf.tsv", "lf.tsv", "cr.tsv")]
    for examples in read_back:
        assert (examples.texts, examples.labels) == (["a fine film", "a dull one", "good"], ["1", "0", "1"])


def test_broken_tsv_rows_are_reported_with_line_numbers_and_skipped(tmp_path):
    lines = ["label\tsentence", "1\tgood", "0\tbad\textra", "1\t", "0", "\tno label", "1\tfine"]
    lines += [f"1\tok {i}\tbroken" for i in range(4)] + ["0\tlast"]
    f = tmp_path / "train.tsv"
    f.write_text("\n".join(lines) + "\n")
    log = []
    examples = read(f, log)
    assert examples.texts == ["good", "fine", "last"]
    assert examples.lines == [2, 7, 12]
    assert log[0] == f"{f}: skipped 8 row(s) that cannot be used:"
    assert log[1:6] == [f"  {f}:3: 3 tab-separated fields, the header has 2",
                        f"  {f}:4: empty text",
                        f"  {f}:5: 1 tab-separated fields, the header has 2",
                        f"  {f}:6: empty label",
                        f"  {f}:8: 3 tab-separated fields, the header has 2"]
    assert log[6:] == ["  ... and 3 more"]


def test_csv_with_quoted_newlines_and_broken_rows(tmp_path):
    f = tmp_path / "data.csv"
    f.write_text('id,review,stars\n1,"spans\ntwo lines",5\n2,short\n3,"a, b",4\n4,"",3\n')
    log = []
    examples = read(f, log, text_field="review", label_field="stars")
    assert examples.texts == ["spans\ntwo lines", "a, b"]
    assert examples.labels == ["5", "4"]
    assert examples.lines == [2, 5]
    assert log[1:] == [f"  {f}:4: 2 comma-separated fields, the header has 3", f"  {f}:6: empty text"]


def test_jsonl_rows_with_numeric_labels_and_bad_lines(tmp_path):
    f = tmp_path / "data.jsonl"
    records = [{"sentence": "good", "label": 1}, "not an object", {"sentence": "bad"}, {"sentence": 7, "label": 0},
               {"sentence": "meh", "label": 0.0}, {"sentence": "odd", "label": [1]}]
    f.write_text("\n".join(json.dumps(r) for r in records) + "\n{broken\n\n")
    log = []
    examples = read(f, log)  # text_field "text" is absent: the GLUE fallback finds "sentence"
    assert (examples.texts, examples.labels, examples.lines) == (["good", "meh"], ["1", "0"], [1, 5])
    assert log[1:] == [f"  {f}:2: a JSON str, not an object", f"  {f}:3: no 'label' field",
                       f"  {f}:4: text is int, not a string", f"  {f}:6: label [1] is not a string or a whole number",
                       f"  {f}:7: not valid JSON (Expecting property name enclosed in double quotes)"]


def test_parquet_pairs_with_nulls(tmp_path):
    f = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"premise": ["a cat sits", None, "it rains", "sun"],
                             "hypothesis": ["an animal sits", "x", "it is dry", ""],
                             "label": ["entailment", "neutral", "contradiction", "neutral"]}), f)
    log = []
    examples = read(f, log, text_field="premise", text_pair_field="hypothesis")
    assert examples.texts == ["a cat sits", "it rains"] and examples.pairs == ["an animal sits", "it is dry"]
    assert log[1:] == [f"  {f}:2: empty text", f"  {f}:4: empty pair text"]


def test_a_missing_column_or_file_is_one_clear_error(tmp_path):
    f = tmp_path / "data.tsv"
    f.write_text("label\tsentence\n1\tgood\n")
    with pytest.raises(UserError, match=r"no column 'sentiment' \(columns: label, sentence\); set data.label_field"):
        read(f, label_field="sentiment")
    (tmp_path / "data.csv").write_text("stars,body\n1,good\n")
    with pytest.raises(UserError, match=r"no text column 'review' in the header \(stars, body\); set data.text_field"):
        read(tmp_path / "data.csv", text_field="review", label_field="stars")
    with pytest.raises(UserError, match="does not exist"):
        read(tmp_path / "missing.tsv")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(UserError, match="unsupported file type '.txt'"):
        read(tmp_path / "data.txt")
    (tmp_path / "blank.tsv").write_text("label\tsentence\n1\t \n")
    with pytest.raises(UserError, match="no usable rows"):
        read(tmp_path / "blank.tsv")


# -- labels -------------------------------------------------------------------------------------------

def test_label_set_is_sorted_numerically_when_numeric():
    assert label_names(["10", "9", "2", "9"]) == ["2", "9", "10"]
    assert label_names(["-1", "1", "0"]) == ["-1", "0", "1"]
    assert label_names(["pos", "neg", "10", "9"]) == ["10", "9", "neg", "pos"]
    assert label_names(["nan", "1"]) == ["1", "nan"]


def test_an_eval_label_training_never_saw_is_one_error_naming_it(tmp_path):
    (tmp_path / "train.tsv").write_text("label\tsentence\npos\tgood\nneg\tbad\n")
    (tmp_path / "dev.tsv").write_text("label\tsentence\npos\tfine\nneutral\tok\nneutral\tso-so\n")
    names = label_names(read(tmp_path / "train.tsv").labels)
    dev = read(tmp_path / "dev.tsv")
    with pytest.raises(UserError) as e:
        label_ids(dev, names)
    message = str(e.value)
    assert "'neutral' (first at" in message and "dev.tsv:3)" in message
    assert "the known labels are 'neg', 'pos'" in message and "\n" not in message
    assert label_ids(read(tmp_path / "train.tsv"), names).tolist() == [1, 0]


# -- tokenizing ---------------------------------------------------------------------------------------

def test_truncation_is_one_warning_counting_the_rows(tmp_path, minilm_tokenizer):
    words = "the movie was surprisingly good and the cast was great".split()
    rows = [" ".join(words[:n]) for n in (2, 4, 9, 10, 3, 10)]
    f = tmp_path / "data.tsv"
    f.write_text("label\tsentence\n" + "".join(f"{i % 2}\t{r}\n" for i, r in enumerate(rows)))
    examples = read(f)
    max_len = 8
    full = [sum(minilm_tokenizer.encode(r).attention_mask) for r in rows]  # its own padding left out
    log = []
    data = tokenize_labeled(examples, label_ids(examples, ["0", "1"]), minilm_tokenizer, max_len, log=log.append)
    assert len(log) == 1
    assert f"{sum(n > max_len for n in full)} of {len(rows)} rows are longer than {max_len} tokens" in log[0]
    assert data.lengths.tolist() == [min(n, max_len) for n in full]
    assert minilm_tokenizer.padding is not None  # the caller's tokenizer keeps its own settings


def test_pairs_are_encoded_as_pairs(tmp_path, minilm_tokenizer):
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"a": "a cat sits on the mat", "b": "an animal sits", "label": "yes"}) + "\n")
    examples = read(f, text_field="a", text_pair_field="b")
    data = tokenize_labeled(examples, np.array([0]), minilm_tokenizer, 64)
    input_ids, mask, types, labels = data.collate(np.array([0]))
    expected = minilm_tokenizer.encode("a cat sits on the mat", "an animal sits")
    n = int(mask.sum())
    assert input_ids[0, :n].tolist() == expected.ids[:n] and types[0, :n].tolist() == expected.type_ids[:n]
    assert set(types[0].tolist()) == {0, 1}


def test_a_length_too_short_for_the_special_tokens_is_a_user_error(tmp_path, minilm_tokenizer):
    f = tmp_path / "data.tsv"
    f.write_text("label\tsentence\n1\tgood\n")
    examples = read(f)
    with pytest.raises(UserError, match="training.seq_len >= 3"):
        tokenize_labeled(examples, np.array([0]), minilm_tokenizer, 2)


# -- batching -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sst2_head(minilm_tokenizer, tmp_path_factory):
    """The first few thousand SST-2 training rows, tokenized with MiniLM's tokenizer."""
    if not (SST2 / "train.tsv").is_file():
        pytest.skip("../shared/data/sst2 is not here")
    f = tmp_path_factory.mktemp("sst2") / "head.tsv"
    f.write_bytes(b"".join((SST2 / "train.tsv").read_bytes().splitlines(keepends=True)[:3001]))
    examples = read(f)
    return tokenize_labeled(examples, label_ids(examples, label_names(examples.labels)), minilm_tokenizer, 128)


def unpadded(batch) -> list[tuple[tuple[int, ...], int]]:
    input_ids, mask, types, labels = batch
    return [(tuple(ids[m.bool()].tolist()), int(label)) for ids, m, label in zip(input_ids, mask, labels)]


def padding_fraction(loader: LabeledLoader) -> float:
    real = padded = 0
    for _ in range(loader.batches_per_epoch):
        input_ids, mask, _, _ = loader.next_batch()
        real, padded = real + int(mask.sum()), padded + mask.numel()
    return 1 - real / padded


def test_length_bucketing_cuts_padding(sst2_head):
    # One batch per chunk sorts within a batch only, which leaves its padding as random batching has it.
    random_batches = padding_fraction(LabeledLoader(sst2_head, 32, 0, 1, seed=0, bucket_batches=1))
    bucketed = padding_fraction(LabeledLoader(sst2_head, 32, 0, 1, seed=0, bucket_batches=64))
    assert random_batches > 0.3
    assert bucketed < random_batches / 4, (bucketed, random_batches)


def test_the_bucket_window_is_a_data_option(sst2_head):
    # data.bucket_batches sets how many batches are sorted together: a wider window pads less, 1 is random batches.
    cfg = Config()
    cfg.training.global_batch_size, cfg.training.seed = 32, 0
    padding = {}
    for window in (1, 4, 64):
        cfg.data.bucket_batches = window
        loader = LabeledLoader.for_run(sst2_head, cfg, 0, 1)
        assert loader.bucket_batches == window
        padding[window] = padding_fraction(loader)
    assert padding[1] == padding_fraction(LabeledLoader(sst2_head, 32, 0, 1, seed=0, bucket_batches=1))
    assert padding[1] > padding[4] > padding[64], padding


def test_batches_are_shuffled_and_deterministic_from_seed_and_epoch(sst2_head):
    loader = LabeledLoader(sst2_head, 32, 0, 1, seed=3)
    again = LabeledLoader(sst2_head, 32, 0, 1, seed=3)
    assert np.array_equal(loader.batch_order(0), again.batch_order(0))
    assert not np.array_equal(loader.batch_order(0), loader.batch_order(1))
    assert not np.array_equal(loader.batch_order(0), LabeledLoader(sst2_head, 32, 0, 1, seed=4).batch_order(0))
    order = loader.batch_order(0)
    assert len(np.unique(order)) == order.size  # no row twice in an epoch
    # Batches are not laid out from short to long: the epoch mixes lengths.
    widths = sst2_head.lengths[order].max(1)
    assert not (np.all(np.diff(widths) >= 0) or np.all(np.diff(widths) <= 0))


def test_unshuffled_batches_are_the_rows_in_file_order(sst2_head):
    loader = LabeledLoader(sst2_head, 32, 0, 1, seed=3, shuffle=False)
    n = loader.batches_per_epoch * 32
    assert loader.batch_order(0).ravel().tolist() == list(range(n))
    assert np.array_equal(loader.batch_order(1), loader.batch_order(0))


def test_two_ranks_see_the_global_batch_of_one(sst2_head):
    one = LabeledLoader(sst2_head, 8, 0, 1, seed=0)
    ranks = [LabeledLoader(sst2_head, 8, r, 2, seed=0) for r in range(2)]
    for _ in range(one.batches_per_epoch + 3):  # into the second epoch
        shares = [unpadded(r.next_batch()) for r in ranks]
        assert len(shares[0]) == len(shares[1]) == 4
        interleaved = [row for pair in zip(*shares) for row in pair]
        assert interleaved == unpadded(one.next_batch())


def test_resuming_mid_epoch_gives_the_same_next_batches(sst2_head):
    run = LabeledLoader(sst2_head, 16, 0, 1, seed=5)
    for _ in range(run.batches_per_epoch - 2):
        run.next_batch()
    state = run.state_dict()
    expected = [unpadded(run.next_batch()) for _ in range(4)]  # crosses into epoch 1
    resumed = [LabeledLoader(sst2_head, 16, r, 2, seed=5) for r in range(2)]  # and with another rank count
    for loader in resumed:
        loader.load_state_dict(state)
    for want in expected:
        shares = [unpadded(r.next_batch()) for r in resumed]
        assert [row for pair in zip(*shares) for row in pair] == want
    with pytest.raises(UserError, match="the checkpoint has seed=5 but this run has 6"):
        LabeledLoader(sst2_head, 16, 0, 1, seed=6).load_state_dict(state)


def test_evaluation_covers_every_row_once_with_equal_batches_on_every_rank(sst2_head):
    world, batch = 3, 32
    shares = [list(eval_batches(sst2_head, batch, r, world)) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    seen, filler = [], 0
    for per_rank in zip(*shares):
        assert len({len(b[3]) for b in per_rank}) == 1
        for input_ids, mask, _, labels in per_rank:
            seen += [(tuple(ids[m.bool()].tolist()), int(label))
                     for ids, m, label in zip(input_ids, mask, labels) if label != IGNORE_LABEL]
            filler += int((labels == IGNORE_LABEL).sum())
    assert filler  # batches that do not split evenly were filled, or the test shows nothing about it
    every = [(tuple(sst2_head.ids[s:e].tolist()), int(label))
             for s, e, label in zip(sst2_head.offsets[:-1], sst2_head.offsets[1:], sst2_head.labels)]
    assert sorted(seen) == sorted(every)


def test_loader_rejects_batches_it_cannot_make(sst2_head):
    with pytest.raises(UserError, match="not divisible by the data-parallel size 3"):
        LabeledLoader(sst2_head, 32, 0, 3, seed=0)
    with pytest.raises(UserError, match="fewer than one global batch"):
        LabeledLoader(sst2_head, len(sst2_head) + 1, 0, 1, seed=0)


# -- scores -------------------------------------------------------------------------------------------

LABELS = torch.tensor([0, 0, 1, 1, 2, 2, IGNORE_LABEL])
PREDICTIONS = torch.tensor([0, 1, 1, 1, 2, 0, 2])


def test_scores_match_hand_computed_values():
    counts = confusion_matrix(PREDICTIONS, LABELS, 3)
    assert counts.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    scores = classification_scores(counts)
    f1 = [2 * 1 / (2 + 2), 2 * 2 / (2 + 3), 2 * 1 / (2 + 1)]  # 2TP / (labelled + predicted), per class
    assert scores["accuracy"] == pytest.approx(4 / 6)
    assert scores["macro_f1"] == pytest.approx(sum(f1) / 3)
    # A class that is neither a label nor a prediction here leaves the average alone.
    assert classification_scores(confusion_matrix(PREDICTIONS, LABELS, 4)) == scores
