"""Speculative decoding by prompt lookup (engine.speculative, the decoder engine's verify step, the acceptance rule
in engine.sampling.sample): greedy text identical to plain decoding, sampled text distributed as the model's."""

import argparse
import json
import math
import threading

import httpx
import pytest
import torch

from infer_helpers import ServerThread, count_calls, generate, make_export, wait
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine, Request
from scalenlp.engine.grammar import json_schema_grammar
from scalenlp.engine.llm import LLM
from scalenlp.engine.sampling import SamplingBatch, SamplingParams, sample
from scalenlp.engine.speculative import propose
from scalenlp.errors import UserError
from scalenlp.models.flavors import build_model, model_args
from scalenlp.models.io import load_pretrained
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)
BLOCK = 4
# Prompts that repeat themselves, so that lookup finds drafts from the first step; two share their first blocks.
LOOP = [5, 9, 14, 22, 31, 9, 14, 22]
PROMPTS = [LOOP + [40, 5, 9], LOOP + [7, 5], list(range(20, 32)) + list(range(20, 26)), [3, 4, 3, 4, 3]]
SIGMAS = 5  # each frequency within 5 standard errors: a correct sampler fails this with odds below 1 in 10^5
SCALE = 3.0  # logits of the random model in the sampled test, spread so that drafts are often kept


@pytest.fixture(scope="module")
def tok(tiny_export):
    return load_tokenizer(tiny_export)


def random_model(vocab_size, logit_scale=1.0, seed=0):
    torch.manual_seed(seed)
    model = build_model(model_args("debug", vocab_size=vocab_size))
    with torch.no_grad():
        model.norm.weight.mul_(logit_scale)  # the final norm's gain scales the logits alone
    return model


def make_engine(tok, vocab_size=None, logit_scale=1.0, draft=None, **kw):
    """An engine on a random model; draft: None (prompt lookup), "same" (a draft model with the model's weights,
    whose drafts are all kept) or "other" (another random model, whose drafts are mostly not)."""
    vocab_size = vocab_size or tok.get_vocab_size()
    model = random_model(vocab_size, logit_scale)
    draft_model = random_model(vocab_size, logit_scale, seed=0 if draft == "same" else 1) if draft else None
    kw.setdefault("eos_id", None)
    return Engine(model, tok, block_size=BLOCK, draft_model=draft_model, **kw).start()


def run(tok, prompts, params, waves=1, field="token_ids", vocab_size=None, **kw):
    """What ``generate`` returns for ``prompts``, and the engine afterwards (stopped)."""
    engine = make_engine(tok, vocab_size, **kw)
    try:
        return generate(engine, prompts, params, waves, field), engine
    finally:
        engine.stop()


def test_lookup_proposes_what_followed_the_latest_longest_match():
    assert propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # "1 2 3" occurred at the start
    assert propose([9, 2, 3, 5, 7, 3, 6, 2, 3], 2) == [5, 7]  # "2 3" beats the later "3"
    assert propose([1, 8, 4, 1, 6, 4, 1], 1) == [6]  # "4 1" twice: the latest
    assert propose([1, 2, 1, 3, 9, 1], 4) == [3, 9, 1]  # only "1" matches; the drafts may run to the end
    assert propose([1, 2, 3], 2) == [] and propose([7], 2) == []


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                      dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, top_k=2)],
                         ids=["plain", "top-k", "top-p", "draft-outside-top-k"])
def test_a_drafted_row_draws_from_the_target_distribution(settings):
    """The acceptance rule on a 6-token vocabulary, 20,000 seeds: each token's frequency matches the row's final
    distribution, and the draft is kept exactly when it is drawn. Keeping the draft always, or drawing the rest
    without removing it, fails this."""
    n, draft = 20_000, 2
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]]).expand(n, -1)
    params = SamplingParams(**settings)
    batch = SamplingBatch.build([params] * n, list(range(n)), [0] * n, "cpu", drafts=[draft] * n)
    tokens, _, _ = sample(logits, batch)
    # The target: temperature, then the top-k / top-p set (sorted logits, so the set is a leading slice).
    p = (logits[0] / params.temperature).softmax(-1)
    keep = torch.arange(6) < (params.top_k or 6)
    keep &= (p.cumsum(-1) - p) < params.top_p
    p = p * keep / (p * keep).sum()
    freq = torch.bincount(tokens, minlength=6).double() / n
    bound = SIGMAS * (p * (1 - p) / n).sqrt() + 1e-12
    assert ((freq - p).abs() <= bound).all(), (freq, p)


def test_greedy_rows_keep_a_draft_only_where_it_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [0, 1, 2], [0] * 3, "cpu", drafts=[1, 2, -1])
    assert sample(logits, batch)[0].tolist() == [1, 1, 0]


@pytest.mark.parametrize("draft", [None, "same", "other"], ids=["lookup", "draft-same", "draft-other"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=0.05, presence_penalty=0.1,
                   logit_bias={91: 1.0, 14: -2.0}, top_k=5)], ids=["greedy", "penalties"])
def test_greedy_output_is_identical_to_plain_decoding(tok, params, draft, monkeypatch):
    """With prefix caching (two waves), chunked prefill (3 tokens a step) and preemption (room for 20 blocks of 4
    positions for 8 requests of up to 15): the same tokens as without drafts, and drafts were verified and kept
    (the random model's greedy text falls into a loop, which lookup finds)."""
    prompts = PROMPTS + PROMPTS
    expected, _ = run(tok, prompts, params, waves=2)
    engine = make_engine(tok, draft=draft, kv_cache_tokens=20 * BLOCK, token_budget=3, speculative_tokens=4)
    preempted = count_calls(monkeypatch, engine, "_preempt")
    try:
        assert generate(engine, prompts, params, waves=2) == expected
    finally:
        engine.stop()
    assert preempted and engine.blocks.hit_tokens > 0
    # Its own drafts are all kept but where the two forwards' rounding differs at a near-tie; not so where the
    # penalties and bias, which the draft model does not apply, change the choice.
    if draft == "same" and not params.logit_bias:
        assert engine.acceptance_rate > 0.9, (engine.accepted, engine.drafted)
    elif draft == "other":  # an unrelated model over 320 tokens: its drafts are (nearly) all rejected
        assert engine.drafted > 0
    else:
        assert 0 < engine.accepted < engine.drafted, (engine.accepted, engine.drafted)


def test_each_verified_position_is_penalized_for_the_drafts_before_it(tok):
    """Greedy, presence penalty 0.8, the same logits at each position [0, 1, 0.5, 0]: token 1 wins the first
    position; penalized, it loses the second to token 2 (the draft, kept); with both penalized, 1 wins again."""
    engine = make_engine(tok, 4)
    engine.stop()
    r = Request([3], SamplingParams(temperature=0, presence_penalty=0.8), print, seed=0)
    logits = torch.tensor([0.0, 1.0, 0.5, 0.0]).expand(1, 3, 4)
    assert [t for t, _, _ in engine._sample([r], logits, [[1, 2]])[0]] == [1, 2, 1]


def test_logprobs_are_those_of_each_verified_position(tok):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    expected, _ = run(tok, PROMPTS, params, field="logprobs")
    got, engine = run(tok, PROMPTS, params, field="logprobs", speculative_tokens=3)
    assert engine.accepted > 0
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


def test_speculation_stops_at_max_tokens_and_at_the_end_of_the_context(tok):
    """Drafts never run past max_tokens or the model's positions: the text is that of plain decoding, to the end."""
    for params in (SamplingParams(max_tokens=33, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)):
        expected, _ = run(tok, PROMPTS, params)
        got, engine = run(tok, PROMPTS, params, speculative_tokens=8)
        assert got == expected and engine.accepted > 0
    assert [len(p) + len(o) for p, o in zip(PROMPTS, got)] == [engine.max_seq_len] * len(PROMPTS)


def chi2_critical(df: int, z: float = 4.265) -> float:
    """The chi-square value that ``df`` degrees of freedom exceed with the normal tail probability of ``z``
    (4.265: 1 in 10^5), by Wilson and Hilferty's cube-root approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
@pytest.mark.parametrize("draft", [None, "same"], ids=["lookup", "draft-model"])
def test_sampled_output_is_distributed_as_the_model_says(tok, draft):
    """A random model over 4 tokens, prompted with its own greedy text (so that lookup proposes what it is likely
    to say): 4 tokens from each of 3,000 seeds, the last 3 through decode steps that verify up to 2 drafts. The
    counts of the 64 possible continuations of each first token pass a chi-square test against the model's own
    probabilities (computed by full forwards) at 1 in 10^5; keeping every draft fails it. The draft model (the
    same weights) proposes its greedy tokens, which the sampled target keeps only as often as it would draw them."""
    vocab, n = 4, 3000
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    engine = make_engine(tok, vocab, SCALE, draft, speculative_tokens=2)
    try:
        prompt = [1] + generate(engine, [[1]], SamplingParams(max_tokens=11, temperature=0, ignore_eos=True))[0]
        outs = generate(engine, [prompt] * n, params, waves=-(-n // engine.max_queue))
    finally:
        engine.stop()
    assert 0 < engine.accepted < engine.drafted, (engine.accepted, engine.drafted)
    model = engine.model

    def target(tokens):
        with torch.no_grad():
            return model(torch.tensor([tokens]))[0, -1].float().softmax(-1).tolist()

    # The first token is drawn at prefill, without drafts: the test is over the other three.
    statistic, bins = 0.0, 0
    for first in set(o[0] for o in outs):
        runs = [tuple(o[1:]) for o in outs if o[0] == first]
        expected = {(): 1.0}
        for _ in range(3):
            expected = {seq + (t,): q * pt for seq, q in expected.items()
                        for t, pt in enumerate(target(prompt + [first, *seq]))}
        # Continuations expected fewer than 5 times are pooled, as the chi-square approximation needs.
        observed, means, rare = [], [], [0, 0.0]
        for seq, q in expected.items():
            if len(runs) * q < 5:
                rare[0] += runs.count(seq)
                rare[1] += len(runs) * q
            else:
                observed.append(runs.count(seq))
                means.append(len(runs) * q)
        if rare[1]:
            observed.append(rare[0])
            means.append(rare[1])
        statistic += sum((o - m) ** 2 / m for o, m in zip(observed, means))
        bins += len(means) - 1
    assert statistic < chi2_critical(bins), (statistic, bins, engine.accepted, engine.drafted)


def test_the_flag_is_declared_checked_and_reaches_the_engine(tiny_export):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(tiny_export, speculative_tokens=3) as llm:
        assert llm.engine.speculative_tokens == 3
        fast = llm.generate(["the quick brown fox"], params)
        assert llm.engine.drafted > 0
    with LLM(tiny_export, speculative_tokens=3, draft=str(tiny_export)) as llm:
        assert llm.engine.draft_model is not None
        assert llm.generate(["the quick brown fox"], params) == fast and llm.engine.acceptance_rate > 0.9
    with LLM(tiny_export) as llm:
        assert llm.generate(["the quick brown fox"], params) == fast
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(["--checkpoint", "x", "--speculative-tokens", "3"])
                                  ).speculative_tokens == 3
    with pytest.raises(UserError, match="--speculative-tokens must be at least 0"):
        EngineConfig("x", speculative_tokens=-1).check()
    with pytest.raises(UserError, match="give --speculative-tokens K"):
        EngineConfig("x", draft="y").check()


def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line(tiny_export, tmp_path):
    other = make_export(tmp_path, special="<|other|>")
    with pytest.raises(UserError) as refused:
        LLM(tiny_export, speculative_tokens=2, draft=str(other))
    assert "another tokenizer" in str(refused.value) and "\n" not in str(refused.value)


def test_a_request_with_a_grammar_runs_beside_speculating_ones_without_drafts(tok, monkeypatch):
    """A JSON-constrained request in the same batches as requests that speculate: it gets no drafts, its text
    parses, and every request's text is the one plain decoding gives."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=30, temperature=0, grammar=json_schema_grammar(schema, "response_format"))
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    items = [(p, free) for p in PROMPTS] + [(PROMPTS[0], constrained)]

    def texts(**kw):
        engine = make_engine(tok, eos_id=find_eos_token_id(tok), **kw)
        drafted = []
        drafts = engine._drafts

        def recording(requests):
            found = drafts(requests)
            drafted.extend(zip(requests, found))
            return found

        monkeypatch.setattr(engine, "_drafts", recording)
        done = [threading.Event() for _ in items]
        outs = [[] for _ in items]

        def collector(i):
            return lambda d: (outs[i].append(d.text), d.finish_reason and done[i].set())

        try:
            engine.submit_many(items, [collector(i) for i in range(len(items))])
            for event in done:
                wait(engine, event)
        finally:
            engine.stop()
        return ["".join(o) for o in outs], [d for r, d in drafted if r.constraint is not None], drafted

    got, grammar_drafts, drafted = texts(speculative_tokens=4)
    assert json.loads(got[-1])["a"] in range(100)
    assert not any(grammar_drafts) and any(d for _, d in drafted)
    assert texts()[0] == got


def test_the_server_streams_speculated_text_and_reports_the_acceptance_rate(tiny_export):
    """Streamed over HTTP, several tokens may come from one step: the text is plain decoding's, and /metrics says
    what share of the drafts was kept."""
    tok = load_tokenizer(tiny_export)
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0, "stream": True}
    texts, rates = [], []
    for k in (0, 4):
        engine = Engine(load_pretrained(tiny_export), tok, eos_id=None, speculative_tokens=k).start()
        server = ServerThread(create_app(LocalBackend(engine, "tiny")))
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            texts.append("".join(c["choices"][0]["text"] for c in chunks))
            metrics = httpx.get(server.url + "/metrics").text
            rates.append(float(next(line for line in metrics.splitlines()
                                    if line.startswith("scalenlp_spec_decode_acceptance_rate")).split()[-1]))
        finally:
            server.stop()
            engine.stop()
    assert texts[0] == texts[1] and texts[0]
    assert rates[0] == 0 and rates[1] == engine.acceptance_rate > 0
