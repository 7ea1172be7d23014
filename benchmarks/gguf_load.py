"""Reading a GGUF file: ``scalenlp.loader.load`` of the packaged SmolLM2 (Q4_1) with this tree's code beside
another tree's (data: none).

  python benchmarks/gguf_load.py --baseline OTHER_TREE/src [--checkpoint FILE] [--rounds 3]

Each load runs in a process of its own, the two trees in turn, and times load() alone (not the imports); the file
is read once first, so that both find it in the page cache. Prints each load's wall and CPU seconds, each tree's
medians and their ratios, and whether the two trees loaded the same model: a SHA-256 of every state_dict tensor
(dtype, shape and bytes), of the raw GGUF blocks kept for --quantize, and the tokenizer's ids on a few texts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "héllo wörld, naïve café — 日本語 🤖",
         "<|im_start|>user\nHi there!<|im_end|>\n", "don't I'M we'll 007 x2 2024-05-01   \t\n\n"]
OURS = Path(__file__).resolve().parents[1] / "src"


def child(checkpoint: str, digest: bool) -> dict:
    import torch

    from scalenlp.loader import load

    start, cpu = time.perf_counter(), time.process_time()
    model, pre = load(checkpoint)
    out: dict = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    if digest:
        def sha(t: torch.Tensor) -> str:
            t = t.detach().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy()
            return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data.tobytes()).hexdigest()

        out["state"] = {name: sha(t) for name, t in model.state_dict().items()}
        out["blocks"] = {name: [kind, sha(raw)] for name, (kind, raw) in pre.blocks.items()}
        out["ids"] = [pre.tokenizer.encode(text).ids for text in TEXTS]
    return out


def run(tree: Path, checkpoint: str, digest: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--child", "--checkpoint", checkpoint] + (["--digest"] if digest else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"loading with {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="the other tree's src folder (e.g. a `git archive` of main)")
    parser.add_argument("--checkpoint", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--digest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checkpoint is None:
        sys.path.insert(0, str(OURS))
        from scalenlp.models.packaged import packaged_model

        args.checkpoint = str(packaged_model("smollm2"))
    if args.child:
        print(json.dumps(child(args.checkpoint, args.digest)))
        return
    if args.baseline is None or not (args.baseline / "scalenlp").is_dir():
        parser.error("--baseline must be a src folder holding scalenlp/")
    Path(args.checkpoint).read_bytes()  # into the page cache, for both trees alike
    trees = {"baseline": args.baseline.resolve(), "this tree": OURS}
    times: dict[str, list[float]] = {name: [] for name in trees}
    cpu: dict[str, list[float]] = {name: [] for name in trees}
    digests = {}
    for i in range(args.rounds):
        for name, tree in trees.items():
            result = run(tree, args.checkpoint, digest=i == 0)
            times[name].append(result.pop("seconds"))
            cpu[name].append(result.pop("cpu"))
            digests.setdefault(name, result)
            print(f"round {i + 1}: {name} {times[name][-1]:.2f} s ({cpu[name][-1]:.2f} s of CPU)", flush=True)
    # CPU time too: on a shared machine the wall time moves with the other work, the CPU time much less.
    for what, seconds in (("wall", times), ("CPU", cpu)):
        medians = {name: statistics.median(t) for name, t in seconds.items()}
        print(f"load() of {args.checkpoint}, {what} time, median of {args.rounds}: baseline "
              f"{medians['baseline']:.2f} s, this tree {medians['this tree']:.2f} s: "
              f"{medians['baseline'] / medians['this tree']:.2f}x faster")
    print(f"load average {os.getloadavg()[0]:.1f}")
    base, ours = digests["baseline"], digests["this tree"]
    for what in ("state", "blocks", "ids"):
        same = base[what] == ours[what]
        print(f"{what}: {'the same' if same else 'DIFFERENT'}"
              + ("" if same or what == "ids" else f" ({sorted(k for k in base[what] if base[what][k] != ours[what].get(k))[:5]})"))


if __name__ == "__main__":
    main()
