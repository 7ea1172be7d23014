"""Bidirectional encoder: BERT (and MiniLM and the sentence-transformers models built on it), RoBERTa,
XLM-RoBERTa and DistilBERT, one model whose options cover where they differ.

Learned absolute positions, token type embeddings, post-LayerNorm blocks (the residual sum is
normalised, not the block input), exact (erf) GELU and a pooler (dense + tanh over the first token).
RoBERTa numbers positions over non-pad tokens from an offset (``position_offset``) and has one token
type; DistilBERT has no token types (``type_vocab_size=0``) and no pooler. One model serves four tasks:
sentence embeddings (pooled hidden states), sequence classification (``classifier_head``: a linear
layer on the pooler output as ``BertForSequenceClassification`` has it, or on a dense + tanh / ReLU of
the first token as RoBERTa's and DistilBERT's have it), token classification (a linear head on every
hidden state) and extractive question answering (start and end logits for every token, as
``BertForQuestionAnswering``'s ``qa_outputs``).

Pure PyTorch, no torch.distributed, named like the decoder so that parallelism applies from outside:
attention reshapes with ``view(B, T, -1, head_dim)`` (a tensor-parallel shard holds n_heads / tp
heads), ``layers`` is a ModuleDict keyed by layer index, q/k/v/o are ``wq``/``wk``/``wv``/``wo`` and
the MLP ``w1``/``w2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from scalenlp.models.limits import check_fields

POOLINGS = ("mean", "cls", "pooler")
TASKS = ("embedding", "classification", "token_classification", "question_answering")
LABELLED_TASKS = ("classification", "token_classification")
CLASSIFIER_HEADS = ("pooler", "tanh", "relu")
# The Hugging Face model types these options reproduce (the names export writes back).
FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert")


@dataclass
class EncoderArgs:
    vocab_size: int = 30522
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 12
    ffn_dim: int = 1536
    max_seq_len: int = 512
    type_vocab_size: int = 2
    """Token types (segments): 2 for BERT; 1 (RoBERTa) reads none from the input; 0 (DistilBERT) has no table."""
    norm_eps: float = 1e-12
    dropout: float = 0.0
    pad_token_id: int = 0
    position_offset: int = 0
    """0: token i sits at position i (BERT). Above 0, as RoBERTa (fairseq) numbers them: non-pad tokens count
    from ``position_offset`` (RoBERTa's is pad_token_id + 1) and every pad token sits at ``position_offset - 1``;
    the position table has ``max_seq_len + position_offset`` rows."""
    pooling: str = "mean"
    """How ``embed`` pools hidden states into one vector: mean over real tokens, the first ([CLS]) token,
    or the pooler's output (dense + tanh over [CLS])."""
    normalize: bool = False
    """Scale sentence embeddings to unit length (so a dot product is the cosine similarity)."""
    task: str = "embedding"
    """What ``forward`` returns: hidden states, per-sequence logits, per-token logits or per-token
    (start, end) span logits."""
    labels: list[str] = field(default_factory=list)
    """Class names in logit order (id -> label), for the classification tasks."""
    pooler: bool = True
    """Whether the model has a pooler; token classification checkpoints are saved without one."""
    classifier_head: str = "pooler"
    """What sequence classification puts under its linear layer: the pooler (BERT), or a dense layer of its own
    over the first token followed by tanh (RoBERTa) or ReLU (DistilBERT)."""
    family: str = "bert"
    """The Hugging Face model type the weights are named after (``hf_encoder`` reads and writes it)."""
    architecture: str = "bert"
    """Written to ``model_args.json``: it tells the loader to build an ``Encoder``, not a decoder."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        """Raise ValueError with a readable reason for a model that cannot be built (a FieldError, naming the
        field, for a value of the wrong type or out of range)."""
        check_fields(self)
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is not a token of the {self.vocab_size}-token "
                             f"vocabulary")
        if self.dim % self.n_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        for name, value, allowed in (("pooling", self.pooling, POOLINGS), ("task", self.task, TASKS),
                                     ("architecture", self.architecture, ("bert",)), ("family", self.family, FAMILIES),
                                     ("classifier_head", self.classifier_head, CLASSIFIER_HEADS)):
            if value not in allowed:
                raise ValueError(f"encoder {name}={value!r} is not one of {allowed}")
        if self.task in LABELLED_TASKS and not self.labels:
            raise ValueError(f"task={self.task!r} needs the class names (labels)")
        if not self.pooler and (self.pooling == "pooler" or self.uses_pooler_head):
            raise ValueError("pooling='pooler' and task='classification' with classifier_head='pooler' need a "
                             "pooler (pooler=True)")
        if self.type_vocab_size < 0 or self.position_offset < 0:
            raise ValueError("type_vocab_size and position_offset must be 0 or more")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len {self.max_seq_len} leaves no position for a token (the position table "
                             f"has max_seq_len + position_offset = {self.max_seq_len + self.position_offset} rows)")

    def without_pooler(self) -> EncoderArgs:
        """These arguments for a model whose head never reads the pooler (which would get no gradient: DDP refuses
        that): no pooler, and sentence embeddings mean-pooled where they were the pooler's output."""
        return replace(self, pooler=False, pooling="mean" if self.pooling == "pooler" else self.pooling)

    @property
    def uses_pooler_head(self) -> bool:
        return self.task == "classification" and self.classifier_head == "pooler"

    @property
    def head_modules(self) -> tuple[str, ...]:
        """The task head's modules: what a pretrained encoder lacks and a fine-tune starts at random."""
        if self.task == "question_answering":
            return ("qa_outputs",)
        if self.task == "classification" and not self.uses_pooler_head:
            return ("head_dense", "classifier")  # RoBERTa's and DistilBERT's own dense layer, where BERT's uses the pooler
        return ("classifier",) if self.task in LABELLED_TASKS else ()

    @property
    def head_names(self) -> list[str]:
        """The head's state-dict names."""
        return [f"{module}.{p}" for module in self.head_modules for p in ("weight", "bias")]


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, args.dim)
        self.wk = nn.Linear(args.dim, args.dim)
        self.wv = nn.Linear(args.dim, args.dim)
        self.wo = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x: (B, T, dim); mask: (B, 1, 1, T), True for the keys every query may see, or None."""
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim)
        self.w2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))  # exact (erf) GELU, as BERT's "gelu"


class Block(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attention_norm(x + self.drop(self.attention(x, mask)))
        return self.ffn_norm(h + self.drop(self.feed_forward(h)))


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len + args.position_offset, args.dim)
        self.type_embeddings = nn.Embedding(args.type_vocab_size, args.dim) if args.type_vocab_size else None
        self.emb_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.drop = nn.Dropout(args.dropout)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.pooler = nn.Linear(args.dim, args.dim) if args.pooler else None
        heads = args.head_modules
        self.head_dense = nn.Linear(args.dim, args.dim) if "head_dense" in heads else None
        self.classifier = nn.Linear(args.dim, len(args.labels)) if "classifier" in heads else None
        # A span's start and end scores for every token (column 0: start, 1: end), named as transformers names it.
        self.qa_outputs = nn.Linear(args.dim, 2) if "qa_outputs" in heads else None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's init: N(0, 0.02) for matrices and embeddings, zero biases, unit LayerNorms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear):
                module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters; with exclude_embedding, only those that take part in matmuls (not the lookup tables)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            tables = (self.tok_embeddings, self.pos_embeddings, self.type_embeddings)
            n -= sum(e.weight.numel() for e in tables if e is not None)
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, 6N + 12·L·H·Q·T, as the decoder counts them (PaLM, appendix B)."""
        a = self.args
        return 6 * self.num_params(exclude_embedding=True) + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, T); attention_mask: (B, T), 1 for real tokens and 0 for padding (None: no padding);
        token_type_ids: (B, T) segment ids (None: all segment 0). Returns (B, T, dim)."""
        T = input_ids.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(input_ids) + self.pos_embeddings(self.positions(input_ids))
        if self.type_embeddings is not None:
            # One type (RoBERTa): a tokenizer may still number a pair's second text 1; the model has no segments.
            one_type = token_type_ids is None or self.args.type_vocab_size == 1
            h = h + self.type_embeddings(torch.zeros_like(input_ids) if one_type else token_type_ids)
        h = self.drop(self.emb_norm(h))
        # Padded keys are hidden from every query; padded queries still compute (and are ignored by pooling).
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.layers.values():
            h = block(h, mask)
        return h

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) or (B, T) position ids, per ``args.position_offset``."""
        offset = self.args.position_offset
        if not offset:
            return torch.arange(input_ids.shape[1], device=input_ids.device)
        real = input_ids.ne(self.args.pad_token_id).long()
        return torch.cumsum(real, dim=1) * real + (offset - 1)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """(B, dim) sentence vectors from (B, T, dim) hidden states, per ``args.pooling``."""
        if self.args.pooling == "mean":
            if attention_mask is None:
                return hidden.mean(dim=1)
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.args.pooling == "cls":
            return hidden[:, 0]
        return self.pooled(hidden)

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pooler's output: dense + tanh over the first ([CLS]) token."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, dim) sentence embeddings, pooled per ``args.pooling`` and unit length with ``args.normalize``."""
        vectors = self.pool(self.hidden_states(input_ids, attention_mask, token_type_ids), attention_mask)
        return F.normalize(vectors, p=2, dim=-1) if self.args.normalize else vectors

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (B, T, dim) for ``task="embedding"``, logits (B, labels) for classification,
        logits (B, T, labels) for token classification, (B, T, 2) start and end logits for question answering."""
        h = self.hidden_states(input_ids, attention_mask, token_type_ids)
        if self.args.task == "embedding":
            return h
        if self.args.task == "question_answering":
            return self.qa_outputs(h)  # transformers applies no dropout before this head
        if self.args.task == "classification":
            h = self.classify_first(h)
        return self.classifier(self.drop(h))

    def classify_first(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the sequence classifier's last linear layer reads, per ``args.classifier_head``; dropout as each
        family's Hugging Face head places it."""
        head = self.args.classifier_head
        if head == "pooler":
            return self.pooled(hidden)
        if head == "tanh":
            return torch.tanh(self.head_dense(self.drop(hidden[:, 0])))
        return F.relu(self.head_dense(hidden[:, 0]))
