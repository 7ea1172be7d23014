"""Running `scalenlp train` as a user does (a subprocess per run), or in this process, and reading what it wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

# ../shared/data beside the repository (in CI), or beside a folder of worktrees the repository sits in; the tests
# that need one of its sets skip, saying so, where it is absent.
SHARED_DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents[1:] if (p / "shared" / "data").is_dir()),
                   Path("shared/data"))

# A debug model on a tiny batch: every run takes seconds, and float32 keeps parity comparisons exact.
TINY = ["model.flavor=debug", "tokenizer.vocab_size=400", "training.seq_len=32", "training.global_batch_size=4",
        "training.log_every=1", "training.eval_every=0", "training.warmup_steps=2", "training.lr=3e-3"]

# Hang guard only: a broken process group must fail the test, not stall CI forever.
HANG_GUARD_S = 900


def write_corpus(path: Path, chars: int = 60_000) -> Path:
    """A slice of Tiny Shakespeare, or generated text where ../shared/data is absent."""
    source = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if source.is_file():
        text = source.read_text()[:chars]
    else:
        words = "the of and to a in is it you that he was for on are with as his they be at one have this".split()
        text = "\n".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(chars // 60))
    path.write_text(text)
    return path


def cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def run_train(run_dir: Path, *sets: str, nproc: int = 1, extra: list[str] | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scalenlp", "train", "--run-dir", str(run_dir), "--nproc", str(nproc)]
    for s in sets:
        cmd += ["--set", s]
    cmd += extra or []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=HANG_GUARD_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def train_here(run_dir: Path, *sets: str) -> list[dict]:
    """One training run in this process (trainer.train on a config validated as the CLI validates it): its records."""
    from scalenlp.train.tasks import load_config
    from scalenlp.train.trainer import train

    return train(load_config(None, list(sets)), run_dir)


def main_train(run_dir: Path, *sets: str, nproc: int = 1) -> int:
    """`scalenlp train` through the CLI's main in this process, its exit status: with one process it trains here;
    with more it checks the layout here, then launches them."""
    from scalenlp.cli import main

    return main(["train", "--run-dir", str(run_dir), "--nproc", str(nproc), *[w for s in sets for w in ("--set", s)]])


def _records(run_dir: Path) -> list[dict]:
    # Only whole lines: a run under way may be in the middle of writing the last one.
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]]


def read_metrics(run_dir: Path) -> list[dict]:
    """Training records (one per logged step), without the evaluation records."""
    return [r for r in _records(run_dir) if "loss" in r]


def checkpoint_keys(path: Path) -> set[str]:
    """The names a checkpoint folder (torch.distributed.checkpoint's) holds, of the model and the optimizer."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def read_evaluations(run_dir: Path) -> list[dict]:
    """The evaluation records (val_loss, val_ppl), one per training.eval_every steps."""
    return [r for r in _records(run_dir) if "val_loss" in r]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def last_step(run_dir: Path) -> int:
    """The newest step in the run's metrics, 0 before the first (for watching a run that is under way)."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return records[-1]["step"] if records else 0


COLLECTIVE = re.compile(r"^(gloo|nccl):|^c10d::")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"}


def assert_traced(trace: Path, wanted: range, collectives: bool) -> None:
    """A profile.steps trace holds training steps ``wanted``, each in one profiler iteration, and every matmul and
    collective in it falls inside those iterations."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    iterations = [span(e) for e in events if e["name"].startswith("ProfilerStep#")]
    steps = {int(e["name"].split()[1]): span(e) for e in events if re.fullmatch(r"step \d+", e["name"])}
    assert sorted(steps) == list(wanted) and len(iterations) == len(wanted)
    for start, end in steps.values():
        assert sum(a <= start and end <= b for a, b in iterations) == 1
    compute = [e for e in events if e["name"] in MATMUL]
    comm = [e for e in events if COLLECTIVE.match(e["name"])]
    assert compute and (comm if collectives else not comm)
    for e in compute + comm:
        assert any(a <= e["ts"] <= b for a, b in iterations), e


def assert_same_checkpoints(sync: Path, not_sync: Path, kept: tuple[str, ...] = ("step-3", "step-4")) -> None:
    """Two runs of the same training, one saving its checkpoints synchronously (``sync``) and one asynchronously,
    kept the same checkpoints, byte for byte, and logged the same losses."""
    from scalenlp.train.checkpoint import read_train_state

    saved, saved_async = sync / "checkpoints", not_sync / "checkpoints"
    assert sorted(p.name for p in saved_async.iterdir()) == sorted(p.name for p in saved.iterdir()) == list(kept)
    for step in kept:
        a, b = read_train_state(saved / step), read_train_state(saved_async / step)
        # DCP's index records a save id of its own; every shard and RNG state is byte for byte the same.
        assert {k: v for k, v in a.pop("sha256").items() if k != ".metadata"} == \
            {k: v for k, v in b.pop("sha256").items() if k != ".metadata"}
        assert a == b
    assert [r["loss"] for r in read_metrics(not_sync)] == [r["loss"] for r in read_metrics(sync)]


def tiny_encoder(folder: Path) -> Path:
    """A small random BERT with MiniLM's tokenizer, exported as model.init reads it."""
    import torch

    from scalenlp.data.tokenizer import load_tokenizer
    from scalenlp.models.encoder import Encoder, EncoderArgs
    from scalenlp.models.io import save_pretrained
    from scalenlp.models.packaged import packaged_model

    tokenizer = load_tokenizer(packaged_model("minilm"))
    torch.manual_seed(0)
    args = EncoderArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=2, n_heads=2, ffn_dim=64,
                       max_seq_len=64)
    return save_pretrained(Encoder(args), folder, tokenizer)


def classify_sets(init: Path, train: Path, dev: Path | None, *extra: str) -> list[str]:
    """training.task=classification from ``init`` on labelled rows (``dev`` held out), on the CPU, logging each step."""
    sets = ["training.task=classification", f"model.init={init}", f"data.path={train}",
            "training.device=cpu", "training.log_every=1", "checkpoint.every=0"]
    return sets + ([f"data.eval_path={dev}"] if dev else []) + list(extra)


# Fine-tuning from model.init: ChatML, as SmolLM2 and Qwen write it.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOKENIZER_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
# The model keys of TINY are the checkpoint's business under model.init.
FINETUNE = [s for s in TINY if not s.startswith(("model.", "tokenizer."))]
SFT = [*FINETUNE, "training.task=sft", "training.seq_len=64", "data.val_fraction=0.2"]


def make_hf_llama(folder: Path, corpus: Path) -> Path:
    """A random LlamaForCausalLM (GQA, tied embeddings) saved by transformers, with a byte-level BPE trained on
    ``corpus`` (tokenizer.json) and a ChatML template beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from scalenlp.data import train_bpe

    tokenizer = train_bpe([corpus.read_text()], 400)
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return folder


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


# Small random configs of the decoder families scalenlp reads (models/families), each with the options that set it
# apart made to matter at this size: windows of 4 on sequences longer than that, soft-caps near the scores' scale.
HF_DECODERS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=True,
                                                     sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=None)),
    # Gemma untied: with its tied, sqrt(dim)-scaled embeddings a random model only repeats its last token.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(tie_word_embeddings=False, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                         pad_token_id=None)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        tie_word_embeddings=False, head_dim=16, sliding_window=4, query_pre_attn_scalar=20, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}})),
}


def make_hf_decoder(folder: Path, model_type: str, corpus: Path):
    """A random model of one of HF_DECODERS' families (2 layers, hidden 64, GQA) saved by transformers with a
    byte-level BPE of ``corpus``; returns the transformers model too (float32, eval mode)."""
    import torch
    import transformers

    from scalenlp.data import train_bpe

    config_class, model_class, options = HF_DECODERS[model_type]
    tokenizer = train_bpe([corpus.read_text()], 400)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        **{"vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "initializer_range": 0.2, "bos_token_id": None, "eos_token_id": None, **options})
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return model


def word_tokenizer(words: list[str], pad: str, unk: str, bos: str, eos: str):
    """A word-level tokenizer for tiny encoders: ``words`` (special tokens among them) split on white space, each
    text wrapped in ``bos`` ... ``eos``, batches padded with ``pad``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[
        (bos, vocab[bos]), (eos, vocab[eos])])
    tokenizer.enable_padding(pad_id=vocab[pad], pad_token=pad)
    return tokenizer


def roberta_sentiment(folder: Path) -> tuple[Path, Path]:
    """(model.init, data.path): a random RobertaModel (2 layers, hidden 32) saved by transformers with a word-level
    tokenizer, and 48 labelled rows whose adjectives give their label away."""
    import torch
    import transformers

    adjectives = {0: ["bad", "awful", "poor"], 1: ["good", "great", "fine"]}
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    g = torch.Generator().manual_seed(0)
    rows = [f"{i % 2}\tthe film was {' '.join(adjectives[i % 2][k] for k in torch.randint(0, 3, (3,), generator=g))}"
            for i in range(48)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.tsv").write_text("label\tsentence\n" + "\n".join(rows) + "\n")
    words = specials + ["the", "film", "was"] + adjectives[0] + adjectives[1]
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=34,
                                        pad_token_id=1, type_vocab_size=1)
    transformers.RobertaModel(config).save_pretrained(folder / "init")
    word_tokenizer(words, "<pad>", "<unk>", "<s>", "</s>").save(str(folder / "init" / "tokenizer.json"))
    return folder / "init", folder / "train.tsv"


def write_tagged(path: Path, sentences: int, seed: int = 0) -> Path:
    """A CoNLL file of short sentences whose words give their tags away: a first name (B-PER) perhaps with a
    surname (I-PER), a city (B-LOC), "new york" (B-LOC I-LOC), other words O."""
    import random

    rng = random.Random(seed)
    filler = "we saw a big dog then went home today and it rained on the old bridge".split()
    names, surnames, cities = ["paul", "mary", "ahmed", "li"], ["smith", "jones"], ["paris", "rome", "lagos"]
    lines = []
    for _ in range(sentences):
        words = [(w, "O") for w in rng.sample(filler, rng.randint(2, 7))]
        entity = rng.choice([[(rng.choice(names), "B-PER")], [(rng.choice(names), "B-PER"),
                                                               (rng.choice(surnames), "I-PER")],
                             [(rng.choice(cities), "B-LOC")], [("new", "B-LOC"), ("york", "I-LOC")]])
        at = rng.randint(0, len(words))
        lines += [f"{w}\t{t}" for w, t in words[:at] + entity + words[at:]] + [""]
    path.write_text("\n".join(lines))
    return path


# One fact per context, its answer a single word: a tiny model learns to point at it within a few dozen steps.
NAMES = ["Ada", "Alan", "Grace", "Linus", "Ken", "Barbara", "Edsger", "Donald"]
PLACES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Accra"]


def write_questions(path: Path, n: int, offset: int = 0) -> Path:
    """n questions "Where does NAME live?" as JSONL, each context a sentence naming the place."""
    rows = []
    for i in range(n):
        name, place = NAMES[(i + offset) % len(NAMES)], PLACES[(i * 3 + offset) % len(PLACES)]
        context = f"{name} lives in {place} and works there every day."
        rows.append({"id": f"q{i}", "question": f"Where does {name} live?", "context": context,
                     "answers": {"text": [place], "answer_start": [context.index(place)]}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_sets(init: Path, train: Path, dev: Path, *extra: str) -> list[str]:
    """The overrides of a short training.task = "qa" run on CPU with the files above."""
    return ["training.task=qa", f"model.init={init}", f"data.path={train}", f"data.eval_path={dev}",
            "training.device=cpu", "training.seq_len=32", "data.doc_stride=8", "training.global_batch_size=8",
            "training.lr=3e-3", "training.warmup_steps=0", "training.weight_decay=0", "checkpoint.every=0",
            "training.log_every=10", *extra]
