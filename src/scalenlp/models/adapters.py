"""Low-rank adapters: LoRA (Hu et al., 2021), its rank-stabilised scaling (rsLoRA) and DoRA (Liu et al., 2024).

A LoRA weight set for one linear layer is ``A`` (rank, in), ``B`` (out, rank) and a ``scaling``: the layer computes
``x W^T + scaling * (x A^T) B^T``. DoRA adds a magnitude per output row, ``m``: the adapted weight
``W' = W + scaling * B A`` is used with its rows rescaled to norms ``m`` (the norm taken without gradient, as the
paper's section 4.3 and PEFT do). ``B`` starts at zero, so a fresh adapter is the identity.

``LoRALinear`` is an ``nn.Linear`` (same ``weight`` and ``bias``, so checkpoints and tensor-parallel plans keep
their names) with ``lora_A``, ``lora_B`` and, for DoRA, ``lora_magnitude`` beside them. The base weight may be an
NF4 tensor (QLoRA, compress/nf4.py); it is then dequantized per use. A plain float32 base on the CPU may instead
be held in the layouts its two products read fastest (``pack_frozen``, models/frozen.py: oneDNN-packed copies of
W and W^T in place of ``weight``, or a row-major copy of W^T beside it). Plain LoRA (no DoRA, no dropout in
training) runs as one autograd node (``_LoRAProducts``), with the layers that read the same input
(``lora_products``: q/k/v, gate/up). ``add_adapters`` swaps the linears whose
names match a pattern; ``merge_adapters`` folds them back into plain linears. Adapters move in and out as
``{module name: LoraWeights}``: ``adapter_weights`` reads them off a model, ``load_adapter_weights`` puts them on.
Reading and writing folders (ours and PEFT's) is in models/adapter_io.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from scalenlp.errors import ConfigError, UserError
from scalenlp.models.frozen import (
    FrozenLinear,
    frozen_dense,
    frozen_operands,
    frozen_product,
    held_for,
    refusal,
)

ALL_LINEAR = "all-linear"
# The linears an adapter may wrap are those of the transformer blocks (``layers.<i>.``): as PEFT's "all-linear",
# the output projection (tied to the embedding in many models) and task heads are left out.
BLOCKS = "layers."


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The hyperparameters one adapter shares over its layers."""

    rank: int
    alpha: float
    dropout: float = 0.0
    use_rslora: bool = False
    dora: bool = False

    @property
    def scaling(self) -> float:
        # rsLoRA divides by sqrt(rank): with alpha / rank the update shrinks as the rank grows (Kalajdzievski, 2023).
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclasses.dataclass
class LoraWeights:
    """One linear layer's adapter: ``A`` (rank, in), ``B`` (out, rank), ``scaling``; ``magnitude`` (out,) for DoRA."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    magnitude: torch.Tensor | None = None

    def delta(self) -> torch.Tensor:
        """What LoRA adds to the weight, (out, in)."""
        return (self.B.float() @ self.A.float()) * self.scaling

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (out, in) with this adapter folded in, in float32."""
        adapted = weight.float() + self.delta()
        if self.magnitude is None:
            return adapted
        return adapted * (self.magnitude.float() / adapted.norm(dim=1)).unsqueeze(1)


def is_nf4(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is an NF4 base (QLoRA's, compress/nf4.py), without importing torchao."""
    return hasattr(weight, "get_original_weight")


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: an NF4 base dequantized (to its compute dtype), any other unchanged."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def base_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` of a frozen base linear."""
    if weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    if dequantized_to_float32(x, weight):
        return _Float32Dequantized.apply(x, weight, bias)
    # An NF4 base computes in its own dtype (bf16), which autograd keeps it in (no dequantized copy).
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def dequantizes_to_float32(device: torch.device) -> bool:
    """Whether an NF4 base's products run in float32, dequantized per use, rather than in bf16 (QLoRA's compute
    dtype, a GPU's): on the CPU. SmolLM2's QLoRA step (rank 16, 128 rows, one thread) ran 10x as fast so on an AMD
    EPYC without bf16 instructions, whose bf16 products oneDNN converts in software (72 against 7 tokens/s), and
    1.33x as fast on a Xeon with AMX (87.8 against 66.1 tokens/s)."""
    return device.type == "cpu"


def dequantized_to_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``weight`` is an NF4 base whose products with ``x`` (float32, outside autocast) run dequantized to
    float32 here (``dequantizes_to_float32``)."""
    return (is_nf4(weight) and x.dtype == torch.float32 and dequantizes_to_float32(x.device)
            and not torch.is_autocast_enabled(x.device.type))


class _Float32Dequantized(torch.autograd.Function):
    """``x W^T (+ b)`` of a frozen NF4 weight dequantized to float32 per use, forward and backward, keeping only
    the NF4 tensor: QLoRA's products on the CPU (``dequantizes_to_float32``). SmolLM2's QLoRA step (rank 16, 128
    rows, one thread, an AMD EPYC without bf16 instructions) took 18.4-19.1 s with bf16 products, 2.5-2.9 s so
    with torchao's dequantization, 1.8-2.0 s with ``float32_nf4``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.weight = weight  # a constant of the model: nothing of this step's to keep
        return F.linear(x, float32_nf4(weight), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad @ float32_nf4(ctx.weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def float32_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 weight dequantized, in float32: ``weight.get_original_weight().float()`` exactly (the same bf16
    products of code value and block scale), in 0.4x its time on the CPU. torchao looks each 4-bit code up on its
    own, as int64 indices; here each byte's two codes come from one 256-row table of value pairs."""
    pairs = torch.stack([weight.nf4.repeat_interleave(16), weight.nf4.repeat(16)], dim=1)  # byte -> (high, low)
    values = F.embedding(weight.quantized_data.int(), pairs)  # (weights / 2, 2), bf16
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)
    return (values.view(scales.numel(), -1) * scales.unsqueeze(1)).float().view(weight.shape)


def unpackable(weight: torch.Tensor) -> str | None:
    """Why a frozen base weight cannot be held in another layout (``pack_frozen``), or None if it can."""
    if is_nf4(weight):
        return "an NF4 base (QLoRA) is dequantized per use"
    if type(weight) is not nn.Parameter:  # a DTensor
        return "the base is sharded (tensor parallelism or ZeRO/FSDP), its products run on shards"
    if weight.device.type != "cpu":
        return f"the layouts are the CPU's, the base is on {weight.device.type}"
    if weight.dtype != torch.float32:
        return f"the base is {weight.dtype}, the layouts are for float32"
    return None


class _LoRAProducts(torch.autograd.Function):
    """``x W_i^T (+ b_i) + scaling (x A_i^T) B_i^T`` for adapted linears i that all read ``x`` (one layer, or q/k/v
    and gate/up: ``lora_products``), each frozen W held as ``frozen_operands`` (or W^T dequantized and the NF4
    weight, dequantized again in backward), as one autograd node.

    Autograd would make six nodes of each layer (two products, the scaling, the sum, and each product's backward),
    each pass over the (rows, out) output allocating another. Here the scaling is applied to the (rows, rank)
    product and the low-rank term is added in the base product's output, by the BLAS (``addmm_``); in backward,
    the low-rank term's input gradient is added the same way into the base's. SmolLM2's LoRA step (rank 16 on
    every block linear, 128 rows, one thread, an AVX-512 Xeon) ran 1.07-1.12x as fast so. Layers that read one
    ``x`` share its low-rank products (their A's stacked: one (rows, 3 x rank) product for q/k/v where three
    narrow ones ran at about a third of the BLAS's speed), and their input gradients are summed by the BLAS as
    they are computed, where autograd would add them up after: 1.00-1.05x more, within that host's noise.

    ``tensors`` are the n layers' forward operands, backward operands, biases, A's and B's, in that order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scaling: float, n: int, *tensors: torch.Tensor | None):
        forwards, backwards, biases, As, Bs = (tensors[i * n:(i + 1) * n] for i in range(5))
        dtype = forwards[0].dtype  # the products': the base's, or autocast's that it was cast to
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        stacked_A = (As[0] if n == 1 else torch.cat(As)).to(dtype)
        Bs = [B.to(dtype) for B in Bs]
        ranks = [A.shape[0] for A in As]
        down = (rows @ stacked_A.t()).mul_(scaling)  # (rows, ranks), scaled
        outs = []
        for forward, bias, B, part in zip(forwards, biases, Bs, down.split(ranks, dim=1)):
            out = frozen_product(rows, forward, None if bias is None else bias.to(dtype)).addmm_(part, B.t())
            outs.append(out.view(*x.shape[:-1], out.shape[-1]))
        ctx.save_for_backward(rows, down, stacked_A, *Bs)
        ctx.backwards, ctx.scaling, ctx.shape, ctx.ranks = backwards, scaling, x.shape, ranks  # the bases: constants
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # Gradients come out in the products' dtype; autograd casts each to its input's (float32 adapter masters).
        rows, down, stacked_A, *Bs = ctx.saved_tensors
        n = len(Bs)
        grads = [grad.reshape(-1, grad.shape[-1]).to(rows.dtype).contiguous() for grad in grads]
        # The gradient of the unscaled (rows, ranks) product
        grad_down = (grads[0] @ Bs[0] if n == 1 else torch.cat([g @ B for g, B in zip(grads, Bs)], dim=1))
        grad_down.mul_(ctx.scaling)
        grad_x = None
        if ctx.needs_input_grad[0]:
            for grad, backward in zip(grads, ctx.backwards):
                backward = float32_nf4(backward) if is_nf4(backward) else backward
                grad_x = frozen_product(grad, backward, into=grad_x)
            grad_x = grad_x.addmm_(grad_down, stacked_A).view(ctx.shape)
        grad_As = [None] * n
        if any(ctx.needs_input_grad[3 + 3 * n:3 + 4 * n]):
            grad_As = (grad_down.t() @ rows).split(ctx.ranks)
        parts, need_B = down.split(ctx.ranks, dim=1), ctx.needs_input_grad[3 + 4 * n:]
        grad_Bs = [g.t() @ part if need else None for g, part, need in zip(grads, parts, need_B)]
        return grad_x, None, None, *[None] * (3 * n), *grad_As, *grad_Bs


def lora_products(x: torch.Tensor, layers: tuple[LoRALinear, ...]) -> tuple[torch.Tensor, ...] | None:
    """The outputs of adapted ``layers`` that all read ``x``, as one ``_LoRAProducts`` node; None where one of
    them takes the general path (``LoRALinear._lora_operands``) or their scalings differ: the caller runs them
    one by one."""
    operands = [layer._lora_operands(x) for layer in layers]
    if any(o is None for o in operands) or len({layer.scaling for layer in layers}) > 1:
        return None
    return _LoRAProducts.apply(x, layers[0].scaling, len(layers), *(o[0] for o in operands),
                               *(o[1] for o in operands), *(layer.bias for layer in layers),
                               *(layer.lora_A for layer in layers), *(layer.lora_B for layer in layers))


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (and a DoRA magnitude when ``spec.dora``)."""

    def __init__(self, base: nn.Linear, spec: LoraSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        # Adapter weights are float32 masters whatever the base's dtype (an NF4 base computes in bf16).
        self.lora_A = nn.Parameter(torch.empty(spec.rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init (nn.Linear's)
        self.scaling = spec.scaling
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # frozen_operands: pack_base
        # A probability, not an nn.Dropout: a tensor-parallel style visits every submodule as a linear.
        self.lora_dropout = spec.dropout
        self.lora_magnitude = None
        if spec.dora:
            with torch.no_grad():
                self.lora_magnitude = nn.Parameter(self._adapted_norm())

    def _adapted_norm(self) -> torch.Tensor:
        """Row norms of W + scaling * B A (DoRA's denominator; its magnitude at init)."""
        return (self.dense_weight() + self.scaling * (self.lora_B @ self.lora_A)).norm(dim=1)

    def dense_weight(self) -> torch.Tensor:
        """The base weight, dequantized, in float32 (a tensor-parallel NF4 shard overrides this: parallel/)."""
        if "weight" not in self._parameters:  # oneDNN's float32 copies replaced it
            return frozen_dense(self.packed)
        return dense(self.weight).float()

    def base(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """The frozen base's product (a tensor-parallel NF4 shard overrides this: parallel/nf4_shards.py)."""
        bias = self.bias if with_bias else None
        if self.packed is not None and (held_for(self.packed, x) is not None or "weight" not in self._parameters):
            return FrozenLinear.apply(x, *self.packed, bias)
        return base_product(x, self.weight, bias)

    def _lora_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The frozen base's operands (``frozen_operands``) where the layer runs in a ``_LoRAProducts`` node: plain
        LoRA (no DoRA, no dropout in training) held in a layout of the products' dtype, or on a plain tensor base of
        ``x``'s dtype, or any under autocast (cast to its dtype), or an NF4 base dequantized to float32
        (``dequantizes_to_float32``); None for the general path (a sharded base, whose products other code computes;
        an NF4 base in bf16; oneDNN's float32 copies, the weight dropped, under autocast). torch.compile traces the
        node: SmolLM2's compiled step ran as fast through it as through the op-by-op layer (0.99x)."""
        if self.lora_magnitude is not None or (self.lora_dropout and self.training) or type(x) is not torch.Tensor:
            return None
        if (held := held_for(self.packed, x)) is not None or "weight" not in self._parameters:
            return held
        autocast = torch.is_autocast_enabled(x.device.type)
        weight = self.weight
        if dequantized_to_float32(x, weight):
            return float32_nf4(weight).t(), weight  # QLoRA on the CPU: backward dequantizes the NF4 weight again
        if type(weight) is not nn.Parameter:
            return None
        if autocast:  # the products in autocast's dtype, as F.linear's would be
            weight = weight.to(torch.get_autocast_dtype(x.device.type))
        elif weight.dtype != x.dtype:
            return None
        return weight.t(), weight

    def pack_base(self, rows: int | None, layout: str, dtype: torch.dtype | None = None) -> None:
        """Hold the frozen weight's products in ``layout`` (models/frozen.py), for products of about ``rows``
        rows in ``dtype`` (autocast's; default the weight's); oneDNN's packed copies of the weight in its own dtype
        replace it, and it is dropped: they are all a training step needs, and give it back exactly."""
        self.packed = frozen_operands(self.weight, layout, rows, dtype)
        if layout == "onednn" and self.packed[1].dtype == self.weight.dtype:
            del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (outs := lora_products(x, (self,))) is not None:
            return outs[0]
        out = self.base(x)
        dropped = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        lora = F.linear(F.linear(dropped, self.lora_A), self.lora_B) * self.scaling
        if self.lora_magnitude is None:
            return out + lora
        # DoRA, in PEFT's order of operations: out + (m / |W'| - 1) * x W^T + m / |W'| * lora, |W'| held constant.
        scale = self.lora_magnitude / self._adapted_norm().detach()
        plain = self.base(dropped, with_bias=False)
        return out + (scale - 1) * plain + scale * lora

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"
                + (", dora" if self.lora_magnitude is not None else ""))


def adaptable(model: nn.Module) -> list[str]:
    """Names of the linears an adapter may wrap: every ``nn.Linear`` of the transformer blocks."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith(BLOCKS)]


def match_targets(model: nn.Module, pattern: str) -> list[str]:
    """The adaptable linears ``pattern`` names: "all-linear", or a regular expression matched against a module
    name or a dotted tail of it (``attention.w[qkvo]`` matches ``layers.3.attention.wq``)."""
    names = adaptable(model)
    if pattern.strip() == ALL_LINEAR:
        return names
    try:
        regex = re.compile(rf"(?:.*\.)?(?:{pattern})")
    except re.error as e:
        raise ConfigError(f"lora.targets={pattern!r} is not a valid regular expression ({e}); write e.g. "
                          f"\"attention.w[qkvo]|feed_forward.w[123]\" or \"all-linear\"") from None
    found = [n for n in names if regex.fullmatch(n)]
    if not found:
        sample = sorted({n.split(".", 2)[-1] for n in names})[:8]
        raise ConfigError(f"lora.targets={pattern!r} matches no linear layer; they are named like "
                          f"layers.0.{', layers.0.'.join(sample)} (a pattern may name the tail, e.g. "
                          f"\"attention.wq|feed_forward.w2\", or use \"all-linear\")")
    return found


def check_rank(model: nn.Module, names: Iterable[str], rank: int) -> None:
    """A rank above a layer's smaller side adds nothing a full update would not, and is surely a mistake."""
    for name in names:
        layer = model.get_submodule(name)
        if rank > min(layer.in_features, layer.out_features):
            raise ConfigError(f"lora.rank={rank} is larger than layer {name} ({layer.in_features} -> "
                              f"{layer.out_features}); choose a rank of at most "
                              f"{min(layer.in_features, layer.out_features)}")


def add_adapters(model: nn.Module, spec: LoraSpec, names: Iterable[str]) -> None:
    """Swap each named linear for a ``LoRALinear`` around the same weights, in place. Initialises the adapters
    from the global RNG, in module order, so every rank that seeds alike gets the same ones."""
    names = list(names)
    check_rank(model, names, spec.rank)
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(model.get_submodule(name), spec))


def freeze_all_but_adapters(model: nn.Module, also_train: Iterable[str] = ()) -> None:
    """Only adapter weights train, and the parameters named in ``also_train`` (a task's new head: PEFT's
    ``modules_to_save``)."""
    keep = set(also_train)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name in keep)


def packable(model: nn.Module) -> tuple[list[LoRALinear], list[nn.Linear], list[str]]:
    """The adapted layers whose frozen base ``pack_frozen`` would pack, the frozen output projection it would pack
    beside them (a list of none or one), and why the other adapted layers cannot be (each reason once)."""
    layers, reasons = [], []
    for layer in model.modules():
        if not isinstance(layer, LoRALinear) or layer.packed is not None:
            continue
        reason = unpackable(layer.weight)
        if reason is None:
            layers.append(layer)
        elif reason not in reasons:
            reasons.append(reason)
    # Only a decoder whose loss is the chunked one (no logit soft-cap) reads output_packed; and only beside a packed
    # base: a QLoRA run holds its base small to save memory, which more copies of the head would spend.
    head = getattr(model, "output", None)
    heads = [head] if (layers and getattr(model, "output_packed", False) is None and head is not None
                       and not model.args.logit_softcap and not head.weight.requires_grad
                       and unpackable(head.weight) is None) else []
    return layers, heads, reasons


def frozen_shapes(model: nn.Module) -> Counter[tuple[int, int]]:
    """How many linears of each (in, out) shape ``pack_frozen`` would pack: what lora.pack_frozen=auto times."""
    layers, heads, _ = packable(model)
    return Counter((m.in_features, m.out_features) for m in [*layers, *heads])


def pack_frozen(model: nn.Module, rows: int | None, layout: str | dict[tuple[int, int], str],
                dtype: torch.dtype = torch.float32) -> tuple[Counter[str], list[str]]:
    """Hold every adapted layer's frozen base in ``layout`` (models/frozen.py; or per (in, out) shape, a shape not
    named staying plain) for products in ``dtype`` (autocast's, or float32) where it can be
    (``LoRALinear.pack_base``), and, if any can, a decoder's frozen output projection for its chunked loss, beside
    its weight (a tied embedding reads that weight); returns how many linears each layout holds and why the others
    were not (each reason once)."""
    layers, heads, reasons = packable(model)
    held: Counter[str] = Counter()
    for linear in [*layers, *heads]:
        name = layout if isinstance(layout, str) else layout.get((linear.in_features, linear.out_features))
        if name is not None and (reason := refusal(name, dtype, compile=False)) is not None:
            if reason not in reasons:
                reasons.append(reason)
        elif name is not None:
            if linear in heads:
                model.output_packed = frozen_operands(linear.weight, name, rows, dtype)
            else:
                linear.pack_base(rows, name, dtype)
            held[name] += 1
    return held, reasons


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_weights(model: nn.Module) -> dict[str, LoraWeights]:
    """{module name: its adapter} of every ``LoRALinear`` in ``model`` (an unsharded model)."""
    return {name: LoraWeights(m.lora_A.detach(), m.lora_B.detach(), m.scaling,
                              None if m.lora_magnitude is None else m.lora_magnitude.detach())
            for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def load_adapter_weights(model: nn.Module, weights: dict[str, LoraWeights], where: str) -> None:
    """Copy ``weights`` into the model's ``LoRALinear`` layers of the same names; an adapter of other shapes or
    names (made for another base model) is one error line."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, w in weights.items():
        layer = layers.get(name)
        if layer is None:
            raise UserError(f"{where} adapts {name}, which this model does not have (or which lora.targets does "
                            f"not select); it was made for another base model")
        for param, value in (("lora_A", w.A), ("lora_B", w.B), ("lora_magnitude", w.magnitude)):
            target = getattr(layer, param)
            if (value is None) != (target is None):
                raise UserError(f"{where}: {name} {'has no' if value is None else 'has a'} DoRA magnitude but "
                                f"this run {'uses' if target is not None else 'does not use'} DoRA; set lora.dora "
                                f"to match the adapter")
            if value is None:
                continue
            if value.shape != target.shape:
                raise UserError(f"{where}: {name}.{param} has shape {tuple(value.shape)}, this model's is "
                                f"{tuple(target.shape)}; the adapter was made for another base model or rank")
            target.copy_(value)
        layer.scaling = w.scaling


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, leaving plain ``nn.Linear`` layers (an NF4 base comes back
    dequantized, in float32): the model computes what it computed with the adapters, without their cost."""
    for name, w in adapter_weights(model).items():
        layer = model.get_submodule(name)
        merged = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        quantized = is_nf4(layer.weight)  # an NF4 base comes back in float32
        merged.weight = nn.Parameter(w.merged(dense(layer.weight)).to(torch.float32 if quantized
                                                                      else layer.weight.dtype))
        if layer.bias is not None:
            merged.bias = nn.Parameter(layer.bias.detach().clone())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, merged)
    for param in model.parameters():
        param.requires_grad_(True)
    return model
