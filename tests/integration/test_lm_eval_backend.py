"""The lm-eval backend (scalenlp.evaluation.lm_eval) against lm-eval's own Hugging Face backend on the same random
Llama saved by transformers, over tasks defined here (a YAML and a JSONL each): the same multiple-choice accuracy,
the same log-likelihood of every choice, of every rolling window and the same generated text. `scalenlp eval
--tasks` on the same questions gives lm-eval's figures too, and the same log-likelihoods under --tp 2."""

import json
import subprocess
import sys

import pytest

from scalenlp.cli import main
from train_helpers import cli_env

pytest.importorskip("lm_eval")
COLOURS = ["red", "green", "blue", "amber", "violet", "silver", "golden"]


def write_tasks(folder):
    """Three tasks over two JSONL files: multiple choice (20 questions, choices of different lengths so that acc
    and acc_norm differ), rolling log-likelihood of texts longer than the model's 128 positions, and greedy
    generation until a newline, " is" or " we" (words this model writes first
    on the corpus of ../shared/data, or on the generated one where that is absent)."""
    folder.mkdir()
    questions = [{"context": f"Question {i}: which colour is the {COLOURS[i % 7]} one? Answer:",
                  "choices": [COLOURS[(i + k) % 7] + " and " * (k == 2) + COLOURS[i % 3] * (k == 2) for k in range(3)],
                  "answer": (i * 2) % 3} for i in range(20)]
    texts = [{"text": " ".join(COLOURS[(i * j) % 7] for j in range(5 + 30 * i)), "prompt": f"Item {i}: the",
              "target": "red"} for i in range(6)]
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (folder / "texts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    common = "dataset_path: json\ntest_split: test\n"
    for task, data, body in [
        ("colours", "questions", 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
                                 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
                                 "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        ("rolling", "texts", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                             "metric_list:\n  - metric: word_perplexity\n"),
        ("generation", "texts", 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
                                'generation_kwargs:\n  until: ["\\n", " is", " we"]\n  max_gen_toks: 12\n  do_sample: false\n'
                                "metric_list:\n  - metric: exact_match\n")]:
        (folder / f"{task}.yaml").write_text(
            f"task: {task}\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / data}.jsonl\n"
            f"  cache_dir: {folder / 'cache'}\n{body}")
    return folder


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval") / "tasks")


def evaluate(lm, tasks):
    """lm-eval's own evaluation of the three tasks: {task: (metrics, samples by doc_id)}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=lm, tasks=["colours", "rolling", "generation"], log_samples=True,
                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    return {task: (out["results"][task], {s["doc_id"]: s for s in out["samples"][task]})
            for task in ("colours", "rolling", "generation")}


@pytest.fixture(scope="module")
def hf_results(hf_llama, tasks):
    from lm_eval.models.huggingface import HFLM

    return evaluate(HFLM(pretrained=str(hf_llama), dtype="float32", device="cpu", batch_size=4), tasks)


@pytest.fixture(scope="module")
def scalenlp_results(hf_llama, tasks):
    from scalenlp.evaluation.lm_eval import ScaleNLPLM

    lm = ScaleNLPLM(checkpoint=str(hf_llama), max_batch=4)
    try:
        yield evaluate(lm, tasks)
    finally:
        lm.close()


def responses(samples: dict) -> list:
    """Every request's answer, in document order: (log-likelihood, is_greedy) pairs, a rolling sum or a text."""
    return [r[0] for doc in sorted(samples) for r in samples[doc]["resps"]]


def test_multiple_choice_accuracy_and_every_loglikelihood_match_the_hf_backend(hf_results, scalenlp_results):
    (ours, our_samples), (theirs, their_samples) = scalenlp_results["colours"], hf_results["colours"]
    assert ours["acc,none"] == theirs["acc,none"] and ours["acc_norm,none"] == theirs["acc_norm,none"]
    assert ours["acc,none"] != ours["acc_norm,none"]  # the long choices are ranked differently per character
    got, expected = responses(our_samples), responses(their_samples)
    assert len(got) == 60
    assert [float(ll) for ll, _ in got] == pytest.approx([float(ll) for ll, _ in expected], abs=1e-4)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]


def test_rolling_loglikelihoods_and_generations_match_the_hf_backend(hf_results, scalenlp_results):
    rolling = responses(scalenlp_results["rolling"][1])
    assert [float(x) for x in rolling] == pytest.approx([float(x) for x in responses(hf_results["rolling"][1])],
                                                        abs=1e-3)
    assert scalenlp_results["rolling"][1][5]["doc"]["text"].count(" ") > 128  # several windows
    generations = responses(scalenlp_results["generation"][1])
    assert generations == responses(hf_results["generation"][1])
    assert "" in generations  # a generation that began with a stop string (it is cut before it)


def test_eval_tasks_gives_the_harness_figures(hf_llama, tasks, hf_results, capsys):
    assert main(["eval", "--checkpoint", str(hf_llama), "--tasks", str(tasks / "questions.jsonl"), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    theirs = hf_results["colours"][0]
    assert (ours["acc"], ours["acc_norm"]) == (theirs["acc,none"], theirs["acc_norm,none"])
    assert ours["acc_stderr"] == pytest.approx(theirs["acc_stderr,none"])


@pytest.mark.slow
def test_eval_tasks_under_tp_2_scores_as_one_process(hf_llama, tasks, tmp_path, capsys):
    """Two ranks each holding half of every block score every choice as one process does (gloo, float32)."""
    lls = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        assert main(["eval", "--checkpoint", str(hf_llama), "--tasks", str(tasks / "questions.jsonl"),
                     "--tp", str(tp), "--max-batch", "64", "--out", str(out)]) == 0  # one forward
        lls[tp] = [ll for q in json.loads(out.read_text())["questions_detail"] for ll in q["loglikelihoods"]]
    assert len(lls[2]) == 60 and lls[2] == pytest.approx(lls[1], abs=1e-4)
    assert "acc " in capsys.readouterr().out


@pytest.mark.slow
def test_lm_eval_builds_the_backend_by_name_from_its_argument_string(hf_llama, tasks, hf_results):
    """What `--model scalenlp --model_args ...` does inside lm-eval; a wrong argument is one clear error."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from scalenlp.errors import UserError
    from scalenlp.evaluation.lm_eval import ScaleNLPLM

    out = simple_evaluate(model="scalenlp", model_args=f"checkpoint={hf_llama},max_batch=4,dtype=float32",
                          tasks=["colours"], task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    assert out["config"]["model"] == "scalenlp"
    assert out["results"]["colours"]["acc,none"] == hf_results["colours"][0]["acc,none"]
    with pytest.raises(UserError, match="colour: not scalenlp engine options"):
        ScaleNLPLM.create_from_arg_string(f"checkpoint={hf_llama},colour=red")


@pytest.mark.slow
def test_lm_eval_command_line_knows_the_scalenlp_model(hf_llama, tasks, tmp_path):
    """`python -m scalenlp.evaluation.lm_eval` is lm-eval's own command line with --model scalenlp registered
    (most of its time here is lm-eval indexing its thousands of built-in task files)."""
    run = subprocess.run(
        [sys.executable, "-m", "scalenlp.evaluation.lm_eval", "--model", "scalenlp", "--model_args",
         f"checkpoint={hf_llama},max_batch=4", "--tasks", "colours", "--include_path", str(tasks),
         "--output_path", str(tmp_path / "out")],
        env=cli_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "colours" in run.stdout and "acc_norm" in run.stdout
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(result.read_text())["results"]["colours"]["alias"] == "colours"
