"""scalenlp against torchtitan on one machine: tokens/s, loss and peak memory per process, side by side.

    python benchmarks/vs_torchtitan.py --work /tmp/titan-work [--steps 20] [--seed 42] [--rounds 1] [--rows fp32,bf16,fsdp] [--compile] [--cosine] [--same-init]

Drives the shared peer (../shared/peers/torchtitan: torchtitan 0.3.0's llama3 debug model, 6.16M
parameters, sequence 2048, batch 8, its test tokenizer, the substitute text): ``--work`` holds the
peer's venv and data as its README sets them up. Each round runs every row for both trainers, one
after the other (interleaved, so the machine's load falls on both alike), both with the round's seed
(``--seed``, 42 by default, then one more each round: the initial weights change, the batches do not), and
the table shows each round's figures:
- tok/s: wall-clock tokens per second over steps 4..N (both trainers' first steps warm up);
- CPU-s/step and tok/CPU-s: user + system CPU time of every process of the run (the process tree,
  sampled from /proc every SAMPLE_S and interpolated at the ends of steps 3 and N), per step and per
  token over the same steps; they move much less with the machine's load than tok/s, since time a
  trainer waits for a core is not counted (time it spins, e.g. in a collective, is), but a core
  shared with other work (caches, a virtual machine's host) still runs slower per CPU-second;
- loss at step 20 and at step N, and its mean over the last LOSS_MEAN steps, on the same batches: torchtitan's
  own data loader (run in the peer's venv) writes out the windows its run will read, in its order, as one
  token file, and scalenlp trains on that file unshuffled (``data.shuffle=false``) with RoPE positions
  restarting at each document as torchtitan's loader has them (``data.reset_positions``), so every step's
  inputs, positions and targets are the same for both, but for one relabelling: torchtitan shifts within a
  document, so its last token's target is EOS where scalenlp's (one stream) is the next document's BOS, and
  EOS is never an input, BOS never a target (both counted: 0), so scalenlp's output row for BOS plays
  torchtitan's for EOS (the output layer is not tied to the embedding). Under FSDP torchtitan's two ranks
  read different halves of the documents: where a window of one rank follows one of the other in the file,
  the target of the first window's last token is the other rank's token (counted and printed). Both runs
  are deterministic for a seed and follow torchtitan's debug recipe: AdamW at 8e-4, 2 warm-up steps,
  then the peak until a linear decay over the last 80% of the steps (scalenlp's training.lr_decay=linear,
  training.decay_ratio=0.8); ``--cosine`` gives scalenlp its default cosine decay from the warm-up's end;
- peak RSS: the largest resident set of any process of the run (getrusage of a wrapper's children).
The load average before each run is printed beside it: on a shared machine the ratios are the figure, and
with ``--rounds`` > 1 each row ends with a line ("all") of the median ratios and the mean losses over its
rounds: one seed's loss at step 200 moves by more than the two trainers differ (a loss spike at the peak
learning rate comes or not with the initial weights), so the mean over seeds is the figure to compare.
With ``--same-init`` both trainers start from torchtitan's initial weights for the round's seed (its seed
checkpoint, written in Hugging Face layout by its own adapter; torchtitan reads it back, scalenlp starts from it as a
Hugging Face folder through model.init, the BOS and EOS output rows traded as above): the loss columns then compare
the two training loops alone, without the draw of the initial weights. They differ in one documented choice:
torchtitan decays every parameter, scalenlp matrices only (not the norms' gains).
Both trainers run eager (torchtitan's configs leave compile off), or with ``--compile`` both compile each
transformer block (scalenlp's training.compile, torchtitan's --compile.enable, which also compiles its loss);
the table's title says which.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from scalenlp.models.families.llama import LLAMA3_ROPE_KEYS

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT.parent / "shared" / "peers" / "torchtitan"  # where the repo sits beside shared/, as in CI
SEQ, BATCH = 2048, 8
SAMPLE_S = 0.5  # CPU-time sampling period; steps here take seconds
LOSS_MEAN = 10  # steps in the mean loss at the end of a run

# row -> (processes, threads per process, parameter dtype)
ROWS = {"fp32": (1, 2, "float32"), "bf16": (1, 2, "bfloat16"), "fsdp": (2, 1, "float32")}
LABELS = {"fp32": "1 process x 2 threads, fp32", "bf16": "1 process x 2 threads, bf16",
          "fsdp": "2 processes x 1 thread, FSDP / ZeRO-3, fp32"}

# torchtitan's debug model turns RoPE as Llama 3.1 does (its ComplexRoPE scaling="llama" defaults), in
# ModelArgs.rope_scaling's order.
TITAN_ROPE_SCALING = (8.0, 1.0, 4.0, 8192)

# scalenlp's side of every run: the peer's driver (argv[1]; it registers the debug model's shape as the titan-debug
# flavor and stamps each metrics record with the wall time) with the flavor given torchtitan's RoPE scaling (argv[2]),
# which the driver predates.
_DRIVER = """import ast, dataclasses, runpy, sys
driver = runpy.run_path(sys.argv[1])
from scalenlp.models import flavors
flavors.FLAVORS["titan-debug"] = dataclasses.replace(flavors.FLAVORS["titan-debug"], rope_scaling=ast.literal_eval(sys.argv[2]))
sys.exit(driver["main"](["train"] + sys.argv[3:]))
"""

# Runs a command and prints the largest peak RSS (KiB) of its descendants as the last line.
_RSS_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def tree_cpu(root: int) -> float:
    """CPU-seconds (user + system, every thread) used so far by ``root`` and its live descendants,
    with what their already reaped children used (a child reaped between two samples moves from
    its own line to its parent's cutime/cstime, so the sum does not jump)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces or brackets: the fields start after its last ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process exited while the folder was listed
            continue
        pid = int(stat.parent.name)
        parent[pid], used[pid] = int(fields[1]), sum(int(f) for f in fields[11:15]) / tick
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(c for c, p in parent.items() if p == pid and c not in tree)
    return sum(used.get(pid, 0.0) for pid in tree)


def run_measured(cmd: list[str], env: dict, log: Path) -> tuple[int, list[tuple[float, float]]]:
    """Run ``cmd`` with output to ``log``; the peak RSS in bytes of its largest process, and
    (time, CPU-seconds of the whole process tree) sampled every SAMPLE_S while it runs."""
    samples = []
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", _RSS_WRAPPER, *cmd], env=env, stdout=subprocess.PIPE,
                                stderr=f, text=True)
        while proc.poll() is None:
            samples.append((time.time(), tree_cpu(proc.pid)))
            time.sleep(SAMPLE_S)
        out = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}); see {log}")
    return int(out.strip().splitlines()[-1]) * 1024, samples


def window(walls: dict[int, float], last: int, samples: list[tuple[float, float]]) -> dict:
    """Tokens/s, CPU-seconds per step and tokens per CPU-second between the ends of step 3 and step
    ``last``; the process tree's CPU time at each end is interpolated between the samples around it."""
    times = [t for t, _ in samples]

    def cpu_at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if not 0 < i < len(times):
            raise RuntimeError(f"no CPU sample around {t}: the run's samples span {times[0]}..{times[-1]}")
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    tokens, cpu = SEQ * BATCH * (last - 3), cpu_at(walls[last]) - cpu_at(walls[3])
    return {"tok_s": tokens / (walls[last] - walls[3]), "cpu_step": cpu / (last - 3), "tok_cpu_s": tokens / cpu}


def loss_figures(losses: dict[int, float], last: int) -> dict:
    """Loss at step 20 (where the run goes past it) and at the last step, and the mean of the last LOSS_MEAN steps."""
    tail = [losses[s] for s in range(max(1, last - LOSS_MEAN + 1), last + 1)]
    return {"loss": losses[last], "loss20": losses.get(20) if last > 20 else None, "loss_mean": sum(tail) / len(tail)}


def titan_command(peer: Path, name: str, procs: int, threads: int, seed: int, *args: str) -> list[str]:
    """run_bench.sh (torchtitan's debug model, its data) for one run; ``args`` go after the script's own, so they win
    (e.g. --checkpoint.enable over its --checkpoint.no-enable)."""
    return ["bash", str(peer / "run_bench.sh"), name, str(procs), str(BATCH // procs), str(threads),
            "--debug.seed", str(seed), *args, "activation-checkpoint:none"]  # the subcommand comes last


def titan_seed_checkpoint(peer: Path, work: Path, seed: int) -> Path:
    """torchtitan's initial weights for ``seed`` (its seed checkpoint: one process, the weights initialised as its
    training run initialises them, nothing trained), saved in Hugging Face layout (q/k rows permuted from its complex
    RoPE pairs to HF's rotate-half halves by its own state-dict adapter)."""
    name = f"seed-{seed}"
    shutil.rmtree(work / "outputs" / name, ignore_errors=True)
    subprocess.run(titan_command(peer, name, 1, 1, seed, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                                 "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
                                 "--checkpoint.folder", "seed"),
                   env=dict(os.environ, WORK=str(work)), check=True)
    return work / "outputs" / name / "seed" / "step-0"


def scalenlp_init_folder(peer: Path, work: Path, checkpoint: Path, seed: int) -> Path:
    """torchtitan's initial weights as a Hugging Face model folder scalenlp starts from (model.init): the seed
    checkpoint's tensors, a config.json of the debug model (Llama 3.1 RoPE scaling as torchtitan's, the window as
    max_position_embeddings) and the peer's tokenizer. The output rows of BOS and EOS trade places: torchtitan's
    EOS targets are scalenlp's BOS targets (see the module docstring), so with the rows traded both trainers compute
    the same logits up to that relabelling, the same loss and the same gradients."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    out = work / "scalenlp-init" / f"seed-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tokenizer = peer / "assets" / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    special = json.loads((tokenizer / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    bos, eos = (vocab.token_to_id(special[key]) for key in ("bos_token", "eos_token"))
    state = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(f).items()}
    head = state["lm_head.weight"].clone()
    head[[bos, eos]] = head[[eos, bos]]
    save_file({**state, "lm_head.weight": head}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 768, "vocab_size": 2048, "max_position_embeddings": SEQ,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", **dict(zip(LLAMA3_ROPE_KEYS, TITAN_ROPE_SCALING))}}, indent=2))
    return out


def titan_run(peer: Path, work: Path, row: str, steps: int, name: str, compiled: bool, seed: int,
              init: Path | None) -> dict:
    procs, threads, dtype = ROWS[row]
    log = work / "logs" / f"{name}.log"
    env = dict(os.environ, WORK=str(work))
    # load_only: read the initial weights, write no checkpoint.
    start = () if init is None else ("--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path",
                                     str(init), "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only")
    cmd = titan_command(peer, name, procs, threads, seed, "--training.steps", str(steps),
                        "--training.mixed-precision-param", dtype, *start,
                        *(["--compile.enable"] if compiled else []))
    rss, samples = run_measured(cmd, env, work / f"{name}.wrapper.log")
    pattern = re.compile(r"\[titan\] (\S+ \S+) - root - INFO - step:\s+(\d+)\s+loss:\s+([\d.]+)")
    walls, losses = {}, {}
    for line in log.read_text().splitlines():
        m = pattern.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            step = int(m.group(2))
            walls[step] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            losses[step] = float(m.group(3))
    return {**window(walls, steps, samples), **loss_figures(losses, steps), "rss": rss}


# Run by the peer's python: writes the windows torchtitan's loader gives each rank for ``steps`` steps, in the
# order of scalenlp's global batches (each step, rank 0's local batch, then rank 1's), as one token stream
# whose windows at stride SEQ (one token of overlap) are those inputs and, but for EOS written as BOS, labels;
# prints what else differs.
_DUMP_BATCHES = """
import json, sys
import numpy as np
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
tokenizer_path, data_path, seq, ranks, local_batch, steps, out = sys.argv[1:]
seq, ranks, local_batch, steps = int(seq), int(ranks), int(local_batch), int(steps)
tok = HuggingFaceTokenizer(tokenizer_path=tokenizer_path)
loaders = [iter(HuggingFaceTextDataset("c4_test", data_path, tok, seq_len=seq, dp_rank=r, dp_world_size=ranks,
                                       infinite=True)) for r in range(ranks)]
windows = [next(loader) for _ in range(steps) for loader in loaders for _ in range(local_batch)]
inputs = np.stack([x["input"].numpy() for x, _ in windows])
labels = np.stack([y.numpy() for _, y in windows])
relabelled = np.where(labels == tok.eos_id, tok.bos_id, labels)
stream = np.append(inputs.ravel(), relabelled[-1, -1])
np.save(out, stream.astype(np.uint16))
targets = np.lib.stride_tricks.sliding_window_view(stream[1:], seq)[::seq]
print(json.dumps({"windows": len(windows), "targets_differing": int((targets != relabelled).sum()),
                  "eos_inputs": int((inputs == tok.eos_id).sum()), "bos_targets": int((labels == tok.bos_id).sum())}))
"""


def titan_batches(peer: Path, work: Path, procs: int, steps: int) -> Path:
    """torchtitan's batches on ``procs`` ranks for ``steps`` steps as a token file for scalenlp (see _DUMP_BATCHES)."""
    out = work / "scalenlp-batches" / f"titan-{procs}ranks-{steps}steps.npy"
    out.parent.mkdir(exist_ok=True)
    report = subprocess.run([str(work / "venv" / "bin" / "python"), "-c", _DUMP_BATCHES,
                             str(peer / "assets" / "tokenizer"), str(work / "pydoc_text"), str(SEQ), str(procs),
                             str(BATCH // procs), str(steps), str(out)], check=True, capture_output=True, text=True)
    print(f"torchtitan's batches on {procs} rank(s): {report.stdout.strip()}", file=sys.stderr, flush=True)
    return out


def scalenlp_run(peer: Path, work: Path, row: str, steps: int, name: str, data: Path, compiled: bool,
                 cosine: bool, seed: int, init: Path | None) -> dict:
    procs, threads, dtype = ROWS[row]
    run_dir = work / "scalenlp-runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    model = ([f"model.init={init}"] if init else
             ["model.flavor=titan-debug", "model.vocab_size=2048", f"tokenizer.path={peer / 'assets' / 'tokenizer'}"])
    sets = [*model, f"data.path={data}", "data.shuffle=false", "data.reset_positions=true", "data.val_fraction=0",
            f"data.cache_dir={work / 'scalenlp-token-cache'}",
            f"training.seq_len={SEQ}", f"training.global_batch_size={BATCH}", f"training.steps={steps}",
            # torchtitan's debug-model recipe: AdamW 8e-4, 2 warm-up steps, linear decay to 0 over the last 80% of
            # the steps (or scalenlp's default cosine decay), clip 1.
            "training.lr=8e-4", "training.warmup_steps=2", "training.min_lr_ratio=0", f"training.seed={seed}",
            *(() if cosine else ("training.lr_decay=linear", "training.decay_ratio=0.8")),
            "training.log_every=1", "training.eval_every=0", "checkpoint.every=0", "checkpoint.export=false",
            f"training.param_dtype={dtype}", f"training.compile={str(compiled).lower()}"]
    if procs > 1:
        sets.append("parallel.data_parallel=zero3")
    args = [a for s in sets for a in ("--set", s)]
    script = work / "scalenlp_driver.py"
    script.write_text(_DRIVER)
    driver = [str(script), str(peer / "scalenlp_titan_flavor.py"), repr(TITAN_ROPE_SCALING), "--run-dir", str(run_dir),
              *args]
    launch = [sys.executable, *driver] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", *driver]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    env.pop("WORLD_SIZE", None)
    rss, samples = run_measured(launch, env, work / f"{name}.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if "loss" in r}
    return {**window({s: r["wall"] for s, r in records.items()}, steps, samples),
            **loss_figures({s: r["loss"] for s, r in records.items()}, steps), "rss": rss,
            "mfu": records[steps]["mfu"], "peak_source": records[steps]["peak_source"]}


def fmt(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"  # "-": the run ends at step 20, its loss is the step-N column


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("WORK", "titan-work")),
                        help="the peer's WORK folder (venv/, pydoc_text/data.json)")
    parser.add_argument("--peer", type=Path, default=PEER, help="the shared peer's folder")
    parser.add_argument("--steps", type=int, default=20, help="steps per run; 200 for the longer loss comparison")
    parser.add_argument("--seed", type=int, default=42,
                        help="the first round's seed (42: torchtitan's run_bench.sh seed)")
    parser.add_argument("--rounds", type=int, default=1, help="round r runs with seed --seed + r")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--compile", action="store_true", help="both trainers compile each transformer block")
    parser.add_argument("--same-init", action="store_true",
                        help="both trainers start from torchtitan's initial weights for the round's seed")
    parser.add_argument("--cosine", action="store_true", help="scalenlp decays the LR by its default cosine "
                                                              "instead of torchtitan's warmup-stable-linear-decay")
    args = parser.parse_args()
    work = args.work.resolve()
    if not (work / "venv" / "bin" / "torchrun").exists():
        print(f"error: {work}/venv has no torchtitan; set it up as {args.peer}/README.md says", file=sys.stderr)
        return 2
    (work / "logs").mkdir(exist_ok=True)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    # The fp32 and bf16 rows read the same batches (one process): each rank count's are written once.
    dumps = {procs: titan_batches(args.peer, work, procs, args.steps) for procs in {ROWS[row][0] for row in rows}}
    batches = {row: dumps[ROWS[row][0]] for row in rows}
    inits = {}  # seed -> (torchtitan's seed checkpoint, the same weights as scalenlp's model.init folder)
    for seed in range(args.seed, args.seed + args.rounds) if args.same_init else ():
        checkpoint = titan_seed_checkpoint(args.peer, work, seed)
        inits[seed] = checkpoint, scalenlp_init_folder(args.peer, work, checkpoint, seed)
    results = []
    for rnd in range(args.rounds):
        for row in rows:
            for trainer in ("torchtitan", "scalenlp"):
                load = os.getloadavg()[0]
                name = f"{trainer}-{row}-{rnd}"
                seed = args.seed + rnd
                init = inits.get(seed)
                out = (titan_run(args.peer, work, row, args.steps, name, args.compile, seed, init and init[0])
                       if trainer == "torchtitan" else
                       scalenlp_run(args.peer, work, row, args.steps, name, batches[row], args.compile, args.cosine,
                                    seed, init and init[1]))
                results.append({"round": rnd, "row": row, "trainer": trainer, "load": load, **out})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print("\nboth trainers " + ("compiled (per transformer block)" if args.compile else "eager")
          + ("; both from torchtitan's initial weights" if args.same_init else "")
          + "; the same batches; scalenlp's LR " + ("cosine" if args.cosine else "schedule is torchtitan's")
          + f"; steps 4..{args.steps}; tt = torchtitan, sn = scalenlp; CPU = user + system seconds of all the run's processes")
    print(f"{'config':<46}{'seed':>6}{'tok/s tt':>10}{'sn':>7}{'ratio':>7}{'CPU-s/step tt':>15}{'sn':>7}"
          f"{'tok/CPU-s tt':>14}{'sn':>6}{'ratio':>7}{'loss@20 tt':>11}{'sn':>7}{f'loss@{args.steps} tt':>13}{'sn':>7}"
          f"{f'mean {LOSS_MEAN} tt':>12}{'sn':>7}{'peak RSS tt':>13}{'sn':>10}"
          f"{'load tt/sn':>12}")
    for row in rows:
        wall_ratios, cpu_ratios, pairs = [], [], []
        for rnd in range(args.rounds):
            tt, sn = (next(r for r in results if (r["round"], r["row"], r["trainer"]) == (rnd, row, t))
                      for t in ("torchtitan", "scalenlp"))
            pairs.append((tt, sn))
            wall_ratios.append(sn["tok_s"] / tt["tok_s"])
            cpu_ratios.append(sn["tok_cpu_s"] / tt["tok_cpu_s"])
            print(f"{LABELS[row]:<46}{args.seed + rnd:>6}{tt['tok_s']:>10,.0f}{sn['tok_s']:>7,.0f}{wall_ratios[-1]:>7.2f}"
                  f"{tt['cpu_step']:>15.2f}{sn['cpu_step']:>7.2f}{tt['tok_cpu_s']:>14,.0f}{sn['tok_cpu_s']:>6,.0f}"
                  f"{cpu_ratios[-1]:>7.2f}{fmt(tt['loss20']):>11}{fmt(sn['loss20']):>7}"
                  f"{tt['loss']:>13.4f}{sn['loss']:>7.4f}"
                  f"{tt['loss_mean']:>12.4f}{sn['loss_mean']:>7.4f}"
                  f"{tt['rss'] / 2**30:>9.2f} GiB{sn['rss'] / 2**30:>6.2f} GiB{tt['load']:>7.1f}/{sn['load']:.1f}")
        if args.rounds > 1:
            def mean(key: str, side: int) -> float | None:  # None (printed "-") where the runs have no such loss
                values = [pair[side][key] for pair in pairs]
                return None if values[0] is None else statistics.mean(values)

            losses = "".join(f"{fmt(mean(key, 0)):>{w}}{fmt(mean(key, 1)):>7}"
                             for key, w in (("loss20", 11), ("loss", 13), ("loss_mean", 12)))
            print(f"{LABELS[row]:<46}{'all':>6}{'':>17}{statistics.median(wall_ratios):>7.2f}{'':>42}"
                  f"{statistics.median(cpu_ratios):>7.2f}{losses}")
    print(f"\nscalenlp's MFU peak: {results[-1]['peak_source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
