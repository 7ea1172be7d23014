"""Fine-tuning from pretrained weights (`model.init`), in this process: a run starts at the checkpoint's loss (our
export or a Hugging Face folder; chat rows on the assistant's tokens only) and its export carries the checkpoint's
tokenizer and template on; keys that contradict the checkpoint are one error line. Several processes under each
layout: tests/integration/test_fine_tuning_layouts.py; SmolLM2 taught a fact: test_sft_teaches_smollm2_a_fact.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scalenlp.config import load_config
from scalenlp.data import DataLoader, TokenDataset, load_tokenizer, open_data
from scalenlp.loader import load, read
from scalenlp.models.decoder import Transformer
from scalenlp.models.io import save_pretrained
from train_helpers import (
    CHAT_TEMPLATE,
    FINETUNE,
    SFT,
    TOKENIZER_CONFIG,
    error_lines,
    main_train,
    read_evaluations,
    read_metrics,
    train_here,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def export(tmp_path_factory, hf_llama):
    """Our own export folder: a random debug-shaped model (untied) with the Llama's tokenizer and chat template."""
    from scalenlp.models.flavors import model_args

    tokenizer = load_tokenizer(hf_llama / "tokenizer.json")
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
    train_here(tmp_path / "run", *sets)
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


@pytest.mark.parametrize("sets, nproc, expected", [
    (["model.vocab_size=999"], 2, "model.vocab_size=999 contradicts model.init"),
    (["model.max_seq_len=512"], 1, "model.max_seq_len=512 contradicts model.init"),
    (["training.seq_len=256"], 1, "training.seq_len=256 is over the model's max_seq_len 128"),
    (["tokenizer.path=TOKENIZER"], 1, "contradicts model.init, which brings its own tokenizer"),
])
def test_keys_that_contradict_the_checkpoint_are_one_error_line(tmp_path, corpus, hf_llama, capsys, sets, nproc,
                                                                expected):
    sets = [s.replace("TOKENIZER", str(hf_llama / "tokenizer.json")) for s in sets]
    # One step: where a check is missing the run ends soon, and the test fails on its exit status.
    assert main_train(tmp_path / "run", *FINETUNE, f"data.path={corpus}", f"model.init={hf_llama}", "training.steps=1",
                      *sets, nproc=nproc) == 2  # two processes: refused before they start
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and expected in errors[0], errors


# ---------------------------------------------------------------- supervised fine-tuning on chat data
def test_chat_rows_train_on_assistant_tokens_only(tmp_path, chats, hf_llama):
    from scalenlp.data import prepare_data
    from scalenlp.data.sft import CHAT_ROWS, ChatDataset

    cfg = load_config(None, [*SFT, f"data.path={chats}", f"model.init={hf_llama}"])
    pretrained = read(hf_llama)
    logs = []
    files = prepare_data(cfg, tmp_path / "run", log=logs.append, pretrained=pretrained, rows=CHAT_ROWS)
    skipped = [line for line in logs if "skipped" in line]
    assert len(skipped) == 1 and "skipped 3 line(s)" in skipped[0], logs
    for lineno, why in ((4, "not valid JSON"), (8, "no `messages` list"), (12, "'wizard'")):
        assert f"chats.jsonl:{lineno}: " in skipped[0] and why in skipped[0]
    train, val = ChatDataset(files.train_tokens, 64), ChatDataset(files.val_tokens, 64)
    assert (len(train), len(val)) == (32, 8)  # 40 usable conversations, the last fifth held out

    # Only the assistant's answers and the ends of their turns are targets, and each target is the
    # next input token; prompts, template markup and padding are not.
    inputs, targets = train.batch([0, 1])
    decode = lambda ids: pretrained.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert decode(targets[1][targets[1] != -100].tolist()) == "1 plus 3 is 4 and so on.<|im_end|>"
    assert decode(inputs[1].tolist()).startswith("<|im_start|>user\nWhat is 1 plus 3?<|im_end|>\n<|im_start|>assistant")
    # Line 1: a system turn and two exchanges, longer than a row: cut at seq_len + 1 tokens, its targets
    # the start of the assistant turns (where the cut falls depends on the test tokenizer's merges).
    cut = decode(targets[0][targets[0] != -100].tolist())
    whole = "0 plus 0 is 0.<|im_end|>red<|im_end|>"
    assert cut and whole.startswith(cut) and cut != whole
    assert decode(inputs[0].tolist()).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n")
    for row_inputs, row_targets in zip(inputs, targets):
        mask = row_targets != -100
        assert torch.equal(row_targets[:-1][mask[:-1]], row_inputs[1:][mask[:-1]])


def sft_batch_loss(init, run_dir, sets) -> tuple[float, float]:
    """The pretrained model's mean loss over the assistant tokens of the run's first global batch, and the
    share of its tokens that are the assistant's."""
    from scalenlp.data.sft import CHAT_ROWS, ChatDataset

    cfg = load_config(None, list(sets))
    model, pretrained = load(init)
    files = open_data(cfg, run_dir, pretrained, CHAT_ROWS)
    t = cfg.training
    inputs, targets = DataLoader(ChatDataset(files.train_tokens, t.seq_len), t.global_batch_size, 0, 1,
                                 t.seed).next_batch()
    with torch.no_grad():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100).item()
    return loss, ((targets != -100).sum() / targets.numel()).item()


def test_sft_starts_at_the_pretrained_loss_on_assistant_tokens(tmp_path, chats, hf_llama):
    sets = [*SFT, f"data.path={chats}", f"model.init={hf_llama}", "training.steps=2", "training.eval_every=2",
            "training.micro_batch_size=1"]
    train_here(tmp_path / "run", *sets)
    got = read_metrics(tmp_path / "run")
    loss, learnt = sft_batch_loss(hf_llama, tmp_path / "run", sets)
    assert got[0]["loss"] == pytest.approx(loss, rel=1e-5)
    # tokens_per_sec (and MFU) count the padded rows the model computes on; the assistant's tokens are fewer
    assert got[0]["assistant_tokens_per_sec"] / got[0]["tokens_per_sec"] == pytest.approx(learnt, rel=1e-6)
    evals = read_evaluations(tmp_path / "run")
    assert len(evals) == 1 and math.isfinite(evals[0]["val_loss"])
