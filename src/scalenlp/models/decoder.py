"""Decoder-only transformer: GPT-2, Llama and the Hugging Face families built like them (Qwen, Mistral, Gemma,
Phi-3) in one module, their differences as ModelArgs options rather than copies of the model
(scalenlp.models.families maps each family's config.json onto them).

Pure PyTorch, no torch.distributed: parallelism is applied from outside (scalenlp.parallel), which
relies on three properties of this file:
- attention reshapes with ``view(B, T, -1, head_dim)``, so a tensor-parallel shard that holds
  n_heads / tp heads works unchanged;
- ``layers`` is a ModuleDict keyed by the global layer index, so a pipeline stage that deletes
  layers keeps the same parameter names (and checkpoints stay layout-independent);
- ``tok_embeddings``, ``norm`` and ``output`` may be set to None by a pipeline stage, and forward
  then passes hidden states through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalenlp.models import cpu_attention, paged_attention
from scalenlp.models.adapters import LoRALinear, lora_products
from scalenlp.models.limits import check_fields
from scalenlp.models.loss import compiled_linear_cross_entropy, linear_cross_entropy


@dataclass
class ModelArgs:
    vocab_size: int = 4096
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = n_heads (multi-head attention); fewer = grouped-query attention
    ffn_dim: int = 256
    max_seq_len: int = 256
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    activation: str = "swiglu"  # swiglu | gelu
    position: str = "rope"  # rope | learned
    tie_embeddings: bool = False
    bias: bool = False
    rope_theta: float = 10000.0
    # Llama 3.1's RoPE frequency scaling, as (factor, low_freq_factor, high_freq_factor, original_max_seq_len);
    # () keeps plain RoPE. A tuple, not a dict, so that ModelArgs stays hashable (the planner caches by it).
    rope_scaling: tuple = ()
    norm_eps: float = 1e-5
    dropout: float = 0.0
    fixed_head_dim: int = 0  # 0 = dim // n_heads; set where heads were pruned (or a Llama gives head_dim)
    # Options of the Hugging Face families beyond GPT-2 and Llama; each default leaves the model as it was.
    qkv_bias: bool = False  # a bias on q, k and v even where ``bias`` is off (Qwen2: none on o or the MLP)
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorms scale by (offset + weight), their weights stored as offsets (Gemma: 1 + w)
    post_norms: bool = False  # a norm on the attention's and the MLP's outputs too, before each residual add (Gemma)
    sliding_window: int = 0  # the keys a query of a local layer sees, itself included (Mistral, Gemma); 0 = all
    local_layers: tuple = ()  # the layers that attend within sliding_window; the others see every earlier key
    rope_local_theta: float = 0.0  # the local layers' own RoPE base (Gemma 3); 0 = rope_theta
    rope_factor: float = 0.0  # linear RoPE scaling: positions divided by it (Gemma 3's global layers); 0 = none
    attn_scale: float = 0.0  # what scores are multiplied by; 0 = head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float = 0.0  # scores become cap * tanh(scores / cap) (Gemma 2); 0 = not capped
    logit_softcap: float = 0.0  # the same on the output logits (Gemma 2); 0 = not capped
    embed_scale: float = 0.0  # token embeddings are multiplied by it (Gemma: sqrt(dim)); 0 = not scaled
    hf_type: str = ""  # the Hugging Face model_type export writes back; "" = gpt2 or llama, told by the shape

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        self.rope_scaling = tuple(self.rope_scaling)  # model_args.json gives back a list
        self.local_layers = tuple(self.local_layers)

    @property
    def head_dim(self) -> int:
        return self.fixed_head_dim or self.dim // self.n_heads

    def check(self) -> None:
        """Raise ValueError with a readable reason for a shape that cannot be built (a FieldError, naming the
        field, for a value of the wrong type or out of range)."""
        check_fields(self)
        if self.dim % self.n_heads and not self.fixed_head_dim:
            raise ValueError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {self.head_dim}")
        if self.rope_scaling:
            if len(self.rope_scaling) != 4:
                raise ValueError(f"rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
                                 f"original_max_seq_len), got {self.rope_scaling}")
            factor, low, high, original = self.rope_scaling
            if factor < 1 or not 0 < low < high or original <= 0:
                raise ValueError(f"rope_scaling {self.rope_scaling} needs factor >= 1, 0 < low_freq_factor < "
                                 f"high_freq_factor and a positive original_max_seq_len")
        if bool(self.sliding_window) != bool(self.local_layers):
            raise ValueError(f"sliding_window={self.sliding_window} and local_layers={self.local_layers} go together: "
                             f"give both (a window and the layers that use it) or neither")
        if any(not 0 <= i < self.n_layers for i in self.local_layers):
            raise ValueError(f"local_layers {self.local_layers} name layers outside 0..{self.n_layers - 1}")
        if (self.norm_offset or self.qk_norm) and self.norm != "rmsnorm":
            raise ValueError("norm_offset and qk_norm need norm='rmsnorm'")
        if self.rope_local_theta and self.position != "rope":
            raise ValueError("rope_local_theta needs position='rope'")
        if self.rope_factor < 0 or self.rope_factor and self.rope_scaling:
            raise ValueError(f"rope_factor {self.rope_factor} must be positive, and not set with rope_scaling")
        for name, value, allowed in (("norm", self.norm, ("rmsnorm", "layernorm")),
                                     ("activation", self.activation, ("swiglu", "geglu", "gelu")),
                                     ("position", self.position, ("rope", "learned"))):
            if value not in allowed:
                raise ValueError(f"model {name}={value!r} is not one of {allowed}")


class _RMSNorm(torch.autograd.Function):
    """torch's RMSNorm over the last dimension (the same operations in float32, the result in x's dtype), keeping
    x and its 1/rms for backward. On a CPU torch composes it from primitives, and autograd then keeps the
    normalised x too, the size of x; backward here computes it again from the two it kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(weight).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed, grad = x.float() * rstd, grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:  # not for LoRA's frozen norms
            grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_normed = grad * weight
        # rstd * (grad_normed - normed * mean(grad_normed * normed)), written over normed's temporary
        grad_x = normed.mul_((grad_normed * normed).mean(-1, keepdim=True)).neg_().add_(grad_normed).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same state dict) that keeps less for backward where autograd records it.
    With an ``offset`` it scales by (offset + weight), the sum taken in float32 as Gemma's norm does it (in
    bf16, 1 + w would lose the small w's digits)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps=eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return _RMSNorm.apply(x, self.weight.float() + self.offset, self.eps)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNorm.apply(x, self.weight, self.eps)
        return super().forward(x)


def make_norm(args: ModelArgs, dim: int = 0) -> nn.Module:
    """The model's norm over ``dim`` features (the model's width unless given)."""
    if args.norm == "rmsnorm":
        return RMSNorm(dim or args.dim, eps=args.norm_eps, offset=args.norm_offset)
    return nn.LayerNorm(dim or args.dim, eps=args.norm_eps, bias=args.bias)


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (max_seq_len, head_dim), in the rotate-half layout that HF Llama uses. With
    ``rope_local_theta`` the local layers' tables follow the global ones on the last dimension,
    (max_seq_len, 2 * head_dim): one pair of buffers, so that every loader that rebuilds the tables
    after a meta-device build rebuilds both (``Transformer.forward`` splits them)."""
    inv_freq = rope_inv_freq(args, device)
    if args.rope_scaling:
        inv_freq = llama3_scaled(inv_freq, *args.rope_scaling)
    if args.rope_factor:
        inv_freq = inv_freq / args.rope_factor
    if args.rope_local_theta:
        inv_freq = torch.cat([inv_freq, rope_inv_freq(args, device, args.rope_local_theta)])
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq).unflatten(-1, (-1, args.head_dim // 2))
    angles = torch.cat([angles, angles], dim=-1).flatten(-2)
    return angles.cos(), angles.sin()


def rope_inv_freq(args: ModelArgs, device=None, theta: float = 0.0) -> torch.Tensor:
    """Plain RoPE's speed, in radians per position, of each of the head_dim / 2 rotated pairs (base
    ``theta``, the model's rope_theta unless given)."""
    half = args.head_dim // 2
    return 1.0 / ((theta or args.rope_theta) ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))


def rope_turns(inv_freq: torch.Tensor, original_max_seq_len: int) -> torch.Tensor:
    """Whole turns each rotated pair makes over the original context: what Llama 3.1's scaling bands are cut by."""
    return original_max_seq_len * inv_freq / (2 * math.pi)


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1's longer context (Meta's reference code, HF rope_type "llama3"): rotations slower than one turn per
    ``original_max_seq_len / low_freq_factor`` tokens turn ``factor`` times slower, those faster than one turn per
    ``original_max_seq_len / high_freq_factor`` tokens keep their speed, and in between the divisor moves from
    ``factor`` to 1 linearly in turns per original context."""
    turns = rope_turns(inv_freq, original_max_seq_len)
    keep = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return inv_freq * (keep + (1 - keep) / factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B or 1, T, 1, D)."""
    if torch.is_grad_enabled() and x.requires_grad and type(x) is torch.Tensor:
        return _Rope.apply(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``x * cos + sign * rotate_half(x) * sin`` into one new tensor, the halves added in place. The half that
    rotate_half negates (the first for sign 1) takes ``sin`` of its own half; the rotation back (sign -1) is
    RoPE's gradient."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half] if sign > 0 else sin[..., half:], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:] if sign > 0 else sin[..., :half], value=sign)
    return out


class _Rope(torch.autograd.Function):
    """apply_rope in training: one output allocated, where the op-by-op form allocates five (and its backward as
    many again), for each of q and k in every layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x, cos, sin, 1.0).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0).to(ctx.dtype), None, None


def stacked_linear(x: torch.Tensor, parts: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...] | None:
    """``x`` through linears that all read it, as one matmul over their stacked weights: one wide product
    reads ``x`` once and keeps the cores busier than several narrow ones (torchtitan fuses q/k/v the
    same way). The parameters stay separate, so checkpoints keep their names (wq, wk, wv, w1, w3) and
    every layout shards them as before; the stacking costs a copy of the weights per call, small
    beside the activations of a training batch. None under tensor parallelism (DTensor weights):
    each column-parallel part's own hooks all-reduce the input's gradient, which a product over the
    local shards would skip, so the caller runs the parts one by one. LoRA's adapted linears share one node
    instead (``lora_products``: their frozen bases' products stay apart, they ran no faster stacked), or run one
    by one where it does not take them, or where only some of the parts are adapted."""
    adapted = [isinstance(p, LoRALinear) for p in parts]
    if any(adapted):
        return lora_products(x, parts) if all(adapted) else None
    if any(hasattr(p.weight, "device_mesh") for p in parts):
        return None
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    out = F.linear(x, torch.cat([p.weight for p in parts]), bias)
    return out.split([p.weight.shape[0] for p in parts], dim=-1)


def stack_projections(model: nn.Module, enabled: bool) -> None:
    """Whether training runs q/k/v and gate/up as one product each (``stacked_linear``) or one by one;
    the same parameters and the same function either way."""
    for module in model.modules():
        if isinstance(module, (Attention, FeedForward)):
            module.stacked = enabled


@dataclass
class CacheIndex:
    """Where one forward writes and reads the paged KV caches (``KVCache``). Every layer uses the same
    positions, so the index tensors and the masks are built once per forward, not once per layer."""

    slot_mapping: torch.Tensor  # (B, T) pool slot each new position's key and value go to
    block_table: torch.Tensor  # (B, N) the pool blocks of each row's positions, in order
    key_slots: torch.Tensor  # (B, S) pool slot of each key a row reads: its block table, block by block
    lengths: torch.Tensor  # (B,) keys the last query of each row sees (its position + 1)
    mask: torch.Tensor  # (B, 1, T, S): each query sees the keys up to its own position
    local_mask: torch.Tensor | None = None  # the same within a sliding window, for local layers

    @classmethod
    def build(cls, input_pos: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              window: int = 0) -> CacheIndex:
        """input_pos: (B, T) positions; block_table: (B, N) the pool blocks holding each row's positions
        0..N * block_size - 1, in order (rows with fewer blocks pad with any block: the mask hides keys past a
        query's position); slot_mapping: (B, T) where each new key goes. window: the sliding window of the
        model's local layers (0: none); their queries see only the last ``window`` positions up to their own."""
        offsets = torch.arange(block_size, device=block_table.device)
        key_slots = (block_table[:, :, None] * block_size + offsets).flatten(1)
        keys = torch.arange(key_slots.shape[1], device=input_pos.device)[None, None, :]
        mask = keys <= input_pos[:, :, None]
        local = (mask & (keys > input_pos[:, :, None] - window))[:, None] if window else None
        return cls(slot_mapping, block_table, key_slots, input_pos[:, -1] + 1, mask[:, None], local)


def window_mask(T: int, window: int, device) -> torch.Tensor:
    """(T, T) causal mask of a sequence's own positions, each query seeing its last ``window`` keys (all if 0)."""
    pos = torch.arange(T, device=device)
    offset = pos[:, None] - pos[None, :]
    return (offset >= 0) & (offset < window) if window else offset >= 0


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         cap: float, dropout: float) -> torch.Tensor:
    """Attention whose scores are capped, cap * tanh(scores / cap), before the mask and the softmax (Gemma 2):
    SDPA has no hook between the two products, so this path writes them out (q: (B, H, T, D), k and v
    (B, H_kv, S, D), mask broadcastable to (B, H, T, S))."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return F.dropout(probs, dropout) @ v


class KVCache(nn.Module):
    """A paged key/value cache (vLLM's PagedAttention layout): a pool of ``num_blocks`` blocks of ``block_size``
    positions each, shared by every sequence. A sequence holds a list of blocks (its block table), so its memory
    grows a block at a time instead of being set aside for the longest sequence, and sequences with the same
    prefix can read the same blocks. The pool is flat, slot = block * block_size + offset.
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.block_size = block_size
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, index: CacheIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, H_kv, T, D), written at ``index.slot_mapping``."""
        slots = index.slot_mapping.flatten()
        self.k.index_copy_(0, slots, k.transpose(1, 2).flatten(0, 1).to(self.k.dtype))
        self.v.index_copy_(0, slots, v.transpose(1, 2).flatten(0, 1).to(self.v.dtype))

    def read(self, index: CacheIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values over its block table, (B, H_kv, S, D), gathered from the pool."""
        return self.k[index.key_slots].transpose(1, 2), self.v[index.key_slots].transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        self.dropout = args.dropout
        self.window = window  # sliding window of a local layer; 0 = every earlier key
        self.scale = args.attn_scale or None  # None: SDPA's own head_dim ** -0.5
        self.softcap = args.attn_softcap
        qkv_bias = args.bias or args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.bias)
        self.q_norm = make_norm(args, args.head_dim) if args.qk_norm else None
        self.k_norm = make_norm(args, args.head_dim) if args.qk_norm else None
        self.cache: KVCache | None = None
        # Inference packing (scalenlp.engine.packing) may replace wq, wk and wv by one matmul: at decode time
        # each weight is read once per token, and one wide product streams them better than three.
        self.wqkv: nn.Module | None = None
        self.qkv_heads: list[int] = []  # its output's split into query, key and value heads
        # q/k/v as one product (stacked_linear): parallelize turns it on for training (training.stack_projections).
        # Off otherwise, so that hooks and module swaps on wq/wk/wv (pruning's calibration, quantization) see calls.
        self.stacked = False

    def local_kv_heads(self) -> int:
        """The key/value heads this module computes: the fused projection's share where inference packing
        fused q/k/v (wk is gone then), else wk's rows (a DTensor's local shard under tensor parallelism)."""
        if self.wqkv is not None:
            return self.qkv_heads[1]
        weight = self.wk.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight
        return weight.shape[0] // self.head_dim

    def forward(self, x, rope, cache_index: CacheIndex | None = None):
        B, T, _ = x.shape
        if self.wqkv is not None:
            q, k, v = self.wqkv(x).view(B, T, -1, self.head_dim).split(self.qkv_heads, dim=2)
        else:
            qkv = stacked_linear(x, (self.wq, self.wk, self.wv)) if self.stacked else None
            q, k, v = qkv or (self.wq(x), self.wk(x), self.wv(x))
            if qkv is not None:
                # Attention keeps v for backward; a view would keep the whole stacked product alive with it,
                # q and k too (two thirds more per layer at equal heads), though only their RoPE'd copies are used.
                v = v.contiguous()
            q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if cache_index is not None:
            self.cache.write(cache_index, k, v)
            if paged_attention.usable(q, self.cache.k):  # a decode step: read in place through the block tables
                out = paged_attention.decode_attention(q, self.cache.k, self.cache.v, cache_index.block_table,
                                                       cache_index.lengths, self.cache.block_size,
                                                       self.scale or self.head_dim ** -0.5, self.softcap, self.window)
            else:
                k, v = self.cache.read(cache_index)
                mask = cache_index.local_mask if self.window else cache_index.mask
                out = self.attend(q, k.to(q.dtype), v.to(q.dtype), mask, 0.0)
        elif not (self.window or self.scale or self.softcap) and cpu_attention.usable(q, k, dropout):
            out = cpu_attention.causal_attention(q, k, v)
        else:
            out = self.attend(q, k, v, window_mask(T, self.window, x.device) if self.window else None, dropout)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, mask: torch.Tensor | None, dropout: float) -> torch.Tensor:
        """Attention of q (B, H, T, D) over k, v (B, H_kv, S, D) under ``mask`` (None: causal over the
        sequence itself), with this layer's scale and soft-cap."""
        if self.softcap:
            mask = window_mask(q.shape[2], 0, q.device) if mask is None else mask
            return softcapped_attention(q, k, v, mask, self.scale or self.head_dim ** -0.5, self.softcap, dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                              scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.activation = args.activation
        gated = args.activation != "gelu"  # swiglu, geglu: act(gate) * up
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=args.bias)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=args.bias)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=args.bias) if gated else None
        self.w13: nn.Module | None = None  # w1 and w3 as one matmul, where inference packing fuses them
        self.stacked = False  # gate and up as one product (stacked_linear) when training turns it on, as Attention

    def forward(self, x):
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)  # w1 is Llama's gate projection, w3 its up projection
            return self.w2(self.gated(gate, up))
        if self.w3 is not None:
            gate_up = stacked_linear(x, (self.w1, self.w3)) if self.stacked else None
            gate, up = gate_up or (self.w1(x), self.w3(x))
            return self.w2(self.gated(gate, up))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "geglu":  # Gemma's: GELU's tanh approximation on the gate
            return F.gelu(gate, approximate="tanh") * up
        return swiglu(gate, up)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward. Autograd would keep silu(gate) as well, the
    size of each of them: a third more of the MLP's saved activations, the largest of a layer. Backward
    computes silu(gate) again, one pass over it, against the reads and writes of the tensor it would have kept."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)  # gate and up are one dtype: two linears' outputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        # Each gradient written over the one temporary it starts from, not into a tensor of its own.
        grad_gate = grad * up
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, F.silu(gate).mul_(grad)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP activation; through _SwiGLU where autograd records it."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.local = layer in args.local_layers  # attends within the sliding window
        self.attention_norm = make_norm(args)
        self.attention = Attention(args, window=args.sliding_window if self.local else 0)
        self.ffn_norm = make_norm(args)
        self.feed_forward = FeedForward(args)
        self.drop = nn.Dropout(args.dropout)
        # Gemma normalises each sublayer's output as well as its input, before the residual add.
        self.post_attention_norm = make_norm(args) if args.post_norms else None
        self.post_ffn_norm = make_norm(args) if args.post_norms else None

    def forward(self, x, rope, cache_index: CacheIndex | None = None):
        out = self.attention(self.attention_norm(x), rope, cache_index)
        if self.post_attention_norm is not None:
            out = self.post_attention_norm(out)
        h = x + self.drop(out)
        out = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return h + self.drop(out)


def init_recipe(args: ModelArgs):
    """The initialisation of each parameter, by name: (std, cutoff) for a normal distribution truncated
    at ±cutoff (None: not truncated), "ones" for norm gains, None for zeros (biases, LayerNorm shifts).
    Two published recipes:

    - GPT-2 family (learned positions; GPT-2, Megatron-LM): every matrix N(0, 0.02), the residual
      stream's output projections (attention ``wo``, MLP ``w2``) N(0, 0.02 / sqrt(2 · n_layers)), so the
      residual stream's variance does not grow with depth.
    - Llama family (RoPE), as torchtitan initialises Llama 3: ``wq``, ``wk``, ``wv`` and ``w1`` (gate)
      truncated normal std 0.02; ``wo``, ``w2`` and ``w3`` (up) std 0.02 / sqrt(2 · (layer + 1)), depth-scaled
      per layer; token embeddings N(0, 1), since RMSNorm rescales them; the output projection std
      dim^-0.5 truncated at 3 std, so logits start at unit scale. A tied embedding is the output
      projection and takes its init. (torchtitan truncates its std-0.02 draws at ±2, which is no truncation.)
    """
    llama = args.position == "rope"
    gpt2_residual = 0.02 / math.sqrt(2 * args.n_layers)
    head = args.dim ** -0.5

    def recipe(name: str):
        module, _, kind = name.rpartition(".")
        if kind == "bias":
            return None
        if module.rsplit(".", 1)[-1].endswith("norm"):
            return None if args.norm_offset else "ones"  # an offset norm's unit gain is a zero weight
        if not llama:
            return (gpt2_residual if module.endswith(("wo", "w2")) else 0.02), None
        if module == "output" or module == "tok_embeddings" and args.tie_embeddings:
            return head, 3 * head
        if module == "tok_embeddings":
            return 1.0, None
        if module.endswith(("wo", "w2", "w3")):
            layer = int(module.split(".")[1])  # layers.<i>.attention.wo
            return 0.02 / math.sqrt(2 * (layer + 1)), 2.0
        return 0.02, 2.0

    return recipe


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.position == "learned" else None
        self.drop = nn.Dropout(args.dropout)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.compile_loss = False  # the chunked loss through torch.compile: parallelize turns it on (training.compile)
        # A frozen output projection's operands (models/frozen.py), for the chunked loss (adapters.pack_frozen).
        self.output_packed: tuple[torch.Tensor, torch.Tensor] | None = None
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if args.position == "rope":
            cos, sin = rope_tables(args)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight by its family's published recipe (``init_recipe``), in a fixed order
        from the global RNG: the same seed gives the same weights whatever the layout, because the
        trainer initialises the whole model once, before tensor parallelism, FSDP or a pipeline split
        it. Also rebuilds the RoPE tables, so a model built on the meta device and moved with
        ``to_empty`` is complete after it."""
        recipe = init_recipe(self.args)
        for name, param in self.named_parameters():  # a tied embedding comes once, as tok_embeddings.weight
            init = recipe(name)
            if init is None:  # biases and LayerNorm shifts
                param.zero_()
            elif init == "ones":
                param.fill_(1.0)
            elif init[1] is None:
                nn.init.normal_(param, 0.0, init[0])
            else:
                std, cutoff = init
                nn.init.trunc_normal_(param, 0.0, std, -cutoff, cutoff)
        if self.args.position == "rope":
            cos, sin = rope_tables(self.args, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def setup_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> None:
        """Attach a paged KV cache of ``num_blocks`` blocks of ``block_size`` positions to every attention layer
        (inference only); a forward given block tables reads and writes it."""
        ref = next(self.parameters())
        for block in self.layers.values():
            attn = block.attention
            attn.cache = KVCache(num_blocks, block_size, attn.local_kv_heads(), attn.head_dim, dtype or ref.dtype,
                                 ref.device)

    def clear_kv_cache(self) -> None:
        for block in self.layers.values():
            block.attention.cache = None

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                block_table: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) ids, or (B, T, dim) hidden states on a pipeline stage without embeddings.
        input_pos: (B, T) positions, required with a KV cache. block_table, slot_mapping: where the KV cache
        (``setup_kv_cache``) is read and written, see ``CacheIndex.build``; without them the cache is not used.
        logits_at: (B,) one position per row whose logits are wanted, giving (B, 1, vocab); a prefill
        then skips the output projection (the largest matmul) for every other position.
        targets: (B, T) next tokens; the summed fp32 cross-entropy is returned instead of the logits,
        computed a chunk of tokens at a time (scalenlp.models.loss), so the full logits never exist
        (not under tensor parallelism, whose sharded output projection needs the vocabulary-parallel loss).
        Returns logits, hidden states, or the loss."""
        B, T = tokens.shape[:2]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's max_seq_len {self.args.max_seq_len}")
        if input_pos is None:
            input_pos = torch.arange(T, device=tokens.device).unsqueeze(0)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.args.embed_scale and self.tok_embeddings is not None:
            h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)  # rounded to h's dtype, as Gemma does
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(input_pos)
        h = self.drop(h)
        rope = local_rope = None
        if self.args.position == "rope":
            rope = (self.rope_cos[input_pos].unsqueeze(2).to(h.dtype), self.rope_sin[input_pos].unsqueeze(2).to(h.dtype))
            if self.args.rope_local_theta:  # the tables hold the global and the local layers' halves (rope_tables)
                rope, local_rope = zip(*(t.split(self.args.head_dim, dim=-1) for t in rope))
        cache_index = None
        blocks = list(self.layers.values())
        if block_table is not None:
            cache_index = CacheIndex.build(input_pos, block_table, slot_mapping, blocks[0].attention.cache.block_size,
                                           self.args.sliding_window)
        for block in blocks:
            h = block(h, local_rope if block.local and local_rope else rope, cache_index)
        if logits_at is not None:
            h = h[torch.arange(B, device=h.device), logits_at].unsqueeze(1)
        if self.norm is not None:
            h = self.norm(h)
        if targets is not None and not self.args.logit_softcap:
            loss = compiled_linear_cross_entropy() if self.compile_loss else linear_cross_entropy
            return loss(h, self.output.weight, targets, packed=self.output_packed)
        if self.output is None:
            return h
        logits = self.output(h)
        if self.args.logit_softcap:
            cap = self.args.logit_softcap
            logits = torch.tanh(logits / cap) * cap
            if targets is not None:  # the chunked loss has no cap inside: this one holds the full logits
                return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")
        return logits

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters; with exclude_embedding, only those that take part in matmuls (a tied
        embedding counts once, as the output projection)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            if self.pos_embeddings is not None:
                n -= self.pos_embeddings.weight.numel()
            if not self.args.tie_embeddings:
                n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM, appendix B): forward + backward of the
        matmul weights, plus the attention score and value products."""
        a = self.args
        return 6 * self.num_params(exclude_embedding=True) + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len

