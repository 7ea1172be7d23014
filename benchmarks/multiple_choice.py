"""Multiple-choice accuracy through scalenlp's engine beside lm-evaluation-harness's own Hugging Face backend.

  python benchmarks/multiple_choice.py --hf-folder runs/smol-hf [--rows 200] [--max-batch 16]

The task: SST-2's dev set (../shared/data/sst2/dev.tsv) as zero-shot two-way multiple choice ("Review: ...
Sentiment:" then " negative" / " positive"). The model: a Hugging Face folder, e.g. SmolLM2 written by
`scalenlp export --checkpoint $SMOL --format hf --out runs/smol-hf`, so that both sides read the same weights.
Prints, measured in this run, float32 on this machine: acc and acc_norm of `scalenlp eval --tasks`'s scorer
and of lm-eval's `hf` backend, the largest difference between their log-likelihoods of a choice, and the
seconds each takes to score (lm-eval's include building its requests).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from scalenlp.engine.llm import LLM
from scalenlp.evaluation.multiple_choice import read_questions, score

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
TASK = """task: sst2_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path, rows: int) -> Path:
    questions = []
    for line in SST2.read_text(encoding="utf-8").splitlines()[1:rows + 1]:
        label, text = line.split("\t", 1)
        questions.append({"context": f"Review: {text.strip()}\nSentiment:", "choices": ["negative", "positive"],
                          "answer": int(label)})
    data = folder / "sst2.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    (folder / "sst2.yaml").write_text(TASK.format(rows=data, cache=folder / "cache"))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-folder", required=True, help="a Hugging Face model folder both sides read")
    parser.add_argument("--rows", type=int, default=200, help="SST-2 dev questions (872 in all)")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences per forward, both sides")
    args = parser.parse_args()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        data = write_task(Path(tmp), args.rows)
        with LLM(args.hf_folder, dtype="float32", max_batch=args.max_batch) as llm:
            ours = score(llm.engine, read_questions(data))
        start = time.perf_counter()
        out = simple_evaluate(model=HFLM(pretrained=args.hf_folder, dtype="float32", device="cpu",
                                         batch_size=args.max_batch),
                              tasks=["sst2_mc"], log_samples=True,
                              task_manager=TaskManager(include_path=tmp, include_defaults=False))
        theirs_seconds = time.perf_counter() - start
    theirs = out["results"]["sst2_mc"]
    samples = sorted(out["samples"]["sst2_mc"], key=lambda s: s["doc_id"])
    gap = max(abs(ll - float(r[0][0])) for q, s in zip(ours.details, samples)
              for ll, r in zip(q["loglikelihoods"], s["resps"]))
    print(f"SST-2 dev, first {args.rows} questions, zero-shot, float32 | {args.hf_folder}")
    print(f"{'':24}{'acc':>14}{'acc_norm':>10}{'seconds':>10}")
    print(f"{'scalenlp eval --tasks':24}{ours.acc:>8.4f} ±{ours.acc_stderr:.3f}{ours.acc_norm:>10.4f}"
          f"{ours.seconds:>10.1f}")
    print(f"{'lm-eval hf':24}{theirs['acc,none']:>8.4f} ±{theirs['acc_stderr,none']:.3f}"
          f"{theirs['acc_norm,none']:>10.4f}{theirs_seconds:>10.1f}")
    print(f"largest |log-likelihood difference| over {ours.continuations} choices: {gap:.2e}")


if __name__ == "__main__":
    main()
