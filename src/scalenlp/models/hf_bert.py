"""Hugging Face BERT folders in and out: ``BertModel``, ``BertForSequenceClassification``,
``BertForTokenClassification`` and ``BertForQuestionAnswering`` <-> our ``Encoder``.

A folder is ``config.json`` (``model_type: bert``; ``architectures`` names the head, ``id2label`` the
classes) + safetensors + ``tokenizer.json``. Head models store the encoder under a ``bert.`` prefix and
the head as ``classifier.*`` (``qa_outputs.*`` for question answering). How sentence embeddings are pooled is not part of Hugging Face's config:
it lives in sentence-transformers' files beside it (``modules.json`` listing a Pooling module with its
own ``config.json``, and optionally a Normalize module), which are read and written here too.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer

from scalenlp.errors import UserError
from scalenlp.models.encoder import LABELLED_TASKS, Encoder, EncoderArgs
from scalenlp.models.hf import read_hf_tokenizer, read_safetensors
from scalenlp.models.io import WEIGHTS, replacing_folder, write_tokenizer
from scalenlp.models.pretrained import Pretrained

ARCHITECTURES = {"embedding": "BertModel", "classification": "BertForSequenceClassification",
                 "token_classification": "BertForTokenClassification",
                 "question_answering": "BertForQuestionAnswering"}
# sentence-transformers' pooling flags that our pooling modes compute; its other modes are not supported.
POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
MODULES = "modules.json"
ST_MODULE = "sentence_transformers.models."


def _pairs(args: EncoderArgs) -> list[tuple[str, str]]:
    """(our name, the name in ``BertModel``) for every encoder tensor."""
    pairs = [("tok_embeddings.weight", "embeddings.word_embeddings.weight"),
             ("pos_embeddings.weight", "embeddings.position_embeddings.weight"),
             ("type_embeddings.weight", "embeddings.token_type_embeddings.weight")]
    modules = [("emb_norm", "embeddings.LayerNorm")] + ([("pooler", "pooler.dense")] if args.pooler else [])
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"encoder.layer.{i}."
        modules += [(ours + a, hf + b) for a, b in (
            ("attention.wq", "attention.self.query"), ("attention.wk", "attention.self.key"),
            ("attention.wv", "attention.self.value"), ("attention.wo", "attention.output.dense"),
            ("attention_norm", "attention.output.LayerNorm"), ("feed_forward.w1", "intermediate.dense"),
            ("feed_forward.w2", "output.dense"), ("ffn_norm", "output.LayerNorm"))]
    return pairs + [(a + suffix, b + suffix) for a, b in modules for suffix in (".weight", ".bias")]


def _head_names(args: EncoderArgs) -> list[str]:
    """The task head's tensors, named alike in both (outside the ``bert.`` prefix)."""
    head = {"embedding": None, "question_answering": "qa_outputs"}.get(args.task, "classifier")
    return [f"{head}.weight", f"{head}.bias"] if head else []


def args_from_bert(config: dict, has_pooler: bool, pooling: str = "mean", normalize: bool = False) -> EncoderArgs:
    """Our encoder arguments from a BERT ``config.json``; the head comes from ``architectures``."""
    for key, supported in (("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
        if config.get(key, supported) != supported:
            raise UserError(f"BERT {key}={config[key]!r} is not supported; only {supported!r}")
    if config.get("is_decoder"):
        raise UserError("this BERT config has is_decoder=true (causal attention); only bidirectional encoders load")
    architecture = (config.get("architectures") or ["BertModel"])[0]
    # Other heads (masked LM, pretraining, ...) load as the bare encoder, as transformers' AutoModel does.
    task = {v: k for k, v in ARCHITECTURES.items()}.get(architecture, "embedding")
    labels: list[str] = []
    if task in LABELLED_TASKS:
        id2label = config.get("id2label") or {i: f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
        labels = [label for _, label in sorted(id2label.items(), key=lambda kv: int(kv[0]))]
    dropout = config.get("hidden_dropout_prob", 0.0)
    try:
        args = EncoderArgs(vocab_size=config["vocab_size"], dim=config["hidden_size"],
                           n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
                           ffn_dim=config["intermediate_size"], max_seq_len=config.get("max_position_embeddings", 512),
                           type_vocab_size=config.get("type_vocab_size", 2), norm_eps=config.get("layer_norm_eps", 1e-12),
                           dropout=dropout, pad_token_id=config.get("pad_token_id") or 0, pooling=pooling,
                           normalize=normalize, task=task, labels=labels, pooler=has_pooler)
        args.check()
    except KeyError as e:
        raise UserError(f"the BERT config.json lacks {e.args[0]}") from None
    except ValueError as e:
        raise UserError(f"cannot load this BERT model: {e}") from None
    return args


def sentence_pooling(folder: Path) -> tuple[str, bool]:
    """(pooling, normalize) from the sentence-transformers files in ``folder``; ("mean", False) without them,
    the pooling sentence-transformers itself gives a plain Hugging Face model."""
    if not (folder / MODULES).is_file():
        return "mean", False
    pooling, normalize = "mean", False
    try:
        for module in json.loads((folder / MODULES).read_text()):
            kind = module["type"].removeprefix(ST_MODULE)
            if kind == "Pooling":
                flags = json.loads((folder / module["path"] / "config.json").read_text())
                on = sorted(k for k, v in flags.items() if k.startswith("pooling_mode") and v is True)
                modes = [mode for mode, flag in POOLING_FLAGS.items() if flag in on]
                if len(on) != 1 or not modes:
                    raise UserError(f"sentence-transformers pooling {on} in {folder / module['path']} is not "
                                    f"supported; set exactly one of {list(POOLING_FLAGS.values())}")
                pooling = modes[0]
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise UserError(f"sentence-transformers module {module['type']} in {folder / MODULES} is not "
                                f"supported; only Transformer, Pooling (mean or CLS) and Normalize")
    except (json.JSONDecodeError, KeyError, TypeError, OSError) as e:
        raise UserError(f"cannot read the sentence-transformers configuration in {folder}: {e!r}") from None
    return pooling, normalize


def read_bert_folder(folder: Path, config: dict) -> Pretrained:
    """A Hugging Face BERT folder (its ``config.json`` already parsed) as a ``Pretrained`` encoder."""
    hf = read_safetensors(folder)
    # Head models keep the encoder under "bert."; BertModel has no prefix.
    hf = {k.removeprefix("bert."): v for k, v in hf.items()}
    args = args_from_bert(config, "pooler.dense.weight" in hf, *sentence_pooling(folder))
    names = _pairs(args) + [(name, name) for name in _head_names(args)]
    try:
        state = {ours: hf[theirs] for ours, theirs in names}
    except KeyError as e:
        raise UserError(f"{folder} lacks the tensor {e.args[0]}; its weights do not match its config.json") from None
    return Pretrained(args, state, *read_hf_tokenizer(folder), "hf", folder)


def bert_config(args: EncoderArgs) -> dict:
    """The ``config.json`` transformers builds the same model from."""
    config = {"architectures": [ARCHITECTURES[args.task]], "model_type": "bert", "vocab_size": args.vocab_size,
              "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
              "intermediate_size": args.ffn_dim, "hidden_act": "gelu", "hidden_dropout_prob": args.dropout,
              "attention_probs_dropout_prob": args.dropout, "max_position_embeddings": args.max_seq_len,
              "type_vocab_size": args.type_vocab_size, "layer_norm_eps": args.norm_eps,
              "pad_token_id": args.pad_token_id, "position_embedding_type": "absolute", "initializer_range": 0.02}
    if args.task in LABELLED_TASKS:
        config["id2label"] = dict(enumerate(args.labels))
        config["label2id"] = {label: i for i, label in enumerate(args.labels)}
    return config


def write_sentence_pooling(folder: Path, args: EncoderArgs) -> None:
    """sentence-transformers' ``modules.json`` and pooling config, so that the pooling (and normalisation)
    travels with the folder; it has no mode for BERT's pooler, so ``pooling="pooler"`` writes none."""
    if args.pooling not in POOLING_FLAGS:
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST_MODULE + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_MODULE + "Pooling"}]
    if args.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_MODULE + "Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / MODULES).write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": args.dim, **{flag: mode == args.pooling for mode, flag in POOLING_FLAGS.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


def write_bert_folder(model: Encoder, tokenizer: Tokenizer | str | Path | None, tokenizer_config: dict | None,
                      out_dir: str | Path) -> Path:
    """Our encoder -> a Hugging Face folder that ``AutoModel`` (embedding), ``AutoModelForSequenceClassification``
    / ``AutoModelForTokenClassification`` (with id2label / label2id) or ``AutoModelForQuestionAnswering`` loads,
    written to a temporary name first."""
    args = model.args
    ours = model.state_dict()
    prefix = "" if args.task == "embedding" else "bert."
    state = {prefix + theirs: ours[name] for name, theirs in _pairs(args)}
    state |= {name: ours[name] for name in _head_names(args)}
    with replacing_folder(out_dir) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt"})  # transformers reads the format tag to know these are PyTorch tensors
        (tmp / "config.json").write_text(json.dumps(bert_config(args), indent=2))
        write_tokenizer(tmp, tokenizer, tokenizer_config)
        write_sentence_pooling(tmp, args)
    return Path(out_dir)
