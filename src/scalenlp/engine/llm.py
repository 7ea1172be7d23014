"""Inference from Python: an engine built from any checkpoint exactly as `scalenlp serve` builds it.

    from scalenlp import LLM, SamplingParams
    with LLM("runs/demo") as llm:
        print(llm.generate(["Return the"], SamplingParams(max_tokens=20, temperature=0)))
        print(llm.chat([{"role": "user", "content": "Hi!"}]))  # a checkpoint with a chat template

``engine_from_checkpoint`` is the one place where an engine gets its defaults (dtype, end-of-text and
end-of-turn tokens, weight packing, tensor parallelism); the CLI's ``generate``/``serve``/``chat`` call it too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scalenlp.data.chat import encode_chat, end_of_text_id, end_of_turn_ids
from scalenlp.errors import UserError
from scalenlp.engine.decoder_engine import Engine, pick_device, pick_dtype
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.encoder import EncoderArgs
from scalenlp.loader import instantiate, read
from scalenlp.compress.quantized import quantization_of


def engine_from_checkpoint(checkpoint: str | Path, *, dtype: str = "auto", device: str | None = None,
                           max_batch: int = 8, max_seq_len: int | None = None, compile: bool = False, tp: int = 1,
                           max_queue: int = 64, quantize: str | None = None, group_size: int = 64) -> Engine:
    """Load any checkpoint the loader reads and start an engine on it. Generation ends at the end-of-text
    token and, for a chat model, at its template's end-of-turn tokens. ``quantize`` (int8, int4, int8dyn)
    quantizes the linear layers at load; ``group_size`` is int4's."""
    if max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {max_batch}")
    if max_seq_len is not None and max_seq_len < 2:  # a prompt token and an output token
        raise UserError(f"--max-seq-len must be at least 2, got {max_seq_len}")
    if tp > 1 and compile:
        raise UserError("--compile is not supported with --tp yet; drop one of them")
    spec = quantization_of(quantize, group_size)
    pre = read(checkpoint)
    if isinstance(pre.args, EncoderArgs):
        raise UserError(f"{checkpoint} is an encoder; it embeds and classifies text but does not generate it")
    torch_device = torch.device(device) if device else pick_device()
    if tp > 1:
        from scalenlp.engine.sharded import start_sharded  # starts processes: only when asked for

        model = start_sharded(pre, tp, dtype, spec)
    else:
        model = instantiate(pre, device=torch_device, dtype=pick_dtype(torch_device, dtype), quantize=spec)
    engine = Engine(model, pre.tokenizer, max_batch=max_batch, max_queue=max_queue, max_seq_len=max_seq_len,
                    eos_id=end_of_text_id(pre.tokenizer, pre.tokenizer_config),  # none: runs to max_tokens
                    stop_ids=end_of_turn_ids(pre.tokenizer, pre.tokenizer_config),
                    tokenizer_config=pre.tokenizer_config, compile=compile)
    if tp > 1:  # a rank that dies ends the engine: its requests are answered, a server exits 1
        model.followers.on_failure = engine.fail
    return engine.start()


class LLM:
    """A running engine for batch generation from Python; ``close()`` (or ``with``) stops it."""

    def __init__(self, checkpoint: str | Path, **engine_options):
        self.engine = engine_from_checkpoint(checkpoint, **engine_options)

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[str]:
        """The completion of each prompt, all run as one continuous batch."""
        return self.engine.generate([prompts] if isinstance(prompts, str) else prompts, params or SamplingParams())

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[str]:
        """The assistant's answer to each conversation (one conversation: a list of role/content messages),
        rendered with the checkpoint's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [encode_chat(self.engine.tokenizer, c, self.engine.tokenizer_config) for c in conversations]
        return self.engine.generate(prompts, params or SamplingParams())

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
