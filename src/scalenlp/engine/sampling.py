"""Per-request sampling, batched: one call picks the next token of every running sequence.

Randomness is counter-based: the uniform number a request draws at its i-th token is a hash of
(seed, i). A request's text therefore depends only on its own seed, not on which other requests
shared its batch or in which order they arrived, and no per-request generator object is stepped in
a Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # alternatives per token: OpenAI's chat top_logprobs, and vLLM's default for completions too
MAX_PENALTY = 2.0  # presence and frequency penalties, as the OpenAI API
MAX_LOGIT_BIAS = 100.0
INT64_MAX = (1 << 63) - 1  # seeds and top_k become int64 tensors


class InvalidParam(ValueError):
    """A sampling setting out of range; ``param`` names it (the HTTP API reports it as such)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the end of the context
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # None = a fresh random seed per request
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    logprobs: int | None = None  # None = none; k = the chosen token's logprob and the top k alternatives
    ignore_eos: bool = False  # keep generating past the end-of-text token (benchmarks)
    # Constrained decoding (engine/grammar.py): llguidance grammar text the output must match; None = free text.
    grammar: str | None = None
    # OpenAI's: a token already generated in this completion loses presence_penalty once and frequency_penalty
    # per time it was generated, from its logit; logit_bias adds to the logits of token ids.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def argmax_only(self) -> bool:
        """Greedy, with nothing that changes the logits or reports them: the token is their argmax alone."""
        return (self.temperature == 0 and self.logprobs is None and self.grammar is None and not self.logit_bias
                and not self.presence_penalty and not self.frequency_penalty)

    def check(self) -> None:
        """Raise InvalidParam naming the first out-of-range field. Written so that NaN fails every
        range (a comparison with NaN is false), and so that no value can overflow the int64 tensors
        the sampler builds from these settings."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (0 <= self.temperature and math.isfinite(self.temperature)):
            raise InvalidParam("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= INT64_MAX:
            raise InvalidParam("top_k", f"top_k must be between 0 (off) and {INT64_MAX}, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -INT64_MAX - 1 <= self.seed <= INT64_MAX:
            raise InvalidParam("seed", f"seed must be a signed 64-bit integer, between {-INT64_MAX - 1} and "
                               f"{INT64_MAX}, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidParam(name, f"{name} must be between {-MAX_PENALTY} and {MAX_PENALTY}, got {value}")
        for token, bias in self.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias values must be between {-MAX_LOGIT_BIAS} and "
                                   f"{MAX_LOGIT_BIAS}, got {bias} for token {token}")
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must not be empty")


_MASK64 = (1 << 64) - 1


def _to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_to_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
# XORed into a seed for the uniform numbers that accept or reject draft tokens: a stream apart from the one that
# draws tokens, so that the two decisions at one position are independent.
_ACCEPT_STREAM = _to_signed(0xD1B54A32D192ED03)


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift of int64 (torch shifts arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform_from(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """splitmix64(seed, step) -> float64 uniform in [0, 1), elementwise; int64 arithmetic wraps."""
    z = seed * _GOLDEN + (step + 1) * _MIX2
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors, built once per step from the running requests."""

    temperature: torch.Tensor  # (B,) float32, 0 = greedy
    top_k: torch.Tensor  # (B,) int64, 0 = off
    top_p: torch.Tensor  # (B,) float32
    seed: torch.Tensor  # (B,) int64
    step: torch.Tensor  # (B,) int64, index of the token being drawn
    logprobs: int  # the most alternatives any row asked for; -1 = no row wants logprobs
    any_sampled: bool  # known from the settings, so that no device sync is needed to branch
    any_truncated: bool
    # Penalties, only where some row has them: (B, 1) float32 each, and (B, V) float32 counts of the tokens each
    # row has generated so far (zeros in the rows without penalties).
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values), any row's
    # Speculative decoding: (B,) int64, the token proposed for each row's position (-1: none), where some row has one.
    draft: torch.Tensor | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int], device,
              counts: list[torch.Tensor | None] | None = None, drafts: list[int] | None = None) -> SamplingBatch:
        """counts: each row's (V,) counts of the tokens it has generated, where the row has penalties (the caller
        keeps them up to date between steps). drafts: each row's proposed token (-1: none), see ``sample``."""
        want = [p.logprobs for p in params if p.logprobs is not None]
        penalties = {}
        if counts is not None and any(c is not None for c in counts):
            zero = torch.zeros_like(next(c for c in counts if c is not None))
            penalties = dict(
                presence=torch.tensor([[p.presence_penalty] for p in params], dtype=torch.float32, device=device),
                frequency=torch.tensor([[p.frequency_penalty] for p in params], dtype=torch.float32, device=device),
                counts=torch.stack([c if c is not None else zero for c in counts]))
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        bias = None
        if biased:
            rows, ids, values = zip(*biased)
            bias = (torch.tensor(rows, dtype=torch.int64, device=device),
                    torch.tensor(ids, dtype=torch.int64, device=device),
                    torch.tensor(values, dtype=torch.float32, device=device))
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seed=torch.tensor(seeds, dtype=torch.int64, device=device),
            step=torch.tensor(steps, dtype=torch.int64, device=device),
            logprobs=max(want) if want else -1,
            any_sampled=any(p.temperature > 0 for p in params),
            any_truncated=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
            bias=bias, **penalties,
            draft=torch.tensor(drafts, dtype=torch.int64, device=device) if drafts and max(drafts) >= 0 else None,
        )


def adjust(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits (B, V) with each row's logit_bias added and its penalties subtracted, as OpenAI defines
    them: logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty, where count[j] is how
    many times this completion has generated token j. A new tensor; the rows without either are unchanged."""
    if batch.counts is not None:
        # Counts are whole, so min(c, 1) = [c > 0]. Built in place in one new tensor: a fresh (B, V) tensor costs
        # more than its arithmetic on a CPU (a second one made this 17 ms instead of 1, 16 rows of 49,152 tokens).
        counts = batch.counts
        logits = counts.clamp(max=1).mul_(batch.presence).addcmul_(counts, batch.frequency).neg_().add_(logits)
    else:
        logits = logits.float().clone()
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch):
    """logits: (B, V). Returns (tokens (B,), chosen logprobs (B,) or None, top logprobs (B, k) + ids or None).

    The logits are first biased and penalized (``adjust``). Greedy rows take the argmax; the others draw one
    uniform number and invert the CDF of the temperature-scaled distribution, truncated to the top-k / top-p set
    when asked for. The sort that truncation needs is done only when some row truncates. Logprobs are the
    model's own distribution, before bias, penalties and temperature (as vLLM's default).

    A row with a draft token d (speculative decoding, whose drafts are point masses) keeps it with probability
    p(d) under the row's final distribution p, drawn from a second uniform number, and otherwise draws from p
    with d removed: the token is then distributed as p exactly (Leviathan et al. 2023, with q = one-hot(d)), and
    it equals d if and only if the draft is accepted. A greedy row's p is a point mass: d is kept if it is the
    argmax."""
    raw = logits.float()
    logits = adjust(raw, batch) if batch.bias is not None or batch.counts is not None else raw
    greedy = logits.argmax(dim=-1)
    tokens = greedy
    if batch.any_sampled:
        scaled = logits / batch.temperature.clamp_min(1e-5)[:, None]
        u = uniform_from(batch.seed, batch.step).float()
        if batch.any_truncated:
            order = scaled.argsort(dim=-1, descending=True)
            probs = scaled.gather(-1, order).softmax(dim=-1)
            rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            keep_k = (batch.top_k[:, None] == 0) | (rank < batch.top_k[:, None])
            # A token stays if the mass before it is under top_p: the top token always stays.
            keep_p = (probs.cumsum(-1) - probs) < batch.top_p[:, None]
            probs = probs * (keep_k & keep_p)
        else:
            order = None
            probs = scaled.softmax(dim=-1)
        accept = None
        if batch.draft is not None:
            index = order if order is not None else torch.arange(probs.shape[-1], device=probs.device)[None, :]
            drafted = index == batch.draft[:, None]  # no column where the row has no draft (-1)
            p_draft = (probs * drafted).sum(-1) / probs.sum(-1)
            accept = uniform_from(batch.seed ^ _ACCEPT_STREAM, batch.step).float() < p_draft
            probs = probs.masked_fill(drafted, 0.0)
        cdf = probs.cumsum(-1)
        target = u[:, None] * cdf[:, -1:]
        index = torch.searchsorted(cdf, target).clamp_max(probs.shape[-1] - 1).squeeze(-1)
        drawn = order.gather(-1, index[:, None]).squeeze(-1) if order is not None else index
        if accept is not None:
            drawn = torch.where(accept, batch.draft, drawn)
        tokens = torch.where(batch.temperature > 0, drawn, greedy)
    if batch.logprobs < 0:
        return tokens, None, None
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top = logp.topk(batch.logprobs, dim=-1) if batch.logprobs > 0 else None
    return tokens, chosen, top
