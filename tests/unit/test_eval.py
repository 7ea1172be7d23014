"""`scalenlp eval`: sliding-window perplexity equal to Hugging Face's guide computed by transformers."""

import json

import pytest
import torch

from infer_helpers import SENTENCES, make_export
from scalenlp.cli import main
from scalenlp.loader import read
from scalenlp.models.hf import to_hf
from scalenlp.models.io import load_pretrained
from scalenlp.models.packaged import packaged_model

torch.set_num_threads(1)


def hf_guide_perplexity(model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The loop of transformers' "Perplexity of fixed-length models" guide: (perplexity, tokens scored).
    The guide weights each window's mean loss by its label count minus one for the internal shift; that
    is exact only where a window's first label is scored, so the count here is of the shifted labels."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        num_valid = (target_ids[:, 1:] != -100).sum().item()  # the labels transformers scores after its shift
        nll_sum += loss.item() * num_valid
        n_tokens += num_valid
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return float(torch.exp(torch.tensor(nll_sum / n_tokens))), n_tokens


@pytest.fixture(scope="module")
def unscaled_export(tmp_path_factory):
    """A tiny export whose logits are not spread (logit_scale 1), built once for the three windowings."""
    return make_export(tmp_path_factory.mktemp("eval"), "debug", logit_scale=1.0)


@pytest.mark.parametrize("seq, stride", [(32, 16), (32, 32), (64, 7)])
def test_perplexity_equals_the_hf_guide(tmp_path, capsys, unscaled_export, transformers, seq, stride):
    export = unscaled_export
    text = tmp_path / "text.txt"
    text.write_text(" ".join(SENTENCES[:4]) * 3)  # 339 tokens: 11 to 48 windows
    assert main(["eval", "--checkpoint", str(export), "--data", str(text), "--seq", str(seq), "--stride", str(stride),
                 "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    ids = torch.tensor([read(export).tokenizer.encode(text.read_text()).ids])
    reference, tokens = hf_guide_perplexity(to_hf(load_pretrained(export)), ids, seq, stride)
    assert ours["perplexity"] == pytest.approx(reference, rel=1e-4)
    assert ours["tokens"] == tokens


@pytest.mark.parametrize("extra, match", [
    (["--seq", "100000"], "between 2 and the model's context length"),
    (["--seq", "16", "--stride", "17"], "--stride 17 must be between 1"),
])
def test_bad_windows_are_one_error_line(tmp_path, capsys, tiny_export, extra, match):
    export = tiny_export
    (tmp_path / "t.txt").write_text(" ".join(SENTENCES))
    assert main(["eval", "--checkpoint", str(export), "--data", str(tmp_path / "t.txt"), *extra]) == 2
    assert match in capsys.readouterr().err


def test_missing_or_binary_data_is_one_error_line(tmp_path, capsys, tiny_export):
    export = tiny_export
    assert main(["eval", "--checkpoint", str(export), "--data", str(tmp_path / "nope.txt")]) == 2
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    assert main(["eval", "--checkpoint", str(export), "--data", str(tmp_path / "bin.txt")]) == 2
    err = capsys.readouterr().err
    assert "is not a file" in err and "is not UTF-8" in err


@pytest.mark.slow  # reads SmolLM2-135M: 10-30 s here
def test_chat_accuracy_of_a_real_chat_model(tmp_path, capsys):
    smollm2 = packaged_model("smollm2")
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}], "expect": e}) for q, e in [
        ("What is the capital of France?", "Paris"), ("What is the capital of Veloria?", "Marisport")]) + "\n")
    assert main(["eval", "--checkpoint", str(smollm2), "--chat", str(questions), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["correct"], out["total"]) == (1, 2)  # it knows Paris; Veloria is made up
    assert [a["right"] for a in out["answers"]] == [True, False]


@pytest.mark.parametrize("line, match", [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "not a question"),
    ('{"messages": [], "expect": "x"}', "not a question"),
    ("not json", "q.jsonl:1: not a question"),
])
def test_bad_question_files_are_one_error_line(tmp_path, capsys, tiny_export, line, match):
    export = tiny_export
    (tmp_path / "q.jsonl").write_text(line + "\n")
    assert main(["eval", "--checkpoint", str(export), "--chat", str(tmp_path / "q.jsonl")]) == 2
    assert match in capsys.readouterr().err
