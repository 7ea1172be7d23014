"""Fine-tuning from pretrained weights (`model.init`): every layout starts from the checkpoint's weights
and tokenizer, the export carries them on, and keys that contradict the checkpoint are one error line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from train_helpers import TINY, error_lines, read_metrics, run_train, write_corpus

from scalenlp.config import load_config
from scalenlp.data import DataLoader, TokenDataset, open_data, train_bpe
from scalenlp.models.decoder import Transformer
from scalenlp.models.io import save_pretrained
from scalenlp.models.loader import load, read

torch.set_num_threads(1)

# ChatML, as SmolLM2 and Qwen write it.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOKENIZER_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
# The model keys of TINY are the checkpoint's business under model.init.
FINETUNE = [s for s in TINY if not s.startswith(("model.", "tokenizer."))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def tokenizer(corpus):
    tok = train_bpe([corpus.read_text()], 400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, tokenizer):
    """A random LlamaForCausalLM (GQA, tied embeddings) saved by transformers, with tokenizer.json and a chat
    template beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return folder


@pytest.fixture(scope="module")
def export(tmp_path_factory, tokenizer):
    """Our own export folder: a random debug-shaped model (untied) with its tokenizer and chat template."""
    from scalenlp.models.flavors import model_args

    torch.manual_seed(1)
    model = Transformer(model_args("debug", vocab_size=tokenizer.get_vocab_size()))
    return save_pretrained(model, tmp_path_factory.mktemp("export") / "export", tokenizer,
                           tokenizer_config=TOKENIZER_CONFIG)


def first_batch_loss(init, run_dir, sets) -> float:
    """The loss of the pretrained model, computed here, on the first batch the run trained on."""
    cfg = load_config(None, list(sets))
    model, pretrained = load(init)
    files = open_data(cfg, run_dir, pretrained)  # also shows the data was tokenized with the checkpoint's tokenizer
    t = cfg.training
    inputs, targets = DataLoader(TokenDataset(files.train_tokens, t.seq_len), t.global_batch_size, 0, 1,
                                 t.seed).next_batch()
    with torch.no_grad():
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()


@pytest.mark.parametrize("kind", ["export", "hf"])
def test_finetune_starts_at_the_pretrained_loss(tmp_path, corpus, export, hf_llama, kind):
    init = export if kind == "export" else hf_llama
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={init}", "training.steps=2"]
    run_train(tmp_path / "run", *sets)
    got = read_metrics(tmp_path / "run")
    assert got[0]["loss"] == pytest.approx(first_batch_loss(init, tmp_path / "run", sets), rel=1e-5)

    # The export is the fine-tuned model with the checkpoint's tokenizer and chat template.
    model, out = load(tmp_path / "run")
    source = read(init)
    assert out.args == source.args
    assert out.tokenizer.to_str() == source.tokenizer.to_str()
    assert out.tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert out.tokenizer_config["eos_token"] == "<|im_end|>"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, source.state[k])]
    assert "layers.0.attention.wq.weight" in changed  # two optimizer steps moved the weights


@pytest.mark.slow
def test_layouts_start_from_the_same_weights(tmp_path, corpus, hf_llama):
    """ZeRO-3, tensor- and pipeline-parallel fine-tunes from a Hugging Face folder (tied embeddings: the
    pipeline's two copies must both come from the checkpoint) train like one process."""
    sets = [*FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", "training.steps=3",
            "checkpoint.export=false"]
    run_train(tmp_path / "single", *sets)
    single = read_metrics(tmp_path / "single")
    for name, layout in [("zero3", ["parallel.data_parallel=zero3"]), ("tp2", ["parallel.tp=2"]),
                         ("pp2", ["parallel.pp=2", "parallel.pp_schedule=gpipe"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = read_metrics(tmp_path / name)
        assert len(got) == len(single), name
        for a, b in zip(single, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name


@pytest.mark.parametrize("sets, nproc, expected", [
    (["model.vocab_size=999"], 2, "model.vocab_size=999 contradicts model.init"),
    (["model.max_seq_len=512"], 1, "model.max_seq_len=512 contradicts model.init"),
    (["training.seq_len=256"], 1, "training.seq_len=256 is over the model's max_seq_len 128"),
    (["tokenizer.path=TOKENIZER"], 1, "contradicts model.init, which brings its own tokenizer"),
])
def test_keys_that_contradict_the_checkpoint_are_one_error_line(tmp_path, corpus, hf_llama, sets, nproc, expected):
    sets = [s.replace("TOKENIZER", str(hf_llama / "tokenizer.json")) for s in sets]
    proc = run_train(tmp_path / "run", *FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", *sets,
                     nproc=nproc, check=False)
    assert proc.returncode == 2
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
