"""training.task = "classification" mistakes are one error line from `scalenlp train` (through the CLI's main in this
process): no encoder or data named, an encoder given to the decoder task, a held-out label training never saw."""

from __future__ import annotations

from train_helpers import classify_sets, error_lines, main_train, tiny_encoder


def test_classification_mistakes_are_one_error_line(tmp_path, capsys):
    decoder_like = tmp_path / "train.tsv"
    decoder_like.write_text("label\tsentence\n1\tgood\n0\tbad\n")
    assert main_train(tmp_path / "run", "training.task=classification", f"data.path={decoder_like}") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: training.task=\"classification\" needs model.init (an encoder checkpoint, e.g. a BERT folder) and "
        "data.path (a labelled .tsv/.csv/.jsonl/.parquet file)"]
    init = tiny_encoder(tmp_path / "tiny")
    assert main_train(tmp_path / "run", *classify_sets(init, decoder_like, None), "training.task=lm") == 2
    assert "is an encoder; training.task='lm' needs a decoder" in error_lines(capsys.readouterr().err)[0]
    unseen = tmp_path / "dev.tsv"
    unseen.write_text("label\tsentence\n2\tso-so\n")
    assert main_train(tmp_path / "run2", *classify_sets(init, decoder_like, unseen, "training.global_batch_size=2",
                                                        "training.steps=1", "training.seq_len=16")) == 2
    assert "has label(s) the training data does not: '2'" in error_lines(capsys.readouterr().err)[0]
