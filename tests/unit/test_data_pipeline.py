"""Data pipeline: sources, tokenizer, token cache, packed windows, and the per-rank loader of global batches (the
tokenizer trained again in another process: tests/integration/test_bpe_across_processes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scalenlp.config import Config
from scalenlp.data import (
    EOS,
    DataLoader,
    TokenDataset,
    eos_token_id,
    load_tokenizer,
    open_data,
    prepare_data,
    sources,
    train_bpe,
)
from scalenlp.data.dataset import document_positions
from scalenlp.data.sources import open_corpus, read_pieces, resolve_sources, stdlib_docstrings, stdlib_files
from scalenlp.data.tokenizer import find_bos_token_id
from scalenlp.errors import UserError

torch.set_num_threads(1)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers "
         "and pack my box with five dozen liquor jugs").split()


def synthetic_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + "." for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_cfg(tmp_path: Path, data_path: str | Path, vocab_size: int = 300, **data) -> Config:
    cfg = Config()
    cfg.data.path = str(data_path)
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.tokenizer.vocab_size = vocab_size
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def texts(files: list[Path], text_field: str = "text") -> list[str]:
    return [p.text for p in read_pieces(files, text_field)]


# ---------------------------------------------------------------- sources

def test_folder_is_read_recursively_sorted_skipping_hidden_and_other_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second document")
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden.txt").write_text("not data either")
    (tmp_path / "empty.txt").write_text("  \n")
    files = resolve_sources(str(tmp_path))
    assert [f.name for f in files] == ["a.txt", "two.txt", "empty.txt"]
    assert texts(files) == ["first document\n", "second document"]


def test_glob_selects_matching_files(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("x.txt", "sub/y.txt", "sub/z.jsonl"):
        (tmp_path / name).write_text("t")
    found = resolve_sources(str(tmp_path / "**" / "*.txt"))
    assert found == [tmp_path / "sub" / "y.txt", tmp_path / "x.txt"]  # sorted by path


def test_large_txt_is_cut_at_paragraphs_but_stays_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TXT_PIECE_CHARS", 50)
    text = "\n\n".join(f"paragraph {i} " + "word " * 12 for i in range(6)) + "\n\n\n"
    (tmp_path / "big.txt").write_text(text)
    pieces = list(read_pieces([tmp_path / "big.txt"], "text"))
    assert len(pieces) > 2
    assert "".join(p.text for p in pieces) == text
    assert [p.ends_document for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_jsonl_reads_field_and_names_bad_line(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ["alpha", "beta"], field="body")
    with open(f, "a") as fh:
        fh.write("\n" + json.dumps({"body": None}) + "\n")
    assert texts([f], "body") == ["alpha", "beta"]
    with pytest.raises(UserError, match=r"d\.jsonl:1: no 'text' field"):
        texts([f], "text")
    with open(f, "a") as fh:
        fh.write('{"body": "gamma"\n')
    with pytest.raises(UserError, match=r"d\.jsonl:5: not valid JSON"):
        texts([f], "body")


def test_parquet_reads_column_and_skips_nulls(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["one", None, "two"], "n": [1, 2, 3]}), f)
    assert texts([f], "content") == ["one", "two"]
    with pytest.raises(UserError, match=r"no column 'text' \(columns: content, n\)"):
        texts([f], "text")


def test_tsv_with_mixed_line_endings_and_glue_headers(tmp_path):
    f = tmp_path / "train.tsv"
    f.write_bytes(b"label\tsentence\r\n1\tgood film \r\n0\tbad film\r1\tfine\n")
    g = tmp_path / "dev.tsv"
    g.write_bytes(b"label\tcontent\n1\tnice\n")
    assert texts([f, g]) == ["good film ", "bad film", "fine", "nice"]
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"label\tsentence\n1\ttoo\tmany\n")
    with pytest.raises(UserError, match=r"bad\.tsv:2: 3 tab-separated fields"):
        texts([bad])


@pytest.mark.parametrize("make_path, message", [
    (lambda d: d / "missing.txt", "does not exist"),
    (lambda d: d / "nothing-*.jsonl", "matches no files"),
    (lambda d: d / "data.csv", "unsupported file type '.csv'"),
    (lambda d: d / "folder", "holds no .txt/.jsonl/.parquet/.tsv/.npy files"),
])
def test_bad_sources_are_user_errors(tmp_path, make_path, message):
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.md").write_text("x")
    with pytest.raises(UserError, match=message):
        resolve_sources(str(make_path(tmp_path)))


def test_glob_matching_an_unsupported_file_is_a_user_error(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.csv").write_text("x")
    with pytest.raises(UserError, match=r"b\.csv: unsupported file type"):
        resolve_sources(str(tmp_path / "*"))


def test_files_without_text_are_a_user_error(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n  ")
    write_jsonl(tmp_path / "b.jsonl", [""])
    with pytest.raises(UserError, match="no text found"):
        prepare_data(make_cfg(tmp_path, tmp_path), tmp_path / "run", log=lambda _: None)


def test_non_utf8_file_is_a_user_error(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        texts([tmp_path / "latin1.txt"])


def test_builtin_corpus_is_stdlib_docstrings_without_tests():
    files = stdlib_files()
    assert len(files) > 300
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.parts[-3:-1])
    assert not any(f.name.startswith("test_") for f in files)
    few = [f for f in files if f.name in ("textwrap.py", "bisect.py")]
    docs = list(stdlib_docstrings(few))
    assert any(d.startswith("Bisection algorithms.") for d in docs)
    assert any(d.startswith("Text wrapping and filling.") for d in docs)
    assert docs == list(stdlib_docstrings(few))


def test_prepare_data_with_builtin_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BUILTIN_MAX_FILES", 40)  # the default reads all of it; a slice is enough here
    logs = []
    files = prepare_data(make_cfg(tmp_path, ""), tmp_path / "run", log=logs.append)
    assert "built-in corpus" in logs[0]
    assert "docstrings from the Python standard library" in logs[-1]
    tokens = np.load(files.train_tokens)
    assert len(tokens) > 10_000 and (tokens == files.eos_id).sum() > 100


# ---------------------------------------------------------------- tokenizer

def test_byte_level_bpe_round_trips_any_text():
    tok = train_bpe(synthetic_docs(200), vocab_size=320)
    assert tok.get_vocab_size() == 320
    assert tok.token_to_id(EOS) is not None
    for s in ["the quick brown fox", "  leading and trailing  \n\n\ttabs", "naïve café — 東京 🦊 \r\n",
              "unseen symbols: §±∞ \x00\x7f"]:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    assert len(tok.encode("the quick brown fox").ids) < len("the quick brown fox")  # merges were learned


def test_vocab_smaller_than_bytes_is_a_user_error():
    with pytest.raises(UserError, match="at least 257"):
        train_bpe(["x"], vocab_size=100)


def test_load_tokenizer_finds_eos_in_file_or_folder_config(tmp_path):
    tok = train_bpe(synthetic_docs(50), vocab_size=300)
    # Rename the EOS to a name no rule knows, so the folder's config has to say which token ends a document.
    data = json.loads(tok.to_str())
    data["model"]["vocab"]["<fin>"] = data["model"]["vocab"].pop(EOS)
    for added in data["added_tokens"]:
        added["content"] = added["content"].replace(EOS, "<fin>")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(data))
    loaded = load_tokenizer(folder)
    with pytest.raises(UserError, match="no end-of-document token"):
        eos_token_id(loaded, folder)
    assert find_bos_token_id(loaded, folder) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<fin>"}, "bos_token": "a"}))
    assert eos_token_id(loaded, folder) == loaded.token_to_id("<fin>")
    assert find_bos_token_id(loaded, folder) == loaded.token_to_id("a")  # BOS is looked up the same way
    plain = tmp_path / "plain.json"
    tok.save(str(plain))
    assert eos_token_id(load_tokenizer(plain), plain) == tok.token_to_id(EOS)
    with pytest.raises(UserError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")


# ---------------------------------------------------------------- prepare_data / open_data

def test_prepare_data_tokenizes_documents_separated_by_eos(tmp_path):
    docs = synthetic_docs(120)
    write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = make_cfg(tmp_path, tmp_path / "d.jsonl", val_fraction=0.1)
    files = prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    train, val = np.load(files.train_tokens), np.load(files.val_tokens)
    assert train.dtype == np.uint16 and val.dtype == np.uint16
    assert len(val) == round((len(train) + len(val)) * 0.1)
    stream = np.concatenate([train, val])
    tok = load_tokenizer(files.tokenizer_json)
    assert files.eos_id == tok.token_to_id(EOS) and files.vocab_size == tok.get_vocab_size() == 300
    assert (stream == files.eos_id).sum() == len(docs) and stream[-1] == files.eos_id
    assert tok.decode(stream.tolist(), skip_special_tokens=False) == "".join(d + EOS for d in docs)
    assert open_data(cfg, tmp_path / "run") == files


def test_cache_hit_then_invalidation_on_source_or_vocab_change(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", synthetic_docs(80))
    cfg = make_cfg(tmp_path, src)
    logs: list[str] = []
    first = prepare_data(cfg, tmp_path / "run", log=logs.append)
    assert not any("cache hit" in line for line in logs)
    mtime = first.train_tokens.stat().st_mtime_ns

    logs.clear()
    again = prepare_data(cfg, tmp_path / "run", log=logs.append)
    assert again == first and first.train_tokens.stat().st_mtime_ns == mtime
    assert sum("cache hit" in line for line in logs) == 2 and not any("tokens: read" in line for line in logs)

    write_jsonl(src, synthetic_docs(81))  # edited source: new tokenizer and new tokens
    logs.clear()
    edited = prepare_data(cfg, tmp_path / "run", log=logs.append)
    assert edited.train_tokens != first.train_tokens and edited.tokenizer_json != first.tokenizer_json
    assert any("tokens: read" in line for line in logs)

    cfg.tokenizer.vocab_size = 310
    bigger = prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    assert bigger.vocab_size == 310 and bigger.train_tokens not in (first.train_tokens, edited.train_tokens)

    cfg.data.val_fraction = 0.2  # same tokenizer, new split
    resplit = prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    assert resplit.tokenizer_json == bigger.tokenizer_json and resplit.train_tokens != bigger.train_tokens
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def test_default_cache_dir_is_beside_the_run_dir(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", synthetic_docs(30))
    cfg = make_cfg(tmp_path, src, cache_dir="")
    files = prepare_data(cfg, tmp_path / "runs" / "exp1", log=lambda _: None)
    assert files.train_tokens.parent.parent == tmp_path / "runs" / ".token_cache"


def test_open_data_before_prepare_is_a_user_error(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", synthetic_docs(30))
    with pytest.raises(UserError, match="prepare_data must run"):
        open_data(make_cfg(tmp_path, src), tmp_path / "run")


def test_bad_jsonl_line_surfaces_through_tokenizer_training(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", synthetic_docs(10))
    with open(src, "a") as fh:
        fh.write("not json\n")
    cfg = make_cfg(tmp_path, src)
    with pytest.raises(UserError, match=r"d\.jsonl:11: not valid JSON"):
        prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    # With a given tokenizer the error comes from the tokenizing pass; its half-written entry is removed.
    tok = tmp_path / "tokenizer.json"
    train_bpe(synthetic_docs(20), vocab_size=280).save(str(tok))
    cfg.tokenizer.path = str(tok)
    with pytest.raises(UserError, match=r"d\.jsonl:11: not valid JSON"):
        prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_prepare_data_with_a_given_tokenizer_folder(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = train_bpe(synthetic_docs(100, seed=5), vocab_size=290)
    tok.save(str(folder / "tokenizer.json"))
    src = tmp_path / "doc.txt"
    src.write_text("the lazy dog jumps.")
    cfg = make_cfg(tmp_path, src, val_fraction=0.0)
    cfg.tokenizer.path = str(folder)
    files = prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    assert files.tokenizer_json == folder / "tokenizer.json" and files.vocab_size == 290
    assert np.load(files.train_tokens).tolist() == tok.encode("the lazy dog jumps.").ids + [tok.token_to_id(EOS)]
    assert len(np.load(files.val_tokens)) == 0


def test_prepare_data_takes_token_files_as_they_are(tmp_path):
    tok_path = tmp_path / "tokenizer.json"
    tok = train_bpe(synthetic_docs(100, seed=5), vocab_size=290)
    tok.save(str(tok_path))
    eos = tok.token_to_id(EOS)
    docs = [tok.encode(d).ids + [eos] for d in synthetic_docs(30, seed=1)]
    (tmp_path / "shards").mkdir()
    np.save(tmp_path / "shards" / "a.npy", np.array(sum(docs[:10], []), dtype=np.int64))  # any integer dtype
    np.save(tmp_path / "shards" / "b.npy", np.array(sum(docs[10:], []), dtype=np.uint16))
    cfg = make_cfg(tmp_path, tmp_path / "shards", val_fraction=0.0)
    cfg.tokenizer.path = str(tok_path)
    logs: list[str] = []
    files = prepare_data(cfg, tmp_path / "run", log=logs.append)
    train = np.load(files.train_tokens)
    assert train.dtype == np.uint16 and train.tolist() == sum(docs, [])
    assert any("read 30 documents already tokenized" in line for line in logs)
    assert open_data(cfg, tmp_path / "run") == files


@pytest.mark.parametrize("array, message", [
    (np.array([[1, 2], [3, 4]]), r"holds a 2-D int64 array; it must be a 1-D integer array"),
    (np.array([1.0, 2.0]), r"holds a 1-D float64 array"),
    (np.array([5, 290]), r"has ids from 5 to 290 \(at least\), outside the tokenizer's 0\.\.289"),
])
def test_bad_token_files_are_user_errors(tmp_path, array, message):
    train_bpe(synthetic_docs(100, seed=5), vocab_size=290).save(str(tmp_path / "tokenizer.json"))
    np.save(tmp_path / "t.npy", array)
    cfg = make_cfg(tmp_path, tmp_path / "t.npy")
    cfg.tokenizer.path = str(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match=message):
        prepare_data(cfg, tmp_path / "run", log=lambda _: None)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing half-written is left


def test_token_files_need_their_tokenizer_and_no_text_beside_them(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(10))
    with pytest.raises(UserError, match=r"holds token files \(\.npy\).*name it with tokenizer\.path"):
        prepare_data(make_cfg(tmp_path, tmp_path / "t.npy"), tmp_path / "run", log=lambda _: None)
    (tmp_path / "notes.txt").write_text("some text")
    with pytest.raises(UserError, match=r"mixes token files \(t\.npy, \.\.\.\) with text files \(notes\.txt"):
        open_corpus(str(tmp_path), "text")


# ---------------------------------------------------------------- TokenDataset / DataLoader

def token_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"tokens{n}.npy"
    np.save(path, np.arange(n, dtype=np.uint16))
    return path


def test_windows_are_packed_at_stride_seq_len(tmp_path):
    ds = TokenDataset(token_file(tmp_path, 103), seq_len=10)
    assert len(ds) == 10
    assert ds[0].tolist() == list(range(11)) and ds[0].dtype == torch.long
    assert ds[9].tolist() == list(range(90, 101)) and ds[-1].tolist() == ds[9].tolist()
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(UserError, match=r"holds 103 tokens, fewer than one sequence of seq_len\+1 = 104"):
        TokenDataset(token_file(tmp_path, 103), seq_len=103)


def global_batch(dataset, G, dp_size, seed, steps, start_state=None):
    """The concatenation over ranks of each rank's batch, per step, plus each rank's window ids."""
    loaders = [DataLoader(dataset, G, r, dp_size, seed) for r in range(dp_size)]
    if start_state is not None:
        for loader in loaders:
            loader.load_state_dict(start_state)
    steps_out = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        for x, y in parts:
            assert x.shape == (G // dp_size, dataset.seq_len) and torch.equal(x[:, 1:], y[:, :-1])
        steps_out.append([x[:, 0] // dataset.seq_len for x, _ in parts])  # window id of each sequence
    return steps_out, loaders


def test_rank_shards_are_disjoint_and_make_the_same_global_batch(tmp_path):
    ds = TokenDataset(token_file(tmp_path, 8 * 200 + 1), seq_len=8)
    reference, _ = global_batch(ds, G=8, dp_size=1, seed=7, steps=30)
    for dp in (2, 4):
        sharded, _ = global_batch(ds, G=8, dp_size=dp, seed=7, steps=30)
        for ref, ranks in zip(reference, sharded):
            ids = torch.cat(ranks)
            assert len(set(ids.tolist())) == 8  # disjoint shards
            assert torch.equal(ids, ref[0])      # rank order concatenated == the single-process batch
    # 200 windows, 25 batches an epoch: the first epoch visits every window once
    assert sorted(torch.cat([s[0] for s in reference[:25]]).tolist()) == list(range(200))


def test_epochs_reshuffle_and_seed_fixes_the_order(tmp_path):
    ds = TokenDataset(token_file(tmp_path, 4 * 43 + 1), seq_len=4)  # 43 windows, 5 batches of 8, 3 dropped
    a, loaders = global_batch(ds, G=8, dp_size=1, seed=1, steps=10)
    b, _ = global_batch(ds, G=8, dp_size=1, seed=1, steps=10)
    c, _ = global_batch(ds, G=8, dp_size=1, seed=2, steps=10)
    flat = lambda steps: [s[0].tolist() for s in steps]  # noqa: E731
    assert flat(a) == flat(b) and flat(a) != flat(c)
    epoch0, epoch1 = flat(a)[:5], flat(a)[5:]
    assert epoch0 != epoch1
    assert len({i for batch in epoch0 for i in batch}) == 40 and len({i for batch in epoch1 for i in batch}) == 40
    assert loaders[0].state_dict()["epoch"] == 1 and loaders[0].state_dict()["batch"] == 5
    loaders[0].set_epoch(0)
    assert loaders[0].next_batch()[0][:, 0].div(4).tolist() == epoch0[0]


@pytest.mark.parametrize("bos, eos, tokens, positions", [
    (1, 2, [7, 2, 1, 5, 6, 2, 1, 9], [0, 1, 0, 1, 2, 3, 0, 1]),  # BOS doc EOS: the BOS is position 0
    (None, 2, [7, 2, 5, 6, 2, 9], [0, 1, 0, 1, 2, 0]),           # doc EOS: the token after EOS is
    (2, 2, [7, 2, 5, 6, 2, 9], [0, 1, 0, 1, 2, 0]),              # GPT-2, whose BOS is its EOS
    (1, 2, [7, 8, 1, 5, 6, 1, 9], [0, 1, 0, 1, 2, 0, 1]),        # BOS only (torchtitan's inputs)
])
def test_document_positions_restart_where_documents_start(bos, eos, tokens, positions):
    got = document_positions(torch.tensor([tokens, tokens[::-1]]), bos, eos)
    assert got[0].tolist() == positions
    assert got[1].tolist() == document_positions(torch.tensor([tokens[::-1]]), bos, eos)[0].tolist()  # per row


def test_unshuffled_loader_reads_windows_in_file_order_every_epoch(tmp_path):
    ds = TokenDataset(token_file(tmp_path, 4 * 43 + 1), seq_len=4)  # 43 windows, 5 batches of 8, 3 dropped
    for dp in (1, 2):
        loaders = [DataLoader(ds, 8, r, dp, seed=1, shuffle=False) for r in range(dp)]
        ids = [torch.cat([loader.next_batch()[0][:, 0] // 4 for loader in loaders]).tolist() for _ in range(7)]
        assert ids == [list(range(8 * b, 8 * b + 8)) for b in range(5)] + [list(range(8)), list(range(8, 16))]
    with pytest.raises(UserError, match="checkpoint has shuffle=False but this run has True"):
        DataLoader(ds, 8, 0, 1, seed=1).load_state_dict(loaders[0].state_dict())


@pytest.mark.parametrize("dp_before, dp_after", [(2, 2), (2, 1), (1, 4)])
def test_resume_from_state_dict_continues_exactly(tmp_path, dp_before, dp_after):
    ds = TokenDataset(token_file(tmp_path, 4 * 30 + 1), seq_len=4)  # 30 windows: 7 batches of 4 an epoch
    straight, _ = global_batch(ds, G=4, dp_size=1, seed=3, steps=20)
    _, loaders = global_batch(ds, G=4, dp_size=dp_before, seed=3, steps=9)
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states) and states[0]["epoch"] == 1 and states[0]["batch"] == 2
    resumed, _ = global_batch(ds, G=4, dp_size=dp_after, seed=3, steps=11, start_state=states[0])
    assert [torch.cat(s).tolist() for s in resumed] == [s[0].tolist() for s in straight[9:]]


def test_loader_user_errors(tmp_path):
    ds = TokenDataset(token_file(tmp_path, 4 * 10 + 1), seq_len=4)
    with pytest.raises(UserError, match="global_batch_size=6 is not divisible by the data-parallel size 4"):
        DataLoader(ds, 6, 0, 4, seed=0)
    with pytest.raises(UserError, match=r"holds 41 tokens \(10 sequences of seq_len=4\).*needs \(49 tokens\)"):
        DataLoader(ds, 12, 0, 2, seed=0)
    with pytest.raises(UserError, match="seed must not be negative"):
        DataLoader(ds, 4, 0, 2, seed=-1)
    loader = DataLoader(ds, 4, 0, 2, seed=0)
    with pytest.raises(UserError, match="global_batch_size=8 but this run has 4"):
        loader.load_state_dict({**loader.state_dict(), "global_batch_size": 8})
