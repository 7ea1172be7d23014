"""Next-token loss straight from the last hidden states, a chunk of tokens at a time.

The output projection's logits are the largest activation of a small model's step: (tokens, vocab)
in fp32, kept for backward along with their gradient (at torchtitan's debug shape, 16k tokens x 2k
vocabulary, 128 MiB each). Here the projection, the log-softmax and their gradients run one chunk
of tokens at a time inside the forward pass, and only the gradients of the hidden states and of the
weight (each the size of its input) are kept for backward, so no more than one chunk's logits is
ever alive. The arithmetic is that of the projection's forward and backward; nothing is recomputed.
The gradients are those of the summed loss, scaled in backward by the incoming gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from scalenlp.models.frozen import frozen_product, held_for

# A chunk's fp32 logits: 2**23 elements, 32 MiB, whatever the vocabulary.
CHUNK_LOGITS = 2**23


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                packed: tuple[torch.Tensor, torch.Tensor] | None):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        chunk = max(1, CHUNK_LOGITS // weight.shape[0])
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk].to(weight.dtype), targets[start:start + chunk]
            # Under autocast the product runs in its dtype, as nn.Linear's would.
            logits = (h @ weight.t() if packed is None else frozen_product(h, packed[0])).float()
            counted = t != ignore_index
            safe = torch.where(counted, t, 0).unsqueeze(1)
            picked = logits.gather(1, safe).squeeze(1)
            # The log-sum-exp and the softmax from one set of passes over the logits, in place: torch.logsumexp
            # would allocate a (rows, vocab) temporary and the softmax take two passes more.
            top = logits.amax(dim=1, keepdim=True)
            sums = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
            lse = (top + sums.log()).squeeze(1)
            total += torch.where(counted, lse - picked, 0.0).sum()
            if not (want_hidden or want_weight):
                continue
            # d(summed loss)/d(logits) = softmax - one_hot(target), zero on ignored rows: their softmax scaled by
            # 0 and no one-hot subtracted, in the same passes (no branch on the data, which torch.compile breaks on).
            grad = logits.mul_(torch.where(counted.unsqueeze(1), sums.reciprocal(), 0.0))
            grad.scatter_add_(1, safe, counted.unsqueeze(1).to(grad.dtype).neg_())
            grad = grad.to(weight.dtype)
            if want_hidden:
                grad_hidden[start:start + chunk] = grad @ weight if packed is None else frozen_product(grad, packed[1])
            if want_weight:
                grad_weight += grad.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype),
                None if grad_weight is None else (grad_weight * grad_output).to(ctx.weight_dtype), None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100,
                         packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Summed cross-entropy (fp32) of ``hidden @ weight.T`` against ``targets``, without ever holding all
    the logits. hidden: (..., dim); weight: (vocab, dim); targets: hidden's leading shape; targets equal
    to ``ignore_index`` (F.cross_entropy's default) count for nothing. ``packed``: a frozen ``weight``'s
    operands (models/frozen.py), for the logits' and the hidden states' products where they are in the products'
    dtype (a copy cast for autocast is not read outside it)."""
    return _LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), ignore_index,
                                     held_for(packed, hidden))


@functools.cache
def compiled_linear_cross_entropy() -> Callable[..., torch.Tensor]:
    """``linear_cross_entropy`` through torch.compile, for training.compile (as torchtitan compiles its
    loss): inductor fuses each chunk's log-softmax and the gradient built from it into a few passes
    over the chunk's logits, where eager makes one per operation. One wrapper per process; the
    compiling itself happens at its first call."""
    return torch.compile(linear_cross_entropy)
