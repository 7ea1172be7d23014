"""Chat prompts made where untrusted model code can be stopped: a few worker processes that render a model's
chat template and run its tokenizer, each job under a time limit, an output-size limit and a memory cap.

A model file brings code that runs on every chat request: its Jinja chat template and its tokenizer's
normalizers and pre-tokenizers (``tokenizer.json``). Jinja's sandbox keeps a template from reaching the system,
not from looping for hours (two nested ``range(100000)``), writing gigabytes (``tojson(indent=50000000)``) or
computing ``(10**10)**(10**10)`` in one C call; a tokenizer can chain normalizers that double the text at each
step. None of that can be interrupted in a thread, so a conversation goes to a worker process: one that passes
the time limit is killed and replaced, a template's text stops as it passes the size limit, and a worker's address
space is capped (an allocation past it fails there, not in the server). Each job also caps the worker's CPU time,
so that a worker whose server has died does not render on alone.

Workers come from multiprocessing's fork server: a clean process (no server threads, no torch) that forks a
replacement in milliseconds. The first worker encodes a test text before the model is accepted, under the same
time limit: a tokenizer that cannot do that is refused at load with one line, before any request meets it.

A caller that leaves (a client gone) lets a job already in a worker finish or time out without it and the worker
return to the pool: killing it would make every abandoned request cost a new process. A job still waiting for a
worker when its caller leaves never takes one: seven clients that give up on a template that spins for the whole
time limit would otherwise leave a backlog of renders that holds every worker long after they have gone. As with
every multiprocessing start method but fork, a worker imports the main script first: a script that starts these
needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import string

from tokenizers import Tokenizer

from scalenlp.data.chat import (
    ChatError,
    TemplateLimit,
    assistant_mask,
    assistant_spans,
    chat_template,
    check_messages,
    render_chat,
    template_variables,
)
from scalenlp.data.text import json_problem
from scalenlp.errors import UserError
from scalenlp.hardware import proc_bytes

try:
    import resource
except ImportError:  # Windows: no POSIX limits, so a worker there is bounded by the time limit alone
    resource = None

DEFAULT_TIMEOUT = 2.0  # seconds; templates and tokenizers of real models take milliseconds
DEFAULT_MAX_BYTES = 1 << 20
DEFAULT_WORKERS = 2
MEMORY_HEADROOM = 1 << 30  # what a worker may allocate beyond what it holds once its tokenizer is loaded
WORKER_NICENESS = 10
LOAD_TIMEOUT = 300.0  # a worker loads the tokenizer the server has already loaded once: generous, not endless
# Every printable ASCII character many times, and some of the scripts models meet, for the load-time probe.
PROBE_TEXT = (string.printable + " The quick brown fox jumps over the lazy dog; naïve café, Ærøskøbing, "
              "日本語のテキスト, 中文, 한국어, Ελληνικά, русский, עברית, العربية, हिन्दी 🙂👍🏽\n") * 8
_RENDERING, _TOKENIZING = 1, 2  # what a worker is doing, for the message when it passes the time limit


def _cap_memory(headroom: int) -> None:
    """Cap the address space at what the process maps now plus ``headroom``: past it, allocations fail."""
    try:
        mapped = proc_bytes("/proc/self/status", "VmSize")
    except OSError:  # no /proc (macOS): what the process maps is unknown, so no cap; the time limit still holds
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = mapped + headroom
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _cap_cpu(seconds: float) -> None:
    """SIGXCPU ends this process once it has used ``seconds`` more CPU (and a second's grace): the server kills
    a late worker itself, this only matters once the server is gone."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _work(conn, phase, tokenizer_json: str, template: str | None, variables: dict, timeout: float,
          max_bytes: int, memory: int) -> None:
    """A worker's loop: ("chat", (messages, tools or None)) -> ("ok", ids) | ("error", message, code); ("text",
    (messages, add_generation_prompt)) -> ("ok", the rendered text); ("masked", (messages, end_of_turn ids)) ->
    ("ok", (ids, assistant mask)) for fine-tuning rows; ("probe", text) -> ("ok", number of ids). Ends when the
    server closes its end of the pipe."""
    # Below the server's priority: a template that spins for its whole time limit, or a worker starting in place
    # of one, takes CPU from requests only where the server leaves some (a real template renders in a millisecond).
    os.nice(WORKER_NICENESS)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    if resource is not None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump a core
        _cap_memory(memory)
    conn.send(("loaded",))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if resource is not None:
            _cap_cpu(timeout)
        try:
            if kind == "probe":
                phase.value = _TOKENIZING
                reply = ("ok", len(tokenizer.encode(payload).ids))
            elif kind == "text":
                phase.value = _RENDERING
                messages, add_generation_prompt = payload
                reply = ("ok", render_chat(messages, template, add_generation_prompt=add_generation_prompt,
                                           max_bytes=max_bytes, **variables))
            elif kind == "masked":
                phase.value = _RENDERING
                messages, end_of_turn = payload
                text, spans = assistant_spans(messages, template, max_bytes=max_bytes, **variables)
                phase.value = _TOKENIZING
                reply = ("ok", assistant_mask(tokenizer.encode(text, add_special_tokens=False), spans, end_of_turn))
            else:
                phase.value = _RENDERING
                messages, tools = payload
                # Tools only when sent: a template tells "no tools" by their absence (``tools is defined``).
                extra = {"tools": tools} if tools is not None else {}
                text = render_chat(messages, template, add_generation_prompt=True, max_bytes=max_bytes, **variables,
                                   **extra)
                phase.value = _TOKENIZING
                # The template writes BOS itself where the model wants one.
                reply = ("ok", tokenizer.encode(text, add_special_tokens=False).ids)
        except ChatError as e:
            limit = f" ({memory >> 20} MiB, what a template worker may add)" if e.code == "template_memory" else ""
            reply = ("error", f"{e}{limit}", e.code)
        except MemoryError:
            reply = ("error", f"the model's tokenizer ran out of memory encoding this conversation ({memory >> 20} "
                     f"MiB, what a template worker may add)", "template_memory")
        except Exception as e:  # the tokenizer refuses the text (a lone surrogate, an unknown character)
            reply = ("error", f"the model's tokenizer cannot encode this conversation: {type(e).__name__}: {e}", None)
        conn.send(reply)


async def _readable(conn, timeout: float) -> None:
    """Wait, on the event loop and holding no thread, until ``conn`` has something to read; TimeoutError after
    ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
    finally:
        loop.remove_reader(fd)


class WorkersStopped(RuntimeError):
    """The pool was closed, or could not replace a worker: no chat prompt can be made any more."""


class _Worker:
    def __init__(self, context, args: tuple):
        self.phase = context.RawValue("b", 0)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_work, args=(child, self.phase, *args), daemon=True,
                                       name="scalenlp-chat-template")
        self.process.start()
        child.close()

    def kill(self, wait: bool = True) -> None:
        """End the process; ``wait``: until its exit is known (the fork server reports it, which can take a while on
        a busy machine: not on the event loop, where multiprocessing reaps it at the next start). Its pipe stays
        open: a waiter may have it registered with its event loop, and its file descriptor must not be reused
        before that registration is removed (``_retire`` closes it after)."""
        self.process.kill()
        if wait:
            self.process.join()


class TemplateWorkers:
    """Chat prompts (token ids) of one model, made by ``workers`` processes under ``timeout`` seconds and
    ``max_bytes`` of template output per conversation, each process allowed ``memory`` bytes more than it holds
    once loaded. ``chat_ids`` is for an event loop (the server), many callers at once; the ``*_blocking`` methods
    for one caller at a time without a loop (the chat command, ``LLM.chat``, lm-eval, fine-tuning data)."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_config: dict, *, timeout: float = DEFAULT_TIMEOUT,
                 max_bytes: int = DEFAULT_MAX_BYTES, workers: int = DEFAULT_WORKERS, memory: int = MEMORY_HEADROOM):
        try:
            template = chat_template(tokenizer_config)
            self.no_template = None
        except ChatError as e:  # served for completions; each chat request gets this error
            template, self.no_template = None, e
        self.timeout, self.max_bytes, self.memory = timeout, max_bytes, memory
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__])  # the fork server imports jinja2 and tokenizers once
        self._args = (tokenizer.to_str(), template, template_variables(tokenizer_config), timeout, max_bytes,
                      memory)
        self._free: asyncio.Queue[_Worker | None] = asyncio.Queue()  # binds to a loop only when a caller waits
        self._live: set[_Worker] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._broken = ""
        try:
            started = [self._start() for _ in range(workers)]
            for worker in started:
                if not worker.conn.poll(LOAD_TIMEOUT):
                    raise UserError(f"a chat template worker did not load the model's tokenizer in {LOAD_TIMEOUT:g} s")
                self._loaded(worker)
            self._probe(started[0])
        except BaseException:
            for worker in list(self._live):
                self._retire(worker)
            raise
        for worker in started:
            self._free.put_nowait(worker)

    def _start(self) -> _Worker:
        worker = _Worker(self._context, self._args)
        self._live.add(worker)
        return worker

    def _loaded(self, worker: _Worker) -> None:
        try:
            worker.conn.recv()
        except (EOFError, OSError):
            raise UserError(f"a chat template worker could not load the model's tokenizer (it ended with "
                            f"{_ending(worker)})") from None

    def _probe(self, worker: _Worker) -> None:
        """Refuse a tokenizer that cannot encode PROBE_TEXT within the time limit (a tokenizer that fails on it
        outright is left to fail on the texts that trouble it)."""
        worker.conn.send(("probe", PROBE_TEXT))
        if worker.conn.poll(self.timeout):
            try:
                worker.conn.recv()
                return
            except (EOFError, OSError):
                problem = f"ended its worker process ({_ending(worker)}; more than {self.memory >> 20} MiB?)"
        else:
            problem = f"took more than {self.timeout:g} s (--template-timeout)"
        raise UserError(f"the model's tokenizer {problem} to encode a {len(PROBE_TEXT)}-character test text: its "
                        f"normalizers or pre-tokenizers (tokenizer.json) grow the text without end; fix them, or "
                        f"serve a model whose tokenizer works")

    def _check(self, messages, tools) -> None:
        if self._closed:
            raise WorkersStopped("the chat template workers are closed (the server is stopping)")
        if self.no_template is not None:
            raise self.no_template
        check_messages(messages)  # here, so that a malformed request costs no worker
        if (problem := json_problem(tools, "tools")) is not None:
            raise ChatError(problem)

    def _send(self, worker: _Worker, kind: str, payload: tuple) -> None:
        try:
            worker.conn.send((kind, payload))
        except Exception as e:  # pickling fails before anything is written: the worker is still idle
            self._free.put_nowait(worker)
            raise ChatError(f"the messages cannot be passed to the chat template ({type(e).__name__})") from None

    def _answer(self, worker: _Worker, ready: bool) -> list[int]:
        """The worker's reply, when it has one (``ready``); a worker that passed the time limit or died is killed
        and its limit raised."""
        reply = None
        if ready:
            try:
                reply = worker.conn.recv()
            except (EOFError, OSError):
                pass
        if reply is not None:
            self._free.put_nowait(worker)
            if reply[0] == "ok":
                return reply[1]
            raise (TemplateLimit(reply[1], reply[2]) if reply[2] else ChatError(reply[1]))
        what = "the chat template" if worker.phase.value == _RENDERING else "the model's tokenizer"
        self._retire(worker)
        if self._closed:  # killed by close(), not by what it was doing
            self._free.put_nowait(None)  # wakes a caller waiting for a worker, which passes it on
            raise WorkersStopped("the chat template workers were closed (the server is stopping)")
        if not ready:
            raise TemplateLimit(f"{what} did not finish with this conversation within {self.timeout:g} s, the time "
                                f"limit on a model's template and tokenizer (serve --template-timeout)",
                                "template_timeout")
        raise TemplateLimit(f"{what} ended its worker process on this conversation ({_ending(worker)}): it needed "
                            f"more than the {self.memory >> 20} MiB a worker may add, or crashed",
                            "template_memory")

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker nobody is waiting on any more, and close its pipe."""
        worker.kill(wait=False)
        worker.conn.close()
        self._live.discard(worker)

    async def chat_ids(self, messages: list, tools: list | None = None) -> list[int]:
        """The conversation's prompt ids (``tools``: the tool definitions the template renders, when it is to);
        ChatError (TemplateLimit for a limit) when they cannot be made."""
        self._check(messages, tools)
        left = asyncio.Event()
        job = asyncio.ensure_future(self._job(messages, tools, left))
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(job)  # a caller that leaves does not stop a render: see the module's note
        except asyncio.CancelledError:
            left.set()
            # A render already running ends without its caller: its error (a time limit) is nobody's to log.
            job.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise

    async def _job(self, messages: list, tools: list | None, left: asyncio.Event) -> list[int]:
        worker = await self._free.get()
        if worker is None:  # a replacement could not be started
            self._free.put_nowait(None)
            raise WorkersStopped(f"the chat template workers have stopped: {self._broken}")
        if left.is_set():  # nobody waits for this render any more: the worker goes to the next caller
            self._free.put_nowait(worker)
            raise asyncio.CancelledError
        self._send(worker, "chat", (messages, tools))
        try:
            await _readable(worker.conn, self.timeout)
            ready = True
        except TimeoutError:
            ready = False
        except asyncio.CancelledError:  # the loop is ending (shutdown): nobody waits for this worker
            self._retire(worker)
            raise
        try:
            return self._answer(worker, ready)
        finally:
            if worker not in self._live and not self._closed:
                self._track(asyncio.ensure_future(self._replace()))

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self) -> None:
        """A new worker in place of a retired one, once it has loaded the tokenizer (off the time limit)."""
        worker = self._start()
        try:
            await _readable(worker.conn, LOAD_TIMEOUT)
            self._loaded(worker)
        except (Exception, asyncio.CancelledError) as e:  # closed meanwhile, or the fork server is gone
            self._retire(worker)
            self._broken = "the pool is closed" if self._closed else str(e)
            self._free.put_nowait(None)  # wakes the next waiter, which passes it on
            return
        self._free.put_nowait(worker)

    def chat_ids_blocking(self, messages: list) -> list[int]:
        """``chat_ids`` for one caller at a time, without an event loop."""
        return self._blocking(messages, "chat", (messages, None))

    def chat_text_blocking(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The conversation's text as the template writes it (``render_chat``), under the same limits."""
        return self._blocking(messages, "text", (messages, add_generation_prompt))

    def masked_ids_blocking(self, messages: list, end_of_turn: list[int]) -> tuple[list[int], list[bool]]:
        """A whole conversation's ids and its assistant mask (``render_with_assistant_mask``), its renders
        together under one time limit and each under the output limit."""
        return self._blocking(messages, "masked", (messages, list(end_of_turn)))

    def _blocking(self, messages: list, kind: str, payload: tuple):
        """One job without an event loop: there is always a free worker, since callers come one at a time."""
        self._check(messages, None)
        worker = self._free.get_nowait()
        self._send(worker, kind, payload)
        try:
            return self._answer(worker, worker.conn.poll(self.timeout))
        finally:
            if worker not in self._live and not self._closed:
                replacement = self._start()
                if not replacement.conn.poll(LOAD_TIMEOUT):
                    raise UserError("a new chat template worker did not load the model's tokenizer")
                self._loaded(replacement)
                self._free.put_nowait(replacement)

    def close(self) -> None:
        """Kill every worker, busy or not: after this nothing renders. From any thread; a job in flight ends
        with its worker's death, and none is replaced."""
        self._closed = True
        for worker in list(self._live):
            worker.kill()


def _ending(worker: _Worker) -> str:
    """How a worker whose pipe closed ended: the signal that killed it, or its exit code."""
    worker.process.join(5)  # its pipe closes a moment before its exit status is known
    code = worker.process.exitcode
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
