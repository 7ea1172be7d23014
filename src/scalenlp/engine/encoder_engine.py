"""A batcher for encoders: concurrent embedding, classification and tagging requests share forward passes.

Each request's texts become units in a queue. A worker thread takes up to ``forward_batch`` units of one kind (embed,
classify or tag), and no more than ``pass_tokens`` token positions once padded (``padded_width``: to one of a few
widths, just above the longest; a longer text runs alone), waiting at most ``batch_wait_ms`` after the oldest one
arrived for more to come, runs one forward and hands each row back; a request's future completes when its last row does.
A batch is filled round-robin across the waiting requests (each request's texts shortest first, the requests with the
fewest tokens encoded so far first: a newcomer's text is in the next pass), so a one-text request behind a 2,048-text
one is served within about one forward pass, and the token budget bounds how long that pass takes (on a CPU a forward's
cost grows with its tokens, at about the same rate from a few hundred up). A request whose future is cancelled (its
client left) leaves the queue at once: its texts not yet taken into a batch are never encoded. When the queue empties
after ``TRIM_AFTER_TOKENS`` or more tokens were encoded since it last did, the heap's free pages go back to the system
(``engine.heap``): forward passes free their activations into glibc's arenas, which kept them (RSS 1.47x its level
before 64-text requests). A text to tag is cut into windows of whole words (``data.tags.word_windows``) when it is
longer than the model's window, each window a unit, so no word is lost.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from scalenlp.compress.quantized import quantization_of
from scalenlp.data.entities import text_entities
from scalenlp.data.spans import Answer, Windower, best_answer, char_spans
from scalenlp.data.tags import plain_tokenizer, special_ends, word_windows
from scalenlp.data.text import check_text
from scalenlp.data.word_floor import counts_words, words
from scalenlp.engine.config import EncoderEngineConfig
from scalenlp.engine.decoder_engine import EngineDead, QueueFull, RequestError, pick_device
from scalenlp.engine.dtype import LayerShapes, choose_dtype
from scalenlp.engine.heap import trim_heap
from scalenlp.errors import UserError
from scalenlp.loader import checkpoint_kind, instantiate, read
from scalenlp.models.encoder import EncoderArgs
from scalenlp.models.hf import read_hf_config
from scalenlp.models.hf_encoder import is_encoder_config
from scalenlp.models.io import load_model_args

KINDS = ("embed", "classify", "tag", "qa")
PER_TOKEN = ("tag", "qa")  # kinds whose rows are per token (a list of tensors), not one vector per text
# Question answering: a context longer than the model's window is cut into windows overlapping by this fraction of
# it (128 tokens of 512, as the reference recipe overlaps 384-token windows by 128 at most).
QA_OVERLAP = 0.25
# Tokens encoded since the last trim that make the next idle moment trim the heap: a 64-text request of 200
# words is ~16,000; a one-word request is 3 and does not pay for a trim.
TRIM_AFTER_TOKENS = 4096
# A pass is padded to the next of a few widths (``padded_width``) rather than to its longest text: oneDNN compiles
# and caches a kernel per new input shape (default capacity 1,024), and after the big-embeddings load of
# benchmarks/abuse.py, where every width from 2 to 256 came up, the server held 70 MB more than before it (20 MB
# with these widths). The widths are the numbers whose binary form has at most this many significant bits (1 to
# 16, 18, 20, ... 32, 36, 40, ...): 48 widths up to 256, a pass padded by at most an eighth of its longest text
# (3 bits: 28 widths, and 7% more positions and CPU time on SST-2's short sentences).
WIDTH_BITS = 4


def is_encoder(checkpoint: str | Path) -> bool:
    """Whether the checkpoint holds an encoder, from its config alone (no weights read)."""
    kind, path = checkpoint_kind(checkpoint)
    if kind == "export":
        return isinstance(load_model_args(path), EncoderArgs)
    return kind == "hf" and is_encoder_config(read_hf_config(path))


def sentence_max_len(folder: Path) -> int | None:
    """sentence-transformers' ``max_seq_length`` (it truncates there, below the position table), if set."""
    file = folder / "sentence_bert_config.json"
    try:
        return int(json.loads(file.read_text())["max_seq_length"]) if file.is_file() else None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"cannot read max_seq_length from {file}: {e!r}") from None


@dataclass(eq=False)
class Job:
    kind: str
    ids: list[list[int]]
    types: list[list[int]] | None = None  # token type ids (segments) of each row; None: all 0
    future: Future = field(default_factory=Future)
    rows: list = field(default_factory=list)
    left: int = 0  # rows not computed yet
    pending: list[int] = field(default_factory=list)  # rows not taken into a batch yet, shortest first
    taken: int = 0  # tokens of its rows taken into batches so far: the job with fewest goes first
    arrival: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.rows = [None] * len(self.ids)
        self.left = len(self.ids)
        self.pending = sorted(range(len(self.ids)), key=lambda i: len(self.ids[i]))


class EncoderEngine:
    def __init__(self, model, tokenizer: Tokenizer, *, max_seq_len: int | None = None, forward_batch: int = 32,
                 pass_tokens: int | None = None, batch_wait_ms: float = 2.0, max_queue: int = 64, max_batch_texts: int = 2048,
                 max_text_chars: int = 32768, max_request_tokens: int | None = None, short_pass_tokens: int = 0):
        """The options are ``EncoderEngineConfig``'s (checked there); ``max_seq_len`` is at most the model's."""
        self.model = model.eval()
        self.args: EncoderArgs = model.args
        self.device = next(model.parameters()).device
        self.max_seq_len = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        # A copy: the checkpoint's tokenizer.json may pad every text to a fixed length (MiniLM's pads to 128);
        # batches are padded here, to their longest text.
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_len)
        # The special tokens wrapped around a text ([CLS] ... [SEP]), added to token-id inputs as well.
        self.prefix, self.suffix = special_ends(self.tokenizer)
        self.words = plain_tokenizer(tokenizer)  # texts to tag are cut into windows here, not truncated
        self.counts_words = counts_words(tokenizer)  # whether a request's words bound its tokens from below
        self.windower = (Windower(tokenizer, self.max_seq_len, int(self.max_seq_len * QA_OVERLAP))
                         if self.args.task == "question_answering" else None)
        self.forward_batch, self.batch_wait_ms = forward_batch, batch_wait_ms
        self.pass_tokens = pass_tokens or forward_batch * self.max_seq_len  # None: texts alone bound a pass
        # A second worker's passes: short texts only, at most this many positions (0: no second worker).
        self.short_pass_tokens = short_pass_tokens
        self.max_queue, self.max_batch_texts = max_queue, max_batch_texts
        self.max_text_chars, self.max_request_tokens = max_text_chars, max_request_tokens
        self.queues: dict[str, list[Job]] = {k: [] for k in KINDS}  # jobs with texts still queued, served in turn
        self.cond = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.error: BaseException | None = None
        self.startup_line: str | None = None  # what its builder says at start-up (engine.dtype.announce)
        # Counters, read by the server's /metrics and by tests and benchmarks.
        self.requests = self.forwards = self.texts = self.tokens = self.padded_tokens = self.truncated = 0

    @property
    def labels(self) -> list[str]:
        return self.args.labels if self.args.task == "classification" else []

    @property
    def is_tagger(self) -> bool:
        return self.args.task == "token_classification"

    def start(self) -> EncoderEngine:
        """One worker takes every pass; with ``short_pass_tokens``, a second takes passes of short texts alone,
        so that a short request is not queued behind a long pass (a pass cannot be interrupted: a one-word
        embedding waited a whole 256-token pass, 2.8x an idle server's p90 under benchmarks/abuse.py's
        big-embeddings load). The two forwards run at once, each on the intra-op threads."""
        lanes = [None] + ([self.short_pass_tokens] if self.short_pass_tokens else [])
        self.threads = [threading.Thread(target=self._loop, args=(lane,), name="scalenlp-encoder", daemon=True)
                        for lane in lanes]
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join()

    @property
    def alive(self) -> bool:
        return bool(self.threads) and all(thread.is_alive() for thread in self.threads)

    @property
    def num_waiting(self) -> int:
        return sum(len(job.pending) for q in self.queues.values() for job in q)

    @property
    def waiting_jobs(self) -> int:
        return sum(map(len, self.queues.values()))

    def encode(self, inputs: list[str | list[int]], priced: bool = False) -> list[list[int]]:
        """Token ids per input, special tokens included, truncated to ``max_seq_len``. Text is tokenized; token
        ids are taken as the text's tokens and wrapped in the special tokens. RequestError for bad input, and
        with ``priced`` for inputs surely past ``max_request_tokens`` (``refuse_surely_over``)."""
        self._check_inputs(inputs)
        if priced:
            self.refuse_surely_over(inputs)
        texts = [x for x in inputs if isinstance(x, str)]
        encoded = iter(self.tokenizer.encode_batch(texts))
        out = []
        room = self.max_seq_len - len(self.prefix) - len(self.suffix)
        for x in inputs:
            if isinstance(x, str):
                e = next(encoded)
                self.truncated += bool(e.overflowing)
                out.append(e.ids)
            else:
                self.truncated += len(x) > room
                out.append(self.prefix + list(x[:room]) + self.suffix)
        return out

    def _word_windows(self, texts: list[str]) -> list[tuple[object, list[tuple[int, int]]]]:
        """Each text's encoding (no special tokens) and its windows of whole words."""
        room = self.max_seq_len - len(self.prefix) - len(self.suffix)
        return [(e, word_windows(e.word_ids, room)) for e in self.words.encode_batch(texts, add_special_tokens=False)]

    def tag_windows(self, texts: list[str], priced: bool = False) -> list[list[int]]:
        """Token ids of every window of every text, in order, special tokens included (``entities`` reads the
        rows back). RequestError for bad input, or for token ids: tagging needs text, to give character offsets;
        with ``priced``, for texts surely past ``max_request_tokens``."""
        self._check_inputs(texts)
        for i, x in enumerate(texts):
            if not isinstance(x, str):
                raise RequestError(f"input {i} is token ids; tagging takes texts (entities come back with the "
                                   f"character offsets of the text)")
        if priced:
            self.refuse_surely_over(texts, whole=True)
        split = self._word_windows(texts)
        for i, (_, windows) in enumerate(split):
            if not windows:
                raise RequestError(f"input {i} becomes no token at all under this model's tokenizer; send some text")
        return [self.prefix + e.ids[start:end] + self.suffix for e, windows in split for start, end in windows]

    def entities(self, texts: list[str], rows: list[torch.Tensor]) -> list[list[dict]]:
        """The entities of each text from the rows ``submit("tag", tag_windows(texts))`` returned."""
        out, k = [], 0
        for text, (e, windows) in zip(texts, self._word_windows(texts)):
            parts = [row[len(self.prefix):len(row) - len(self.suffix)] for row in rows[k:k + len(windows)]]
            k += len(windows)
            probs = torch.cat(parts).numpy() if parts else torch.zeros(0, len(self.args.labels)).numpy()
            out.append(text_entities(text, e.offsets, e.word_ids, probs, self.args.labels))
        return out

    def tag(self, texts: list[str]) -> list[list[dict]]:
        """Entities of each text (type, text, start, end character offsets, score), long texts in windows."""
        return self.entities(texts, self.submit("tag", self.tag_windows(texts)).result())

    def qa_windows(self, questions: list[str], contexts: list[str], priced: bool = False) -> list[list]:
        """The windows (tokenizers Encodings: ids, segments, offsets) of each (question, context) pair.
        RequestError for bad input: no pairs, unequal lists, an empty or too long text, a question too long
        for a window; with ``priced``, pairs surely past ``max_request_tokens``."""
        self._check_answers_questions()
        if len(questions) != len(contexts):
            raise RequestError(f"{len(questions)} questions and {len(contexts)} contexts; send one context per "
                               f"question")
        self._check_inputs(questions)
        self._check_inputs(contexts)
        if any(not isinstance(x, str) for x in questions + contexts):
            raise RequestError("questions and contexts must be texts")
        if priced:  # a pair's windows hold its question's and context's words, between a text's special tokens
            self.refuse_surely_over([f"{q} {c}" for q, c in zip(questions, contexts)], whole=True)
        windows = self.windower(questions, contexts)
        for i, w in enumerate(windows):
            if isinstance(w, str):
                raise RequestError(f"question {i}: {w}")
        return windows

    def _check_answers_questions(self) -> None:
        if self.windower is None:
            raise RequestError(f"this model does not answer questions (its task is {self.args.task!r}); question "
                               f"answering needs a checkpoint fine-tuned with training.task=\"qa\"")

    def answers(self, contexts: list[str], windows: list[list], rows: list[torch.Tensor], allow_empty: bool = False,
                n_best: int = 20, max_answer_len: int = 30) -> list[Answer]:
        """The answer to each question from its windows (``qa_windows``) and the (tokens, 2) start and end logits
        ``submit("qa", ...)`` returned for them, in order."""
        out, k = [], 0
        for context, ws in zip(contexts, windows):
            logits = rows[k:k + len(ws)]
            k += len(ws)
            out.append(best_answer([x[:, 0] for x in logits], [x[:, 1] for x in logits], [char_spans(w) for w in ws],
                                   context, n_best, max_answer_len, allow_empty))
        return out

    def answer(self, questions: list[str], contexts: list[str], allow_empty: bool = False) -> list[Answer]:
        """The answer to each question in its context: text, character offsets, probability; with
        ``allow_empty`` (a SQuAD v2.0 model) the empty answer when "no answer" scores above every span."""
        windows = self.qa_windows(questions, contexts)
        flat = [w for ws in windows for w in ws]
        rows = self.submit("qa", [w.ids for w in flat], types=[w.type_ids for w in flat]).result()
        return self.answers(contexts, windows, rows, allow_empty)

    def _check_inputs(self, inputs: list[str | list[int]]) -> None:
        if not inputs:
            raise RequestError("the input must not be empty")
        if len(inputs) > self.max_batch_texts:
            raise RequestError(f"{len(inputs)} inputs in one request; this server takes at most "
                               f"{self.max_batch_texts} (--max-batch-texts)")
        for i, x in enumerate(inputs):
            if not x or (isinstance(x, str) and not x.strip()):
                raise RequestError(f"input {i} is empty; every input must hold some text or token ids")
            if isinstance(x, str):
                check_text(x, f"input {i}", self.max_text_chars, " per input (--max-text-chars)", RequestError)
            elif len(x) > self.max_text_chars:
                raise RequestError(f"input {i} holds {len(x)} token ids; this server takes at most "
                                   f"{self.max_text_chars} per input (--max-text-chars)")
            elif not all(0 <= t < self.args.vocab_size for t in x):
                raise RequestError(f"input {i} has token ids outside the vocabulary [0, {self.args.vocab_size})")

    def price(self, ids: list[list[int]]) -> int:
        """The tokens these encoded texts cost; RequestError past ``max_request_tokens`` (checked before queueing)."""
        tokens = sum(map(len, ids))
        self._refuse_over(tokens, len(ids), "")
        return tokens

    def refuse_surely_over(self, inputs: list[str | list[int]], whole: bool = False) -> None:
        """RequestError when these inputs cost more than ``max_request_tokens`` even at the fewest tokens they can
        become, found without tokenizing: each text's special tokens and one per word (``data.word_floor``, when
        this tokenizer allows it), cut at ``max_seq_len`` as ``encode`` cuts unless ``whole`` (tagging's and
        question answering's windows keep every token). The count stops once past the limit, so that a refused
        request of megabytes costs little more than its first texts; ``price`` still applies after tokenizing."""
        if self.max_request_tokens is None:
            return
        ends = len(self.prefix) + len(self.suffix)
        room = None if whole else self.max_seq_len - ends
        least = 0
        for x in inputs:
            body = len(x) if not isinstance(x, str) else words(x, room) if self.counts_words else 0
            least += ends + (body if room is None else min(body, room))
            if least > self.max_request_tokens:
                self._refuse_over(least, len(inputs), "at least ")

    def _refuse_over(self, tokens: int, texts: int, bound: str) -> None:
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            raise RequestError(f"the input holds {bound}{tokens} tokens ({texts} texts); this server encodes at "
                               f"most {self.max_request_tokens} per request (--max-request-tokens): split it")

    def submit(self, kind: str, ids: list[list[int]], *, types: list[list[int]] | None = None,
               bypass_queue_limit: bool = False) -> Future:
        """Queue encoded texts (see ``encode``); the future's result is a float32 tensor, one row per text:
        the sentence embeddings, or the class probabilities; for "tag", a list of (tokens, tags) tensors of
        tag probabilities; for "qa", a list of (tokens, 2) start and end logits. ``types``: each row's token type
        ids (a question answering window's segments). Cancelling the future drops its queued texts."""
        if kind == "classify" and not self.labels:
            raise RequestError(f"this model is not a classifier (its task is {self.args.task!r}); classification "
                               "needs a checkpoint fine-tuned for it"
                               + (": tag texts with /v1/tag or `scalenlp tag`" if self.is_tagger else ""))
        if kind == "tag" and not self.is_tagger:
            raise RequestError(f"this model is not a tagger (its task is {self.args.task!r}); tagging needs a "
                               f"checkpoint fine-tuned with training.task=\"token_classification\""
                               + (": classify texts with /v1/classify or `scalenlp classify`" if self.labels else ""))
        if kind == "qa":
            self._check_answers_questions()
        job = Job(kind, ids, types)
        with self.cond:
            if not self.alive:
                raise EngineDead(f"the encoder is not running: {self.error!r}")
            if self.waiting_jobs >= self.max_queue and not bypass_queue_limit:
                raise QueueFull(f"{self.waiting_jobs} requests are already waiting; retry later")
            self.requests += not bypass_queue_limit
            self.queues[kind].append(job)
            self.cond.notify_all()  # a short-pass worker woken alone would leave a long text queued
        job.future.add_done_callback(lambda f: f.cancelled() and self._drop(job))
        return job.future

    def _drop(self, job: Job) -> None:
        """A cancelled job leaves the queue: its texts not taken yet are never encoded."""
        with self.cond:
            if job in self.queues[job.kind]:
                self.queues[job.kind].remove(job)
            job.pending.clear()

    def run(self, kind: str, inputs: list[str | list[int]]) -> torch.Tensor:
        """Encode, queue and wait: the rows of ``submit`` for these inputs."""
        return self.submit(kind, self.encode(inputs)).result()

    def _take(self, lane: int | None) -> tuple[str, list[tuple[Job, int]]] | None:
        """The next batch: texts of the kind waiting longest, once ``forward_batch`` of them are queued or the
        oldest has waited ``batch_wait_ms``; with ``lane``, of the jobs whose next text has at most ``lane``
        tokens, in a pass of at most ``lane`` positions. None when stopping."""
        with self.cond:
            while True:
                if self.stopping:
                    return None
                queues = {kind: [job for job in q if lane is None or job.pending and len(job.ids[job.pending[0]]) <= lane]
                          for kind, q in self.queues.items()}
                heads = [(min(job.arrival for job in q), kind) for kind, q in queues.items() if q]
                if not heads:
                    self.cond.wait()
                    continue
                oldest, kind = min(heads)
                queue = queues[kind]
                wait = oldest + self.batch_wait_ms / 1000 - time.perf_counter()
                if sum(len(job.pending) for job in queue) < self.forward_batch and wait > 0:
                    self.cond.wait(wait)
                    continue
                batch, left = fair_batch(queue, self.forward_batch, lane or self.pass_tokens,
                                         lambda n: padded_width(n, self.max_seq_len))
                chosen = set(map(id, queue))
                self.queues[kind] = left + [job for job in self.queues[kind] if id(job) not in chosen]
                return kind, batch

    def _forward(self, kind: str, batch: list[tuple[Job, int]]) -> torch.Tensor | list[torch.Tensor]:
        rows = [job.ids[i] for job, i in batch]
        width = padded_width(max(map(len, rows)), self.max_seq_len)
        ids = torch.full((len(rows), width), self.args.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (row, (job, i)) in enumerate(zip(rows, batch)):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
            if job.types is not None:
                types[r, :len(row)] = torch.tensor(job.types[i])
        with self.cond:  # two workers count
            self.forwards += 1
            self.texts += len(rows)
            self.tokens += int(mask.sum())
            self.padded_tokens += mask.numel()
        ids, mask, types = ids.to(self.device), mask.to(self.device), types.to(self.device)
        with torch.inference_mode():
            if kind == "embed":
                out = self.model.embed(ids, mask)
            elif kind == "qa":  # start and end logits: answers are ranked by their sums across windows
                out = self.model(ids, mask, types)
            else:
                out = self.model(ids, mask, types).float().softmax(-1)
        out = out.float().cpu()
        return [probs[:len(row)] for probs, row in zip(out, rows)] if kind in PER_TOKEN else out

    def _loop(self, lane: int | None) -> None:
        trimmed_at = 0  # self.tokens at the last trim
        try:
            while (taken := self._take(lane)) is not None:
                kind, batch = taken
                if not batch:
                    continue
                try:
                    out = self._forward(kind, batch)
                except Exception as e:  # noqa: BLE001 - fail these requests, keep serving the others
                    for job in {id(j): j for j, _ in batch}.values():
                        _settle(job.future, exception=e)
                    continue
                with self.cond:  # a job's rows may come from both workers
                    for (job, i), row in zip(batch, out):
                        job.rows[i] = row
                        job.left -= 1
                        if job.left == 0:  # per-token rows differ in length: they stay a list
                            _settle(job.future, result=job.rows if kind in PER_TOKEN else torch.stack(job.rows))
                if self.tokens - trimmed_at >= TRIM_AFTER_TOKENS and not any(self.queues.values()):
                    trim_heap()
                    trimmed_at = self.tokens
        except BaseException as e:
            self.error = e
            raise
        finally:
            with self.cond:
                for queue in self.queues.values():
                    for job in queue:
                        _settle(job.future, exception=EngineDead(f"the encoder stopped: {self.error!r}"))
                    queue.clear()


def padded_width(longest: int, cap: int) -> int:
    """The width a pass whose longest text has ``longest`` tokens is padded to: ``longest`` rounded up to
    ``WIDTH_BITS`` significant bits, never past ``cap`` (the longest a text can be), so that a server's passes take
    a bounded set of shapes."""
    step = 1 << max(0, longest.bit_length() - WIDTH_BITS)
    return max(longest, min(-(-longest // step) * step, cap))


def fair_batch(queue: list[Job], size: int, tokens: int,
               padded: Callable[[int], int] = lambda n: n) -> tuple[list[tuple[Job, int]], list[Job]]:
    """(the next batch of (job, row), the jobs left queued, in their new turn order). The batch takes one text
    from each job in turn (each job's shortest first) until it holds ``size`` texts, or until no job's next text
    keeps it within ``tokens`` positions once padded to ``padded`` of its longest (the first text is taken whatever
    its length: a text longer than the budget runs alone). The turn goes to the jobs with the fewest tokens taken so far, so
    that a request just arrived is in the next pass even when a pass holds fewer texts than there are requests;
    among equals, the jobs a batch served go behind those it did not reach (or could not fit), so that over
    successive batches every waiting request moves forward."""
    batch: list[tuple[Job, int]] = []
    served: list[Job] = []
    width = 0
    full: set[int] = set()  # ids of jobs whose next text does not fit in this batch
    queue = sorted(queue, key=lambda job: job.taken)  # stable: the turn order breaks ties
    while len(batch) < size:
        took = False
        for job in queue:
            if not job.pending or len(batch) == size or id(job) in full:
                continue
            length = len(job.ids[job.pending[0]])
            if batch and (len(batch) + 1) * padded(max(width, length)) > tokens:
                full.add(id(job))
                continue
            batch.append((job, job.pending.pop(0)))
            job.taken += length
            width = max(width, length)
            took = True
            if job not in served:
                served.append(job)
        if not took:
            break
    unserved = [job for job in queue if job not in served]
    return batch, unserved + [job for job in served if job.pending]


def _settle(future: Future, result=None, exception: BaseException | None = None) -> None:
    """Complete a future unless its caller cancelled it (gone) or it already failed."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def encoder_from_checkpoint(config: EncoderEngineConfig) -> EncoderEngine:
    """Load an encoder checkpoint and start a batcher on it, as ``config`` says. Texts are truncated at
    ``max_seq_len``, else where sentence-transformers truncates them for this folder, else at the model's
    position table."""
    config.check()
    spec = quantization_of(config.quantize, config.group_size)
    torch_device = pick_device(config.device)
    pre = read(config.checkpoint)
    if not isinstance(pre.args, EncoderArgs):
        raise UserError(f"{config.checkpoint} is a decoder (it generates text); embed, classify and tag need an "
                        f"encoder")
    dtype = choose_dtype(torch_device, config.dtype, LayerShapes.of(pre.args))
    model = instantiate(pre, device=torch_device, dtype=dtype.dtype, quantize=spec)
    engine = EncoderEngine(model, pre.tokenizer, max_seq_len=config.max_seq_len or sentence_max_len(pre.path),
                         forward_batch=config.forward_batch, pass_tokens=config.pass_tokens,
                         batch_wait_ms=config.batch_wait_ms,
                         max_queue=config.max_queue, max_batch_texts=config.max_batch_texts,
                         max_text_chars=config.max_text_chars, max_request_tokens=config.max_request_tokens,
                         short_pass_tokens=config.short_pass_tokens)
    engine.startup_line = dtype.line() if dtype.reason else None  # said by the caller: dtype.announce
    return engine.start()
