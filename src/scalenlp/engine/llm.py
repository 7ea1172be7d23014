"""Inference from Python: an engine built from any checkpoint exactly as `scalenlp serve` builds it.

    from scalenlp import LLM, SamplingParams
    with LLM("runs/demo") as llm:
        print(llm.generate(["Return the"], SamplingParams(max_tokens=20, temperature=0)))
        print(llm.chat([{"role": "user", "content": "Hi!"}]))  # a checkpoint with a chat template

``chat`` renders with the checkpoint's template in a worker process, under the server's time and output limits
(``data/template_workers.py``): a script that calls it needs the ``if __name__ == "__main__":`` guard.

``engine_from_checkpoint`` is the one place where an engine is built from its options (``EngineConfig``,
whose fields hold the defaults) and gets the checkpoint's end-of-text and end-of-turn tokens; the CLI's
``generate``/``serve``/``chat`` call it too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from scalenlp.compress.quantized import quantization_of
from scalenlp.data.chat import end_of_text_id, end_of_turn_ids
from scalenlp.engine.compile_choice import choose_compile
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine, pick_device
from scalenlp.engine.dtype import LayerShapes, announce, choose_dtype
from scalenlp.engine.sampling import SamplingParams
from scalenlp.errors import UserError
from scalenlp.loader import instantiate, read
from scalenlp.models.encoder import EncoderArgs


def engine_from_checkpoint(config: EngineConfig) -> Engine:
    """Load any checkpoint the loader reads and start an engine on it, as ``config`` says. Generation ends at
    the end-of-text token and, for a chat model, at its template's end-of-turn tokens."""
    config.check()
    spec = quantization_of(config.quantize, config.group_size)
    torch_device = pick_device(config.device)
    # On Apple's GPUs the engine runs eagerly (Inductor's Metal kernels are few) in one process (the sharded
    # engine's ranks are CUDA's or the CPU's). config.check has refused --compile with --tp.
    if torch_device.type == "mps" and (config.compile == "on" or config.tp > 1):
        raise UserError(f"--device {config.device} runs the engine eagerly in one process; drop "
                        f"{'--compile' if config.compile == 'on' else '--tp'}")
    pre = read(config.checkpoint)
    if isinstance(pre.args, EncoderArgs):
        raise UserError(f"{config.checkpoint} is an encoder; it embeds and classifies text but does not generate it")
    # Refused before the dtype is timed and the weights are loaded.
    quantized = spec or pre.quantization
    dynamic = quantized is not None and quantized.method == "int8dyn"
    if dynamic and config.compile == "on":
        raise UserError("--compile on does not take int8dyn layers (their per-token activation scales break the "
                        "compiled graph); drop --compile, or quantize with int8 or int4")
    # Chosen once here, for every rank under --tp: ranks that each measured could disagree.
    dtype = choose_dtype(torch_device, config.dtype, LayerShapes.of(pre.args, config.tp))
    if config.tp > 1:
        from scalenlp.engine.sharded import start_sharded  # starts processes: only when asked for

        model = start_sharded(pre, config.tp, dtype.dtype, spec)
    else:
        model = instantiate(pre, device=torch_device, dtype=dtype.dtype, quantize=spec)
    adapters = serve_adapters(model, config) if config.serves_adapters else None
    draft = None
    if config.draft:
        draft_pre = read(config.draft)
        if isinstance(draft_pre.args, EncoderArgs) or draft_pre.tokenizer.get_vocab() != pre.tokenizer.get_vocab():
            raise UserError(f"the draft model {config.draft} has another tokenizer than {config.checkpoint}; a "
                            f"draft model must share the model's tokenizer (a smaller model of the same family)")
        draft = instantiate(draft_pre, device=torch_device, dtype=dtype.dtype)
    # Eager where the compiled step is not supported or not measured (config.check refused --compile on there).
    # Speculative decoding's verifying forward (several positions a row) breaks the compiled graph in pieces at the
    # generic attention path, recompiling as draft lengths change (10 graphs for 3 requests of a tiny model).
    unsupported = ("--tp" if config.tp > 1 else "LoRA adapters" if adapters else
                   "int8dyn layers (their activation scales break the graph)" if dynamic else
                   "speculative decoding (its verifying step breaks the graph)" if config.speculative_tokens else "")
    compiling = choose_compile(config.compile, torch_device, pre.args, dtype.dtype, unsupported=unsupported,
                               quantize=quantized)
    engine = Engine(model, pre.tokenizer, max_batch=config.max_batch, max_queue=config.max_queue,
                    max_seq_len=config.max_seq_len,
                    eos_id=end_of_text_id(pre.tokenizer, pre.tokenizer_config),  # none: runs to max_tokens
                    stop_ids=end_of_turn_ids(pre.tokenizer, pre.tokenizer_config),
                    tokenizer_config=pre.tokenizer_config, compile=compiling.on, adapters=adapters,
                    kv_cache_tokens=config.kv_cache_tokens, block_size=config.block_size,
                    prefix_caching=not config.no_prefix_caching, token_budget=config.token_budget,
                    speculative_tokens=config.speculative_tokens, draft_model=draft)
    if config.tp > 1:  # a rank that dies ends the engine: its requests are answered, a server exits 1
        model.followers.on_failure = engine.fail
    # Said by the caller once everything it checks has passed (``announce``): a refused model or tokenizer gets
    # its one error line alone.
    said = [choice.line() for choice in (dtype, compiling) if choice.reason]
    if compiling.on:
        said.append(engine.compile_line)
    engine.startup_line = "\n".join(said) or None
    return engine.start()


def serve_adapters(model, config: EngineConfig):
    """The adapter slots of ``model`` with the --lora adapters in them, read first so that a bad folder is one
    line before any layer is swapped."""
    from scalenlp.engine.lora import DEFAULT_RANK, LoraSlots, check_name, read_folder

    read = {}
    for name, path in config.adapters().items():
        check_name(name)
        read[name] = (*read_folder(path, model.args), path)
    rank = config.max_lora_rank or max((spec.rank for spec, _, _ in read.values()), default=DEFAULT_RANK)
    slots = LoraSlots(model, len(read) if config.max_loras is None else config.max_loras, rank,
                      next(model.parameters()).dtype)
    for name, (spec, weights, path) in read.items():
        slots.add(name, spec, weights, path)
    return slots


class LLM:
    """A running engine for batch generation from Python; ``close()`` (or ``with``) stops it."""

    def __init__(self, checkpoint: str | Path | EngineConfig, **options):
        """``LLM(checkpoint, max_batch=4, ...)`` takes ``EngineConfig``'s fields as keywords; ``LLM(config)``
        takes the config itself."""
        if isinstance(checkpoint, EngineConfig):
            config = dataclasses.replace(checkpoint, **options)
        else:
            config = EngineConfig(checkpoint, **options)
        self.engine = engine_from_checkpoint(config)
        self._templates = None
        announce(self.engine)

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None,
                 adapter: str | None = None) -> list[str]:
        """The completion of each prompt, all run as one continuous batch, with the LoRA adapter named
        ``adapter`` (one of ``lora=["NAME=PATH"]``; None: the base model)."""
        return self.engine.generate([prompts] if isinstance(prompts, str) else prompts, params or SamplingParams(),
                                    adapter)

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[str]:
        """The assistant's answer to each conversation (one conversation: a list of role/content messages),
        rendered with the checkpoint's chat template (ChatError, one line, when it cannot be: within the
        template's time and output limits)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.templates.chat_ids_blocking(c) for c in conversations]
        return self.engine.generate(prompts, params or SamplingParams())

    @property
    def templates(self):
        """The worker that renders this checkpoint's chat template (``TemplateWorkers``), started on first use:
        generation alone needs no process beside the engine."""
        if self._templates is None:
            from scalenlp.data.template_workers import TemplateWorkers

            self._templates = TemplateWorkers(self.engine.tokenizer, self.engine.tokenizer_config, workers=1)
        return self._templates

    def close(self) -> None:
        if self._templates is not None:
            self._templates.close()
        self.engine.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
