"""Log-likelihood scoring through the engine (``Engine.loglikelihood``) against a plain forward of the model, and
`scalenlp eval --tasks`: lm-eval's context/continuation split, acc / acc_norm / acc_bytes, bad rows."""

import json
import threading

import pytest
import torch

from scalenlp.cli import main
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine, RequestError
from scalenlp.engine.sampling import SamplingParams
from scalenlp.evaluation.multiple_choice import encode_pair, read_questions
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)
COLOURS = ["red", "green", "blue", "amber", "violet", "silver"]


def reference_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One sequence, no cache, no batch: the summed log-probability of the continuation and whether it is greedy."""
    whole = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(whole[:, :-1])[0].float().log_softmax(-1)[-len(continuation):]
    target = torch.tensor(continuation)
    return logprobs.gather(-1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


@pytest.fixture(scope="module")
def model(tiny_export):
    return load_pretrained(tiny_export, dtype=torch.float32)


@pytest.fixture
def engine(tiny_export):
    tokenizer = load_tokenizer(tiny_export)
    # A small token budget, so that the pairs below take several forwards of different widths.
    e = Engine(load_pretrained(tiny_export, dtype=torch.float32), tokenizer, max_batch=4, token_budget=64,
               eos_id=find_eos_token_id(tokenizer)).start()
    yield e
    e.stop()


def pairs_of(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """Contexts and continuations of varied lengths, one continuation the model's own greedy token."""
    pairs = []
    for i in range(n):
        context = tokenizer.encode(f"the quick brown fox number {i} " * (1 + i % 4)).ids
        continuation = tokenizer.encode(" ".join(COLOURS[:1 + i % 5])).ids
        pairs.append((context, continuation))
    return pairs


def test_loglikelihood_equals_a_plain_forward(engine, model):
    pairs = pairs_of(engine.tokenizer, 11)
    with torch.no_grad():  # a continuation that is greedy, so that is_greedy is seen true as well as false
        context = pairs[0][0]
        pairs.append((context, [int(model(torch.tensor([context]))[0, -1].argmax())]))
    got = engine.loglikelihood(pairs)
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        ref_ll, ref_greedy = reference_loglikelihood(model, context, continuation)
        assert ll == pytest.approx(ref_ll, abs=1e-4)
        assert greedy == ref_greedy
    assert got[-1][1] and not all(g for _, g in got)


def test_a_sequence_longer_than_the_context_keeps_its_last_tokens(engine, model):
    context = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40).ids
    continuation = engine.tokenizer.encode(" red green").ids
    assert len(context) > engine.max_seq_len
    (ll, _), = engine.loglikelihood([(context, continuation)])
    kept = (context + continuation)[-(engine.max_seq_len + 1):]
    assert ll == pytest.approx(reference_loglikelihood(model, kept[:-len(continuation)], continuation)[0], abs=1e-4)


def test_scoring_while_generating_leaves_the_generation_alone(engine):
    """Scoring forwards use the cache rows no request holds: a generation running through them computes the same
    log-probabilities as one alone (its tokens would not tell: this tiny model's greedy tokens hardly depend on
    attention)."""
    prompt = engine.tokenizer.encode("continuous batching lets requests").ids
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, logprobs=0)

    def generate(while_scoring: bool) -> list[float]:
        logprobs, first, done = [], threading.Event(), threading.Event()

        def on_event(delta):
            logprobs.extend(delta.logprobs)
            first.set()
            if delta.finish_reason is not None:
                done.set()

        engine.submit(prompt, params, on_event)
        if while_scoring:
            first.wait()  # it holds a cache row now
            engine.loglikelihood(pairs_of(engine.tokenizer, 12))
            assert not done.is_set()  # the scoring ran in the middle of the generation
        done.wait()
        return logprobs

    assert generate(while_scoring=True) == pytest.approx(generate(while_scoring=False), abs=1e-5)


def test_loglikelihood_refuses_what_it_cannot_score(engine):
    with pytest.raises(RequestError, match="empty continuation"):
        engine.loglikelihood([([1, 2], [])])
    with pytest.raises(RequestError, match="empty context"):
        engine.loglikelihood([([], [1])])
    with pytest.raises(RequestError, match="positions of a sequence"):
        engine.loglikelihood([([1], [1] * (engine.max_seq_len + 1))])
    assert engine.loglikelihood([]) == []


def test_encode_pair_moves_the_contexts_trailing_space_and_stands_a_prefix_for_no_context(tiny_export):
    tokenizer = load_tokenizer(tiny_export)
    context, continuation = encode_pair(tokenizer, "the quick brown ", "fox", prefix_id=7)
    assert context == tokenizer.encode("the quick brown").ids
    assert continuation == tokenizer.encode("the quick brown fox").ids[len(context):]
    assert encode_pair(tokenizer, "", " fox", prefix_id=7) == ([7], tokenizer.encode(" fox").ids)


def write_tasks(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_eval_tasks_reports_acc_and_acc_norm_as_lm_eval_computes_them(tmp_path, capsys, tiny_export, model):
    tokenizer = load_tokenizer(tiny_export)
    rows = [{"context": f"the colour of item {i} is", "answer": i % 3,
             "choices": [COLOURS[i % 6], COLOURS[(i + 1) % 6], f"{COLOURS[(i + 3) % 6]} and {COLOURS[i % 4]}"]}
            for i in range(12)]
    rows[5]["answer"] = rows[5]["choices"][1]  # an answer given as the choice's text
    tasks = write_tasks(tmp_path / "tasks.jsonl", rows)
    assert main(["eval", "--checkpoint", str(tiny_export), "--tasks", tasks, "--json", "--max-batch", "3",
                 "--out", str(tmp_path / "result.json")]) == 0
    ours = json.loads(capsys.readouterr().out)
    detail = json.loads((tmp_path / "result.json").read_text())["questions_detail"]
    acc = acc_norm = 0
    for row, question in zip(rows, detail):
        lls = [reference_loglikelihood(model, *encode_pair(tokenizer, row["context"], " " + c, None))[0]
               for c in row["choices"]]
        assert question["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
        answer = row["answer"] if isinstance(row["answer"], int) else row["choices"].index(row["answer"])
        acc += max(range(3), key=lambda j: lls[j]) == answer
        acc_norm += max(range(3), key=lambda j: lls[j] / len(row["choices"][j])) == answer
    assert (ours["acc"], ours["acc_norm"], ours["questions"]) == (acc / 12, acc_norm / 12, 12)
    assert ours["acc"] != ours["acc_norm"]  # the long third choice is ranked differently per character
    assert ours["acc_bytes"] == ours["acc_norm"]  # ASCII choices: as many bytes as characters


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not a multiple-choice question"),
    ('{"context": "a", "choices": ["x", "y"]}', "no answer"),
    ('{"context": "a", "choices": ["x"], "answer": 0}', "at least two"),
    ('{"context": "a", "choices": ["x", "y"], "answer": 2}', "0 to 1"),
    ('{"context": "a", "choices": ["x", "y"], "answer": "z"}', "none of the choices"),
    ('{"context": "a", "choices": ["x", ""], "answer": 0}', "non-empty strings"),
])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, capsys, tiny_export, line, problem):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"context": "a", "choices": ["x", "y"], "answer": 0}\n\n' + line + "\n")
    assert main(["eval", "--checkpoint", str(tiny_export), "--tasks", str(tasks)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{tasks}:3: " in err and problem in err


def test_an_empty_task_file_and_tp_for_perplexity_are_refused(tmp_path, capsys, tiny_export):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(Exception, match="holds no questions"):
        read_questions(tmp_path / "empty.jsonl")
    (tmp_path / "text.txt").write_text("the quick brown fox")
    assert main(["eval", "--checkpoint", str(tiny_export), "--data", str(tmp_path / "text.txt"), "--tp", "2"]) == 2
    assert "--tp works with --tasks" in capsys.readouterr().err
