"""The decoder engine's bookkeeping of the paged KV cache (models.decoder.KVCache): which pool blocks are free,
which each sequence holds, and which hold a prefix that a later request may reuse (prefix caching).

A block whose positions are all computed gets a key: a digest chained over every token before and in it (and the
LoRA adapter it was computed with, since an adapter changes the keys and values), so equal keys mean equal KV.
Blocks are reference-counted; one whose count drops to 0 keeps its contents and its key, and is reused by key
until a new block is needed and none is free, when the least recently used of them is taken (LRU eviction).
Block 0 is never handed out: padding positions of a batch write there, and block tables pad with it.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

NULL_BLOCK = 0


def block_keys(tokens: list[int], block_size: int, count: int, seed: bytes, start: int = 0,
               parent: bytes | None = None) -> list[bytes]:
    """Keys of blocks ``start`` .. ``count - 1`` of ``tokens``, chained from ``parent`` (the key of block
    ``start - 1``; None for the first block, which is chained from ``seed``)."""
    keys, key = [], parent if parent is not None else seed
    for i in range(start, count):
        digest = hashlib.blake2b(key, digest_size=16)
        digest.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        key = digest.digest()
        keys.append(key)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.capacity = num_blocks - 1  # blocks a sequence may hold: all but the null block
        self._free = collections.deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block -> key, for blocks reusable by key
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # keyed, unreferenced; LRU first
        self.prompt_tokens = 0  # prompt tokens admitted, and those of them found in the cache
        self.hit_tokens = 0

    @property
    def available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free, or cached and evictable)."""
        return len(self._free) + len(self._idle)

    def allocate(self) -> int:
        """A block for new positions, referenced once: a free one, else the least recently used cached one,
        which loses its key. The caller checks ``available`` first."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a keyed block stays cached (most recently used last)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys``, each referenced once more."""
        found = []
        for key in keys if self.prefix_caching else ():
            block = self._block_of.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
            found.append(block)
        return found

    def register(self, block: int, key: bytes) -> None:
        """``block`` now holds the positions ``key`` names: later requests may reuse it. A block with the same key
        already cached (computed by a request admitted alongside) stays the one found; this one is freed as usual."""
        if self.prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens admitted (0 before any)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
