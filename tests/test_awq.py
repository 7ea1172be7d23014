"""Activation-aware int4 (``scalenlp quantize --calibration``): folding the scales leaves the float model's
outputs as they were, the calibrated int4 model is nearer the float one than plain rounding on inputs it was not
calibrated on, its export round-trips exactly, and bad calibration requests end in one line."""

from __future__ import annotations

import pytest
import torch

import scalenlp.compress.awq
from infer_helpers import SENTENCES, train_tokenizer
from scalenlp.cli import main
from scalenlp.compress.awq import awq
from scalenlp.engine.llm import LLM
from scalenlp.compress.calibration import calibration_batches
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.flavors import build_model, model_args
from scalenlp.models.io import save_pretrained
from scalenlp.loader import instantiate, load, read
from scalenlp.compress.quantized import Quantization, build_quantized

torch.set_num_threads(1)
SPEC = Quantization("int4", 32)


@pytest.fixture
def export(tmp_path):
    """A random Llama-shaped decoder (GQA, tied embeddings) with a few input channels of every norm's output
    much larger than the rest, as trained models have them: what activation-aware scales are for."""
    tok = train_tokenizer(tmp_path / "tok.json")
    torch.manual_seed(0)
    model = build_model(model_args("debug", vocab_size=320, ffn_dim=128, tie_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p[torch.randperm(len(p))[:4]] *= 20
    return save_pretrained(model, tmp_path / "export", tok)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text(" ".join(SENTENCES * 8))
    return path


def test_folded_scales_leave_the_float_model_unchanged(export, text, monkeypatch):
    monkeypatch.setattr(scalenlp.compress.awq, "ALPHAS", (0.5,))  # every set scaled: each fold (GQA's v too) runs
    pre = read(export)
    model = instantiate(pre, "cpu", torch.float32)
    tokens = torch.randint(0, 320, (2, 24))
    before = model(tokens)
    folded = ["attention_norm.weight", "attention.wv.weight", "ffn_norm.weight", "feed_forward.w3.weight"]
    original = {name: model.layers["0"].get_parameter(name).clone() for name in folded}
    awq(model, calibration_batches(text, pre.tokenizer, 4, 32), SPEC)
    for name in folded:
        assert not torch.equal(original[name], model.layers["0"].get_parameter(name)), name
    torch.testing.assert_close(model(tokens), before, atol=1e-5, rtol=1e-5)


def test_calibrated_int4_is_nearer_the_float_model_than_plain_rounding(export, text):
    pre = read(export)
    float_model = instantiate(pre, "cpu", torch.float32)
    plain = instantiate(pre, "cpu", torch.float32, quantize=SPEC)
    model = instantiate(pre, "cpu", torch.float32)
    grams = awq(model, calibration_batches(text, pre.tokenizer, 8, 32), SPEC)
    calibrated = build_quantized(pre.args, model.state_dict(), SPEC, True, grams=grams)
    torch.manual_seed(1)
    held_out = torch.randint(0, 320, (4, 32))  # random tokens: not the calibration text
    with torch.no_grad():
        want = float_model(held_out)
        plain_error = (plain(held_out) - want).square().mean()
        calibrated_error = (calibrated(held_out) - want).square().mean()
    assert calibrated_error < 0.8 * plain_error


def test_calibrated_export_round_trips_exactly(tmp_path, export, text, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(export), "--method", "int4", "--group-size", "32",
                 "--calibration", str(text), "--calibration-samples", "4", "--calibration-seq", "32",
                 "--out", str(out)]) == 0
    pre = read(export)
    model = instantiate(pre, "cpu", torch.float32)
    grams = awq(model, calibration_batches(text, pre.tokenizer, 4, 32), SPEC)
    in_process = build_quantized(pre.args, model.state_dict(), SPEC, True, grams=grams)
    saved, loaded = load(out, dtype=torch.float32)
    assert loaded.quantization == SPEC
    tokens = torch.randint(0, 320, (2, 9))
    assert torch.equal(in_process(tokens), saved(tokens))


@pytest.mark.parametrize("argv, says", [
    (["--method", "int4", "--calibration", "missing.txt"],
     "--calibration 'missing.txt' is not a file; pass a UTF-8 text file (e.g. wikitext2/valid.txt)"),
    (["--method", "int8", "--calibration", "{text}"],
     "calibration rounds int4 only; --method int8 rounds without it, drop --calibration"),
])
def test_bad_calibration_is_one_line(tmp_path, export, text, capsys, argv, says):
    argv = [a.replace("{text}", str(text)) for a in argv]
    assert main(["quantize", "--checkpoint", str(export), "--out", str(tmp_path / "q"), *argv]) == 2
    assert capsys.readouterr().err == f"error: {says}\n"


@pytest.mark.slow  # two processes
def test_calibrated_export_serves_under_tp2_as_on_one_process(tmp_path, export, text):
    """The folded norms and the scaled, rounded weights shard like any int4 export: greedy tokens on two ranks
    are the single process's."""
    out = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(export), "--method", "int4", "--group-size", "32",
                 "--calibration", str(text), "--calibration-samples", "4", "--calibration-seq", "32",
                 "--out", str(out)]) == 0
    outputs = []
    for tp in (1, 2):
        with LLM(out, dtype="float32", tp=tp) as llm:
            outputs.append(llm.generate(["the quick brown fox", "hello"],
                                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    assert outputs[0] == outputs[1]
