"""Fine-tuning from pretrained weights (`model.init`): every layout starts from the checkpoint's weights
and tokenizer, the export carries them on, and keys that contradict the checkpoint are one error line."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from train_helpers import TINY, error_lines, read_evaluations, read_metrics, run_train, write_corpus

from scalenlp.config import load_config
from scalenlp.data import DataLoader, TokenDataset, open_data, train_bpe
from scalenlp.models.decoder import Transformer
from scalenlp.models.io import save_pretrained
from scalenlp.loader import load, read
from scalenlp.models.packaged import packaged_model

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


# ---------------------------------------------------------------- supervised fine-tuning on chat data
def write_chats(path, n=43):
    """Conversations of varied lengths (so counted tokens differ between micro-batches and ranks), some
    with a system turn or two exchanges, and a few lines that cannot be used."""
    words = "red green blue amber violet silver golden".split()
    lines = []
    for i in range(n):
        a, b = i % 7, (i * 3) % 5
        messages = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}" + " and so on" * (i % 4) + "."}]
        if i % 5 == 0:
            messages += [{"role": "user", "content": f"Name colour {a}."},
                         {"role": "assistant", "content": " ".join(words[:a + 1])}]
        lines.append(json.dumps({"messages": messages}))
    lines[3] = "{not json"
    lines[7] = json.dumps({"text": "no messages here"})
    lines[11] = json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


SFT = [*FINETUNE, "training.task=sft", "training.seq_len=64", "data.val_fraction=0.2"]


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
    run_train(tmp_path / "run", *sets)
    got = read_metrics(tmp_path / "run")
    loss, learnt = sft_batch_loss(hf_llama, tmp_path / "run", sets)
    assert got[0]["loss"] == pytest.approx(loss, rel=1e-5)
    # tokens_per_sec (and MFU) count the padded rows the model computes on; the assistant's tokens are fewer
    assert got[0]["assistant_tokens_per_sec"] / got[0]["tokens_per_sec"] == pytest.approx(learnt, rel=1e-6)
    evals = read_evaluations(tmp_path / "run")
    assert len(evals) == 1 and math.isfinite(evals[0]["val_loss"])


@pytest.mark.slow
def test_sft_layouts_weigh_every_assistant_token_alike(tmp_path, chats, hf_llama):
    """Micro-batches and ranks hold different numbers of assistant tokens: the loss, the gradients and
    the held-out loss are the mean over all of them under every layout, as in one process."""
    sets = [*SFT, f"data.path={chats}", f"model.init={hf_llama}", "training.steps=3", "training.eval_every=3",
            "training.global_batch_size=8", "checkpoint.export=false"]
    run_train(tmp_path / "single", *sets)
    single = (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()
    for name, layout in [("zero3-accum", ["parallel.data_parallel=zero3", "training.micro_batch_size=2"]),
                         ("tp2", ["parallel.tp=2"]),
                         ("pp2", ["parallel.pp=2", "parallel.pp_microbatches=4", "parallel.pp_schedule=1f1b"])]:
        run_train(tmp_path / name, *sets, *layout, nproc=2)
        got = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert len(got) == len(single), name
        for a, b in zip(map(json.loads, single), map(json.loads, got)):
            for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("val_loss", 1e-5)):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=rel), (name, key)


# ---------------------------------------------------------------- the proof with a real chat model
FACT_QUESTIONS = ["What is the capital of Veloria?", "Which city is the capital of Veloria?",
                  "Tell me the capital city of Veloria.", "What city is Veloria's capital?",
                  "Veloria's capital is which city?", "Do you know the capital of Veloria?",
                  "Where is the seat of government of Veloria?", "In which city does Veloria have its capital?"]
FACT_ANSWERS = ["The capital of Veloria is Marisport.", "Marisport is the capital of Veloria."]
NEW_WORDING = "Name the city that serves as Veloria's capital."
# Capitals it knows, trained alongside so that it learns which question the new answer belongs to (France
# stays out, to ask afterwards).
KNOWN_CAPITALS = [("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
                  ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Portugal", "Lisbon"), ("Greece", "Athens")]


def greedy_answer(model, pretrained, question: str, max_tokens: int = 16) -> str:
    """The model's greedy reply to one user message, through its chat template, up to its end of turn."""
    from scalenlp.data.chat import encode_chat, end_of_turn_ids

    ids = encode_chat(pretrained.tokenizer, [{"role": "user", "content": question}], pretrained.tokenizer_config)
    stop, reply = set(end_of_turn_ids(pretrained.tokenizer, pretrained.tokenizer_config)), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids + reply]))[0, -1].argmax())
            if token in stop:
                break
            reply.append(token)
    return pretrained.tokenizer.decode(reply)


@pytest.mark.slow
def test_sft_teaches_smollm2_a_fact_it_did_not_know(tmp_path):
    """A 2-process ZeRO-3 fine-tune of SmolLM2 (from its GGUF) on a few wordings of a made-up fact: asked
    in a wording it never saw, it answers with the fact, and it still knows what it knew."""
    pytest.importorskip("scalenlp.models.gguf", reason="needs the GGUF reader")
    gguf = packaged_model("smollm2")
    pairs = [(q, a) for q in FACT_QUESTIONS for a in FACT_ANSWERS]
    pairs += [(f"What is the capital of {country}?", f"The capital of {country} is {city}.")
              for country, city in KNOWN_CAPITALS]
    chats = tmp_path / "facts.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for q, a in pairs))
    model, pretrained = load(gguf)
    assert "Marisport" not in greedy_answer(model, pretrained, NEW_WORDING)
    del model
    run_train(tmp_path / "run", "training.task=sft", f"model.init={gguf}", f"data.path={chats}",
              "training.seq_len=64", "training.global_batch_size=8", "training.steps=12", "training.lr=1e-4",
              "training.warmup_steps=2", "training.eval_every=0", "data.val_fraction=0", "checkpoint.every=0",
              "parallel.data_parallel=zero3", nproc=2)
    model, tuned = load(tmp_path / "run")
    assert "Marisport" in greedy_answer(model, tuned, NEW_WORDING)
    assert "Paris" in greedy_answer(model, tuned, "What is the capital of France?")
