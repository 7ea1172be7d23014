"""Data pipeline: text sources -> tokenizer -> cached token files -> packed windows -> per-rank global batches.

Training calls ``prepare_data`` on one rank (heavy, cached, idempotent), then ``open_data`` on every rank
after a barrier, then builds a ``TokenDataset`` and a ``DataLoader`` over the files it names.

Names are imported on first use: the chat template workers import ``scalenlp.data.chat`` in a process of their
own, and the package must not bring torch into it.
"""

import importlib

_EXPORTS = {
    "DataLoader": "scalenlp.data.dataset", "TokenDataset": "scalenlp.data.dataset",
    "DataFiles": "scalenlp.data.prepare", "open_data": "scalenlp.data.prepare", "prepare_data": "scalenlp.data.prepare",
    "EOS": "scalenlp.data.tokenizer", "eos_token_id": "scalenlp.data.tokenizer",
    "load_tokenizer": "scalenlp.data.tokenizer", "train_bpe": "scalenlp.data.tokenizer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scalenlp.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
