"""Tensor parallelism (Megatron-style) and sequence parallelism for the decoder family, and tensor
parallelism for the encoder (BERT) family, whose blocks use the same plan.

Each block needs one all-reduce (with sequence parallelism, an all-gather plus a reduce-scatter) for
attention and one for the MLP: wq/wk/wv and w1/w3 are column-parallel (n_heads/tp heads per rank, which the
decoder's ``view(B, T, -1, head_dim)`` allows), wo and w2 row-parallel. The embedding is vocabulary-parallel
and the output projection column-parallel over the vocabulary; training keeps its logits sharded and runs
the cross-entropy under ``loss_parallel`` (``shard_logits=True``), inference gathers them.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from scalenlp.models.adapters import LoRALinear
from scalenlp.models.encoder import Encoder


class RelayoutHiddenInput(ParallelStyle):
    """Redistribute a module's first positional input (the hidden states) from ``src`` to ``dst``
    and pass the rest (RoPE tables, positions, cache slots, ...) through untouched, whatever their number."""

    def __init__(self, src: Placement, dst: Placement):
        super().__init__()
        self.src, self.dst = src, dst

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def relayout(_, args):
            x = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], device_mesh, (self.src,),
                                                                                run_check=False)
            return (x.redistribute(placements=(self.dst,)).to_local(), *args[1:])
        module.register_forward_pre_hook(relayout)
        return module


def block_plan(sequence_parallel: bool, has_w3: bool) -> dict[str, ParallelStyle]:
    """Plan for one decoder Block, keyed by submodule name."""
    plan: dict[str, ParallelStyle | None] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
        "feed_forward.w3": ColwiseParallel() if has_w3 else None,  # SwiGLU's gate; GELU MLPs have none
    }
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": RelayoutHiddenInput(Shard(1), Replicate()),
            "ffn_norm": SequenceParallel(),
            "feed_forward": RelayoutHiddenInput(Shard(1), Replicate()),
        }
    return {name: style for name, style in plan.items() if style is not None}


def split_dim(name: str) -> int | None:
    """The dim of a block linear's weight (``layers.<i>.attention.wo``) that ``block_plan`` splits: 0 where the
    layer is column-parallel, 1 where it is row-parallel, None where it is not split."""
    style = block_plan(sequence_parallel=False, has_w3=True).get(name.split(".", 2)[-1])
    return None if style is None else 0 if isinstance(style, ColwiseParallel) else 1


def norm_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for a block's norms beyond the two of every block (training and inference alike).

    Per-head q/k norms (Qwen3, Gemma 3) see only this rank's heads: their one weight is a Replicate DTensor
    over an input sharded on the heads (dim 2 of (B, T, H, D)), so its gradient, a sum over every head, is
    reduced over the ranks as one process would have it. Post-norms (Gemma) see the attention's and the MLP's
    outputs: whole and replicated without sequence parallelism (plain parameters, equal gradients on every
    rank), sharded on the sequence with it, like the pre-norms."""
    plan: dict[str, ParallelStyle] = {}
    if block.attention.q_norm is not None:
        plan |= {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    if sequence_parallel and block.post_attention_norm is not None:
        plan |= {n: SequenceParallel(use_local_output=True) for n in ("post_attention_norm", "post_ffn_norm")}
    return plan


def outer_plan(model: nn.Module, sequence_parallel: bool, shard_logits: bool = False) -> dict[str, ParallelStyle]:
    """Plan for the embeddings, final norm and output projection that this model (or stage) holds.
    With ``shard_logits`` the output projection returns its logits as a DTensor sharded on the
    vocabulary (the last dim), for a loss computed under ``vocab_parallel_loss``; else full logits."""
    plan: dict[str, ParallelStyle] = {}
    learned_positions = getattr(model, "pos_embeddings", None) is not None
    if model.tok_embeddings is not None:
        # With learned positions the position embedding is added to the full sequence, so the token
        # embedding stays replicated and the stream is sharded at the dropout that follows.
        shard_here = sequence_parallel and not learned_positions
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1) if shard_here else Replicate())
        if sequence_parallel and learned_positions:
            plan["drop"] = RelayoutHiddenInput(Replicate(), Shard(1))
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                         output_layouts=Shard(-1) if shard_logits else Replicate(),
                                         use_local_output=not shard_logits)
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, shard_logits: bool = False) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one) in place over ``tp_mesh``; its logits
    are vocabulary-sharded DTensors with ``shard_logits``, full tensors on every rank without.
    An ``Encoder`` goes to ``apply_tp_encoder`` (``shard_logits`` does not apply: it has no vocabulary head)."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    _apply_tp(model, tp_mesh, sequence_parallel, shard_logits)
    # SequenceParallel (the norms' style) makes new parameters that train: a LoRA run's frozen norms stay frozen.
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, shard_logits: bool) -> None:
    if isinstance(model, Encoder):
        if sequence_parallel:
            raise ValueError("sequence parallelism is not implemented for encoders; shard them with "
                             "sequence_parallel=False")
        apply_tp_encoder(model, tp_mesh)
        return
    blocks = list(model.layers.values())
    for block in blocks:
        plan = block_plan(sequence_parallel, block.feed_forward.w3 is not None)
        parallelize_module(block, tp_mesh, plan)
        shard_adapters(block, tp_mesh, plan)
        parallelize_module(block, tp_mesh, norm_plan(block, sequence_parallel))
    parallelize_module(model, tp_mesh, outer_plan(model, sequence_parallel, shard_logits))
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Both styles shard the (vocab, dim) matrix by rows (Shard(0)), so one DTensor serves both again.
        model.output.weight = model.tok_embeddings.weight
    if sequence_parallel and blocks:
        # Pipeline stages exchange the full sequence: the receiving stage derives positions (RoPE)
        # from the length of what it receives, so a sharded boundary would get them wrong.
        if model.tok_embeddings is None:
            parallelize_module(blocks[0], tp_mesh, RelayoutHiddenInput(Replicate(), Shard(1)))
        if model.norm is None:
            parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))


def apply_tp_encoder(model: Encoder, tp_mesh: DeviceMesh) -> None:
    """Shard an ``Encoder`` in place: each block as a decoder block (column-parallel q/k/v and w1,
    row-parallel o and w2, one all-reduce each; the post-norm LayerNorms act on the reduced, replicated
    stream) and the token embedding vocabulary-parallel, its largest matrix. Position and type
    embeddings, the pooler and the classifier are small and stay replicated, so hidden states, sentence
    vectors and logits come out whole on every rank. Sequence parallelism would leave the last hidden
    states sharded on the sequence, which pooling reads whole; it is not offered."""
    for block in model.layers.values():
        plan = block_plan(sequence_parallel=False, has_w3=False)
        parallelize_module(block, tp_mesh, plan)
        shard_adapters(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Replicate())})


def shard_adapters(block: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Lay out the LoRA adapters of ``block``'s parallelized linears as their base: a column-parallel base (output
    rows sharded) takes B's rows (and DoRA's magnitudes) sharded and A whole, so each rank adds the update of
    its own rows; a row-parallel base (input columns sharded) takes A's columns sharded and B whole, so the
    update is a partial sum like the base's, reduced with it. The parallel styles shard every parameter of a
    column-parallel linear by rows and none but weight and bias of a row-parallel one: this sets them right."""
    for name, style in plan.items():
        layer = block.get_submodule(name)
        if not isinstance(layer, LoRALinear):
            continue
        colwise = isinstance(style, ColwiseParallel)
        layout = {"lora_A": Replicate() if colwise else Shard(1), "lora_B": Shard(0) if colwise else Replicate(),
                  "lora_magnitude": Shard(0) if colwise else Replicate()}
        for param_name, placement in layout.items():
            param = getattr(layer, param_name)
            if param is None:
                continue
            whole = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
            layer.register_parameter(param_name, nn.Parameter(distribute_tensor(whole, tp_mesh, [placement]),
                                                              requires_grad=param.requires_grad))


def vocab_parallel_loss(enabled: bool) -> contextlib.AbstractContextManager:
    """The context that cross-entropy over vocabulary-sharded logits, and its backward, must run in
    (``torch.distributed.tensor.parallel.loss_parallel``); nothing when ``enabled`` is false."""
    return loss_parallel() if enabled else contextlib.nullcontext()
