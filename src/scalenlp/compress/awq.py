"""Activation-aware int4 rounding (AWQ: Lin et al. 2023), for ``scalenlp quantize --calibration``.

Each set of linears sharing an input (q/k/v, o, gate/up, down) gets per-input-channel scales s = mean|x|^alpha,
alpha from ``ALPHAS`` chosen for the least output error tr(dW H dW^T) (H = X^T X from one float pass), folded
exactly into what computes that input (the norms' weights, v's rows, up's rows); each group's clipping is then
chosen by the same output error. The result is an ordinary float model whose int4 rounding loses less, so the
export keeps ``compress.quantized``'s Int4Linear layout. Llama-shaped decoders only. docs/compression.md.

    grams = awq(model, calibration_batches("valid.txt", pre.tokenizer, 32, 512), Quantization("int4", 64))
    quantized = build_quantized(pre.args, model.state_dict(), spec, True, grams=grams)
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from scalenlp.compress.quantized import Quantization, check_shapes, dequantize_int4, int4_grouped, linears_of
from scalenlp.errors import UserError
from scalenlp.models.decoder import Transformer

log = logging.getLogger(__name__)

ALPHAS = tuple(i / 20 for i in range(21))  # alpha 0 is s = 1, plain rounding: the search can only gain


def awq(model: Transformer, calibration: list[torch.Tensor], spec: Quantization) -> dict[str, torch.Tensor]:
    """Fold activation-aware scales into ``model``'s blocks in place (its float outputs stay the same) and
    return each block linear's calibration Gram matrix X^T X, by name, in the scaled model's inputs, for
    ``quantize_state``'s ``grams``."""
    check_model(model, spec)
    stats = input_statistics(model, calibration)
    grams = {}
    for index, block in model.layers.items():
        attention = block.attention
        prefix = f"layers.{index}."
        tie, per_value_row = shared_per_kv_head(len(attention.wq.weight) // attention.head_dim,
                                                attention.local_kv_heads())
        sets = [(("attention.wq", "attention.wk", "attention.wv"), fold_into_norm(block.attention_norm), None),
                (("attention.wo",), fold_into_rows(attention.wv, per_value_row), tie),
                (("feed_forward.w1", "feed_forward.w3"), fold_into_norm(block.ffn_norm), None),
                (("feed_forward.w2",), fold_into_rows(block.feed_forward.w3), None)]
        for names, fold, shared in sets:
            linears = [block.get_submodule(n) for n in names]
            gram, mean_abs = stats[prefix + names[0]]
            if shared is not None:
                mean_abs = shared(mean_abs)
            alpha, scales = best_scales([m.weight.detach().float() for m in linears], gram, mean_abs, spec.group_size)
            with torch.no_grad():
                fold(scales)
                for linear in linears:
                    linear.weight.mul_(scales.to(linear.weight.dtype))
            scaled = gram / torch.outer(scales, scales)
            grams.update({prefix + n: scaled for n in names})
            log.info("AWQ: block %s %s: alpha %.2f", index, "/".join(n.rpartition(".")[2] for n in names), alpha)
    return grams


def check_model(model: nn.Module, spec: Quantization) -> None:
    if spec.method != "int4":
        raise UserError(f"calibration rounds int4 only; --method {spec.method} rounds without it, drop --calibration")
    if not isinstance(model, Transformer) or model.args.activation != "swiglu":
        raise UserError("calibrated int4 takes decoders with a SwiGLU MLP (Llama's shape); quantize this model "
                        "without --calibration")
    check_shapes(spec, linears_of(model))


def input_statistics(model: Transformer,
                     calibration: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(X^T X, mean |x| per channel) of the inputs X (every calibration token) of the first linear of each set
    in ``awq`` (q, o, gate, down), by name, in float64 sums."""
    firsts = {name: m for name, m in linears_of(model.layers).items()
              if name.rpartition(".")[2] in ("wq", "wo", "w1", "w2")}
    sums, count = {}, [0]

    def hook(name):
        def accumulate(module, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            gram, total = (x.T @ x).double(), x.abs().sum(dim=0).double()
            old = sums.get(name)
            sums[name] = (gram, total) if old is None else (old[0] + gram, old[1] + total)
        return accumulate

    def stop(module, inputs):
        raise BlocksDone

    handles = [m.register_forward_hook(hook("layers." + name)) for name, m in firsts.items()]
    # The output projection (a fifth of SmolLM2's weights, 49k logits a token) has nothing to tell the blocks.
    handles.append(model.norm.register_forward_pre_hook(stop))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in calibration:
                try:
                    model(batch.to(device))
                except BlocksDone:
                    pass
                count[0] += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return {name: (gram.float(), (total / count[0]).float()) for name, (gram, total) in sums.items()}


class BlocksDone(Exception):
    """Ends a calibration pass after the last block."""


def best_scales(weights: list[torch.Tensor], gram: torch.Tensor, mean_abs: torch.Tensor,
                group_size: int) -> tuple[float, torch.Tensor]:
    """(alpha, s) of ``ALPHAS`` whose int4 rounding of the ``weights`` times s, divided back by s,
    leaves the least summed output error tr(dW H dW^T). Each candidate rounds as the final weights will
    (``int4_grouped``'s grid search, by output error): on SmolLM2 (int4 group 64, 4,096 WikiText-2 test tokens)
    that chose scales worth +4.0% perplexity over fp32, where the grid search by weight error gave +4.8% and
    the paper's plain min..max rounding +6.4% (searching about 2 and 7 times faster)."""
    best = None
    # A channel the calibration never moves would get s near 0, and its fold a near-infinite factor.
    base = mean_abs.clamp(min=mean_abs.max().item() * 1e-4)
    for alpha in ALPHAS:
        scales = base ** alpha
        scales = scales / (scales.max() * scales.min()).sqrt()  # centred on 1: bf16 grids keep their range
        scaled_gram = gram / torch.outer(scales, scales)  # the scaled weights' inputs are x / s
        error = 0.0
        for w in weights:
            d = dequantize_int4(*int4_grouped(w * scales, group_size, scaled_gram)).float() / scales - w
            error += ((d @ gram) * d).sum().item()
        if best is None or error < best[0]:
            best = (error, alpha, scales)
    return best[1], best[2]


def fold_into_norm(norm: nn.Module):
    """Divides a norm's output by s (its weight, and bias if any)."""
    def fold(scales: torch.Tensor) -> None:
        for p in (norm.weight, getattr(norm, "bias", None)):
            if p is not None:
                p.div_(scales.to(p.dtype))
    return fold


def fold_into_rows(linear: nn.Linear, per_row=lambda scales: scales):
    """Divides a linear's output by ``per_row(s)`` (its weight's rows, and bias if any)."""
    def fold(scales: torch.Tensor) -> None:
        rows = per_row(scales)
        linear.weight.div_(rows[:, None].to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.div_(rows.to(linear.bias.dtype))
    return fold


def shared_per_kv_head(n_heads: int, n_kv_heads: int):
    """(tie, per_value_row): o's input statistic (n_heads * head_dim,) averaged over the query heads that read
    each KV head and repeated back to all of them (GQA's order: query head h reads KV head h // (n_heads /
    n_kv_heads)); and such a tied vector's values once per KV head, for v's rows."""
    def tie(values: torch.Tensor) -> torch.Tensor:
        per_head = values.view(n_kv_heads, n_heads // n_kv_heads, -1)
        return per_head.mean(dim=1, keepdim=True).expand_as(per_head).reshape(-1)

    def per_value_row(scales: torch.Tensor) -> torch.Tensor:
        return scales.view(n_kv_heads, n_heads // n_kv_heads, -1)[:, 0].reshape(-1)
    return tie, per_value_row
