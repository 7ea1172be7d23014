"""Fixtures for the inference tests: a tiny exported model with its own byte-level BPE tokenizer,
built here so that the tests depend on neither the trainer nor the data pipeline."""

from __future__ import annotations

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


class ServerThread:
    """uvicorn serving an app on a free localhost port, in a thread of the test process."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join()


def wait_healthy(url: str, proc) -> None:
    """Until the server process at ``url`` answers /health with 200; fails with its output if it exits."""
    import time

    import httpx

    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


# ``ray.init`` keywords of the tests that start a local Ray for `serve --replicas` (cluster.start's ray_init_kwargs).
RAY_INIT = {"num_cpus": 2, "include_dashboard": False, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
