"""Hugging Face encoder folders in and out: BERT, RoBERTa, XLM-RoBERTa and DistilBERT, each as its ``...Model``,
``...ForSequenceClassification``, ``...ForTokenClassification`` and ``...ForQuestionAnswering`` <-> our ``Encoder``.

A folder is ``config.json`` (``model_type`` names the family; ``architectures`` the head, ``id2label`` the
classes) + safetensors + ``tokenizer.json``. Head models store the encoder under the family's prefix
(``bert.``, ``roberta.``, ``distilbert.``) and the head beside it. A family here is only names and options:
how its tensors and config keys are called and which ``EncoderArgs`` options (position offset, token types,
classifier head) reproduce it. How sentence embeddings are pooled is not part of Hugging Face's config: it
lives in sentence-transformers' files beside it (``modules.json`` listing a Pooling module with its own
``config.json``, and optionally a Normalize module), which are read and written here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer

from scalenlp.errors import UserError
from scalenlp.models.encoder import FAMILIES, LABELLED_TASKS, Encoder, EncoderArgs
from scalenlp.models.hf import read_hf_tokenizer, read_safetensors
from scalenlp.models.io import WEIGHTS, replacing_folder, write_tokenizer
from scalenlp.models.limits import check_counts, read_from
from scalenlp.models.pretrained import Pretrained

# The class-name ending of each task's head (after the family's stem: Bert, Roberta, XLMRoberta, DistilBert).
HEAD_CLASSES = {"embedding": "Model", "classification": "ForSequenceClassification",
                "token_classification": "ForTokenClassification", "question_answering": "ForQuestionAnswering"}
# Encoder model types people meet that this module cannot read: named so that they get the encoder error
# (which lists FAMILIES) rather than the decoder reader's.
OTHER_ENCODERS = ("albert", "camembert", "deberta", "deberta-v2", "electra", "modernbert", "mpnet", "xlm",
                  "mobilebert", "longformer", "nomic_bert", "jina_bert", "xlm-roberta-xl", "ernie")
# sentence-transformers' pooling flags that our pooling modes compute; its other modes are not supported.
POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
MODULES = "modules.json"
ST_MODULE = "sentence_transformers.models."


OUR_BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "attention_norm", "feed_forward.w1",
             "feed_forward.w2", "ffn_norm")
BERT_BLOCK = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
              "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
DISTILBERT_BLOCK = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "sa_layer_norm",
                    "ffn.lin1", "ffn.lin2", "output_layer_norm")


@dataclass(frozen=True)
class Family:
    model_type: str
    stem: str
    """Class names: stem + HEAD_CLASSES."""
    prefix: str
    """Where head models keep the encoder's tensors."""
    config_keys: dict[str, str]
    """Our EncoderArgs field -> its config.json key."""
    classifier_names: dict[str, str]
    """Our sequence-classification head modules -> theirs, where they differ."""
    layers: str = "encoder.layer"
    """Where the blocks are, each under its index."""
    block_names: tuple[str, ...] = BERT_BLOCK
    """A block's modules in OUR_BLOCK's order."""

    def encoder_pairs(self, args: EncoderArgs) -> list[tuple[str, str]]:
        """(our name, the name in the bare ``...Model``) for every encoder tensor."""
        embeddings = ["tok_embeddings", "pos_embeddings"] + (["type_embeddings"] if args.type_vocab_size else [])
        pairs = [(f"{ours}.weight", f"embeddings.{theirs}.weight") for ours, theirs in zip(
            embeddings, ("word_embeddings", "position_embeddings", "token_type_embeddings"))]
        modules = [("emb_norm", "embeddings.LayerNorm")] + ([("pooler", "pooler.dense")] if args.pooler else [])
        for i in range(args.n_layers):
            modules += [(f"layers.{i}.{a}", f"{self.layers}.{i}.{b}") for a, b in zip(OUR_BLOCK, self.block_names)]
        return pairs + [(a + suffix, b + suffix) for a, b in modules for suffix in (".weight", ".bias")]

    def head_pairs(self, args: EncoderArgs) -> list[tuple[str, str]]:
        """(our name, theirs) for the task head's tensors, which sit outside the encoder prefix in both."""
        renamed = self.classifier_names if args.task == "classification" else {}
        return [(f"{module}.{p}", f"{renamed.get(module, module)}.{p}") for module in args.head_modules
                for p in ("weight", "bias")]

    def options(self, config: dict) -> dict:
        """The EncoderArgs options that make our model compute as this family does."""
        pad = config.get("pad_token_id")
        if self.model_type == "distilbert":
            return {"type_vocab_size": 0, "position_offset": 0, "classifier_head": "relu", "norm_eps": 1e-12,
                    "pad_token_id": pad or 0}
        if self.model_type == "bert":
            return {"type_vocab_size": config.get("type_vocab_size", 2), "position_offset": 0,
                    "classifier_head": "pooler", "norm_eps": config.get("layer_norm_eps", 1e-12),
                    "pad_token_id": pad or 0}
        pad = 1 if pad is None else pad  # RoBERTa's vocabularies put <pad> at 1
        return {"type_vocab_size": config.get("type_vocab_size", 2), "position_offset": pad + 1,
                "classifier_head": "tanh", "norm_eps": config.get("layer_norm_eps", 1e-12), "pad_token_id": pad}


BERT_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
             "ffn_dim": "intermediate_size", "dropout": "hidden_dropout_prob", "activation": "hidden_act"}
ROBERTA_HEAD = {"head_dense": "classifier.dense", "classifier": "classifier.out_proj"}
FAMILY = {f.model_type: f for f in (
    Family("bert", "Bert", "bert.", BERT_KEYS, {}),
    Family("roberta", "Roberta", "roberta.", BERT_KEYS, ROBERTA_HEAD),
    Family("xlm-roberta", "XLMRoberta", "roberta.", BERT_KEYS, ROBERTA_HEAD),
    Family("distilbert", "DistilBert", "distilbert.", {"dim": "dim", "n_layers": "n_layers", "n_heads": "n_heads",
           "ffn_dim": "hidden_dim", "dropout": "dropout", "activation": "activation"}, {"head_dense": "pre_classifier"},
           "transformer.layer", DISTILBERT_BLOCK),
)}
assert tuple(FAMILY) == FAMILIES


def is_encoder_config(config: dict) -> bool:
    """Whether a config.json is for an encoder (the loader sends it here, not to the decoder reader)."""
    return config.get("model_type") in FAMILIES + OTHER_ENCODERS


def family_of(config: dict) -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILY:
        raise UserError(f"cannot load a Hugging Face {model_type!r} encoder; the supported encoder model types are "
                        f"{', '.join(FAMILIES)}")
    return FAMILY[model_type]


def args_from_config(config: dict, has_pooler: bool, pooling: str = "mean", normalize: bool = False,
                     where: str = "config.json") -> EncoderArgs:
    """Our encoder arguments from an encoder's ``config.json`` (``where``, for errors); the head comes from
    ``architectures``."""
    family = family_of(config)
    keys = family.config_keys
    name = family.stem
    with read_from(where):
        check_counts(config, {keys[field]: field for field in ("dim", "n_layers", "n_heads", "ffn_dim")}
                     | {k: k for k in ("vocab_size", "type_vocab_size", "pad_token_id")}
                     | {"max_position_embeddings": "max_seq_len", "num_labels": "num_labels"})
    activation = config.get(keys["activation"], "gelu")
    if activation != "gelu":
        raise UserError(f"{name} {keys['activation']}={activation!r} is not supported; only 'gelu'")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{name} position_embedding_type={config['position_embedding_type']!r} is not supported; "
                        f"only 'absolute'")
    if config.get("is_decoder"):
        raise UserError(f"this {name} config has is_decoder=true (causal attention); only bidirectional encoders load")
    with read_from(where):
        architecture = (config.get("architectures") or [name + "Model"])[0]
        # Other heads (masked LM, pretraining, ...) load as the bare encoder, as transformers' AutoModel does.
        task = next((t for t, ending in HEAD_CLASSES.items() if t != "embedding" and architecture.endswith(ending)),
                    "embedding")
        labels: list[str] = []
        if task in LABELLED_TASKS:
            id2label = config.get("id2label") or {i: f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
            labels = [label for _, label in sorted(id2label.items(), key=lambda kv: int(kv[0]))]
        options = family.options(config)
        args = EncoderArgs(vocab_size=config["vocab_size"], dim=config[keys["dim"]], n_layers=config[keys["n_layers"]],
                           n_heads=config[keys["n_heads"]], ffn_dim=config[keys["ffn_dim"]],
                           max_seq_len=config.get("max_position_embeddings", 512) - options["position_offset"],
                           dropout=config.get(keys["dropout"], 0.0), pooling=pooling, normalize=normalize, task=task,
                           labels=labels, pooler=has_pooler, family=family.model_type, **options)
        args.check()
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


def read_encoder_folder(folder: Path, config: dict) -> Pretrained:
    """A Hugging Face encoder folder (its ``config.json`` already parsed) as a ``Pretrained`` encoder."""
    family = family_of(config)
    hf = read_safetensors(folder)
    # Head models keep the encoder under the family's prefix; the bare model has none.
    hf = {k.removeprefix(family.prefix): v for k, v in hf.items()}
    args = args_from_config(config, "pooler.dense.weight" in hf, *sentence_pooling(folder), str(folder / "config.json"))
    try:
        state = {ours: hf[theirs] for ours, theirs in family.encoder_pairs(args) + family.head_pairs(args)}
    except KeyError as e:
        raise UserError(f"{folder} lacks the tensor {e.args[0]}; its weights do not match its config.json") from None
    return Pretrained(args, state, *read_hf_tokenizer(folder), "hf", folder)


def hf_config(args: EncoderArgs) -> dict:
    """The ``config.json`` transformers builds the same model from; UserError for options its family lacks."""
    family = FAMILY[args.family]
    expected = family.options({"type_vocab_size": args.type_vocab_size, "layer_norm_eps": args.norm_eps,
                               "pad_token_id": args.pad_token_id})
    differ = [f"{k}={getattr(args, k)!r}" for k, v in expected.items() if getattr(args, k) != v]
    if differ:
        raise UserError(f"this encoder ({', '.join(differ)}) has no Hugging Face {family.stem} equivalent; "
                        f"{family.stem} models have {', '.join(f'{k}={v!r}' for k, v in expected.items())}")
    keys = family.config_keys
    config = {"architectures": [family.stem + HEAD_CLASSES[args.task]], "model_type": family.model_type,
              "vocab_size": args.vocab_size, keys["dim"]: args.dim, keys["n_layers"]: args.n_layers,
              keys["n_heads"]: args.n_heads, keys["ffn_dim"]: args.ffn_dim, keys["activation"]: "gelu",
              keys["dropout"]: args.dropout, "max_position_embeddings": args.max_seq_len + args.position_offset,
              "pad_token_id": args.pad_token_id, "initializer_range": 0.02}
    if family.model_type == "distilbert":
        config |= {"attention_dropout": args.dropout, "qa_dropout": args.dropout, "seq_classif_dropout": args.dropout,
                   "sinusoidal_pos_embds": False}
    else:
        config |= {"attention_probs_dropout_prob": args.dropout, "type_vocab_size": args.type_vocab_size,
                   "layer_norm_eps": args.norm_eps, "position_embedding_type": "absolute"}
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


def write_encoder_folder(model: Encoder, tokenizer: Tokenizer | str | Path | None, tokenizer_config: dict | None,
                         out_dir: str | Path) -> Path:
    """Our encoder -> a Hugging Face folder of its family that ``AutoModel`` (embedding),
    ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification`` (with id2label / label2id) or
    ``AutoModelForQuestionAnswering`` loads, written to a temporary name first."""
    args = model.args
    family = FAMILY[args.family]
    config = hf_config(args)
    ours = model.state_dict()
    prefix = "" if args.task == "embedding" else family.prefix
    # Only the bare models (DistilBERT's excepted) and BERT's sequence classifier have a pooler in transformers; the
    # other heads are built without one, so ours (unused there) stays behind rather than load as unexpected.
    has_pooler = family.model_type != "distilbert" and (args.task == "embedding" or args.uses_pooler_head)
    pairs = family.encoder_pairs(replace(args, pooler=args.pooler and has_pooler))
    state = {prefix + theirs: ours[name] for name, theirs in pairs}
    state |= {theirs: ours[name] for name, theirs in family.head_pairs(args)}
    with replacing_folder(out_dir) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt"})  # transformers reads the format tag to know these are PyTorch tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(tmp, tokenizer, tokenizer_config)
        write_sentence_pooling(tmp, args)
    return Path(out_dir)
