"""Activation-aware int4 (``scalenlp quantize --calibration``): folding the scales leaves the float model's
outputs as they were, the calibrated int4 model is nearer the float one than plain rounding on inputs it was not
calibrated on, its export round-trips exactly, and bad calibration requests end in one line. (Under tensor
parallelism: integration/test_tensor_parallel_serving.py.)"""

from __future__ import annotations

import pytest
import torch

import scalenlp.compress.awq
from infer_helpers import SENTENCES, quantizable_decoder
from scalenlp.cli import main
from scalenlp.compress.awq import awq
from scalenlp.compress.calibration import calibration_batches
from scalenlp.compress.quantized import Quantization, build_quantized
from scalenlp.loader import instantiate, load, read

torch.set_num_threads(1)
SPEC = Quantization("int4", 32)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A random Llama-shaped decoder (GQA, tied embeddings) with a few loud input channels in every norm's output,
    as trained models have them: what activation-aware scales are for. Read, never written."""
    return quantizable_decoder(tmp_path_factory.mktemp("awq"), loud_channels=4)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
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


def test_calibrated_int4_is_nearer_the_float_model_than_plain_rounding(export, text, monkeypatch):
    # Every fifth alpha of the search's 21 (0 among them: plain rounding): each is a choice the full search has too.
    monkeypatch.setattr(scalenlp.compress.awq, "ALPHAS", scalenlp.compress.awq.ALPHAS[::5])
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


def test_calibrated_export_round_trips_exactly(tmp_path, export, text, capsys, monkeypatch):
    monkeypatch.setattr(scalenlp.compress.awq, "ALPHAS", (0.5,))  # one alpha: every set scaled and folded, quickly
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
