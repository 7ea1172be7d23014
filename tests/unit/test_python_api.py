"""The Python API: every exported name resolves, LLM stops a real chat model at its end of turn and refuses an
encoder, and a Trainer validates a config as the CLI does. (The README's example, run in a fresh interpreter, is
in integration/test_readme_python_example.py.)"""

import pytest

import scalenlp
from scalenlp.models.packaged import packaged_model

SMOLLM2 = packaged_model("smollm2")


def test_every_exported_name_resolves():
    for name in scalenlp.__all__:
        assert getattr(scalenlp, name) is not None
    with pytest.raises(AttributeError):
        scalenlp.not_a_name  # noqa: B018 (the lookup itself is what raises)


@pytest.mark.slow  # reads SmolLM2-135M: 10-30 s here
def test_llm_stops_at_the_end_of_turn_of_a_real_chat_model():
    with scalenlp.LLM(SMOLLM2, dtype="float32", max_batch=2) as llm:
        params = scalenlp.SamplingParams(max_tokens=48, temperature=0)
        answer, = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
        assert "Paris" in answer and "<|im_end|>" not in answer
        assert len(llm.engine.tokenizer.encode(answer).ids) < params.max_tokens  # it stopped, not ran out


def test_an_encoder_is_refused_by_llm():
    minilm = packaged_model("minilm")
    with pytest.raises(scalenlp.UserError, match="encoder"):
        scalenlp.LLM(minilm)


def test_a_trainer_from_a_python_config_is_validated_as_the_cli_validates(tmp_path):
    cfg = scalenlp.Config()
    cfg.training.mixed_precision = "fp8"
    with pytest.raises(scalenlp.ConfigError) as from_python:
        scalenlp.Trainer(cfg, tmp_path / "run")
    with pytest.raises(scalenlp.ConfigError) as from_cli:
        scalenlp.load_config(None, ["training.mixed_precision=fp8"])
    assert str(from_python.value) == str(from_cli.value)
    assert not (tmp_path / "run").exists()
