"""The README's Python example runs as written, in a fresh interpreter from the repository root."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python_blocks() -> list[str]:
    section = README.read_text().split("## Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.slow  # trains, generates and plans in a new interpreter: 20-80 s here
def test_readme_python_example_runs(tmp_path):
    blocks = readme_python_blocks()
    assert blocks, "README.md has a '## Python' section with python code blocks"
    repo = README.parent
    for code in blocks:  # in a fresh interpreter, from the repository root as a user would run it
        proc = subprocess.run([sys.executable, "-c", code.replace("runs/", f"{tmp_path}/")], cwd=repo,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
