"""Inference engine: a paged KV cache, prefix caching, chunked prefill and continuous batching.

One background thread runs the loop; callers submit requests from any thread and receive
``Delta`` events through a callback. The KV cache is a pool of fixed-size blocks (models.decoder.KVCache,
kept by engine.kv_blocks.BlockPool): a running request holds the blocks its positions need, so as many
requests run as the blocks allow (up to ``max_batch``). Each step of the loop
  1. drops cancelled requests and gives back their blocks,
  2. admits waiting requests while blocks allow, preempted ones first, then the cheapest (fewest positions
     asked for: prompt + max_tokens), a request passed over by ``max_overtaken`` later arrivals going first
     (``_next_waiting``); a prompt whose leading blocks are cached (the same prefix computed before, with the
     same adapter) takes those blocks and computes only the rest,
  3. runs one decode step over every request whose prompt is computed: a request that needs a new block
     when none is left preempts the newest running request, which gives its blocks back and waits at the
     queue's front with its output kept, to be computed again (recompute) and continue; with speculative
     decoding, each request's draft tokens (engine.speculative) are computed in the same forward, and those the
     model's own choice agrees with are kept, with the token after them,
  4. computes prompt tokens with what is left of the step's token budget: a prompt longer than that is
     computed in chunks over several steps, so a long prompt delays the running decodes by one chunk per step;
     a prompt's last chunk yields its first token,
  5. detokenizes, checks stop conditions, and emits events.
With a sliding window on every layer (Mistral), a request gives back the blocks wholly before the window of its
next position as it goes (``_drop_outside_window``), and takes blocks for a prompt chunk as the chunk is computed,
so a sequence holds about a window's worth of blocks however long it grows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import random
import threading
import time
import types
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from scalenlp.data.text import check_text
from scalenlp.data.tokenizer import token_bytes
from scalenlp.engine import compile_cache
from scalenlp.engine.grammar import Constraint, GrammarError, Grammars, constrain
from scalenlp.engine.kv_blocks import NULL_BLOCK, BlockPool, block_keys
from scalenlp.engine.packing import pack_for_inference
from scalenlp.engine.sampling import InvalidParam, SamplingBatch, SamplingParams, sample
from scalenlp.engine.speculative import propose
from scalenlp.errors import UserError
from scalenlp.hardware import release_openmp_workers
from scalenlp.models.memory import DEFAULT_CACHED_SEQUENCES, check_kv_cache, kv_cache_blocks
from scalenlp.parallel.mesh import device_type

log = logging.getLogger(__name__)
# Settled tokens decoded before the new ones when streaming, so that these decode as they do mid-sequence.
DECODE_CONTEXT = 4
# A prefill forward pads its rows to the longest chunk, and a padded position costs what a computed one does: rows
# go into one forward only while it computes at most this many positions per prompt token. A forward more costs
# its few hundred operator calls (milliseconds); a 532-token chunk beside a 1,500-token one would cost 968 padded
# positions (about a second on two cores).
PREFILL_PADDING = 1.25
# model -> a weak reference to the last engine built on it: the KV cache lives in the model, so only one engine may
# run on it at a time. The value is weak too, since the engine holds its model: a strong one would keep both, and
# the cache (gigabytes), alive for the life of the process.
_ENGINE_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class RequestError(ValueError):
    """A request that can never be served as asked (too long, bad sampling settings); ``param``
    names the request field at fault."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class EngineDead(RuntimeError):
    """The engine loop has stopped (after an error or ``stop()``)."""


@dataclass
class Delta:
    """What one step produced for one request."""

    text: str  # new text since the previous event
    token_ids: list[int]
    logprobs: list[float] | None  # the chosen tokens' logprobs, when asked for
    top_logprobs: list[dict[str, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "error" (this request) | "abort" (engine)
    time: float  # time.perf_counter() when produced
    error: str | None = None  # with finish_reason "error": what went wrong
    tokens: list[str] | None = None  # with logprobs: the text of each token (``Engine.token_str``)


@dataclass(eq=False)  # a request is itself: the waiting queue removes it by identity (``cancel``)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Delta], None]
    seed: int
    slot: int = -1  # the key of the engine's running table: its admission number, so the newest has the largest
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output, full
    sent: int = 0  # characters of ``text`` already emitted
    read_offset: int = 0  # output tokens already turned into settled text
    cancelled: bool = False
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    adapter: int = 0  # the LoRA adapter this request runs with (engine/lora.py); 0: the base model
    constraint: Constraint | None = None  # its grammar's matcher (engine/grammar.py), when it has one
    # (V,) how many times each token has been generated, on the device; kept only for presence/frequency penalties.
    token_counts: torch.Tensor | None = None
    blocks: list[int] = field(default_factory=list)  # its block table: the KV cache blocks of its positions
    computed: int = 0  # leading positions (prompt, then output) whose keys and values are in those blocks
    draft_computed: int = 0  # those whose draft model's keys and values are there too (speculative decoding)
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks computed
    planned: list[bytes] = field(default_factory=list)  # those of the full blocks it had when admitted
    overtaken: int = 0  # requests that arrived after it and were admitted while it waited

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class _Scoring:
    """One ``loglikelihood`` call, scored a batch per loop step without the KV cache, longest sequences first
    (so that a batch pads little)."""

    inputs: list[list[int]]  # context + continuation less its last token, left-truncated to max_seq_len
    targets: list[list[int]]  # the continuation tokens, predicted by the inputs' last len(target) positions
    results: list[tuple[float, bool] | None]
    order: list[int]  # indices into inputs, longest first
    done: threading.Event = field(default_factory=threading.Event)
    scored: int = 0  # entries of ``order`` done


def padding_groups(counts: list[int]) -> list[list[int]]:
    """The prefill rows of chunk lengths ``counts`` split into forwards, as lists of their indices: from the longest
    down, a row joins the current forward while that pads to at most PREFILL_PADDING positions per token computed;
    the forwards come cheapest first, so that short prompts' first tokens do not wait behind a long one."""
    groups: list[list[int]] = []
    for i in sorted(range(len(counts)), key=lambda i: -counts[i]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * counts[group[0]] <= PREFILL_PADDING * (sum(counts[j] for j in group) + counts[i]):
            group.append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups[::-1]]  # each forward's rows in their given (oldest-first) order


def pick_device(requested: str | None = None) -> torch.device:
    """The device an engine runs on: ``requested`` (--device) once this machine is seen to have it, else CUDA where
    present, else the CPU. Apple's GPUs (mps) run only when asked for: their kernels cover fewer operators than
    CUDA's and the CPU's, and the engine runs eagerly there (``engine_from_checkpoint`` refuses --compile)."""
    if requested is None:
        return torch.device(device_type())
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(f"--device {requested!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UserError(f"--device {requested}: this machine has {count} CUDA devices visible to PyTorch; use "
                            f"--device cpu{f' or cuda:0 to cuda:{count - 1}' if count else ''}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"--device {requested} is Apple silicon's GPU, which this machine or its PyTorch build "
                            f"does not have (torch.backends.mps.is_available() is False); use --device cpu or cuda")
    elif device.type != "cpu":
        raise UserError(f"--device {requested}: the engine runs on cpu, cuda, cuda:N or mps, not {device.type}")
    return device


def compiled_step(model) -> Callable[..., torch.Tensor]:
    """``model``'s forward through torch.compile (taking ``Engine._run``'s arguments), one graph for every batch
    size and block-table width. Marked only dynamic, sizes 1 get graphs of their own (Dynamo specialises them):
    SmolLM2 compiled four graphs, a minute each here, as batch 1 and 16 met short and long contexts. Unbacked sizes
    are never specialised: one graph serves them all, and they are all the dynamism the step needs. With
    ``dynamic=True`` Dynamo made float attributes symbols too (the embedding's ``norm_type``), which Inductor then
    could not turn into tensors: it restarted the whole trace, and every compile traced the model twice.

    Without Inductor's freezing, which folded the weights into the graph as constants (packing bf16 ones for
    oneDNN), so that the graph is one AOTAutograd's and Inductor's caches keep between starts
    (engine/compile_cache.py): they refuse frozen graphs. A model whose linears ``pack_linears`` packed calls them
    as operators on their packed weights instead (float32 panels as inputs; oneDNN's opaque ones by number).

    Dynamo's guards on the model's modules (about 6,000 for SmolLM2: hooks, types, attributes, each parameter's
    metadata) took 1.0-1.5 ms a step to check, a tenth of an int4 token at batch 1; they are skipped. That is sound
    because the step is a function of this model alone: a copy of ``forward``'s code object, and Dynamo keeps its
    compiled graphs per code object, so no other model (another engine's, of the same class and shapes) is ever run
    through them; and an engine's model does not change once the engine is built (its inputs and the global state
    stay guarded).

    On the CPU, the graph's wrapper (which calls its kernels and operators in order) is C++, not Python: Python's
    wrapper cost about 1 ms of an int4 SmolLM2's 8-10 ms batch-1 step at 2 threads (its 120 product operators and
    30 attention calls each through the dispatcher from Python), and the step ran 1.2x as fast in C++. Built apart
    from the kernels, as Inductor offers: one file of both took 66 s more to compile than the Python wrapper at a
    first start and 81 s more after Inductor's cache folder was emptied (the step's cached artifacts hold sources,
    not binaries); built apart, 14 s and 7 s more."""
    from torch._dynamo.decorators import mark_unbacked

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, None,
                             forward.__closure__)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if next(model.parameters()).device.type == "cpu":
        options |= {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    step = torch.compile(own, options=options)

    def run(tokens, input_pos, block_table, slot_mapping, logits_at=None):
        for t in (tokens, input_pos, block_table, slot_mapping, logits_at):
            if t is not None:
                mark_unbacked(t, 0, shape_id="rows")
        mark_unbacked(block_table, 1, shape_id="blocks")
        return step(tokens, input_pos, block_table, slot_mapping, logits_at=logits_at)

    return run


def _cache_hits() -> int:
    """Graphs this process took from AOTAutograd's or Inductor's cache so far."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]


class Engine:
    def __init__(self, model, tokenizer, *, max_batch: int = 64, max_queue: int = 64, token_budget: int = 2048,
                 max_seq_len: int | None = None, eos_id: int | None = None, stop_ids: Collection[int] = (),
                 compile: bool = False, cache_dtype: torch.dtype | None = None, pack_weights: bool = True,
                 tokenizer_config: dict | None = None, adapters=None, kv_cache_tokens: int | None = None,
                 block_size: int = 16, prefix_caching: bool = True, speculative_tokens: int = 0, draft_model=None,
                 max_overtaken: int | None = None):
        """model: a Transformer (or anything with its ``setup_kv_cache`` and forward signature, like a
        sharded one). tokenizer: a ``tokenizers.Tokenizer``. max_batch: most requests running at once.
        max_seq_len: positions per sequence (prompt + output), at most the model's. token_budget: tokens one
        step computes (one per decoding request, the rest for prompts, chunked to fit). kv_cache_tokens:
        positions the KV cache holds over all requests (default: DEFAULT_CACHED_SEQUENCES x max_seq_len),
        in blocks of ``block_size``; prefix_caching: reuse the blocks of a prompt prefix computed before.
        speculative_tokens: draft tokens proposed per request and step by prompt lookup (engine.speculative) and
        verified in the decode step's forward; 0: none. draft_model: a smaller model with the same vocabulary that
        proposes them instead (greedily, with its own KV cache in the same blocks), or None.
        pack_weights: on CPU, pre-pack the linear layers of a float32 model (in scalenlp's panels, or for oneDNN
        where that kernel does not build), or of a bf16 one for oneDNN where it computes in bf16
        (engine.packing.pack_for_inference; the model is changed in place and is for
        inference only afterwards). tokenizer_config: the checkpoint's
        special tokens and chat template, for whoever renders conversations into prompts. adapters: the
        LoRA adapters served on this model (an engine.lora.LoraSlots built on it before this engine), or None.
        max_overtaken: how many cheaper requests that arrived later may be admitted before a waiting one, which
        then goes first (default: max_batch, a batch's worth), so that cheap-first never starves a long request."""
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_overtaken = max_batch if max_overtaken is None else max_overtaken
        self.token_budget = token_budget
        self.max_seq_len = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        kv_cache_tokens = kv_cache_tokens or DEFAULT_CACHED_SEQUENCES * self.max_seq_len
        num_blocks = kv_cache_blocks(kv_cache_tokens, block_size)
        self.blocks = BlockPool(num_blocks, block_size, prefix_caching)
        args = model.args
        # Blocks before a request's window are given back only when no layer reads past it (every layer local) and
        # no draft model (whose own attention may see every earlier key) shares its blocks.
        windowed = args.sliding_window and len(args.local_layers) == args.n_layers and draft_model is None
        self.window = args.sliding_window if windowed else 0
        self._admitted = 0  # requests admitted so far, which numbers them (Request.slot)
        self._adapter_epoch: collections.Counter[int] = collections.Counter()  # loads of each adapter slot
        self.eos_id = eos_id
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.tokenizer_config = tokenizer_config or {}
        self.adapters = adapters
        ref = next(model.parameters())
        self.device = ref.device
        previous = _ENGINE_OF[model]() if model in _ENGINE_OF else None
        if previous is not None and not previous._stopping and previous.error is None:
            raise UserError("this model already has an Engine that has not stopped, and the KV cache lives in the "
                            "model; stop() that engine first, or load the model again for a second one")
        # Refused before allocating: a model file's context length may be far more than this device can cache.
        check_kv_cache(model.args, kv_cache_tokens, block_size, cache_dtype or ref.dtype, self.device,
                       sum(p.numel() * p.element_size() for p in model.parameters()))
        model.setup_kv_cache(num_blocks, block_size, cache_dtype or ref.dtype)
        self.draft_model = draft_model
        if draft_model is not None:
            if draft_model.args.vocab_size < model.args.vocab_size:
                raise UserError(f"the draft model's vocabulary ({draft_model.args.vocab_size} tokens) is smaller than "
                                f"the model's ({model.args.vocab_size}); a draft model must share its tokenizer")
            # The draft's keys and values live in blocks of the same numbers: one block table serves both models.
            draft_model.setup_kv_cache(num_blocks, block_size, cache_dtype or ref.dtype)
        self.compile_seconds = 0.0  # how long compiling the decode step took, at start-up
        self.compile_line: str | None = None  # how it went, for the start-up line (whether it came from cache)
        if pack_weights:  # the compiled step calls the packed products too (engine/packing.py)
            pack_for_inference(model)
        self._decode = model
        if compile:
            self._decode = compiled_step(model)
            self._compile_now(cache_dtype or ref.dtype, num_blocks, block_size)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}
        self._scoring: collections.deque[_Scoring] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.startup_line: str | None = None  # what its builder says at start-up (engine.dtype.announce)
        self._failure: BaseException | None = None  # set by ``fail``
        self._grammars: Grammars | None = None  # built by the first request with a grammar
        self.steps = 0  # completed loop steps; a health check watches it move
        self.speculative_tokens = speculative_tokens
        self.drafted = 0  # draft tokens verified so far, and those of them accepted
        self.accepted = 0
        # Called with the error when the loop dies: a server exits then, so that its supervisor restarts it.
        self.on_death: Callable[[BaseException], None] | None = None
        _ENGINE_OF[model] = weakref.ref(self)

    def _compile_now(self, cache_dtype: torch.dtype, num_blocks: int, block_size: int) -> None:
        """Compile the decode step before the first request comes, which would wait for it otherwise: a step of
        two padding rows (their keys and values go to the null block); from the artifacts an earlier start cached
        for this model and KV cache where there are some, else compiled and cached for the next start. Sets
        ``compile_seconds`` (reading the cache included) and ``compile_line``."""
        key = compile_cache.step_key(self.model, cache_dtype, num_blocks, block_size)
        path = compile_cache.artifacts_path(key, self.device, next(self.model.parameters()).dtype)
        start, hits = time.perf_counter(), _cache_hits()
        loaded, unusable = compile_cache.load(path, key)
        with torch.inference_mode():  # as the loop runs it, so that the graph is the one the loop calls
            self._decode(*(torch.full((2, n), value, dtype=torch.long, device=self.device)
                           for n, value in ((1, 0), (1, 0), (2, NULL_BLOCK), (1, NULL_BLOCK * block_size))),
                         logits_at=torch.zeros(2, dtype=torch.long, device=self.device))
        self.compile_seconds = time.perf_counter() - start
        said = f"compiled the decode step in {self.compile_seconds:.0f} s"
        hit = _cache_hits() > hits  # each engine's step is traced anew (compiled_step): another engine's is a hit
        if hit:
            said += f" from the artifacts cached in {path}" if loaded else " from Inductor's cache"
        if unusable:
            said += f" (the cache file {path} {unusable}: not used)"
        # Written unless this start was served from it: a file that loaded but missed (the model's code changed)
        # is replaced by what was compiled now.
        if not (loaded and hit) and compile_cache.save(path, key):
            said += f"; cached for later starts in {path}"
        self.compile_line = said

    # ---- public API (any thread) ----

    def start(self) -> Engine:
        release_openmp_workers()  # this thread's workers would otherwise keep the loop's from spinning
        self._thread = threading.Thread(target=self._loop, name="scalenlp-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if self._grammars is not None:
            self._grammars.close()
        close = getattr(self.model, "close", None)  # a sharded model's other ranks
        if close is not None:
            close()

    def fail(self, error: BaseException) -> None:
        """End the loop with ``error`` from outside it (a sharded model's rank died): as if a step had raised
        it, every request waiting or running is told and ``on_death`` is called."""
        with self._wake:
            self._failure = error
            self._wake.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def acceptance_rate(self) -> float:
        """Draft tokens accepted over draft tokens verified (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; RequestError if it is not Unicode text. Called off the event loop by
        the server: ``encode_batch`` lets other threads run meanwhile, where ``encode`` holds the GIL."""
        check_text(text, "the prompt", error=RequestError)
        return self.tokenizer.encode_batch([text])[0].ids

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request can never be served."""
        try:
            params.check()
        except InvalidParam as e:
            raise RequestError(str(e), e.param) from None
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {params.max_tokens}; shorten the prompt or lower max_tokens")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias keys must be token ids of this model, in [0, {vocab}); got "
                               f"{sorted(t for t in params.logit_bias if not 0 <= t < vocab)[:5]}", "logit_bias")
        pool = self.blocks.capacity * self.blocks.block_size
        if min(len(prompt_ids) + params.max_tokens, self._most_held()) > pool:
            raise RequestError(
                f"the KV cache holds {pool} positions in all, but the prompt has {len(prompt_ids)} tokens and "
                f"max_tokens asks for {params.max_tokens}; shorten the prompt, lower max_tokens or start the server "
                f"with a larger --kv-cache-tokens")

    def _most_held(self) -> int:
        """The most positions one request holds blocks for at once: the window and the blocks it straddles, with a
        sliding window on every layer; else no bound but its length."""
        size = self.blocks.block_size
        return (-(-self.window // size) + 1) * size if self.window else self.max_seq_len

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[Delta], None],
               bypass_queue_limit: bool = False, adapter: str | None = None) -> Request:
        return self.submit_many([(prompt_ids, params)], [on_event], bypass_queue_limit, adapter)[0]

    def submit_many(self, items: list[tuple[list[int], SamplingParams]], on_events: list[Callable[[Delta], None]],
                    bypass_queue_limit: bool = False, adapter: str | None = None) -> list[Request]:
        """All or none: either every request is queued, or QueueFull / RequestError / UnknownAdapter is raised.
        A request without max_tokens may run to the end of the context (or of the KV cache, if that is smaller).
        ``adapter``: the name of the LoRA adapter every request runs with (None: the base model)."""
        longest = self.max_seq_len if self.window else min(self.max_seq_len, self.blocks.capacity * self.blocks.block_size)
        items = [(p, params if params.max_tokens is not None else
                  dataclasses.replace(params, max_tokens=max(1, longest - len(p)))) for p, params in items]
        for prompt_ids, params in items:
            self.check(prompt_ids, params)
        requests = [Request(list(p), params, cb, params.seed if params.seed is not None else random.getrandbits(62))
                    for (p, params), cb in zip(items, on_events)]
        self._constrain(requests)
        with self._wake:
            if not self.alive:
                raise EngineDead(f"the engine has stopped: {self.error!r}")
            if not bypass_queue_limit and len(self._waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self._waiting)} of {self.max_queue} requests; retry later")
            if adapter is not None:  # looked up under the lock ``step`` releases slots under: see _release_adapters
                index = self._adapter_index(adapter)
                for r in requests:
                    r.adapter = index
            self._waiting.extend(requests)
            self._wake.notify()
        return requests

    def grammars(self) -> Grammars:
        """The vocabulary as llguidance reads it, built by the first call (a second on a 50k vocabulary): a
        server calls this off its event loop before it submits a request with a grammar."""
        with self._wake:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model.args.vocab_size, self.stop_ids)
        self._grammars.tokenizer()
        return self._grammars

    def _constrain(self, requests: list[Request]) -> None:
        """Give each request with a grammar its matcher (RequestError naming the field if it does not compile)."""
        for r in requests:
            if r.params.grammar is None:
                continue
            try:
                r.constraint = self.grammars().start(r.params.grammar)
            except GrammarError as e:
                raise RequestError(str(e), e.param) from None

    def cancel(self, request: Request) -> None:
        """Stop a request (client gone): one still waiting leaves the queue now, so it is never prefilled and its
        place there is free for another; a running one gives its blocks back at the next step."""
        with self._wake:  # the flag under the lock ``_preempt`` reads it under: a cancelled request never waits
            request.cancelled = True
            with contextlib.suppress(ValueError):
                self._waiting.remove(request)
            self._wake.notify()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams, adapter: str | None = None) -> list[str]:
        """Blocking helper: the completion text of each prompt (text or token ids), all run as one continuous
        batch, with the LoRA adapter named ``adapter`` (None: the base model)."""
        done = [threading.Event() for _ in prompts]
        texts = [""] * len(prompts)

        def collector(i):
            def on_event(d: Delta):
                texts[i] += d.text
                if d.finish_reason is not None:
                    done[i].set()
            return on_event

        self.submit_many([(self.encode(p) if isinstance(p, str) else p, params) for p in prompts],
                         [collector(i) for i in range(len(prompts))],
                         bypass_queue_limit=True, adapter=adapter)
        for event in done:
            while not event.wait(1.0):
                if not self.alive:
                    raise EngineDead(f"the engine has stopped: {self.error!r}")
        return texts

    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Blocking: for each (context ids, continuation ids), the summed log-probability of the continuation
        given the context and whether greedy decoding would have produced it, computed as evaluation harnesses
        do (lm-eval's ``loglikelihood``): one forward of context + continuation, no generation; a sequence longer
        than ``max_seq_len`` keeps its last ``max_seq_len`` + 1 tokens. The forwards run on the engine's loop
        between its steps, without the KV cache, up to ``max_batch`` sequences and ``token_budget`` tokens each."""
        inputs, targets = [], []
        vocab = self.model.args.vocab_size
        for n, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise RequestError(f"pair {n} has an empty {'context' if not context else 'continuation'}; each "
                                   "needs at least one token (put a start-of-text token before an empty context)")
            if len(continuation) > self.max_seq_len:
                raise RequestError(f"pair {n}'s continuation has {len(continuation)} tokens, more than the "
                                   f"{self.max_seq_len} positions of a sequence; shorten it")
            if any(not 0 <= t < vocab for t in (*context, *continuation)):
                raise RequestError(f"pair {n} holds token ids outside [0, {vocab})")
            whole = [*context, *continuation][-(self.max_seq_len + 1):]
            inputs.append(whole[:-1])
            targets.append(list(continuation))
        if not pairs:
            return []
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        job = _Scoring(inputs, targets, [None] * len(inputs), order)
        with self._wake:
            if not self.alive:
                raise EngineDead(f"the engine has stopped: {self.error!r}")
            self._scoring.append(job)
            self._wake.notify()
        while not job.done.wait(1.0):
            if not self.alive:
                raise EngineDead(f"the engine has stopped: {self.error!r}")
        return job.results

    # ---- the loop (engine thread) ----

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._wake:
                        while not (self._stopping or self._waiting or self._running or self._scoring
                                   or self._failure):
                            self._wake.wait()
                        if self._failure is not None:
                            raise self._failure
                        if self._stopping:
                            break
                    self.step()
        except BaseException as e:  # noqa: BLE001 - recorded; every waiting caller is told below
            self.error = e
            raise
        finally:
            with self._wake:
                pending = list(self._waiting) + list(self._running.values())
                self._waiting.clear()
                self._running.clear()
            for r in pending:
                _tell(r, Delta("", [], None, None, "abort", time.perf_counter()))
            if self.error is not None and self.on_death is not None:
                self.on_death(self.error)

    def step(self) -> None:
        for r in list(self._running.values()):
            if r.cancelled:
                self._leave(r)
        if self._scoring:
            self._score_batch()
        self._admit()
        decoding = [r for r in self._running.values() if r.computed == r.length - 1]
        spent = self._decode_step(decoding) if decoding else 0
        if any(r.computed < r.length - 1 for r in self._running.values()):
            self._prefill(self.token_budget - spent)
        if self.adapters is not None and self.adapters.retiring:  # after this step's requests have finished
            self._release_adapters()
        self.steps += 1

    def _score_batch(self) -> None:
        """One forward, without the KV cache, over the next sequences of the oldest ``loglikelihood`` call,
        right-padded (a causal forward's positions do not see the padding after them)."""
        job = self._scoring[0]
        rows: list[int] = []
        while job.scored < len(job.order) and len(rows) < self.max_batch:
            i = job.order[job.scored]
            # Longest first, so the first row's length is the batch's width.
            if rows and len(job.inputs[rows[0]]) * (len(rows) + 1) > self.token_budget:
                break
            rows.append(i)
            job.scored += 1
        T = len(job.inputs[rows[0]])
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for b, i in enumerate(rows):
            tokens[b, :len(job.inputs[i])] = torch.tensor(job.inputs[i])
        positions = torch.arange(T).expand(len(rows), T)
        self._select_adapters([0] * len(rows))  # scoring runs on the base model
        logits = self.model(tokens.to(self.device), positions.to(self.device))
        for b, i in enumerate(rows):
            n, k = len(job.inputs[i]), len(job.targets[i])
            logprobs = logits[b, n - k:n].float().log_softmax(-1)
            target = torch.tensor(job.targets[i], device=logprobs.device)
            chosen = logprobs.gather(-1, target[:, None]).sum().item()
            job.results[i] = (chosen, bool((logprobs.argmax(-1) == target).all()))
        if job.scored == len(job.order):
            with self._wake:
                self._scoring.popleft()
            job.done.set()

    def _admit(self) -> None:
        """Move waiting requests into the running table, in ``_next_waiting``'s order, while there is room and
        blocks for their tokens so far; each takes the cached blocks of its longest cached prefix first. A
        request that does not fit yet stops admission, so that those after it in that order do not pass it."""
        pool, size = self.blocks, self.blocks.block_size
        with self._wake:
            while self._waiting and len(self._running) < self.max_batch:
                index = self._next_waiting()
                r = self._waiting[index]
                tokens = r.tokens
                # The last token is always computed, for the logits the next token is sampled from.
                keys = block_keys(tokens, size, (len(tokens) - 1) // size, self._key_seed(r))
                cached = pool.lookup(keys)
                needed = -(-len(tokens) // size) - len(cached)
                if self.window:  # the rest is taken chunk by chunk, as the window moves on (_prefill)
                    needed = min(needed, 1)
                if needed > pool.available or self._computing_elsewhere(keys, len(cached)):
                    pool.release(cached)
                    break
                del self._waiting[index]
                for passed in itertools.islice(self._waiting, index):
                    passed.overtaken += 1
                if not r.output_ids:  # counted once, not again after a preemption
                    pool.prompt_tokens += len(tokens)
                    pool.hit_tokens += len(cached) * size
                r.blocks = cached + [pool.allocate() for _ in range(needed)]
                r.keys, r.planned, r.computed = keys[:len(cached)], keys, len(cached) * size
                # A cached block holds the draft model's keys and values too, if a request's draft computed them.
                r.draft_computed = r.computed
                r.slot, self._admitted = self._admitted, self._admitted + 1
                self._running[r.slot] = r

    def _next_waiting(self) -> int:
        """The queue index of the request to admit next. Preempted requests first (they are at the queue's front,
        with output their clients already have); then the cheapest, the fewest positions asked for (prompt +
        max_tokens), in arrival order among equals. Cheapest first because a slot is held until its request ends:
        in arrival order, a 2-token request waited behind every request to the end of the context queued before it
        (benchmarks/abuse.py's disconnect load: 8 clients that start such requests and leave kept a 2-token
        client's p90 latency at 5.9x an idle server's), while it delays them by a step or two. A request passed
        over ``max_overtaken`` times goes before any cheaper one, so a long request waits behind a bounded number
        of later arrivals, never for ever."""
        return min(range(len(self._waiting)), key=lambda i: (
            not self._waiting[i].output_ids, self._waiting[i].overtaken < self.max_overtaken,
            len(self._waiting[i].prompt_ids) + self._waiting[i].params.max_tokens, i))

    def _computing_elsewhere(self, keys: list[bytes], hits: int) -> bool:
        """Whether a running request is computing block ``hits`` of the prefix ``keys`` names (admitted in the same
        step as an earlier request with the same prompt prefix, say): the request waits, to take those blocks from
        the cache a step or two later rather than compute them again (16 requests with one system prompt then
        compute it once, not 16 times)."""
        size = self.blocks.block_size
        return self.blocks.prefix_caching and hits < len(keys) and any(
            len(q.planned) > hits and q.planned[hits] == keys[hits] and q.computed < (hits + 1) * size
            for q in self._running.values())

    def _key_seed(self, r: Request) -> bytes:
        """What a request's prefix keys start from: its adapter, and how often that adapter's slot was freed
        for another, so that KV computed with different weights is never shared."""
        return f"{r.adapter}.{self._adapter_epoch[r.adapter]}".encode()

    def _leave(self, r: Request) -> None:
        """Take ``r`` out of the running table and give its blocks back."""
        self._running.pop(r.slot, None)
        self.blocks.release([b for b in r.blocks if b != NULL_BLOCK])
        r.blocks, r.keys, r.planned, r.computed = [], [], [], 0

    def _preempt(self, r: Request) -> None:
        """Give ``r``'s blocks back and put it at the front of the queue; it keeps its output so far, and is
        computed again (its cached blocks reused) when admitted, then goes on from where it stopped."""
        log.info("KV cache full: a request goes back to the queue and will be computed again "
                 "(a larger --kv-cache-tokens avoids this)")
        self._leave(r)
        with self._wake:
            if not r.cancelled:  # a gone client's request is dropped, not queued again
                self._waiting.appendleft(r)

    def _forward(self, requests: list[Request], counts: list[int], model,
                 drafts: list[list[int]] | None = None) -> torch.Tensor:
        """One forward computing the next ``counts[i]`` positions of each request, its KV through the block tables.
        drafts: tokens proposed to follow each request's, computed at the positions after its own; their KV is
        written but not counted as computed (``_sample_and_emit`` counts those accepted; the others are overwritten).
        Returns the logits at each request's last position computed, (B, vocab); with drafts, those at each of its
        positions, (B, T, vocab)."""
        inputs = [r.tokens[r.computed:r.computed + n] + (drafts[i] if drafts else [])
                  for i, (r, n) in enumerate(zip(requests, counts))]
        logits = self._run(model, requests, inputs, [r.computed for r in requests], every_position=bool(drafts))
        for r, n in zip(requests, counts):
            self._count_computed(r, n)
        return logits

    def _run(self, model, requests: list[Request], inputs: list[list[int]], starts: list[int],
             every_position: bool = False) -> torch.Tensor:
        """``model``'s forward over ``inputs[i]`` at positions ``starts[i]`` on of each request (right-padded;
        padding writes to the null block and reads nothing a real position sees), its KV cache read and written
        through the requests' block tables. Returns the logits at each row's last input, (B, vocab), or at
        every position, (B, T, vocab)."""
        size, T = self.blocks.block_size, max(map(len, inputs))
        width = max(len(r.blocks) for r in requests)
        # Built as lists, one tensor each at the end: per-row tensor operations cost more than a batch-1 decode
        # step's whole host side.
        tokens, positions, slot_mapping, table = [], [], [], []
        for r, row, start in zip(requests, inputs, starts):
            pad, pos = T - len(row), range(start, start + len(row))
            tokens.append(row + [0] * pad)
            positions.append([*pos] + [pos[-1]] * pad)
            slot_mapping.append([r.blocks[p // size] * size + p % size for p in pos] + [NULL_BLOCK * size] * pad)
            table.append(r.blocks + [NULL_BLOCK] * (width - len(r.blocks)))
        tokens, positions, slot_mapping, table = (torch.tensor(rows, dtype=torch.long, device=self.device)
                                                  for rows in (tokens, positions, slot_mapping, table))
        self._select_adapters([r.adapter for r in requests])
        lasts = None if every_position else torch.tensor([len(row) - 1 for row in inputs], device=self.device)
        logits = model(tokens, positions, table, slot_mapping, logits_at=lasts)
        return logits if every_position else logits[:, -1]

    def _count_computed(self, r: Request, n: int) -> None:
        """The next ``n`` positions of ``r`` hold its tokens' keys and values; the blocks that completes become
        reusable by key (prefix caching)."""
        size = self.blocks.block_size
        r.computed += n
        full = r.computed // size
        if full > len(r.keys):
            keys = block_keys(r.tokens, size, full, self._key_seed(r), len(r.keys), r.keys[-1] if r.keys else None)
            for block, key in zip(r.blocks[len(r.keys):full], keys):
                self.blocks.register(block, key)
            r.keys += keys
        if self.window:
            self._drop_outside_window(r)

    def _drop_outside_window(self, r: Request) -> None:
        """Give back ``r``'s blocks that lie wholly before the window of its next position, which no later query
        of it sees; their table entries become the null block, which the window's mask hides. A block the prefix
        cache keeps stays cached (and held by any other request that holds it: references are counted)."""
        dead = max(0, r.computed - self.window + 1) // self.blocks.block_size
        gone = [b for b in r.blocks[:dead] if b != NULL_BLOCK]
        if gone:
            self.blocks.release(gone)
            r.blocks[:dead] = [NULL_BLOCK] * dead

    def _prefill(self, budget: int) -> None:
        """Compute prompt tokens of the requests admitted, oldest first, ``budget`` of them in all (at least
        one): a prompt that does not fit is computed in part, and continues next step. A request whose prompt
        is complete then samples its first token."""
        budget = max(1, budget)
        requests, counts = [], []
        for r in list(self._running.values()):
            pending = r.length - r.computed
            if pending > 1 and budget > 0 and self._running.get(r.slot) is r:
                count = min(pending, budget)
                if self.window:
                    wanted, count = count, self._take_blocks(r, r.computed, count)
                    while not count and self._running.get(r.slot) is r:
                        # No block is free for the chunk: the newest running request makes room, as in decode.
                        self._preempt(max(self._running.values(), key=lambda q: q.arrival))
                        count = self._take_blocks(r, r.computed, wanted) if self._running.get(r.slot) is r else 0
                if count:
                    requests.append(r)
                    counts.append(count)
                    budget -= count
        # A request listed may have been preempted since, for a later one's chunk.
        kept = [i for i, r in enumerate(requests) if self._running.get(r.slot) is r]
        requests, counts = [requests[i] for i in kept], [counts[i] for i in kept]
        if not requests:
            return
        for group in padding_groups(counts):
            rows = [requests[i] for i in group]
            logits = self._forward(rows, [counts[i] for i in group], self.model)
            done = [i for i, r in enumerate(rows) if r.computed == r.length]
            if done:
                self._sample_and_emit([rows[i] for i in done], logits[done])

    def _decode_step(self, decoding: list[Request]) -> int:
        """One token for each request in ``decoding``, after finding a block for those whose blocks are full;
        when none is left, the running request that arrived last is preempted (possibly one of these). With
        speculative decoding, a request's draft tokens are verified in the same forward and it may get more.
        Returns the positions computed."""
        size = self.blocks.block_size
        for r in decoding:
            while r.slot in self._running and (r.length - 1) // size >= len(r.blocks):
                if self.blocks.available:
                    r.blocks.append(self.blocks.allocate())
                else:
                    self._preempt(max(self._running.values(), key=lambda q: q.arrival))
        # Every one of them may have been preempted, for an older request still computing its prompt.
        decoding = [r for r in decoding if self._running.get(r.slot) is r]
        if not decoding:
            return 0
        drafts = self._drafts(decoding) if self.speculative_tokens else []
        if not any(drafts):
            self._sample_and_emit(decoding, self._forward(decoding, [1] * len(decoding), self._decode))
            return len(decoding)
        self.drafted += sum(map(len, drafts))
        self._sample_and_emit(decoding, self._forward(decoding, [1] * len(decoding), self._decode, drafts), drafts)
        return len(decoding) + sum(map(len, drafts))

    def _drafts(self, decoding: list[Request]) -> list[list[int]]:
        """Draft tokens for each request, from prompt lookup (engine.speculative) or the draft model."""
        rooms = [self._room(r) for r in decoding]
        if self.draft_model is None:
            drafts = [propose(r.tokens, room) if room else [] for r, room in zip(decoding, rooms)]
            return [d[:self._take_blocks(r, r.length, len(d))] for r, d in zip(decoding, drafts)]
        rooms = [self._take_blocks(r, r.length, room) for r, room in zip(decoding, rooms)]
        return self._draft_with_model(decoding, rooms)

    def _room(self, r: Request) -> int:
        """How many draft tokens ``r`` may take: as many as it may still generate less the one its forward yields
        anyway. A request with a grammar takes none: its matcher would have to follow each draft token first."""
        if r.constraint is not None:
            return 0
        return max(0, min(self.speculative_tokens, r.params.max_tokens - len(r.output_ids) - 1,
                          self.max_seq_len - r.length - 1))

    def _take_blocks(self, r: Request, start: int, n: int) -> int:
        """How many of the ``n`` positions of ``r`` from ``start`` on its blocks hold, after taking free blocks for
        them; it preempts no one. For draft tokens (after the last token), and for a prompt chunk of a windowed
        engine, which admits a prompt with one block and takes the others as its chunks come."""
        size = self.blocks.block_size
        while n and (start + n - 1) // size >= len(r.blocks):
            if self.blocks.available:
                r.blocks.append(self.blocks.allocate())
            else:
                n = max(0, len(r.blocks) * size - start)
        return n

    def _draft_with_model(self, decoding: list[Request], rooms: list[int]) -> list[list[int]]:
        """The draft model's greedy tokens after each request, ``rooms[i]`` of them: its first forward computes
        the positions it has not computed yet (the prompt, or the last step's tokens), each later one the token
        before. Its keys and values go into the request's own blocks (the draft model's cache), so a rejected
        draft's are overwritten later, as the target's are."""
        drafts: list[list[int]] = [[] for _ in decoding]
        active = [i for i, room in enumerate(rooms) if room]
        inputs = {i: decoding[i].tokens[decoding[i].draft_computed:] for i in active}
        vocab = self.model.args.vocab_size
        while active:
            requests = [decoding[i] for i in active]
            logits = self._run(self.draft_model, requests, [inputs[i] for i in active],
                               [r.draft_computed for r in requests])
            for i, r, token in zip(active, requests, logits[:, :vocab].argmax(-1).tolist()):
                r.draft_computed += len(inputs[i])
                drafts[i].append(token)
                inputs[i] = [token]
            active = [i for i in active if len(drafts[i]) < rooms[i]]
        return drafts

    def unload_adapter(self, name: str) -> None:
        """Stop serving the LoRA adapter ``name``: requests for it are refused from now on (UnknownAdapter),
        those queued or running finish on it, and its slot is reused once they have."""
        from scalenlp.engine.lora import UnknownAdapter

        if self.adapters is None:
            raise UnknownAdapter(f"no adapter named {name!r}: this engine serves no LoRA adapters")
        with self._wake:
            self.adapters.unload(name)
            self._release_adapters()

    def _adapter_index(self, name: str) -> int:
        from scalenlp.engine.lora import UnknownAdapter

        if self.adapters is None:
            raise UnknownAdapter(f"no adapter named {name!r}: this engine serves no LoRA adapters")
        return self.adapters.index_of(name)

    def _release_adapters(self) -> None:
        """Free the slots of unloaded adapters that no request waiting or running uses any more."""
        with self._wake:
            in_use = {r.adapter for r in self._waiting} | {r.adapter for r in self._running.values()}
            retiring = set(self.adapters.retiring)
            self.adapters.release(in_use)
            for index in retiring - self.adapters.retiring:  # another adapter may load there: new prefix keys
                self._adapter_epoch[index] += 1

    def _select_adapters(self, indices: list[int]) -> None:
        """Which adapter each row of the next forward uses."""
        if self.adapters is not None:
            self.adapters.select(indices)

    def _sample_and_emit(self, requests: list[Request], logits: torch.Tensor,
                         drafts: list[list[int]] | None = None) -> None:
        """Pick and hand out each request's next token, or with ``drafts`` (logits at every position then, see
        ``_forward``) its accepted draft tokens and the one after them. Whatever goes wrong here for one request
        (its settings, its text, its callback) ends that request with finish_reason "error" and leaves the
        others running; the batch forward before it has no such owner, and an error there ends the loop."""
        try:
            runs = self._sample(requests, logits, drafts) if drafts else [[p] for p in self._sample(requests, logits)]
        except Exception:  # noqa: BLE001 - sample each request alone to find the one at fault
            runs = []
            for i, r in enumerate(requests):
                try:
                    runs += (self._sample([r], logits[i:i + 1], drafts[i:i + 1]) if drafts else
                             [self._sample([r], logits[i:i + 1])])
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._fail(r, e)
                    runs.append(None)
        now = time.perf_counter()
        for r, run in zip(requests, runs):
            if run is None:
                continue
            try:
                for pick in run:
                    self._emit(r, *pick, now)
                    if r.finish_reason is not None:
                        break
                else:  # the draft tokens accepted, before the last token emitted, are computed (see _forward)
                    self._count_computed(r, len(run) - 1)
                    r.draft_computed = min(r.draft_computed, r.computed)  # the draft model's, as far as they agree
            except Exception as e:  # noqa: BLE001 - as above
                self._fail(r, e)

    def _sample(self, requests: list[Request], logits: torch.Tensor, drafts: list[list[int]] | None = None) -> list:
        """(token, its logprob or None, top alternatives or None) for each request. With ``drafts``, logits holds
        (B, T, vocab), each request's at its last token and its draft tokens: each position is sampled as if the
        drafts before it had been generated (its step, its penalty counts), with its draft token proposed to
        ``sample``, and a list of those picks is returned for each request, up to the first that is not its draft."""
        if not drafts and all(r.params.argmax_only for r in requests):  # no settings tensors to build
            return [(token, None, None) for token in logits.argmax(dim=-1).tolist()]
        for r in requests:
            if r.token_counts is None and (r.params.presence_penalty or r.params.frequency_penalty):
                r.token_counts = torch.zeros(logits.shape[-1], device=self.device)
        # One row per position sampled: (request index, how many of its drafts come before it).
        rows = [(i, j) for i, d in enumerate(drafts) for j in range(len(d) + 1)] if drafts else [
            (i, 0) for i in range(len(requests))]
        counts = [requests[i].token_counts for i, _ in rows]
        if drafts:
            logits = logits[[i for i, _ in rows], [j for _, j in rows]]
            counts = [c if c is None or not j else c.index_add(0, torch.tensor(drafts[i][:j], device=c.device),
                                                              torch.ones(j, device=c.device))
                      for c, (i, j) in zip(counts, rows)]
        batch = SamplingBatch.build([requests[i].params for i, _ in rows], [requests[i].seed for i, _ in rows],
                                    [len(requests[i].output_ids) + j for i, j in rows], self.device, counts,
                                    [drafts[i][j] if j < len(drafts[i]) else -1 for i, j in rows] if drafts else None)
        logits = constrain([requests[i].constraint for i, _ in rows], logits)  # grammars: only their rows pay
        tokens, chosen, top = sample(logits, batch)
        tokens = tokens.tolist()
        chosen = chosen.tolist() if chosen is not None else [None] * len(tokens)
        top = list(zip(top.values.tolist(), top.indices.tolist())) if top is not None else [None] * len(tokens)
        picks = list(zip(tokens, chosen, top))
        if not drafts:
            return picks
        runs = [[] for _ in requests]
        for (i, j), pick in zip(rows, picks):
            # A request's picks after one that differs from its draft were sampled after a token it did not get.
            if j == len(runs[i]) and (j == 0 or runs[i][-1][0] == drafts[i][j - 1]):
                runs[i].append(pick)
        self.accepted += sum(len(run) - 1 for run in runs)
        return runs

    def _emit(self, r: Request, token: int, chosen: float | None, top: tuple | None, now: float) -> None:
        r.output_ids.append(token)
        if r.token_counts is not None:  # counted as generated, for the penalties of the next position
            r.token_counts[token] += 1
        logprob = top_lp = texts = None
        if r.params.logprobs is not None:
            logprob, texts = [chosen], [self.token_str(token)]
            k = r.params.logprobs
            top_lp = [{self.token_str(t): v for v, t in zip(top[0][:k], top[1][:k])}] if k else None
        self._advance(r, token)
        if r.constraint is not None and r.finish_reason is None and r.constraint.advance(token):
            r.finish_reason = "stop"  # the grammar is complete: nothing may follow
        new_text = self._releasable_text(r)
        r.sent += len(new_text)
        if r.finish_reason is not None:
            self._leave(r)
        r.on_event(Delta(new_text, [token], logprob, top_lp, r.finish_reason, now, tokens=texts))

    def _fail(self, r: Request, error: Exception) -> None:
        log.error("request failed in the engine; the others continue", exc_info=error)
        r.finish_reason = "error"
        self._leave(r)
        _tell(r, Delta("", [], None, None, "error", time.perf_counter(), f"{error.__class__.__name__}: {error}"))

    def token_str(self, token: int) -> str:
        """A token's text. A token that is part of a character has none: it is written as OpenAI writes one,
        ``bytes:`` and its bytes escaped (``bytes:\\xe2\\x80``), or as its vocabulary name where those are unknown."""
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        name = self.tokenizer.id_to_token(token)
        raw = token_bytes(name)
        return name if raw is None else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _advance(self, r: Request, token: int) -> None:
        """Extend the request's text by its newest token and decide whether it is finished."""
        if token in self.stop_ids and not r.params.ignore_eos:
            r.finish_reason = "stop"
            return
        # The unsettled tokens are decoded after a few settled ones and only the text they add is kept: a
        # token's text depends on its neighbours (SentencePiece decoders drop the space of a sequence's first
        # word, byte-level BPE splits characters across tokens); text ending in U+FFFD is not settled yet.
        before = r.output_ids[max(0, r.read_offset - DECODE_CONTEXT):r.read_offset]
        if len(before) < DECODE_CONTEXT:
            before = r.prompt_ids[len(r.prompt_ids) - (DECODE_CONTEXT - len(before)):] + before
        settled = self.tokenizer.decode(before, skip_special_tokens=False)
        pending = self.tokenizer.decode(before + r.output_ids[r.read_offset:], skip_special_tokens=False)
        if pending.startswith(settled):
            pending = pending[len(settled):]
        else:  # a normalizing decoder rewrote the settled text: the new tokens alone
            pending = self.tokenizer.decode(r.output_ids[r.read_offset:], skip_special_tokens=False)
        if not pending.endswith("\ufffd"):
            r.text += pending
            r.read_offset = len(r.output_ids)
        if r.params.stop:
            window = r.text[max(0, r.sent - max(map(len, r.params.stop))):]
            hits = [window.find(s) for s in r.params.stop if s in window]
            if hits:
                r.text = r.text[:max(0, r.sent - max(map(len, r.params.stop))) + min(hits)]
                r.finish_reason = "stop"
                return
        if len(r.output_ids) >= r.params.max_tokens or r.length >= self.max_seq_len:
            r.finish_reason = "length"

    def _releasable_text(self, r: Request) -> str:
        """Text safe to send: while running, hold back a tail that could still grow into a stop string."""
        end = len(r.text)
        if r.finish_reason is None and r.params.stop:
            end = max(r.sent, end - (max(map(len, r.params.stop)) - 1))
        return r.text[r.sent:end]


def _tell(r: Request, delta: Delta) -> None:
    """Send a request its last event, which may fail as the one before did (its caller is gone)."""
    try:
        r.on_event(delta)
    except Exception:  # noqa: BLE001 - nobody is left to tell
        log.warning("could not deliver a request's final event", exc_info=True)
