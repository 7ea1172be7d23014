"""Abusive loads against a `scalenlp serve` process, with a normal client beside them (issue 32's proof).

  python benchmarks/abuse.py [--checkpoint PATH] [--loads big-prompt,disconnect,slow-template] [--seconds 20]
                             [--serve-args "--max-seq-len 2048 --max-batch 4"]
                             [--loads big-embeddings --encoder PATH --encoder-serve-args "--pass-tokens 256"]

One server process runs throughout. The normal client sends one 2-token completion after another; its latency
is measured first against the idle server, then during each load in turn. The server's RSS (from /proc) is read
before each load, at its peak during it, and after it (once the load's last request has ended and two seconds
have passed). Each load's window starts once its clients are running. Loads:

  big-prompt    8 clients, each posting a ~4 MB prompt (refused: too long), then pausing --pause seconds, and
                again (the issue's eight concurrent 4 MB prompts, repeated; --pause 0 floods)
  disconnect    8 clients, each starting a streamed completion to the end of the context and leaving after its
                first chunk, pausing, and again
  slow-template 8 clients, each sending a chat request to a model whose chat template never finishes (two nested
                range(100000) loops, the issue's template) and giving up after a second (status 499 in the load's
                statuses), pausing, and again; with this load the decoder is served from a Hugging Face copy
                of --checkpoint that carries that template (exported first: a minute or so)
  big-embeddings  (an encoder checkpoint, --encoder PATH, served by a second process) 8 clients, each posting
                2,048 texts of 330 words (3.9 MB: priced and refused) and 64 texts of 200 words (served), then
                pausing; the normal client there embeds one word

The goal: the normal client's p90 latency under each load within 2x of the idle server's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SETTLE_S = 2.0
NEVER_ENDING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# A slow-template client leaves after GIVE_UP_S, before the server's template time limit (2 s by default) ends
# the render, and counts that as status GAVE_UP (nginx's "client closed request").
GIVE_UP_S, GAVE_UP = 1.0, 499


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@contextlib.contextmanager
def served(checkpoint: str, serve_args: str):
    """(URL, pid) of `scalenlp serve` on a free port, once /health answers."""
    from scalenlp.parallel.mesh import free_port

    port = free_port()
    with started([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", checkpoint, "--port", str(port),
                  *shlex.split(serve_args)], port, {**os.environ, "OMP_NUM_THREADS": "1"}) as server:
        yield server


@contextlib.contextmanager
def started(command: list[str], port: int, env: dict, log=None):
    """(URL, pid) of a server process that listens on ``port``, once its /health answers; stopped on exit."""
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=30).status_code == 200:
                    break
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait()


@contextlib.contextmanager
def never_ending_template(checkpoint: str):
    """A Hugging Face folder of ``checkpoint`` (any kind `scalenlp export` reads) whose chat template never
    finishes, in a temporary folder removed on exit."""
    with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
        folder = Path(tmp) / "model"
        done = subprocess.run([sys.executable, "-m", "scalenlp", "export", "--checkpoint", checkpoint, "--format",
                               "hf", "--out", str(folder)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"exporting {checkpoint} for slow-template failed: {done.stderr.strip()}")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NEVER_ENDING}))
        yield str(folder)


def model_of(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


class Normal:
    """The normal client: one small request after another, its latencies kept while ``recording``."""

    def __init__(self, url: str, route: str, body: dict):
        self.url, self.route, self.body = url, route, body
        self.latencies: list[float] = []
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=None) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                r = client.post(self.url + self.route, json=self.body)
                if r.status_code == 200:
                    self.latencies.append(time.perf_counter() - start)
                else:
                    self.errors += 1
                time.sleep(0.05)

    def measure(self, seconds: float) -> list[float]:
        self.latencies = []
        self.stop.clear()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        time.sleep(seconds)
        self.stop.set()
        self.thread.join()
        return self.latencies


def big_prompt(url: str, model: str, stop: threading.Event, statuses: list, pause: float) -> None:
    body = json.dumps({"model": model, "prompt": "the quick brown fox " * 200_000, "max_tokens": 2}).encode()
    with httpx.Client(timeout=None) as client:
        while not stop.is_set():
            r = client.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            stop.wait(pause)


def disconnect(url: str, model: str, stop: threading.Event, statuses: list, pause: float) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        with httpx.Client(timeout=None) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                break  # the first chunk: then leave, closing the connection
        stop.wait(pause)


def slow_template(url: str, model: str, stop: threading.Event, statuses: list, pause: float) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    with httpx.Client(timeout=GIVE_UP_S) as client:
        while not stop.is_set():
            try:
                statuses.append(client.post(url + "/v1/chat/completions", json=body).status_code)
            except httpx.TimeoutException:
                statuses.append(GAVE_UP)
            stop.wait(pause)


def big_embeddings(url: str, model: str, stop: threading.Event, statuses: list, pause: float) -> None:
    words = (DATA / "wikitext2" / "valid.txt").read_text(encoding="utf-8").split()
    words *= 1 + 2048 * 330 // len(words)  # the file holds fewer: repeat it rather than send empty texts
    # 2,048 texts of 330 words: 3.9 MB, inside the default body limit, as in the issue.
    huge = {"model": model, "input": [" ".join(words[i * 330:(i + 1) * 330]) for i in range(2048)]}
    allowed = {"model": model, "input": [" ".join(words[i * 200:(i + 1) * 200]) for i in range(64)]}
    with httpx.Client(timeout=None) as client:
        while not stop.is_set():
            for body in (huge, allowed):
                statuses.append(client.post(url + "/v1/embeddings", json=body).status_code)
            stop.wait(pause)


LOADS = {"big-prompt": big_prompt, "disconnect": disconnect, "slow-template": slow_template,
         "big-embeddings": big_embeddings}
CLIENTS = 8


def load_process(name: str, url: str, model: str, started, stop, pause: float, results) -> None:
    """CLIENTS threads of load ``name``, ``started`` set once they run, until ``stop`` is set, then their statuses
    into ``results``. A process of its own: in the normal client's, their Python work would hold the GIL and show
    up as server latency."""
    import threading

    statuses, local_stop = [], threading.Event()
    threads = [threading.Thread(target=LOADS[name], args=(url, model, local_stop, statuses, pause), daemon=True)
               for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    started.set()
    stop.wait()
    local_stop.set()
    for t in threads:
        t.join()
    results.put(statuses)


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def sample_peak(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak.append(vm_rss_mb(pid))
        time.sleep(0.2)


def run_loads(url: str, pid: int, loads: list[str], normal: Normal, seconds: float, pause: float) -> list[dict]:
    """The idle row, then a row per load: normal client's latencies, the server's RSS, the load's statuses."""
    model = model_of(url)
    normal.measure(2)  # warm-up
    rows = [{"load": "idle", "latencies": normal.measure(seconds), "rss": (vm_rss_mb(pid),) * 3, "statuses": []}]
    spawn = multiprocessing.get_context("spawn")
    for name in loads:
        before = vm_rss_mb(pid)
        started, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
        peak, sampling = [before], threading.Event()
        worker = spawn.Process(target=load_process, args=(name, url, model, started, stop, pause, results))
        worker.start()
        started.wait()  # a spawned process takes seconds to import httpx here: not part of the load's window
        threading.Thread(target=sample_peak, args=(pid, sampling, peak), daemon=True).start()
        latencies = normal.measure(seconds)
        stop.set()
        statuses = results.get()
        worker.join()
        sampling.set()
        time.sleep(SETTLE_S)
        rows.append({"load": name, "latencies": latencies, "rss": (before, max(peak), vm_rss_mb(pid)),
                     "statuses": statuses})
    return rows


def report(rows: list[dict]) -> None:
    idle_p90 = p(rows[0]["latencies"], 90)
    print(f"{'load':<15} {'requests':>8} {'p50 s':>7} {'p90 s':>7} {'p90/idle':>8} {'RSS before':>10} "
          f"{'peak':>7} {'after':>7} {'after/before':>12}  load's statuses")
    for r in rows:
        lat, (before, peak, after) = r["latencies"], r["rss"]
        counts = {s: r["statuses"].count(s) for s in sorted(set(r["statuses"]))}
        print(f"{r['load']:<15} {len(lat):>8} {p(lat, 50):>7.3f} {p(lat, 90):>7.3f} {p(lat, 90) / idle_p90:>8.2f} "
              f"{before:>8.0f}MB {peak:>5.0f}MB {after:>5.0f}MB {after / before:>12.3f}  {counts or ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a decoder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--encoder", default=None, help="an encoder, for big-embeddings (the packaged MiniLM: "
                        "python -m scalenlp.models.packaged minilm)")
    parser.add_argument("--loads", default="big-prompt,disconnect", help="comma-separated: " + ", ".join(LOADS))
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds each load's client waits between requests (default 1)")
    parser.add_argument("--serve-args", default="--max-seq-len 2048 --max-batch 4",
                        help="more `scalenlp serve` flags (default: a 2,048-token context and 4 slots)")
    parser.add_argument("--encoder-serve-args", default="",
                        help="more `scalenlp serve` flags for the encoder (e.g. \"--pass-tokens 256\")")
    args = parser.parse_args()
    loads = args.loads.split(",")
    if unknown := set(loads) - set(LOADS):
        parser.error(f"unknown loads {sorted(unknown)}; choose from {', '.join(LOADS)}")
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    decoder_loads = [x for x in loads if x != "big-embeddings"]
    if decoder_loads:
        from scalenlp.models.packaged import packaged_model

        checkpoint = args.checkpoint or str(packaged_model("smollm2"))
        with contextlib.ExitStack() as stack:
            if "slow-template" in decoder_loads:
                checkpoint = stack.enter_context(never_ending_template(checkpoint))
            url, pid = stack.enter_context(served(checkpoint, args.serve_args))
            normal = Normal(url, "/v1/completions", {"model": model_of(url), "prompt": "Hello", "max_tokens": 2,
                                                     "temperature": 0})
            print(f"{checkpoint} ({args.serve_args}): normal client = 2-token completions")
            report(run_loads(url, pid, decoder_loads, normal, args.seconds, args.pause))
    if "big-embeddings" in loads:
        if args.encoder is None:
            parser.error("big-embeddings needs --encoder PATH")
        with served(args.encoder, args.encoder_serve_args) as (url, pid):
            normal = Normal(url, "/v1/embeddings", {"model": model_of(url), "input": "hello"})
            print(f"{args.encoder} ({args.encoder_serve_args}): normal client = one-word embeddings")
            report(run_loads(url, pid, ["big-embeddings"], normal, args.seconds, args.pause))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
