"""Hugging Face interop: the same logits on both sides, and lossless round trips (in memory and on disk)."""

import pytest
import torch
from infer_helpers import make_export

from scalenlp.errors import UserError
from scalenlp.models.flavors import build_model, model_args
from scalenlp.models.hf import export_to_hf, from_hf, import_from_hf, to_hf
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)


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


def test_greedy_generate_matches_hf(tmp_path):
    model = load_pretrained(make_export(tmp_path, "debug"))
    hf = to_hf(model)
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        ours = prompt
        for _ in range(10):
            ours = torch.cat([ours, model(ours)[:, -1:].argmax(-1)], dim=1)
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert theirs.tolist() == ours.tolist()


@pytest.mark.parametrize("flavor", ["debug", "debug-gpt2"])
def test_folder_round_trip(tmp_path, flavor):
    export = make_export(tmp_path / "src", flavor)
    hf_dir = export_to_hf(export, tmp_path / "hf")
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    assert (hf_dir / "tokenizer.json").is_file()
    back = import_from_hf(hf_dir, tmp_path / "back")
    a, b = load_pretrained(export), load_pretrained(back)
    assert a.args == b.args
    tokens = torch.randint(0, a.args.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(a(tokens), b(tokens), atol=0, rtol=0)


def test_unsupported_shape_is_a_user_error():
    args = model_args("debug", activation="gelu")  # RoPE with GELU: neither GPT-2 nor Llama
    with pytest.raises(UserError, match="no Hugging Face equivalent"):
        to_hf(build_model(args))


def test_import_missing_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot load"):
        import_from_hf(tmp_path / "nothing", tmp_path / "out")
