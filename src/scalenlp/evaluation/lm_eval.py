"""A model backend for EleutherAI's lm-evaluation-harness: its requests run through scalenlp's engine.

    python -m scalenlp.evaluation.lm_eval --model scalenlp --model_args checkpoint=runs/sft,tp=2 --tasks hellaswag

takes lm-eval's own command line (this module registers the name ``scalenlp`` in its model registry, then runs
its CLI: lm-eval 0.4 has no entry point through which a package could register a model, so plain ``lm_eval
--model scalenlp`` does not know the name). From Python, importing this module registers it as well::

    import lm_eval, scalenlp.evaluation.lm_eval
    lm_eval.simple_evaluate(model="scalenlp", model_args="checkpoint=runs/sft", tasks=["arc_easy"])

``--model_args`` takes ``checkpoint`` and any other ``EngineConfig`` field (``tp``, ``dtype``, ``quantize``,
``max_seq_len``, ``max_batch``: sequences per forward, default 8, ...); lm-eval's ``--batch_size`` is not
used; ``--device`` is the device (CPU where ``cuda`` is asked for
but absent, as lm-eval's own backend does). The weights
load in float32 unless ``dtype`` says otherwise. Requests are answered as lm-eval's Hugging Face backend answers
them: ``loglikelihood`` splits context and continuation by its rules (``TemplateLM``) and scores both in one
forward, keeping the last ``max_seq_len`` + 1 tokens; ``loglikelihood_rolling`` scores a text in its disjoint
windows of ``max_seq_len``; ``generate_until`` decodes (greedy unless ``do_sample``) until a stop string, the
end-of-text token or ``max_gen_toks`` (256), its prompt cut from the left to leave room for them.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref

import torch

from scalenlp.data.chat import chat_template as template_of
from scalenlp.data.chat import end_of_text_id, special_token
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import EngineDead
from scalenlp.engine.llm import LLM
from scalenlp.engine.sampling import SamplingParams
from scalenlp.errors import UserError, require
from scalenlp.evaluation.multiple_choice import EVAL_COMPILE, prefix_token_id

require("lm_eval", "eval")
from lm_eval.api.model import TemplateLM  # noqa: E402 - only after the one-line error for a missing extra
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

MAX_GEN_TOKS = 256  # lm-eval's default for generate_until, as its Hugging Face backend
# generate_until's keyword arguments and the SamplingParams field each becomes; lm-eval's task files use these.
GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}


@register_model("scalenlp")
class ScaleNLPLM(TemplateLM):
    def __init__(self, checkpoint: str, batch_size: int | str | None = None, max_batch_size: int | None = None,
                 device: str | None = None, dtype: str = "float32", **options):
        """``batch_size`` and ``max_batch_size`` (lm-eval's flags) are not used: the engine batches the requests
        itself, up to ``max_batch`` sequences and its token budget per forward, and lm-eval's default batch size
        of 1 would turn that off."""
        super().__init__()
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise UserError(f"--model_args {', '.join(unknown)}: not scalenlp engine options; use checkpoint and "
                            f"any of {', '.join(sorted(fields - {'checkpoint'}))}")
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's CLI passes cuda:0 unless told otherwise; its HF backend falls back too
        options.setdefault("compile", EVAL_COMPILE)  # eager unless model_args asks for it
        self.llm = LLM(EngineConfig(checkpoint, dtype=dtype, device=device, **options))
        self.engine = self.llm.engine
        self.checkpoint = str(checkpoint)
        # lm-eval never closes a model it built from its name: the engine (and a sharded model's other ranks)
        # stop when this object is collected, or at exit.
        self.close = weakref.finalize(self, self.llm.close)

    # ---- what TemplateLM needs ----

    @property
    def eot_token_id(self) -> int:
        eot = end_of_text_id(self.engine.tokenizer, self.engine.tokenizer_config)
        if eot is None:
            raise UserError(f"{self.checkpoint} has no end-of-text token, which lm-eval needs for empty contexts "
                            "and generation; name one as eos_token in its tokenizer_config.json")
        return eot

    @property
    def prefix_token_id(self) -> int:
        prefix = prefix_token_id(self.engine.tokenizer, self.engine.tokenizer_config)
        return prefix if prefix is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's ids; by default with the special tokens its post-processor adds (a BOS for Llama),
        except before a text that already starts with the BOS token's text (a rendered chat template)."""
        if add_special_tokens is None:
            bos = special_token(self.engine.tokenizer_config, "bos_token")
            add_special_tokens = not (bos and string.startswith(bos))
        return self.engine.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.engine.loglikelihood([(context, continuation) for _, context, continuation in requests])
        for (strings, _, _), result in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length`` tokens, the first opened by the
        prefix token: every token scored once, all windows of all texts in one batched call."""
        windows, owner = [], []
        for n, (string,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """As lm-eval's Hugging Face backend: the generated tokens decoded at once without special tokens, cut
        before the first stop string (decoding the whole keeps the replacement characters of a sequence that
        ends inside a character, which the engine's streamed text holds back)."""
        prompts, params, stops = [], [], []
        for context, kwargs in (request.args for request in requests):
            sampling = self._sampling(dict(kwargs))
            prompts.append(self.tok_encode(context)[-(self.max_length - sampling.max_tokens):])
            params.append(sampling)
            stops.append(sampling.stop)
        texts = []
        for request, ids, stop in zip(requests, self._generate(prompts, params), stops):
            text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
            for s in stop:
                text = text.split(s)[0]
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts

    def _sampling(self, kwargs: dict) -> SamplingParams:
        """SamplingParams from a request's generation keywords: greedy unless ``do_sample``; the prompt keeps
        at least one token beside ``max_gen_toks``."""
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_tokens = min(int(kwargs.pop("max_gen_toks", MAX_GEN_TOKS)), self.max_length - 1)
        do_sample = bool(kwargs.pop("do_sample", False))
        unknown = sorted(set(kwargs) - set(GENERATION_KWARGS))
        if unknown:
            raise UserError(f"generation keywords {', '.join(unknown)} are not supported by the scalenlp backend; "
                            f"it takes until, max_gen_toks, do_sample and {', '.join(GENERATION_KWARGS)}")
        sampling = {GENERATION_KWARGS[k]: v for k, v in kwargs.items()}
        if not do_sample:
            sampling["temperature"] = 0.0
        return SamplingParams(max_tokens=max_tokens, stop=[s for s in until if s], **sampling)

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        """Every request's generated token ids, all submitted at once: one continuous batch."""
        ids: list[list[int]] = [[] for _ in prompts]
        finished = threading.Semaphore(0)

        def collect(n: int):
            def on_event(delta) -> None:
                ids[n].extend(delta.token_ids)
                if delta.finish_reason is not None:
                    finished.release()
            return on_event

        self.engine.submit_many(list(zip(prompts, params)), [collect(n) for n in range(len(prompts))],
                                bypass_queue_limit=True)
        for _ in prompts:
            while not finished.acquire(timeout=1.0):
                if not self.engine.alive:
                    raise EngineDead(f"the engine has stopped: {self.engine.error!r}")
        return ids

    # ---- chat templates (lm-eval's --apply_chat_template) ----

    @property
    def tokenizer_name(self) -> str:
        return self.checkpoint

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return template_of(self.engine.tokenizer_config) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        # In the engine's template worker, under its time and output limits: the template is the model file's code.
        return self.llm.templates.chat_text_blocking(chat_history, add_generation_prompt)


def main() -> None:
    """lm-eval's command line, with ``--model scalenlp`` known (registered by importing this module); a mistake
    of ours (a missing checkpoint, an unknown option) ends in one line and exit code 2, as scalenlp's commands."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
