"""A byte-level BPE trained on the same documents is the same in another process (another hash seed)."""

from __future__ import annotations

import json
import subprocess
import sys

from scalenlp.data import train_bpe
from train_helpers import cli_env

# The other process imports scalenlp.data.tokenizer alone, without the package's __init__ and the torch it
# imports (5-9 s here): train_bpe is the same function either way.
TRAIN_ELSEWHERE = """
import json, sys, types, scalenlp
data = types.ModuleType("scalenlp.data")
data.__path__ = [scalenlp.__path__[0] + "/data"]
sys.modules["scalenlp.data"] = data
from scalenlp.data.tokenizer import train_bpe
assert "torch" not in sys.modules
print(train_bpe(json.load(open(sys.argv[1])), 400).to_str())
"""


def test_bpe_training_is_deterministic_across_processes(tmp_path, corpus):
    docs = [line for line in corpus.read_text().splitlines() if line.strip()][:300]
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    other = subprocess.run([sys.executable, "-c", TRAIN_ELSEWHERE, str(tmp_path / "docs.json")], capture_output=True,
                           text=True, env=cli_env(), check=True).stdout.strip()
    assert train_bpe(docs, 400).to_str() == other
