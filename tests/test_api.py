"""The Python API: the README's example runs as written, and engines built through it keep serve's defaults."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import scalenlp
from scalenlp.models.packaged import packaged_model

README = Path(__file__).resolve().parents[1] / "README.md"
SMOLLM2 = packaged_model("smollm2")


def readme_python_blocks() -> list[str]:
    section = README.read_text().split("## Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_python_example_runs(tmp_path):
    blocks = readme_python_blocks()
    assert blocks, "README.md has a '## Python' section with python code blocks"
    repo = README.parent
    for code in blocks:  # in a fresh interpreter, from the repository root as a user would run it
        proc = subprocess.run([sys.executable, "-c", code.replace("runs/", f"{tmp_path}/")], cwd=repo,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_exported_name_resolves():
    for name in scalenlp.__all__:
        assert getattr(scalenlp, name) is not None
    with pytest.raises(AttributeError):
        scalenlp.not_a_name


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
    cfg.training.mixed_precision = "fp16"
    with pytest.raises(scalenlp.ConfigError) as from_python:
        scalenlp.Trainer(cfg, tmp_path / "run")
    with pytest.raises(scalenlp.ConfigError) as from_cli:
        scalenlp.load_config(None, ["training.mixed_precision=fp16"])
    assert str(from_python.value) == str(from_cli.value)
    assert not (tmp_path / "run").exists()
