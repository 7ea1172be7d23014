"""The BERT family: the same hidden states, sentence embeddings and logits as transformers and
sentence-transformers, Hugging Face folders in and out, export folders through the one loader (tensor
parallelism: tests/integration/test_encoder_tensor_parallel.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from scalenlp import loader
from scalenlp.errors import UserError
from scalenlp.models.encoder import Encoder, EncoderArgs
from scalenlp.models.hf_encoder import write_encoder_folder
from scalenlp.models.io import save_pretrained
from scalenlp.models.packaged import packaged_model

torch.set_num_threads(1)

MINILM = packaged_model("minilm")
SENTENCES = ["A man is playing a guitar.", "The quick brown fox jumps over the lazy dog near the riverbank today.",
             "Hi", "Sentence embeddings compare meanings."]


def tokenize(tokenizer, sentences):
    """Right-padded ids and attention mask for a batch, padded to its longest sentence."""
    tokenizer.no_truncation()
    tokenizer.enable_padding(pad_id=0)
    batch = tokenizer.encode_batch(sentences)
    return torch.tensor([e.ids for e in batch]), torch.tensor([e.attention_mask for e in batch])


@pytest.fixture(scope="module")
def minilm():
    model, pre = loader.load(MINILM)
    ids, mask = tokenize(pre.tokenizer, SENTENCES)
    assert mask.sum(1).unique().numel() == len(SENTENCES)  # every row padded differently
    return model, pre, ids, mask


def test_minilm_matches_transformers(minilm, transformers):
    model, pre, ids, mask = minilm
    assert (pre.args.pooling, pre.args.normalize) == ("mean", True)  # from modules.json and 1_Pooling/config.json
    hf = transformers.AutoModel.from_pretrained(str(MINILM)).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        ours, embedded = model(ids, mask), model.embed(ids, mask)
    real = mask.bool()
    # Only real tokens: hidden states at padding are ill-conditioned (transformers' own eager and SDPA paths
    # differ there by ~5e-5) and every pooling ignores them.
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    weights = mask.unsqueeze(-1).float()
    pooled = torch.nn.functional.normalize((theirs * weights).sum(1) / weights.sum(1), dim=-1)
    torch.testing.assert_close(embedded, pooled, atol=1e-5, rtol=0)


def test_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    model, _, ids, mask = minilm
    reference = SentenceTransformer(str(MINILM), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    with torch.no_grad():
        torch.testing.assert_close(model.embed(ids, mask), reference, atol=1e-5, rtol=0)


def tiny(task: str, **overrides) -> Encoder:
    torch.manual_seed(0)
    labels = {"embedding": [], "classification": ["negative", "positive"],
              "token_classification": ["O", "B-PER", "I-PER"]}[task]
    args = EncoderArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, task=task, labels=labels,
                       pooler=task != "token_classification", **overrides)
    return Encoder(args).eval()


@pytest.mark.parametrize("task", ["embedding", "classification", "token_classification"])
def test_bert_folder_loads_in_transformers(tmp_path, minilm, transformers, task):
    _, pre, ids, mask = minilm
    model = tiny(task)
    folder = write_encoder_folder(model, pre.tokenizer, pre.tokenizer_config, tmp_path / "hf")
    auto = {"embedding": transformers.AutoModel, "classification": transformers.AutoModelForSequenceClassification,
            "token_classification": transformers.AutoModelForTokenClassification}[task]
    hf = auto.from_pretrained(str(folder)).eval()
    types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        theirs = out.last_hidden_state if task == "embedding" else out.logits
        ours = model(ids, mask, types)
    keep = mask.bool() if ours.dim() == 3 else slice(None)  # per-token outputs: real tokens only, as above
    torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=0)
    if task != "embedding":
        assert [hf.config.id2label[i] for i in range(len(model.args.labels))] == model.args.labels
        assert hf.config.label2id == {label: i for i, label in enumerate(model.args.labels)}
    back, read = loader.load(folder)
    assert read.source == "hf" and read.args == model.args  # task, labels, pooling and normalize survive
    with torch.no_grad():
        torch.testing.assert_close(back(ids, mask, types), ours, atol=0, rtol=0)


def test_export_folder_round_trip(tmp_path, minilm):
    _, pre, ids, mask = minilm
    model = tiny("classification", pooling="cls", normalize=True)
    save_pretrained(model, tmp_path / "export", pre.tokenizer, tokenizer_config=pre.tokenizer_config)
    assert json.loads((tmp_path / "export" / "model_args.json").read_text())["architecture"] == "bert"
    back, read = loader.load(tmp_path / "export")
    assert isinstance(back, Encoder) and read.source == "export" and read.args == model.args
    with torch.no_grad():
        torch.testing.assert_close(back(ids, mask), model(ids, mask), atol=0, rtol=0)
        torch.testing.assert_close(back.embed(ids, mask), model.embed(ids, mask), atol=0, rtol=0)


def edit(folder: Path, name: str, change) -> None:
    file = folder / name
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


@pytest.mark.parametrize("name, change, message", [
    ("config.json", lambda c: {**c, "model_type": "electra"}, "'electra' encoder; the supported encoder model types are bert, "),
    ("config.json", lambda c: {**c, "hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ("config.json", lambda c: {**c, "position_embedding_type": "relative_key"}, "position_embedding_type"),
    ("1_Pooling/config.json", lambda c: {**c, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True},
     "pooling .* is not supported"),
    ("modules.json", lambda m: m + [{"idx": 3, "name": "3", "path": "3_Dense",
                                     "type": "sentence_transformers.models.Dense"}], "Dense .* is not supported"),
])
def test_unsupported_folders_are_user_errors(tmp_path, name, change, message):
    folder = write_encoder_folder(tiny("embedding"), MINILM / "tokenizer.json", None, tmp_path / "hf")
    loader.read(folder)  # unedited, it loads
    edit(folder, name, change)
    with pytest.raises(UserError, match=message):
        loader.read(folder)


def test_missing_tensor_is_a_user_error(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(MINILM, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    write_encoder_folder(tiny("embedding"), None, None, tmp_path / "small")
    shutil.copyfile(tmp_path / "small" / "model.safetensors", folder / "model.safetensors")  # 2 layers, config says 6
    with pytest.raises(UserError, match="lacks the tensor encoder.layer.2"):
        loader.read(folder)
