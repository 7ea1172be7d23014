"""Many LoRA adapters served on one base model, in one continuous batch (S-LoRA and Punica's idea).

The base model's block linears (q/k/v/o, gate/up/down: every linear an adapter may target) are swapped once for
``MultiLoRALinear``: the base product runs once for the whole batch, and each row adds the low-rank product of its
own adapter, ``x A[i]^T B[i]^T * scaling[i]``. Every adapter's weights sit stacked in a fixed number of slots
(``--max-loras``, each padded to ``--max-lora-rank``: zero rows of A and columns of B add nothing), so loading or
unloading one writes a slot and never copies the model. The engine says which adapter each row of a forward uses
(``LoraSlots.select``, 0 for the base model); the layers share that choice.

Three ways to compute the per-row products, chosen per forward:
  - the kernel (models/lora_decode.cpp), for a decode step (one token per row) on a CPU in float32 or bfloat16:
    one call per layer adds each row's own adapter's product, reading only the slots the rows use and skipping
    rows on the base model. On one CPU thread the two ways below are tiny matmuls whose cost is the library's
    per-call overhead: at SmolLM2-135M, 16 rows and 4 adapters they took about 26 ms of a 90 ms decode step;
  - dense, for a decode step elsewhere (a GPU) with at least as many rows as the highest slot used: ``x`` goes
    through the stacked A of slots ``0..hi`` as one matmul, a mask keeps each row's own slot's columns (a base
    row keeps none), and one matmul through the stacked B follows. Each adapter's weights are read once per
    layer, where gathering would copy them once per row: at one token per row, reading weights is the cost;
  - gathered, otherwise: each row's A and B are gathered by its index and multiplied batch-wise (``bmm``). A
    prefill's many tokens per row make the products' arithmetic the cost, and dense would multiply every token by
    every slot's A; with fewer rows than slots (a lone request on a high slot) unused slots are not read.
All give the same numbers as the adapter merged into the base weight (up to float rounding).

The engine changes a slot only when no request waiting or running uses it: an unloaded adapter's name is gone at
once (new requests get 404), its slot is freed once the requests already admitted to it have finished.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scalenlp.errors import UserError
from scalenlp.models.adapters import LoraSpec, LoraWeights
from scalenlp.native import NativeKernel

# The block linears an adapter may target, by their attribute names: attention's q/k/v/o, the MLP's gate/down/up.
TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
BASE = 0  # the adapter index of rows that use the base model alone
DEFAULT_RANK = 16  # --max-lora-rank when no --lora names a rank (vLLM's default too)
# The decode kernel; where it cannot be built or SCALENLP_LORA_KERNEL=0 turns it off, the dense or gathered
# products run instead.
kernel_available = NativeKernel("scalenlp_lora_decode", Path(__file__).parents[1] / "models" / "lora_decode.cpp",
                                "SCALENLP_LORA_KERNEL")


class UnknownAdapter(LookupError):
    """A request names an adapter this engine does not serve (a server answers 404)."""


class _Selection:
    """What every MultiLoRALinear of a model reads during one forward: which slots its rows use and how."""

    def __init__(self):
        self.used: list[int] = []  # slots (0-based) some row uses; empty: the base model alone
        self.hi = 0  # 1 + the highest slot used
        self.kernel = False  # decode steps run the kernel (a CPU, float32 or bfloat16, and it built)
        self.mask: torch.Tensor | None = None  # dense: (rows, 1, hi * rank), 1 where a column is the row's slot's
        self.rows: torch.Tensor | None = None  # kernel, gathered: (rows,) slot per row, the zero slot for base rows


class MultiLoRALinear(nn.Module):
    """A base linear (plain, packed or quantized: anything with in_features/out_features) plus the adapters of
    ``slots`` slots of rank ``rank``; ``scaling`` is folded into B when a slot is written."""

    def __init__(self, base: nn.Module, selection: _Selection, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.selection = selection
        self.rank = rank
        # One slot more than served, always zero: where a base row points in the gathered product.
        self.register_buffer("lora_A", torch.zeros(slots + 1, rank, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        # (slot, rank, out): each slot's rows are contiguous over the outputs (the kernel's axpy per rank), and
        # the first ``hi`` slots are one (hi * rank, out) matrix, no copy.
        self.register_buffer("lora_B", torch.zeros(slots + 1, rank, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.present = [False] * slots  # which slots hold an adapter of this layer: others are skipped

    @property
    def weight(self) -> torch.Tensor:
        """The base weight, for whoever reads a layer's shape from it (Attention.local_kv_heads)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_to(self.base(x), x)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Add each row's adapter product to ``out``, in place, and return it: the base's output for ``x``, or this
        layer's columns of a fused base's (``FusedMultiLoRA``: a view whose rows are strided)."""
        sel = self.selection
        if not any(self.present[s] for s in sel.used):
            return out
        r, rows = self.rank, x.shape[0]
        # The low-rank product is added into the base's output in place (addmm_, baddbmm_): at decode time these
        # products are small, and a separate sum and its allocation were a measurable part of their cost.
        if sel.kernel and x.shape[-2] == 1:  # a decode step: see the module's docstring
            torch.ops.scalenlp_lora.add_lora(out.view(rows, self.out_features), x.reshape(rows, self.in_features),
                                             self.lora_A, self.lora_B, sel.rows)
            return out
        if sel.mask is not None and x.shape[-2] == 1:
            h = F.linear(x, self.lora_A[:sel.hi].view(sel.hi * r, self.in_features)).mul_(sel.mask)
            out.view(rows, self.out_features).addmm_(h.view(rows, -1), self.lora_B[:sel.hi].view(sel.hi * r, -1))
            return out
        # index_select, not indexing: the same copy, 5-9x faster here (SmolLM2's up projection, 16 rows, on a CPU).
        a = self.lora_A.index_select(0, sel.rows)  # (rows, rank, in)
        b = self.lora_B.index_select(0, sel.rows)  # (rows, rank, out)
        h = torch.bmm(x.reshape(rows, -1, self.in_features), a.transpose(1, 2))
        out.view(rows, -1, self.out_features).baddbmm_(h, b)
        return out

    @torch.no_grad()
    def write(self, slot: int, weights: LoraWeights | None) -> None:
        """Put an adapter's weights for this layer in ``slot`` (zeros where the adapter leaves this layer alone)."""
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.present[slot] = weights is not None
        if weights is not None:
            rank = weights.A.shape[0]
            self.lora_A[slot, :rank] = weights.A
            self.lora_B[slot, :rank] = (weights.B.float() * weights.scaling).t()

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, slots={len(self.present)}, rank={self.rank}"


class FusedMultiLoRA(nn.Module):
    """Adapted linears that read one input (q/k/v, gate/up) on one fused base (engine/packing.py's
    ``fuse_projections``): the base product runs once, as in the engine without adapters, and each part adds its
    rows' adapter products into its own columns of the output. Without it the adapted engine ran q/k/v and gate/up
    as five base products a layer instead of two (SmolLM2 bf16, 30 layers, 16 rows: 20.7-24.3 ms against 18.6-22.5).
    The parts keep their adapter slots (``LoraSlots`` writes them); their unfused bases are dropped."""

    def __init__(self, base: nn.Module, parts: tuple[MultiLoRALinear, ...]):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        for part in parts:
            del part.base
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        column = 0
        for part in self.parts:
            part.add_to(out[..., column:column + part.out_features], x)
            column += part.out_features
        return out


class LoraSlots:
    """The adapters an engine serves: names, slots, and the swapped layers of its model. Names are looked up and
    slots released under the engine's lock (see decoder_engine), so that a request never runs on a slot reused
    for another adapter."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype):
        """Swap the block linears of ``model`` (before the engine packs them: packing then swaps the base linear
        inside each wrapper) for ``MultiLoRALinear`` with ``max_loras`` slots of rank ``max_rank``."""
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.selection = _Selection()
        self.layers: dict[str, MultiLoRALinear] = {}
        device = next(model.parameters()).device
        for name, module in list(model.named_modules()):
            if name.startswith("layers.") and name.split(".", 2)[-1] in TARGETS and hasattr(module, "in_features"):
                parent, _, child = name.rpartition(".")
                layer = MultiLoRALinear(module, self.selection, max_loras, max_rank, dtype, device)
                setattr(model.get_submodule(parent), child, layer)
                self.layers[name] = layer
        self.names: dict[str, int] = {}  # adapter name -> its index (slot + 1)
        self.paths: dict[str, str] = {}
        self.retiring: set[int] = set()  # indices unloaded, still used by requests in the engine
        self._reserved: set[int] = set()  # indices being written by load
        self.lock = threading.Lock()

    # ---- loading and unloading (any thread) ----

    def load(self, name: str, path: str | Path) -> None:
        """Read the adapter folder at ``path`` (PEFT's or scalenlp's) and serve it as ``name``."""
        check_name(name)
        if name in self.names:
            raise UserError(f"an adapter named {name!r} is already loaded; unload it first or pick another name")
        self.add(name, *read_folder(path, self.model.args), str(path))

    def add(self, name: str, spec: LoraSpec, weights: dict[str, LoraWeights], where: str) -> None:
        """Serve ``weights`` (by our module names) as ``name``, in the lowest free slot."""
        self.check(spec, weights, where)
        with self.lock:
            if name in self.names:
                raise UserError(f"an adapter named {name!r} is already loaded; unload it first or pick another name")
            free = sorted(set(range(1, self.max_loras + 1)) - set(self.names.values()) - self.retiring
                          - self._reserved)
            if not free:
                raise UserError(f"all {self.max_loras} adapter slots are in use ({', '.join(sorted(self.names))}); "
                                f"unload one, or start the server with a larger --max-loras")
            index = free[0]
            self._reserved.add(index)
        try:  # no request uses this slot: writing it does not disturb a forward running meanwhile
            for module, layer in self.layers.items():
                layer.write(index - 1, weights.get(module))
        finally:
            with self.lock:
                self._reserved.discard(index)
        with self.lock:
            self.names[name], self.paths[name] = index, where

    def check(self, spec: LoraSpec, weights: dict[str, LoraWeights], where: str) -> None:
        """One line for an adapter this engine cannot serve: DoRA, a rank over the slots', another base model."""
        if spec.rank > self.max_rank:
            raise UserError(f"the adapter in {where} has rank {spec.rank}, more than this engine's --max-lora-rank "
                            f"{self.max_rank}; start it with --max-lora-rank {spec.rank} or more")
        for module, w in weights.items():
            layer = self.layers.get(module)
            if layer is None:
                raise UserError(f"the adapter in {where} adapts {module}, which this base model does not have (or "
                                f"which is not a block linear); it was made for another base model")
            if w.magnitude is not None:
                raise UserError(f"the adapter in {where} is a DoRA adapter, which is served merged only: write the "
                                f"merged model with `scalenlp export --merge` and serve that")
            want_a, want_b = (spec.rank, layer.in_features), (layer.out_features, spec.rank)
            if tuple(w.A.shape) != want_a or tuple(w.B.shape) != want_b:
                raise UserError(f"the adapter in {where}: {module} has A {tuple(w.A.shape)} and B {tuple(w.B.shape)}, "
                                f"this base model needs {want_a} and {want_b}; it was made for another base model")
            if not (torch.isfinite(w.A).all() and torch.isfinite(w.B).all() and math.isfinite(w.scaling)):
                raise UserError(f"the adapter in {where} holds non-finite weights in {module}")

    def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests for it are refused at once, those already queued or running finish
        on it, and its slot is reused after them (``release``)."""
        with self.lock:
            if name not in self.names:
                raise UnknownAdapter(self.unknown(name))
            self.retiring.add(self.names.pop(name))
            del self.paths[name]

    def unknown(self, name: str) -> str:
        served = ", ".join(sorted(self.names)) or "none"
        return f"no adapter named {name!r} is loaded (adapters: {served})"

    # ---- the engine's side ----

    def index_of(self, name: str | None) -> int:
        """The index requests for ``name`` (None: the base model) run with; UnknownAdapter if it is not served."""
        if name is None:
            return BASE
        with self.lock:
            index = self.names.get(name)
        if index is None:
            raise UnknownAdapter(self.unknown(name))
        return index

    def release(self, in_use: set[int]) -> None:
        """Free the slots of unloaded adapters that no request in the engine uses any more."""
        if self.retiring:
            with self.lock:
                self.retiring &= in_use

    def select(self, indices: list[int]) -> None:
        """Set which adapter each row of the next forward uses (``BASE`` for the base model alone)."""
        sel = self.selection
        sel.used = sorted({i - 1 for i in indices if i != BASE})
        sel.mask = sel.rows = None
        sel.kernel = False
        if not sel.used:
            sel.hi = 0
            return
        sel.hi = sel.used[-1] + 1
        ref = next(iter(self.layers.values())).lora_A
        sel.rows = torch.tensor([self.max_loras if i == BASE else i - 1 for i in indices], device=ref.device)
        sel.kernel = (ref.device.type == "cpu" and ref.dtype in (torch.float32, torch.bfloat16)
                      and kernel_available())
        if sel.hi <= len(indices) and not sel.kernel:
            mask = torch.zeros(len(indices), sel.hi, self.max_rank)
            for row, i in enumerate(indices):
                if i != BASE:
                    mask[row, i - 1] = 1
            sel.mask = mask.view(len(indices), 1, -1).to(device=ref.device, dtype=ref.dtype)


def read_folder(path: str | Path, args) -> tuple[LoraSpec, dict[str, LoraWeights]]:
    """The adapter in folder ``path`` (PEFT's layout, under Hugging Face names or ours) for the base model
    ``args`` describes; a path that is no adapter folder is one line naming what it lacks."""
    from scalenlp.models.adapter_io import CONFIG, WEIGHTS, read_adapter

    folder = Path(path)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise UserError(f"{str(path)!r} is not an adapter folder: it needs {CONFIG} and {WEIGHTS} (what PEFT's "
                        f"save_pretrained writes, or a LoRA run's export/adapter)")
    return read_adapter(folder, args)


def check_name(name: str) -> None:
    if not name or name != name.strip() or "=" in name:
        raise UserError(f"an adapter name must be non-empty, without surrounding spaces or '=', got {name!r}")
