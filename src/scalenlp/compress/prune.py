"""Pruning a trained model: zero weights (magnitude, wanda, 2:4) or remove whole KV groups and MLP neurons
(structured), in the linear layers inside the transformer blocks only.

    prune(model, method, sparsity=0.5, *, scope="layer", calibration=None) -> model
        calibration: token batches (B, T) (compress.calibration.calibration_batches); wanda needs them.
        Returns the same model for the masking methods, a new, smaller one for "structured".
    sparsity(model) -> dict[str, float]: the share of zeros in each prunable weight
    prunable(model) -> dict[str, nn.Linear]: the linear layers inside the blocks

docs/compression.md, "Pruning", gives each method's score and what it keeps.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from scalenlp.errors import UserError
from scalenlp.models.decoder import Transformer
from scalenlp.models.io import build

log = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "2:4", "structured")
SCOPES = ("layer", "global")


def prunable(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers inside the blocks, by their parameter-name prefix (``layers.0.attention.wq``)."""
    return {name: m for name, m in model.layers.named_modules(prefix="layers") if isinstance(m, nn.Linear)}


def sparsity(model: nn.Module) -> dict[str, float]:
    """The share of exact zeros in each prunable weight."""
    return {name: (m.weight == 0).float().mean().item() for name, m in prunable(model).items()}


def input_norms(model: nn.Module, calibration: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """||X_j||_2 over every calibration token, for each input channel j of each prunable layer."""
    layers = prunable(model)
    sums = {name: torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device) for name, m in layers.items()}

    def hook(name):
        def accumulate(module, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            sums[name] += x.double().pow(2).sum(dim=0)
        return accumulate

    handles = [m.register_forward_hook(hook(name)) for name, m in layers.items()]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in calibration:
                model(batch.to(device))
    finally:
        for h in handles:
            h.remove()
    silent = [name for name, s in sums.items() if not s.any()]
    if silent:  # e.g. a model whose projections were fused for inference: hooks on the parts never fire
        raise UserError(f"calibration never reached {silent[0]}; prune the model as loaded, before inference packing")
    return {name: s.sqrt().float() for name, s in sums.items()}


def check_request(model: nn.Module, method: str, amount: float, scope: str, calibration) -> None:
    """One clear line for every request this model cannot take."""
    if method not in METHODS:
        raise UserError(f"unknown pruning method {method!r}; choose one of {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise UserError(f"unknown pruning scope {scope!r}; choose layer or global")
    if not 0 < amount < 1:
        raise UserError(f"sparsity {amount} must be strictly between 0 and 1 (the share of weights removed)")
    if not hasattr(model, "layers"):
        raise UserError(f"cannot prune a {type(model).__name__}; pruning takes scalenlp decoders and encoders")
    # an Engine's packing swaps linears for kernels whose weights are buffers, not parameters (engine.packing)
    packed = next((name for name, m in model.named_modules() if getattr(m, "packed_for_inference", False)), None)
    if packed is not None:
        raise UserError(f"the model is packed for inference ({packed} was swapped when an Engine was built on it); "
                        f"prune the model as loaded, before building an Engine on it")
    quantized = [n for n, t in [*model.layers.named_parameters(), *model.layers.named_buffers()]
                 if not t.is_floating_point()]
    if quantized:
        raise UserError(f"the model is quantized ({quantized[0]} holds integers); prune the float checkpoint, "
                        f"then quantize it")
    if scope == "global" and method != "magnitude":
        raise UserError(f"scope='global' applies to magnitude pruning only; {method} compares weights within "
                        f"each {'output row' if method == 'wanda' else 'group of 4' if method == '2:4' else 'block'}")
    if method == "wanda" and not calibration:
        raise UserError("wanda needs calibration text to measure input activations; pass --calibration FILE "
                        "(e.g. wikitext2/valid.txt)")
    if method == "2:4":
        if amount != 0.5:
            raise UserError(f"2:4 sparsity always removes half the weights; pass --sparsity 0.5, not {amount}")
        odd = [f"{name} ({m.in_features})" for name, m in prunable(model).items() if m.in_features % 4]
        if odd:
            raise UserError(f"2:4 pruning needs input widths divisible by 4; {odd[0]} is not")
    if method == "structured" and not isinstance(model, Transformer):
        raise UserError("structured pruning takes decoders only: Hugging Face's BERT derives its head size from "
                        "hidden_size / num_attention_heads, so an encoder with fewer heads would not load there; "
                        "use magnitude, wanda or 2:4 for encoders")


def prune(model: nn.Module, method: str, sparsity: float = 0.5, *, scope: str = "layer",
          calibration: list[torch.Tensor] | None = None) -> nn.Module:
    """Prune ``model`` (see the module docstring); masking methods work in place and return the same model."""
    check_request(model, method, sparsity, scope, calibration)
    model.eval()
    norms = input_norms(model, calibration) if calibration else None
    if method == "structured":
        return prune_structured(model, sparsity, norms)
    layers = prunable(model)
    with torch.no_grad():
        scores = {name: m.weight.abs() * (norms[name] if norms else 1) for name, m in layers.items()}
        if method == "magnitude" and scope == "global":
            masks = global_masks(scores, sparsity)
        elif method == "magnitude":
            masks = {name: lowest_mask(s.flatten(), sparsity).view_as(s) for name, s in scores.items()}
        elif method == "wanda":
            masks = {name: lowest_mask(s, sparsity) for name, s in scores.items()}
        else:
            masks = {name: lowest_mask(s.view(s.shape[0], -1, 4), 0.5).view_as(s) for name, s in scores.items()}
        for name, m in layers.items():
            m.weight.mul_(masks[name])
    log.info("pruned %s: %s", method, describe(model))
    if method == "2:4":
        use_semi_structured(layers)
    return model


def lowest_mask(scores: torch.Tensor, share: float) -> torch.Tensor:
    """A keep-mask zeroing the ``share`` lowest scores along the last dim (an exact count, whatever the ties:
    weights dequantized from GGUF blocks tie a lot)."""
    k = int(scores.shape[-1] * share)
    mask = torch.ones_like(scores, dtype=torch.bool)
    return mask.scatter_(-1, scores.topk(k, dim=-1, largest=False).indices, False)


def global_masks(scores: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    """Keep-masks zeroing the ``share`` lowest scores over all layers together, an exact count: all below
    the threshold, then as many at it as the count still needs."""
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = int(flat.numel() * share)
    threshold = flat.kthvalue(k).values if k else flat.min() - 1
    ties_needed = k - int((flat < threshold).sum())
    masks = {}
    for name, s in scores.items():
        mask = s > threshold
        at = (s == threshold).flatten().nonzero().squeeze(1)
        keep_ties = at[min(ties_needed, at.numel()):]
        ties_needed -= min(ties_needed, at.numel())
        mask.view(-1)[keep_ties] = True
        masks[name] = mask
    return masks


def use_semi_structured(layers: dict[str, nn.Linear]) -> None:
    """Swap 2:4-pattern weights for semi-structured sparse tensors where the device has kernels for them."""
    weight = next(iter(layers.values())).weight
    if weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) < (8, 0):
        log.info("2:4 weights stay dense with zeros: %s has no 2:4 sparse kernels (CUDA 8.0+ only)", weight.device)
        return
    from torch.sparse import to_sparse_semi_structured  # CUDA only

    converted = 0
    for name, m in layers.items():
        try:
            m.weight = nn.Parameter(to_sparse_semi_structured(m.weight.detach()), requires_grad=False)
            converted += 1
        except (RuntimeError, ValueError) as e:  # shapes or dtypes its kernels do not take
            log.info("%s stays dense with zeros: %s", name, str(e).splitlines()[0])
    log.info("2:4 sparse kernels for %d of %d layers", converted, len(layers))


def describe(model: nn.Module) -> str:
    """One line: the share of zeros over all prunable weights, and its range per layer."""
    per_layer = sparsity(model)
    sizes = {name: m.weight.numel() for name, m in prunable(model).items()}
    total = sum(per_layer[n] * sizes[n] for n in sizes) / sum(sizes.values())
    return (f"{total:.1%} of the block weights are zero ({len(sizes)} layers, "
            f"{min(per_layer.values()):.1%} to {max(per_layer.values()):.1%} each)")


def unit_scores(weight: torch.Tensor, norm: torch.Tensor | None, group: int) -> torch.Tensor:
    """Importance of each output unit that owns ``group`` consecutive input channels of an output projection:
    sum over its channels of ||X_c|| · ||W[:, c]||."""
    contribution = weight.float().norm(dim=0) * (norm if norm is not None else 1)
    return contribution.view(-1, group).sum(dim=1)


def prune_structured(model: Transformer, share: float, norms: dict[str, torch.Tensor] | None) -> Transformer:
    """A new decoder without the lowest-scoring KV groups and MLP neurons of every block."""
    args = model.args
    groups, per_group = args.n_kv_heads, args.n_heads // args.n_kv_heads
    hd = args.head_dim
    keep_groups = max(1, round(groups * (1 - share)))
    keep_neurons = max(1, round(args.ffn_dim * (1 - share)))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for i, block in model.layers.items():
        p = f"layers.{i}."
        attn, ffn = block.attention, block.feed_forward
        score = unit_scores(attn.wo.weight, norms[p + "attention.wo"] if norms else None, per_group * hd)
        kept = score.topk(keep_groups).indices.sort().values
        kv_rows = (kept[:, None] * hd + torch.arange(hd, device=kept.device)).flatten()
        q_rows = (kept[:, None] * per_group * hd + torch.arange(per_group * hd, device=kept.device)).flatten()
        neurons = unit_scores(ffn.w2.weight, norms[p + "feed_forward.w2"] if norms else None, 1)
        kept_neurons = neurons.topk(keep_neurons).indices.sort().values
        for name, rows in (("attention.wq", q_rows), ("attention.wk", kv_rows), ("attention.wv", kv_rows),
                           ("feed_forward.w1", kept_neurons), ("feed_forward.w3", kept_neurons)):
            for suffix in (".weight", ".bias"):
                if p + name + suffix in state:
                    state[p + name + suffix] = state[p + name + suffix][rows]
        state[p + "attention.wo.weight"] = state[p + "attention.wo.weight"][:, q_rows]
        state[p + "feed_forward.w2.weight"] = state[p + "feed_forward.w2.weight"][:, kept_neurons]
    n_heads = keep_groups * per_group
    new_args = dataclasses.replace(args, n_heads=n_heads, n_kv_heads=keep_groups, ffn_dim=keep_neurons,
                                   fixed_head_dim=hd if n_heads * hd != args.dim else 0)
    ref = next(model.parameters())
    small = build(new_args, {k: v.contiguous() for k, v in state.items()}, ref.device, ref.dtype)
    log.info("structured pruning: %d of %d KV groups (%d of %d heads) and %d of %d MLP neurons kept per block; "
             "parameters %s -> %s", keep_groups, groups, n_heads, args.n_heads, keep_neurons, args.ffn_dim,
             f"{model.num_params():,}", f"{small.num_params():,}")
    return small

