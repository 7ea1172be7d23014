"""Giving the heap's free memory back to the system.

glibc keeps what a thread frees in that thread's arena for its next allocations, and a large request frees a lot
at once: tokenizing 2,048 texts, or the activations of an encoder's forward passes over a 64-text request, left
the server's RSS 160 MB (and 47%) above its level before, with nothing left to use it. ``malloc_trim`` returns
the free pages of every arena.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the system; nothing where the C library cannot. Call it off
    the event loop: on a heap of many freed pages it took up to 0.7 s here."""
    if (trim := _malloc_trim()) is not None:
        trim(0)
