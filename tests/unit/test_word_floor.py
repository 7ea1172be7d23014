"""The lower bound on a text's tokens from its words (``data.word_floor``), which lets the encoder server refuse a
request over --max-request-tokens before tokenizing it: it must never exceed the true count, on real text of
every kind here (articles, reviews, plays, tweets, Wikipedia paragraphs with accents and other scripts) and on
text made to defeat it, under WordPiece (MiniLM) and byte-level BPE; and it must be refused for tokenizers whose
parts could delete or join words."""

import json

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from infer_helpers import train_tokenizer
from scalenlp.data.word_floor import counts_words, words
from scalenlp.models.packaged import packaged_model

# Words that a normalizer deletes or a separator Python knows and the tokenizers do not: each must count 0 or be
# joined, never more than the tokens they become.
ODD = ["\u200b", "e\u0301", "\u0301", "a\x1cb", "a\u00a0b", "don't", "x_y", "__", "\x00a", "\ufeff ok", "日本語",
       "①②", "ǅemal", "İstanbul", "😀 🙂", "a" * 500, "\t\n \r", "word\u2028word", "ﬁne", "ＡＢＣ"]


def real_lines(data) -> list[str]:
    lines = [x for x in (data / "wikitext2" / "valid.txt").read_text(encoding="utf-8").splitlines() if x.strip()]
    lines += [x.split("\t", 1)[1] for x in (data / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    lines += (data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()[:5000]
    tweets = (data / "wnut17" / "dev.conll").read_text(encoding="utf-8").split("\n\n")
    lines += [" ".join(row.split("\t")[0] for row in tweet.splitlines()) for tweet in tweets]
    for article in json.loads((data / "squad" / "dev.json").read_text(encoding="utf-8"))["data"]:
        for paragraph in article["paragraphs"]:
            lines += [paragraph["context"]] + [qa["question"] for qa in paragraph["qas"]]
    return lines


@pytest.fixture(scope="module")
def lines(shared_data):
    return real_lines(shared_data)


def minilm() -> Tokenizer:
    """MiniLM's WordPiece, without the padding to 128 its file asks for."""
    tokenizer = Tokenizer.from_file(str(packaged_model("minilm") / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def check_bound(tokenizer: Tokenizer, texts: list[str]) -> tuple[int, int]:
    """(the bound, the true count) over all ``texts``, once each text's bound is checked against its count."""
    assert counts_words(tokenizer)
    true = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    bounds = [words(x) for x in texts]
    over = [(x[:80], b, t) for x, b, t in zip(texts, bounds, true) if b > t]
    assert not over, f"the bound exceeds the true count: {over[:5]}"
    assert all(b > 0 for x, b in zip(texts, bounds) if any(c.isalnum() for c in x))  # every text with words counts
    return sum(bounds), sum(true)


def test_words_bound_wordpiece_tokens_on_real_text(lines):
    bound, true = check_bound(minilm(), lines + ODD)
    assert bound > true / 2  # close enough to refuse a request of several times the limit before tokenizing


def test_words_bound_byte_level_bpe_tokens_on_real_text(lines, tmp_path):
    check_bound(Tokenizer.from_file(str(train_tokenizer(tmp_path / "bpe.json"))), lines + ODD)


@pytest.mark.slow
def test_words_bound_smollm2_tokens_on_real_text(lines, smollm2):
    check_bound(Tokenizer.from_str(smollm2.tokenizer.to_str()), lines + ODD)


def test_words_stops_counting_at_most():
    assert words("one two three four", 2) == 2 and words("one two three four") == 4
    assert words("  ... -- one,two\tthree\n") == 2  # a word needs a letter or a digit; "one,two" is one word


def test_tokenizers_that_could_delete_or_join_words_get_no_bound():
    """A normalizer that rewrites text, a BPE that drops what its vocabulary lacks, a pre-tokenizer that does not
    split on every separator, an added token holding a space: each could make a word no token."""
    deleting = minilm()
    deleting.normalizer = normalizers.Sequence([normalizers.Replace("a", ""), normalizers.Lowercase()])
    assert len(deleting.encode("a a a", add_special_tokens=False).ids) < words("a a a")
    dropping = Tokenizer(models.BPE(vocab={"b": 0}, merges=[]))
    dropping.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert dropping.encode("a b").ids == [0]
    metaspace = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    joined = minilm()
    joined.add_tokens(["new york"])
    for tokenizer in (deleting, dropping, metaspace, joined):
        assert not counts_words(tokenizer)
