"""Packed training windows over a token file, and the per-rank loader of global batches.

The token file is a flat stream of documents separated by EOS. Windows are cut at a fixed stride of
``seq_len`` with one extra token of overlap, so a window of ``seq_len + 1`` tokens gives ``seq_len`` inputs and
their ``seq_len`` next-token targets, and every token of the stream is a target exactly once per epoch.
Windows cross document boundaries; the EOS between documents tells the model where one ends.

Sharding is over global batches, like ``DistributedSampler`` but one level up: the order of windows
depends only on (seed, epoch) (or is the file's order, with ``data.shuffle=false``), each global batch is
a contiguous slice of that order, and each data-parallel rank takes its contiguous share of the batch. The
global batch, and so the loss of every step, is therefore the same whatever the number of ranks, and a
position saved with one rank count resumes with another.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from scalenlp.errors import UserError


def open_tokens(token_file: Path) -> np.ndarray:
    """The token stream, memory-mapped read-only (a ``.npy`` file carries its own dtype and length)."""
    try:
        return np.load(token_file, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read token file {token_file} ({e}); delete it to have it rebuilt") from None


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens at stride ``seq_len`` over a memory-mapped token file."""

    def __init__(self, token_file: Path, seq_len: int):
        self.token_file = Path(token_file)
        self.tokens = open_tokens(self.token_file)
        self.seq_len = seq_len
        if seq_len < 1:
            raise UserError(f"training.seq_len must be at least 1, got {seq_len}")
        if seq_len + 1 > len(self.tokens):
            raise UserError(f"{self.token_file} holds {len(self.tokens)} tokens, fewer than one sequence of "
                            f"seq_len+1 = {seq_len + 1}; use more data or a smaller training.seq_len "
                            f"(for the held-out split, a larger data.val_fraction also helps)")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = (i % n) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows at ``indices``: targets are the inputs shifted by one."""
        windows = torch.stack([self[int(i)] for i in indices])
        return windows[:, :-1], windows[:, 1:]

    def shortfall(self, global_batch_size: int) -> str:
        """Why this dataset cannot fill one global batch."""
        needed = global_batch_size * self.seq_len + 1
        return (f"{self.token_file} holds {len(self.tokens)} tokens ({len(self)} sequences of "
                f"seq_len={self.seq_len}), fewer than one global batch of {global_batch_size} "
                f"sequences needs ({needed} tokens); use more data or a smaller "
                f"training.global_batch_size / training.seq_len")


def document_positions(tokens: torch.Tensor, bos_id: int | None, eos_id: int) -> torch.Tensor:
    """(B, T) positions of packed windows that restart at 0 where a document starts: at a BOS token, or at the
    token after an EOS (so ``BOS doc EOS BOS ...`` and ``doc EOS doc ...`` streams both put a document's first
    token where a prompt's is at inference). A window that opens inside a document counts from its first token."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    if bos_id is not None and bos_id != eos_id:  # GPT-2's BOS is its EOS: the token after it starts a document
        starts |= tokens == bos_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class GlobalBatchLoader:
    """The position of a loader of global batches, epoch after epoch: which batch comes next, and what a saved
    position must match to mean the same batches. The position is global, so it resumes with any dp_size."""

    # The name under which the number of items (windows, rows) is saved with the position.
    size_key = "num_items"

    def __init__(self, num_items: int, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not a rank of dp_size={dp_size}")
        if seed < 0:
            raise UserError(f"training.seed must not be negative, got {seed}")
        if global_batch_size % dp_size:
            raise UserError(f"training.global_batch_size={global_batch_size} is not divisible by the "
                            f"data-parallel size {dp_size}; make it a multiple of {dp_size}")
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.batches_per_epoch = num_items // global_batch_size  # the incomplete last batch is dropped
        self.epoch, self.batch = 0, 0

    def advance(self) -> tuple[int, int]:
        """The (epoch, batch) to serve now; the position moves on to the one after."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        self.batch += 1
        return self.epoch, self.batch - 1

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self.epoch, self.batch = epoch, 0

    def state_dict(self) -> dict:
        """The global position (independent of dp_size) plus what must match for it to mean the same batches."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, self.size_key: self.num_items}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in ((self.size_key, self.num_items), ("global_batch_size", self.global_batch_size),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise UserError(f"cannot resume the data position: the checkpoint has {key}={state[key]} but this "
                                f"run has {mine}; resume with the same data, seq_len, global_batch_size, seed and "
                                f"data.shuffle")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


class DataLoader(GlobalBatchLoader):
    """This rank's share of each global batch of token windows, epoch after epoch, resumable at any batch.
    ``dataset`` is a ``TokenDataset`` or any dataset with ``__len__``, ``seq_len``, ``batch`` and ``shortfall``
    (``ChatDataset``)."""

    size_key = "num_windows"

    def __init__(self, dataset, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        super().__init__(len(dataset), global_batch_size, dp_rank, dp_size, seed, shuffle)
        if len(dataset) < global_batch_size:
            raise UserError(dataset.shortfall(global_batch_size))
        self.dataset = dataset
        self._order: tuple[int, np.ndarray] | None = None

    def window_order(self, epoch: int) -> np.ndarray:
        """The permutation of window indices for ``epoch``: a function of (seed, epoch) only; file order
        in every epoch without shuffling."""
        if self._order is None or self._order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset)) if self.shuffle \
                else np.arange(len(self.dataset))
            self._order = (epoch, order)
        return self._order[1]

    def global_batch_indices(self, epoch: int, batch: int) -> np.ndarray:
        return self.window_order(epoch)[batch * self.global_batch_size:(batch + 1) * self.global_batch_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each a LongTensor (global_batch_size / dp_size, seq_len); targets are the next
        tokens, -100 (ignored by the loss) where none is trained on."""
        indices = self.global_batch_indices(*self.advance())
        mine = indices[self.dp_rank * self.local_batch_size:(self.dp_rank + 1) * self.local_batch_size]
        return self.dataset.batch(mine)
