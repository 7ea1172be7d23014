"""Encoder heads and families against transformers: a small random model of each Hugging Face class, saved
with save_pretrained, loads into scalenlp with the same outputs on a padded batch, and scalenlp's export of it
loads back into the same class with the same outputs."""

import pytest
import torch
from tokenizers import Tokenizer, models, processors

from scalenlp import loader
from scalenlp.models.hf_encoder import write_encoder_folder

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


def word_tokenizer(specials: tuple[str, ...], roles: str) -> Tokenizer:
    """A word-level vocabulary of VOCAB entries whose post-processor wraps a text in the family's first and last
    special tokens: any tokenizer.json does, the ids under test are made directly."""
    vocab = {token: i for i, token in enumerate(list(specials) + [f"w{i}" for i in range(VOCAB - len(specials))])}
    _, unk, bos, eos = roles.split()
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[
        (bos, vocab[bos]), (eos, vocab[eos])])
    return tokenizer


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
    hf, specials, roles = hf_model(transformers, family, task)
    hf.save_pretrained(tmp_path / "hf")
    word_tokenizer(specials, roles).save(str(tmp_path / "hf" / "tokenizer.json"))
    ids, mask = batch(hf.config.pad_token_id)
    with torch.no_grad():
        theirs = outputs(hf(input_ids=ids, attention_mask=mask))

    model, pre = loader.load(tmp_path / "hf")
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
