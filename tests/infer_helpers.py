"""Fixtures for the inference tests: a tiny exported model with its own byte-level BPE tokenizer (and a tiny
Hugging Face chat model), built here so that the tests depend on neither the trainer nor the data pipeline;
servers in a thread of the test process or in a process of their own."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scalenlp.models.flavors import build_model, model_args
from scalenlp.models.io import save_pretrained

EOS = "<|endoftext|>"
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a model that is trained on a few sentences says little of interest",
    "continuous batching lets requests join and leave every step",
    "hello world, this is scalenlp serving text over http",
] * 4


def train_tokenizer(path: Path, vocab_size: int = 320, special: str | None = EOS) -> Path:
    """A byte-level BPE whose one special token (id 0) is ``special``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special] if special else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(path))
    return path


def make_export(root: Path, flavor: str = "debug", seed: int = 0, logit_scale: float = 8.0,
                max_seq_len: int = 128, special: str | None = EOS, vocab_size: int = 0) -> Path:
    """An export folder of a random tiny model. ``logit_scale`` spreads the output logits so that
    greedy choices are not decided by float rounding noise; ``vocab_size`` (0: the tokenizer's) may be larger."""
    root.mkdir(parents=True, exist_ok=True)
    tok_path = train_tokenizer(root / "tok.json", special=special)
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    torch.manual_seed(seed)
    model = build_model(model_args(flavor, vocab_size=max(vocab, vocab_size), max_seq_len=max_seq_len))
    with torch.no_grad():
        model.norm.weight.mul_(logit_scale)  # the final norm's gain scales the logits alone, tied or not
    return save_pretrained(model, root / "export", tok_path)


def quantizable_decoder(root: Path, tie: bool = True, loud_channels: int = 0) -> Path:
    """A random Llama-shaped export (GQA, tied embeddings unless ``tie`` is false) whose widths every int4 group
    size divides but 128. ``loud_channels``: that many input channels of every norm's output made 20 times larger
    than the rest, as trained models have them (what activation-aware scales are for)."""
    tok = train_tokenizer(root / "tok.json")
    torch.manual_seed(0)
    model = build_model(model_args("debug", vocab_size=320, ffn_dim=128, tie_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if loud_channels and name.endswith("norm.weight"):
                p[torch.randperm(len(p))[:loud_channels]] *= 20
    return save_pretrained(model, root / "export", tok)


CLASSIFIER_LABELS = ["negative", "neutral", "positive"]


def minilm_classifier(root: Path) -> Path:
    """An export of a small random classifier (labels ``CLASSIFIER_LABELS``) with the packaged MiniLM's tokenizer;
    its head is scaled so that the probabilities are far from uniform."""
    from scalenlp.models.encoder import Encoder, EncoderArgs
    from scalenlp.models.packaged import packaged_model

    torch.manual_seed(0)
    model = Encoder(EncoderArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64,
                                task="classification", labels=CLASSIFIER_LABELS))
    with torch.no_grad():
        model.classifier.weight.mul_(200)
    return save_pretrained(model, root / "export", packaged_model("minilm") / "tokenizer.json")


# SmolLM2-Instruct's template (ChatML with a default system message).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The special tokens of ChatML and of Llama 3's template, added to the byte-level BPE.
CHAT_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]


def chat_tokenizer(root: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(train_tokenizer(root / "base.json")))
    tok.add_special_tokens(CHAT_SPECIAL)
    return tok


def make_hf_chat_model(root: Path, template: str | None = CHATML, logit_scale: float = 8.0, family: str = "Llama",
                       max_positions: int = 256) -> Path:
    """A tiny random ``family``ForCausalLM (Llama, Qwen2...) saved as a Hugging Face folder with a ChatML tokenizer
    config."""
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = chat_tokenizer(root)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # spread the logits so that greedy choices are not decided by rounding noise
        model.model.norm.weight.mul_(logit_scale)
    folder = root / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    # The end-of-text token is not the end-of-turn token, so that stopping at <|im_end|> shows the template's.
    config = {"eos_token": "<|endoftext|>", "bos_token": None}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def run_request(engine, ids: list[int], params) -> tuple[str, list[int], str]:
    """One request through a started engine: (its text, its token ids, its finish reason)."""
    import queue

    events = queue.Queue()
    engine.submit(ids, params, events.put)
    deltas = [events.get()]
    while deltas[-1].finish_reason is None:
        deltas.append(events.get())
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


class ServerThread:
    """uvicorn serving an app on a free localhost port, in a thread of the test process; with ``limits`` (a
    ServeLimits), on the connections `scalenlp serve` makes (its request-read and keep-alive deadlines)."""

    def __init__(self, app, limits=None):
        import threading

        import uvicorn

        from scalenlp.parallel.mesh import free_port
        from scalenlp.serving.connections import server_config

        self.port = free_port()
        config = (uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning") if limits is None
                  else server_config(app, limits, host="127.0.0.1", port=self.port, log_level="warning"))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join()


@contextlib.contextmanager
def serving(config, name: str = "tiny"):
    """The engine ``config`` builds, served on a thread as model ``name``: (server, engine), both stopped after."""
    from scalenlp.engine.llm import engine_from_checkpoint
    from scalenlp.serving.app import create_app
    from scalenlp.serving.backend import LocalBackend

    engine = engine_from_checkpoint(config)
    server = ServerThread(create_app(LocalBackend(engine, name)))
    try:
        yield server, engine
    finally:
        server.stop()
        engine.stop()


@contextlib.contextmanager
def serve_process(checkpoint: Path, *flags: str, env: dict | None = None):
    """`scalenlp serve --checkpoint CHECKPOINT FLAGS` in a process of its own on a free port: (its URL, the
    process) once /health answers; the process is terminated on leaving."""
    import os
    import subprocess
    import sys

    from scalenlp.parallel.mesh import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", str(checkpoint),
                             "--port", str(port), *flags], env=env or {**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def wait_healthy(url: str, proc) -> None:
    """Until the server process at ``url`` answers /health with 200; fails with its output if it exits."""
    import time

    import httpx

    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            # A generous timeout: each /health sends a probe through the engine, and a client that gives up
            # and asks again sends another, which under load can be the step a test's injected fault counts on.
            if httpx.get(url + "/health", timeout=60).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


# ``ray.init`` keywords of the tests that start a local Ray for `serve --replicas` (cluster.start's ray_init_kwargs).
RAY_INIT = {"num_cpus": 2, "include_dashboard": False, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}


def paged_args(tables: torch.Tensor, input_pos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table, slot_mapping) for a model forward over a paged KV cache: each row's positions live in the
    blocks of its row of ``tables`` (B, N), in order."""
    rows = torch.arange(tables.shape[0])[:, None]
    return tables, tables[rows, input_pos // block_size] * block_size + input_pos % block_size


def generate(engine, prompts, params, waves=1, field="token_ids"):
    """Token ids generated for each prompt (or another list ``field`` of the events: "logprobs"); the prompts go
    in ``waves`` batches, each after the one before has finished (a later wave finds the earlier one's blocks in
    the prefix cache)."""
    outs = [[] for _ in prompts]
    size = -(-len(prompts) // waves)
    for start in range(0, len(prompts), size):
        done = [threading.Event() for _ in prompts[start:start + size]]

        def collector(i):
            def on_event(d):
                outs[start + i].extend(getattr(d, field) or [])
                if d.finish_reason:
                    done[i].set()
            return on_event

        engine.submit_many([(p, params) for p in prompts[start:start + size]], [collector(i) for i in range(len(done))])
        for event in done:
            wait(engine, event)
    return outs


def wait(engine, event):
    """Until ``event`` is set; fails if the engine's loop dies first (no time limit: a slow machine is not a bug)."""
    while not event.wait(1.0):
        assert engine.alive, engine.error


def count_calls(monkeypatch, engine, name):
    calls = []
    method = getattr(engine, name)
    monkeypatch.setattr(engine, name, lambda *a: (calls.append(a), method(*a))[1])
    return calls
