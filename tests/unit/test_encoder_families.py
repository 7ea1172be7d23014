"""Encoder heads and families against transformers: a small random model of each Hugging Face class, saved
with save_pretrained, loads into scalenlp with the same outputs on a padded batch, and scalenlp's export of it
loads back into the same class with the same outputs."""

import pytest
import torch
from tokenizers import Tokenizer, models, processors

from scalenlp import loader
from scalenlp.models.hf_bert import write_bert_folder

torch.set_num_threads(1)

VOCAB = 64
# Per family: the transformers config class and its special tokens (id order as the family's vocabularies have them).
FAMILIES = {"bert": ("BertConfig", ["[PAD]", "[UNK]", "[CLS]", "[SEP]"])}
CLASSES = {"embedding": "Model", "question_answering": "ForQuestionAnswering"}


def word_tokenizer(specials: list[str]) -> Tokenizer:
    """A word-level vocabulary of VOCAB entries whose post-processor wraps a text in the family's first and last
    special tokens: any tokenizer.json does, the ids under test are made directly."""
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[1]))
    bos, eos = specials[2], specials[3]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[
        (bos, vocab[bos]), (eos, vocab[eos])])
    return tokenizer


def batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of different lengths, right-padded with the family's pad id, and their attention mask."""
    g = torch.Generator().manual_seed(1)
    lengths = [9, 5, 3]
    ids = torch.full((len(lengths), max(lengths)), pad_id)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(4, VOCAB, (n,), generator=g)
        mask[r, :n] = 1
    return ids, mask


def hf_model(transformers, family: str, task: str):
    """transformers' random model of this family and head, every tensor perturbed so that a swapped bias or
    LayerNorm shows (their init is all zeros / all ones)."""
    config_class, specials = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=specials.index(specials[0]))
    torch.manual_seed(0)
    model = getattr(transformers, config_class.removesuffix("Config") + CLASSES[task])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, specials


def outputs(out) -> torch.Tensor:
    """The comparable output of a transformers model: hidden states, logits or stacked span logits."""
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> None:
    """Equal within 1e-4 relative; per-token outputs on real tokens only (padded positions compute on, ignored)."""
    keep = mask.bool() if ours.dim() == 3 else slice(None)
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("task", sorted(CLASSES))
def test_hf_folder_in_and_out(tmp_path, transformers, family, task):
    hf, specials = hf_model(transformers, family, task)
    hf.save_pretrained(tmp_path / "hf")
    word_tokenizer(specials).save(str(tmp_path / "hf" / "tokenizer.json"))
    ids, mask = batch(hf.config.pad_token_id)
    with torch.no_grad():
        theirs = outputs(hf(input_ids=ids, attention_mask=mask))

    model, pre = loader.load(tmp_path / "hf")
    assert pre.args.task == task
    with torch.no_grad():
        ours = model(ids, mask)
    assert ours.shape == theirs.shape
    assert_same(ours, theirs, mask)

    write_bert_folder(model, pre.tokenizer, pre.tokenizer_config, tmp_path / "out")
    back = type(hf).from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert_same(outputs(back(input_ids=ids, attention_mask=mask)), ours, mask)
