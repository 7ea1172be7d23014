"""Data pipeline: text sources -> tokenizer -> cached token files -> packed windows -> per-rank global batches.

Training calls ``prepare_data`` on one rank (heavy, cached, idempotent), then ``open_data`` on every rank
after a barrier, then builds a ``TokenDataset`` and a ``DataLoader`` over the files it names.
"""

from scalenlp.data.dataset import DataLoader, TokenDataset
from scalenlp.data.prepare import DataFiles, open_data, prepare_data
from scalenlp.data.tokenizer import EOS, eos_token_id, load_tokenizer, train_bpe

__all__ = ["DataFiles", "DataLoader", "EOS", "TokenDataset", "eos_token_id", "load_tokenizer", "open_data",
           "prepare_data", "train_bpe"]
