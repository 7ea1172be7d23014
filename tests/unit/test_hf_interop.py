"""Hugging Face interop: the same logits on both sides, and lossless round trips (in memory and on disk)."""

import dataclasses
import json

import pytest
import torch

from infer_helpers import make_export
from scalenlp.cli import main
from scalenlp.errors import UserError
from scalenlp.loader import load
from scalenlp.models.flavors import build_model, model_args
from scalenlp.models.hf import from_hf, to_hf
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("transformers")  # every test here converts to or from it


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2", "small-llama"])
def test_same_logits_and_round_trip(flavor):
    torch.manual_seed(0)
    model = build_model(model_args(flavor, vocab_size=300, max_seq_len=64)).eval()
    tokens = torch.randint(0, 300, (2, 20))
    hf = to_hf(model)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)
    back = from_hf(hf)
    assert back.args == model.args
    for name, t in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t, atol=0, rtol=0)


def test_greedy_generate_matches_hf(tiny_export):
    model = load_pretrained(tiny_export)
    hf = to_hf(model)
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        ours = prompt
        for _ in range(10):
            ours = torch.cat([ours, model(ours)[:, -1:].argmax(-1)], dim=1)
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert theirs.tolist() == ours.tolist()


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2", "small-llama"])
def test_hf_folder_in_and_export_out(tmp_path, flavor):
    """A folder saved by transformers -> our loader -> `scalenlp export --format hf` -> transformers: same logits."""
    from transformers import AutoModelForCausalLM

    export = make_export(tmp_path / "src", flavor, max_seq_len=64)
    saved_by_hf = tmp_path / "hf"
    to_hf(load_pretrained(export)).save_pretrained(saved_by_hf, safe_serialization=True)
    (saved_by_hf / "tokenizer.json").write_bytes((export / "tokenizer.json").read_bytes())
    (saved_by_hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                  "chat_template": "{{ messages }}"}))
    ours, pre = load(saved_by_hf)
    assert pre.source == "hf" and pre.tokenizer_config["chat_template"] == "{{ messages }}"
    assert ours.args == load_pretrained(export).args
    assert main(["export", "--checkpoint", str(saved_by_hf), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)
    exported_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert exported_config["chat_template"] == "{{ messages }}"


def test_llama3_rope_scaling_in_and_out(tmp_path, tiny_export):
    """Llama 3.1-style RoPE scaling (HF rope_type "llama3"): the same logits as transformers' at positions past the
    original context, kept through a saved folder, our loader and `scalenlp export --format hf`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # the vocabulary of tiny_export's tokenizer, copied in below: a smaller table is refused at load
    scaled = dataclasses.replace(model_args("debug", vocab_size=320, max_seq_len=128), rope_scaling=(8.0, 1.0, 4.0, 32))
    model = build_model(scaled).eval()
    plain = build_model(dataclasses.replace(scaled, rope_scaling=())).eval()
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 320, (2, 100))
    to_hf(model).save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "hf" / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    ours, _ = load(tmp_path / "hf")
    assert ours.args.rope_scaling == (8.0, 1.0, 4.0, 32)
    assert main(["export", "--checkpoint", str(tmp_path / "hf"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    with torch.no_grad():
        expected = theirs(tokens).logits
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(tokens), expected, atol=1e-4, rtol=1e-4)  # without the scaling: another function


def test_export_refuses_an_existing_target(tmp_path, capsys, tiny_export):
    (tmp_path / "out").mkdir()
    assert main(["export", "--checkpoint", str(tiny_export), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_export_makes_missing_parent_folders(tmp_path, capsys, tiny_export):
    out = tmp_path / "runs" / "nested" / "out"
    assert main(["export", "--checkpoint", str(tiny_export), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    (tmp_path / "afile").write_text("x")
    assert main(["export", "--checkpoint", str(tiny_export), "--format", "hf", "--out", str(tmp_path / "afile" / "o")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_unsupported_shape_is_a_user_error():
    args = model_args("debug", activation="gelu")  # RoPE with GELU: neither GPT-2 nor Llama
    with pytest.raises(UserError, match="no Hugging Face equivalent"):
        to_hf(build_model(args))


@pytest.mark.parametrize("make, match", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "is not a model"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "t5"}')), "supported: gpt2"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{oops")), "not valid JSON"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
         "vocab_size": 10, "intermediate_size": 8, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))),
     "'yarn' is not supported"),
])
def test_a_folder_that_is_not_a_model_is_one_error_line(tmp_path, make, match):
    make(tmp_path / "m")
    with pytest.raises(UserError, match=match):
        load(tmp_path / "m")
