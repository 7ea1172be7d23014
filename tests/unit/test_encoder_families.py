"""Encoder heads and families against transformers: a small random model of each Hugging Face class, saved
with save_pretrained, loads into scalenlp with the same outputs on a padded batch, and scalenlp's export of it
loads back into the same class with the same outputs."""

import json
import re

import pytest
import torch
from tokenizers import Tokenizer

from scalenlp import loader
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.encoder_engine import encoder_from_checkpoint, is_encoder
from scalenlp.errors import UserError
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.hf_encoder import write_encoder_folder
from train_helpers import classify_sets, read_metrics, roberta_sentiment, train_here, word_tokenizer

torch.set_num_threads(1)

VOCAB = 64
# Per family: transformers' config class, its size keys, and the special tokens in id order as the family's
# vocabularies have them (the first four: pad, unk, cls/bos, sep/eos in BERT's order; RoBERTa's own order).
BERT_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
ROBERTA = ("<s>", "<pad>", "</s>", "<unk>")
FAMILIES = {
    "bert": ("BertConfig", BERT_SIZES, ("[PAD]", "[UNK]", "[CLS]", "[SEP]"), "[PAD] [UNK] [CLS] [SEP]"),
    "roberta": ("RobertaConfig", {**BERT_SIZES, "type_vocab_size": 1}, ROBERTA, "<pad> <unk> <s> </s>"),
    "xlm-roberta": ("XLMRobertaConfig", {**BERT_SIZES, "type_vocab_size": 1}, ROBERTA, "<pad> <unk> <s> </s>"),
    "distilbert": ("DistilBertConfig", {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64},
                   ("[PAD]", "[UNK]", "[CLS]", "[SEP]"), "[PAD] [UNK] [CLS] [SEP]"),
}
CLASSES = {"embedding": "Model", "classification": "ForSequenceClassification",
           "token_classification": "ForTokenClassification", "question_answering": "ForQuestionAnswering"}
LABELS = ["neg", "neutral", "pos"]
LABELLED = ("classification", "token_classification")


def batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of different lengths and one left-padded row (where RoBERTa's positions, counted over
    non-pad tokens, differ from 0..T-1 on real tokens), with the family's pad id, and their attention mask."""
    g = torch.Generator().manual_seed(1)
    spans = [(0, 9), (0, 5), (0, 3), (4, 9)]
    ids = torch.full((len(spans), 9), pad_id)
    mask = torch.zeros_like(ids)
    for r, (a, b) in enumerate(spans):
        ids[r, a:b] = torch.randint(4, VOCAB, (b - a,), generator=g)
        mask[r, a:b] = 1
    return ids, mask


def hf_model(transformers, family: str, task: str):
    """transformers' random model of this family and head, every tensor perturbed so that a swapped bias or
    LayerNorm shows (their init is all zeros / all ones)."""
    config_class, sizes, specials, roles = FAMILIES[family]
    labels = {"id2label": dict(enumerate(LABELS))} if task in LABELLED else {}
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, max_position_embeddings=40, pad_token_id=specials.index(roles.split()[0]), **sizes, **labels)
    torch.manual_seed(0)
    model = getattr(transformers, config_class.removesuffix("Config") + CLASSES[task])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, specials, roles


def hf_folder(tmp_path, transformers, family: str, task: str):
    """(transformers' model, the folder it saved with a tokenizer.json beside it)."""
    hf, specials, roles = hf_model(transformers, family, task)
    hf.save_pretrained(tmp_path / "hf")
    words = list(specials) + [f"w{i}" for i in range(VOCAB - len(specials))]
    word_tokenizer(words, *roles.split()).save(str(tmp_path / "hf" / "tokenizer.json"))
    return hf, tmp_path / "hf"


def outputs(out) -> torch.Tensor:
    """The comparable output of a transformers model: hidden states, logits or stacked span logits."""
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> None:
    """Equal within 1e-4 relative; per-token outputs on real tokens only (padded positions compute on, ignored),
    per-sequence outputs on rows whose first token is real (the one those heads read)."""
    keep = mask.bool() if ours.dim() == 3 else mask[:, 0].bool()
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("task", sorted(CLASSES))
def test_hf_folder_in_and_out(tmp_path, transformers, family, task):
    hf, folder = hf_folder(tmp_path, transformers, family, task)
    ids, mask = batch(hf.config.pad_token_id)
    with torch.no_grad():
        theirs = outputs(hf(input_ids=ids, attention_mask=mask))

    model, pre = loader.load(folder)
    assert (pre.args.family, pre.args.task) == (family, task)
    assert pre.args.labels == (LABELS if task in LABELLED else [])
    with torch.no_grad():
        ours = model(ids, mask)
    assert ours.shape == theirs.shape
    assert_same(ours, theirs, mask)

    write_encoder_folder(model, pre.tokenizer, pre.tokenizer_config, tmp_path / "out")
    back, info = type(hf).from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # every tensor named as transformers names it
    assert back.config.pad_token_id == hf.config.pad_token_id
    if task in LABELLED:
        assert back.config.id2label == hf.config.id2label
    back.eval()
    with torch.no_grad():
        assert_same(outputs(back(input_ids=ids, attention_mask=mask)), ours, mask)


def test_roberta_classifier_is_served(tmp_path, transformers):
    """A RoBERTa folder goes to the encoder batcher (not the decoder engine) and classifies as transformers does,
    through the same head as transformers'."""
    hf, folder = hf_folder(tmp_path, transformers, "roberta", "classification")
    assert is_encoder(folder)
    texts = ["w5 w7 w9 w11 w13", "w10 w11", "w3"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=hf.config.pad_token_id)
    encoded = tokenizer.encode_batch(texts)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([e.ids for e in encoded]),
                      attention_mask=torch.tensor([e.attention_mask for e in encoded])).logits.softmax(-1)
    engine = encoder_from_checkpoint(EncoderEngineConfig(str(folder), dtype="float32", device="cpu"))
    try:
        assert engine.labels == LABELS
        torch.testing.assert_close(engine.run("classify", texts), expected, rtol=1e-4, atol=1e-6)
    finally:
        engine.stop()


def test_roberta_fine_tunes_from_its_bare_model(tmp_path, transformers):
    """training.task=classification from a RobertaModel folder: the head RobertaForSequenceClassification adds
    (classifier.dense and out_proj) starts at random, the loss falls, and the run's export is a RoBERTa classifier
    that transformers loads with the same logits."""
    init, data = roberta_sentiment(tmp_path)
    train_here(tmp_path / "run", *classify_sets(
        init, data, None, "training.steps=12", "training.global_batch_size=8",
        "training.seq_len=16", "training.eval_every=0", "training.lr=3e-3", "training.warmup_steps=1"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])

    model, pre = loader.load(tmp_path / "run" / "export")
    assert (pre.args.family, pre.args.classifier_head, pre.args.labels) == ("roberta", "tanh", ["0", "1"])
    assert not pre.args.pooler  # RobertaModel's pooler is left behind: unused, it would stall DDP
    write_encoder_folder(model, pre.tokenizer, pre.tokenizer_config, tmp_path / "hf")
    back, info = transformers.RobertaForSequenceClassification.from_pretrained(
        str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = batch(1)
    ids = ids.clamp(max=model.args.vocab_size - 1)
    with torch.no_grad():
        assert_same(model(ids, mask), back.eval()(input_ids=ids, attention_mask=mask).logits, mask)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "modernbert"}, "cannot load a Hugging Face 'modernbert' encoder; the supported encoder model "
                                   "types are bert, roberta, xlm-roberta, distilbert"),
    ({"activation": "relu"}, "DistilBert activation='relu' is not supported; only 'gelu'"),
    ({"n_heads": 5}, "config.json: model dim 32 is not divisible by n_heads 5"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be at least 1"),
])
def test_unsupported_encoder_folders_are_one_error(tmp_path, transformers, change, message):
    _, folder = hf_folder(tmp_path, transformers, "distilbert", "embedding")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UserError, match=re.escape(message)):
        loader.read(folder)


def test_options_without_a_hf_equivalent_are_refused_at_export(tmp_path):
    model = Encoder(EncoderArgs(dim=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=16, family="distilbert"))
    with pytest.raises(UserError, match=re.escape("this encoder (type_vocab_size=2, classifier_head='pooler') has no "
                                                  "Hugging Face DistilBert equivalent")):
        write_encoder_folder(model, None, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
