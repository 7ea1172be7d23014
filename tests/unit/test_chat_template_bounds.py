"""Untrusted model code is bounded (issue 32, item 2): a chat template or a tokenizer from a model file runs in a
worker process under a time limit, an output-size limit and a memory cap; a render past one is a 400 naming it, and
every template error is a 400 in OpenAI's shape; a tokenizer whose normalizers never finish is refused at load;
slow renders hold no server thread, so completions go on beside them; closing the workers (as serve does after
SIGTERM's drain) stops a render in flight, and a worker whose server died stops by itself."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from infer_helpers import CHATML, ServerThread
from scalenlp.data.chat import ChatError, TemplateLimit, render_chat, render_with_assistant_mask
from scalenlp.data.template_workers import TemplateWorkers, WorkersStopped
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.errors import UserError
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

HELLO = [{"role": "user", "content": "hello there"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
ERRORS = {  # template -> what the 400 says
    "{{ 1/0 }}": "ZeroDivisionError",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": "RecursionError",
    "{{ 10**5000 }}": "integer string conversion",
    "{{ messages|no_such_filter }}": "No filter named 'no_such_filter'",
    "{{ raise_exception('no system messages') }}": "no system messages",
    "{{ messages.__class__.__subclasses__() }}": "unsafe",
}


def word_tokenizer(normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "there": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


def doubling(text: str, times: int) -> normalizers.Sequence:
    """Normalizers that double every ``text`` ``times`` times: a 30-character prompt becomes ~30 * 2**times."""
    return normalizers.Sequence([normalizers.Replace(text, text + text)] * times)


@pytest.mark.parametrize("template", ERRORS)
def test_template_errors_are_chat_errors(template):
    with pytest.raises(ChatError, match=ERRORS[template]):
        render_chat(HELLO, template, add_generation_prompt=True)


def test_output_stops_at_the_size_limit():
    with pytest.raises(TemplateLimit, match="passed 1000 bytes") as e:
        render_chat(HELLO, "{% for i in range(100000) %}{{ messages }}{% endfor %}", add_generation_prompt=True,
                    max_bytes=1000)
    assert e.value.code == "template_output_too_large"
    assert render_chat(HELLO, CHATML, add_generation_prompt=True, max_bytes=1000) == \
        render_chat(HELLO, CHATML, add_generation_prompt=True)


# ---- the workers ----

def test_a_normal_conversation_gives_the_in_process_ids():
    tok = word_tokenizer()
    answered = [*HELLO, {"role": "assistant", "content": "hello"}]
    workers = TemplateWorkers(tok, {"chat_template": CHATML}, workers=1)
    try:
        ids = workers.chat_ids_blocking(HELLO)
        assert asyncio.run(workers.chat_ids(HELLO)) == ids
        text = workers.chat_text_blocking(answered, add_generation_prompt=False)
        masked = workers.masked_ids_blocking(answered, [0])
    finally:
        workers.close()
    assert ids == tok.encode(render_chat(HELLO, CHATML, add_generation_prompt=True), add_special_tokens=False).ids
    assert text == render_chat(answered, CHATML, add_generation_prompt=False)
    assert masked == render_with_assistant_mask(tok, answered, CHATML, end_of_turn=[0])


def test_tokenizer_whose_normalizers_never_finish_is_refused_at_load():
    """Twenty Replace("a", "aa"): a 30-character prompt would become 31 million characters."""
    with pytest.raises(UserError, match=r"tokenizer .* to encode a \d+-character test text") as e:
        TemplateWorkers(word_tokenizer(doubling("a", 20)), {"chat_template": CHATML}, timeout=1, workers=1,
                        memory=256 << 20)
    assert "\n" not in str(e.value)


def test_tokenizer_slow_on_one_text_is_stopped_at_the_time_limit():
    """A normalizer the test text does not trigger: the request's own text is encoded where it can be stopped."""
    workers = TemplateWorkers(word_tokenizer(doubling("zq", 24)), {"chat_template": CHATML}, timeout=1, workers=1,
                              memory=256 << 20)
    try:
        with pytest.raises(TemplateLimit, match="tokenizer (did not finish .* within 1 s|ended its worker)") as e:
            workers.chat_ids_blocking([{"role": "user", "content": "zq" * 15}])
        assert e.value.code in ("template_timeout", "template_memory")
        assert workers.chat_ids_blocking(HELLO)  # a new worker took its place
    finally:
        workers.close()


def test_close_stops_a_render_in_flight():
    """What serve does after SIGTERM's drain: nothing goes on rendering."""
    workers = TemplateWorkers(word_tokenizer(), {"chat_template": NESTED_LOOPS}, timeout=30, workers=1)
    (worker,) = workers._live

    async def render_then_close():
        job = asyncio.ensure_future(workers.chat_ids(HELLO))
        while worker.phase.value != 1:  # the worker has the conversation
            await asyncio.sleep(0.05)
        workers.close()
        assert not worker.process.is_alive()  # stopped now, not at its time limit
        with pytest.raises(WorkersStopped):
            await job

    asyncio.run(render_then_close())
    with pytest.raises(WorkersStopped):
        workers.chat_ids_blocking(HELLO)


ORPHAN = """
import os, sys, time
from tokenizers import Tokenizer, models, pre_tokenizers
from scalenlp.data.template_workers import TemplateWorkers

if __name__ == "__main__":
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    workers = TemplateWorkers(tok, {"chat_template": sys.argv[1]}, timeout=1, workers=1)
    (worker,) = workers._live
    worker.conn.send(("chat", [{"role": "user", "content": "hi"}]))
    print(worker.process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow  # 11 s here: a Python process and its fork server start, then the worker's 2 s of CPU
def test_a_worker_whose_server_died_stops_rendering(tmp_path):
    """The server killed with SIGKILL (no chance to close its workers): the worker's CPU cap ends it."""
    script = tmp_path / "server.py"
    script.write_text(ORPHAN)
    server = subprocess.Popen([sys.executable, str(script), NESTED_LOOPS], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid = int(server.stdout.readline())
    server.kill()
    server.wait()
    deadline = time.monotonic() + 60  # CPU seconds of a 1 s limit, on a machine others load too
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped = not alive(pid)
    if not stopped:
        os.kill(pid, signal.SIGKILL)
    assert stopped


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped; init reaps it
    except FileNotFoundError:
        return False


def test_a_render_whose_caller_left_before_it_had_a_worker_never_runs():
    """Four callers of a template that spins for the whole time limit leave while the first renders: the three
    still queued take no worker, so the next caller waits for one render, not four (a backlog of abandoned
    renders held both workers for minutes under abuse.py's slow-template load)."""
    spin = [{"role": "user", "content": "spin"}]
    template = "{% if messages[0]['content'] == 'spin' %}" + NESTED_LOOPS + "{% endif %}" + CHATML
    workers = TemplateWorkers(word_tokenizer(), {"chat_template": template}, timeout=1, workers=1)
    sent = []
    send = workers._send
    workers._send = lambda worker, kind, payload: sent.append(payload[0][0]["content"]) or send(worker, kind, payload)

    unhandled = []

    async def callers():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        leaving = [asyncio.ensure_future(workers.chat_ids(spin)) for _ in range(4)]
        while not sent:
            await asyncio.sleep(0.01)
        for caller in leaving:
            caller.cancel()
        ids = await workers.chat_ids(HELLO)
        gc.collect()  # the first render's job, ended by the time limit, is gone: its error was not left unread
        return ids

    try:
        assert asyncio.run(callers())
    finally:
        workers.close()
    assert sent == ["spin", "hello there"]
    assert unhandled == []


def test_a_chat_request_whose_client_left_while_it_waited_for_a_worker_never_renders(served):
    """Four clients give up on a template that spins for its whole time limit: only the render that had the
    worker runs, and the next request waits for that one alone (under abuse.py's slow-template load the renders
    of gone clients piled up and held both workers for a minute after the load ended)."""
    server, backend = served
    spin = [{"role": "user", "content": "spin"}]
    use_template(backend, "{% if messages[0]['content'] == 'spin' %}" + NESTED_LOOPS + "{% endif %}" + CHATML,
                 timeout=1.5, workers=1)
    sent = []
    send = backend.templates._send
    backend.templates._send = lambda worker, kind, payload: (sent.append(payload[0][0]["content"])
                                                             or send(worker, kind, payload))

    def gives_up():
        with contextlib.suppress(httpx.TimeoutException):
            chat(server, spin, timeout=0.5)

    clients = [threading.Thread(target=gives_up) for _ in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert chat(server).status_code == 200
    # The first render may have had its worker before its client left (on a busy machine, it may not have).
    assert sent[-1] == "hello there" and sent.count("spin") <= 1, sent


# ---- the other places a template renders: LLM.chat, lm-eval's chat template, fine-tuning data ----

def spinning_model(hf_chat_model, folder, template: str):
    """A copy of the tiny chat model whose tokenizer_config.json carries ``template``."""
    shutil.copytree(hf_chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def assert_time_limit(e: pytest.ExceptionInfo) -> None:
    assert e.value.code == "template_timeout" and "\n" not in str(e.value), str(e.value)


def test_llm_chat_and_lm_eval_stop_a_template_that_never_ends(hf_chat_model, tmp_path):
    from scalenlp.evaluation.lm_eval import ScaleNLPLM

    lm = ScaleNLPLM(checkpoint=str(spinning_model(hf_chat_model, tmp_path / "model", NESTED_LOOPS)))
    try:
        with pytest.raises(TemplateLimit, match="did not finish with this conversation within 2 s") as e:
            lm.llm.chat(HELLO)
        assert_time_limit(e)
        with pytest.raises(TemplateLimit, match="did not finish") as e:
            lm.apply_chat_template(HELLO)
        assert_time_limit(e)
    finally:
        lm.close()


def test_sft_data_skips_a_row_whose_template_never_ends(hf_chat_model, tmp_path):
    from scalenlp.config import load_config
    from scalenlp.data import prepare_data
    from scalenlp.data.sft import CHAT_ROWS
    from scalenlp.loader import read
    from train_helpers import SFT

    # Endless for one conversation only, ChatML for the others.
    template = "{% if messages[1]['content'] == 'spin' %}" + NESTED_LOOPS + "{% endif %}" + CHATML
    folder = spinning_model(hf_chat_model, tmp_path / "model", template)
    chats = tmp_path / "chats.jsonl"
    rows = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
             {"role": "assistant", "content": "hello there"}]
            for q in ("hello", "spin", "there")]
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    logs = []
    cfg = load_config(None, [*SFT, f"data.path={chats}", f"model.init={folder}"])
    prepare_data(cfg, tmp_path / "run", log=logs.append, pretrained=read(folder), rows=CHAT_ROWS)
    (skipped,) = [line for line in logs if "skipped" in line]
    assert "skipped 1 line(s): " in skipped and f"{chats}:2: the chat template did not finish" in skipped, logs
    assert any("2 conversations" in line for line in logs), logs


# ---- through the server: 400s in OpenAI's shape, and other requests served meanwhile ----

@pytest.fixture(scope="module")
def served(hf_chat_model):
    engine = engine_from_checkpoint(EngineConfig(str(hf_chat_model), max_queue=16))
    backend = LocalBackend(engine, "tiny")
    server = ServerThread(create_app(backend))
    yield server, backend
    backend.close()  # first: renders still in flight end now, and with them their requests
    server.stop()
    engine.stop()


def use_template(backend, template: str, **limits) -> None:
    """Serve ``template`` from now on, in workers of its own."""
    if backend.templates is not None:
        backend.templates.close()
    config = {**backend.engine.tokenizer_config, "chat_template": template}
    backend.templates = TemplateWorkers(backend.engine.tokenizer, config, **limits)


def chat(server, messages=HELLO, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=timeout,
                      json={"model": "tiny", "messages": messages, "max_tokens": 2})


def assert_openai_400(response: httpx.Response, match: str, code: str | None = None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
    assert match in error["message"], error["message"]
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize("template", ERRORS)
def test_template_errors_are_400s_in_openai_shape(served, template):
    server, backend = served
    use_template(backend, template, workers=1)
    assert_openai_400(chat(server), ERRORS[template])


@pytest.mark.parametrize("template, limits, match, codes", [
    (NESTED_LOOPS, {"timeout": 1}, "within 1 s", ("template_timeout",)),
    ("{% for i in range(100000) %}{{ messages }}{% endfor %}", {"max_bytes": 5000}, "passed 5000 bytes",
     ("template_output_too_large",)),
    # 50 million spaces a line: gigabytes, where the server's process aborted; here the worker's cap stops it.
    ("{{ messages|tojson(indent=50000000) }}", {"memory": 256 << 20, "timeout": 5}, "", ("template_memory",
                                                                                         "template_timeout")),
])
def test_a_render_past_a_limit_is_a_400_naming_it(served, template, limits, match, codes):
    server, backend = served
    use_template(backend, template, workers=1, **limits)
    response = chat(server)
    assert_openai_400(response, match)
    assert response.json()["error"]["code"] in codes
    assert "--template-" in response.json()["error"]["message"] or "MiB" in response.json()["error"]["message"]
    use_template(backend, CHATML, workers=1)
    assert chat(server).status_code == 200  # and the server serves on


def test_abandoned_slow_renders_hold_no_thread_and_completions_go_on(served):
    """Seven chat requests whose template never finishes, abandoned by their clients: they wait for the two
    workers on the event loop, not in threads, so a 2-token completion is served while they render."""
    server, backend = served
    use_template(backend, NESTED_LOOPS, timeout=1.5, workers=2)
    left = []

    def abandoned():
        try:
            chat(server, timeout=0.5)
        except httpx.TimeoutException:
            left.append(True)

    clients = [threading.Thread(target=abandoned) for _ in range(7)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert backend.templates._free.qsize() == 0  # the renders were still going on
    assert len(left) == 7


def test_chat_command_refuses_a_tokenizer_that_never_finishes(hf_chat_model, tmp_path, capsys):
    from scalenlp.cli import main

    folder = tmp_path / "model"
    shutil.copytree(hf_chat_model, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = json.loads(doubling("a", 20).__getstate__())
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    assert main(["chat", "--checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the model's tokenizer") and "test text" in err[0], err



def children(pid: int, named: bytes = b"") -> list[int]:
    """Live processes whose parent is ``pid`` (and whose command line holds ``named``)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if parent == pid and named in command and alive(int(entry)):
            found.append(int(entry))
    return found


def rendering(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"R"


@pytest.mark.slow  # a `scalenlp serve` process: 20-40 s here
def test_sigterm_stops_a_render_in_flight(hf_chat_model, tmp_path):
    """A chat request rendering a template that never ends, then SIGTERM: once --drain-timeout has passed the
    server exits, and its template workers with it (a server kept rendering for 66 minutes)."""
    from infer_helpers import serve_process

    folder = tmp_path / "model"
    shutil.copytree(hf_chat_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NESTED_LOOPS}))

    def chat_request():
        with contextlib.suppress(httpx.HTTPError):  # cancelled at the drain's end
            httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": HELLO}, timeout=120)

    with serve_process(folder, "--model-name", "tiny", "--template-timeout", "60", "--drain-timeout", "1") \
            as (url, proc):
        (fork_server,) = children(proc.pid, b"scalenlp.data.template_workers")
        workers = children(fork_server)
        assert len(workers) == 2
        client = threading.Thread(target=chat_request)
        client.start()
        while not any(rendering(pid) for pid in workers):
            assert proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0  # drained, then out through the engine's stop
        client.join()
    left = [pid for pid in workers if alive(pid)]
    for pid in left:  # not to render on for a minute
        os.kill(pid, signal.SIGKILL)
    assert not left
