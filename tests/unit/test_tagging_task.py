"""training.task = "token_classification" in this process: a tiny encoder learns made-up entities, with entity
scores (micro and per type) in metrics.jsonl every eval_every steps, the best kept by f1 and an export that tags;
mistakes are one error line, and bad sentences or unseen eval tags are reported by file and line while the rest
is used. (Two processes under ZeRO-3 and TP: tests/integration/test_tagging_training.py.)"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.encoder_engine import encoder_from_checkpoint
from scalenlp.loader import read
from train_helpers import error_lines, main_train, tiny_encoder, train_here, write_tagged


def tag_sets(init, train, dev, *extra: str) -> list[str]:
    sets = ["training.task=token_classification", f"model.init={init}", f"data.path={train}", "training.device=cpu",
            "training.log_every=1", "checkpoint.every=0", "training.global_batch_size=8", "training.seq_len=12",
            "training.lr=5e-3", "training.warmup_steps=2", "training.weight_decay=0.0"]
    return sets + ([f"data.eval_path={dev}"] if dev else []) + list(extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 40-step run, evaluated every 20 steps and keeping the best by f1; its folder and what it logged. The
    training file holds one sentence out of BIO order, the eval file a tag training never saw."""
    folder = tmp_path_factory.mktemp("tagging")
    train = write_tagged(folder / "train.conll", 96)
    train.write_text(train.read_text() + "\nthen\tO\nyork\tI-LOC\n")
    dev = write_tagged(folder / "dev.conll", 24, seed=1)
    dev.write_text(dev.read_text() + "\nacme\tB-ORG\nrocks\tO\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # where the trainer logs
        train_here(folder / "run", *tag_sets(tiny_encoder(folder / "tiny"), train, dev, "training.steps=40",
                                             "training.eval_every=20", "checkpoint.keep_best=f1"))
    logged = err.getvalue().splitlines()
    return folder, logged


def test_entities_are_learnt_and_scored_every_eval_every_steps(run):
    folder, logged = run
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evaluations = [r for r in records if "f1" in r]
    assert [r["step"] for r in evaluations] == [20, 40]
    assert losses[-1] < losses[0] / 3
    final = evaluations[-1]
    assert set(final) >= {"eval_loss", "precision", "recall", "f1", "PER_f1", "LOC_precision", "ORG_recall"}
    assert final["f1"] > 0.8 and final["PER_f1"] > 0.8 and final["LOC_f1"] > 0.8, final
    assert final["ORG_recall"] == 0.0  # a type training never saw: its one entity counts as missed
    best = max(evaluations, key=lambda r: r["f1"])
    assert json.loads((folder / "run" / "best" / "best.json").read_text())["f1"] == best["f1"]
    args = read(folder / "run" / "export").args
    assert args.task == "token_classification" and not args.pooler
    assert args.labels == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    engine = encoder_from_checkpoint(EncoderEngineConfig(folder / "run" / "export", dtype="float32"))
    try:
        found = engine.tag(["we saw mary jones in paris today"])[0]
    finally:
        engine.stop()
    assert [(e["type"], e["text"]) for e in found] == [("PER", "mary jones"), ("LOC", "paris")]


def test_bad_sentences_and_unseen_tags_are_reported_by_line(run):
    folder, logged = run
    train, dev = folder / "train.conll", folder / "dev.conll"
    bad = len(train.read_text().splitlines())  # the last line: I-LOC after O
    assert f"  {train}:{bad}: tag 'I-LOC' follows 'O'; an I- tag continues a B- or I- tag of its own type" in logged
    unseen = len(dev.read_text().splitlines()) - 1
    assert any(line.startswith(f"{dev}:{unseen}: tag 'B-ORG' is not among the training data's tags") for line in logged)
    assert any("96 training sentences" in line for line in logged)  # the bad one left out, the rest used


def test_tagging_mistakes_are_one_error_line(tmp_path, capsys):
    train = write_tagged(tmp_path / "train.conll", 8)
    assert main_train(tmp_path / "run", "training.task=token_classification", f"data.path={train}") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: training.task=\"token_classification\" needs model.init (an encoder checkpoint, e.g. a BERT folder) "
        "and data.path (a CoNLL-style or .jsonl file of tagged words)"]
    init = tiny_encoder(tmp_path / "tiny")
    assert main_train(tmp_path / "run", *tag_sets(init, train, None, "checkpoint.keep_best=f1")) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: checkpoint.keep_best needs data.eval_path: the best checkpoint is judged on it"]
    outside = tmp_path / "outside.conll"
    outside.write_text("a\tO\nb\tO\n")
    assert main_train(tmp_path / "run", *tag_sets(init, outside, None, "training.steps=1")) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: {outside} tags every word 'O'; there are no entities "
                                                    f"to learn"]


def test_trains_step_for_step_as_the_transformers_recipe(tmp_path):
    """With dropout off, one starting point (head included) and the same batches, the trainer's loss at every step
    equals a plain transformers loop's (run_ner's recipe: BertForTokenClassification, the tag on each word's first
    sub-token, AdamW with decay on matrices, warm-up + cosine, clipping): what benchmarks/ner.py compares differs
    only in what is random."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForTokenClassification

    from scalenlp.data.tags import read_tagged, tag_names
    from scalenlp.models.packaged import packaged_model
    from scalenlp.train.optim import build_scheduler, param_groups
    from scalenlp.train.tasks import load_config

    train = write_tagged(tmp_path / "train.conll", 48)
    sentences = read_tagged(train, lambda _: None)
    labels = tag_names(sentences)
    tokenizer = AutoTokenizer.from_pretrained(packaged_model("minilm"))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, id2label=dict(enumerate(labels)),
                        label2id={t: i for i, t in enumerate(labels)}, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = BertForTokenClassification(config)
    model.save_pretrained(tmp_path / "init")
    tokenizer.save_pretrained(tmp_path / "init")

    sets = tag_sets(tmp_path / "init", train, None, "training.steps=6", "training.seq_len=32", "model.dropout=0.0",
                    "data.shuffle=false", "training.weight_decay=0.01", "training.grad_clip=0.5")
    ours = [r["loss"] for r in train_here(tmp_path / "run", *sets) if "loss" in r]

    t = load_config(None, sets).training
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    scheduler = build_scheduler(optimizer, t)
    encoded = tokenizer(sentences.words, is_split_into_words=True)
    index = {tag: i for i, tag in enumerate(labels)}
    theirs = []
    for start in range(0, t.steps * t.global_batch_size, t.global_batch_size):
        rows = range(start, start + t.global_batch_size)
        width = max(len(encoded["input_ids"][i]) for i in rows)
        ids, labels_ = torch.zeros(len(rows), width, dtype=torch.long), torch.full((len(rows), width), -100)
        for r, i in enumerate(rows):
            words = encoded.word_ids(i)
            ids[r, :len(words)] = torch.tensor(encoded["input_ids"][i])
            for position, w in enumerate(words):
                if w is not None and (position == 0 or words[position - 1] != w):
                    labels_[r, position] = index[sentences.tags[i][w]]
        loss = model(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels_).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        theirs.append(loss.item())
    assert len(ours) == t.steps
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)
    assert ours[-1] < ours[0] * 0.8  # it learnt: the comparison is not of two models that stand still
