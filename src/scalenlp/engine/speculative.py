"""Draft tokens for speculative decoding by prompt lookup (n-gram matching), with no second model.

A request whose output repeats its prompt or itself (a summary that quotes, code edited in place, a list that
continues a pattern) often goes on as it went on after the previous occurrence of its last few tokens. The engine
verifies the proposed tokens in the same forward that computes the request's next token (decoder_engine), and
keeps those the model agrees with, so a good guess yields several tokens for one forward and a bad one costs only
the extra positions of that forward.
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried after it, down to one token


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of ``tokens``, for the
    largest n from ``max_ngram`` down to 1 that occurs; [] when none does. A longer match is tried first because
    it predicts the continuation better; the latest occurrence because text nearby is the likeliest to repeat."""
    end = len(tokens) - 1
    best, best_n = -1, 0
    # One pass backwards over the earlier occurrences of the last token, each scored by how many tokens before it
    # match too: the first one found with the most matching is the latest of those.
    for i in range(end - 1, -1, -1):
        if tokens[i] != tokens[end]:
            continue
        n = 1
        while n < max_ngram and n <= i and tokens[i - n] == tokens[end - n]:
            n += 1
        if n > best_n:
            best, best_n = i, n
            if n == max_ngram:
                break
    return tokens[best + 1:best + 1 + k] if best_n else []
