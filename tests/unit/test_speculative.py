"""Speculative decoding by prompt lookup (engine.speculative, the decoder engine's verify step, the acceptance rule
in engine.sampling.sample): greedy text identical to plain decoding, sampled text distributed as the model's."""

import argparse
import math

import pytest
import torch

from infer_helpers import count_calls, generate
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingBatch, SamplingParams, sample
from scalenlp.engine.speculative import propose
from scalenlp.errors import UserError
from scalenlp.models.flavors import build_model, model_args

torch.set_num_threads(1)
BLOCK = 4
# Prompts that repeat themselves, so that lookup finds drafts from the first step; two share their first blocks.
LOOP = [5, 9, 14, 22, 31, 9, 14, 22]
PROMPTS = [LOOP + [40, 5, 9], LOOP + [7, 5], list(range(20, 32)) + list(range(20, 26)), [3, 4, 3, 4, 3]]
SIGMAS = 5  # each frequency within 5 standard errors: a correct sampler fails this with odds below 1 in 10^5


@pytest.fixture(scope="module")
def tok(tiny_export):
    return load_tokenizer(tiny_export)


def make_engine(tok, vocab_size=None, **kw):
    torch.manual_seed(0)
    model = build_model(model_args("debug", vocab_size=vocab_size or tok.get_vocab_size()))
    return Engine(model, tok, eos_id=None, block_size=BLOCK, **kw).start()


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


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=0.05, presence_penalty=0.1,
                   logit_bias={91: 1.0, 14: -2.0}, top_k=5)], ids=["greedy", "penalties"])
def test_greedy_output_is_identical_to_plain_decoding(tok, params, monkeypatch):
    """With prefix caching (two waves), chunked prefill (3 tokens a step) and preemption (room for 20 blocks of 4
    positions for 8 requests of up to 15): the same tokens as without drafts, and drafts were verified and kept
    (the random model's greedy text falls into a loop, which lookup finds)."""
    prompts = PROMPTS + PROMPTS
    expected, _ = run(tok, prompts, params, waves=2)
    engine = make_engine(tok, kv_cache_tokens=20 * BLOCK, token_budget=3, speculative_tokens=4)
    preempted = count_calls(monkeypatch, engine, "_preempt")
    try:
        assert generate(engine, prompts, params, waves=2) == expected
    finally:
        engine.stop()
    assert preempted and engine.blocks.hit_tokens > 0
    assert 0 < engine.accepted < engine.drafted, (engine.accepted, engine.drafted)


def test_logprobs_are_those_of_each_verified_position(tok):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    expected, _ = run(tok, PROMPTS, params, field="logprobs")
    got, engine = run(tok, PROMPTS, params, field="logprobs", speculative_tokens=3)
    assert engine.accepted > 0
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_speculation_stops_at_max_tokens_and_at_the_end_of_the_context(tok):
    """Drafts never run past max_tokens or the model's positions: the text is that of plain decoding, to the end."""
    for params in (SamplingParams(max_tokens=33, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)):
        expected, _ = run(tok, PROMPTS, params)
        got, engine = run(tok, PROMPTS, params, speculative_tokens=8)
        assert got == expected and engine.accepted > 0
    assert [len(p) + len(o) for p, o in zip(PROMPTS, got)] == [engine.max_seq_len] * len(PROMPTS)


@pytest.mark.slow
def test_sampled_output_is_distributed_as_the_model_says(tok):
    """A random model over 8 tokens, top-k 2, a presence penalty: 4 tokens from each of 1,500 seeds, the last 3
    through a decode step that verifies 2 drafts. Each of the 16 possible continuations comes up as often as the
    model's own probability of it says (computed by full forwards), within 5 standard errors."""
    vocab, n, prompt = 8, 1500, [1, 3, 5, 7, 2, 4, 6, 0, 1, 3, 5]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, presence_penalty=0.5, ignore_eos=True)
    engine = make_engine(tok, vocab, speculative_tokens=2)
    try:
        outs = generate(engine, [prompt] * n, params, waves=-(-n // engine.max_queue))
    finally:
        engine.stop()
    assert 0 < engine.accepted < engine.drafted, (engine.accepted, engine.drafted)
    # The first token is drawn at prefill, without drafts: the test is over the other three.
    model = engine.model

    def target(tokens, generated):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1].float()
        logits[list(set(generated))] -= params.presence_penalty
        top = logits.topk(params.top_k)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    firsts = {o[0] for o in outs}
    for first in firsts:
        runs = [tuple(o[1:]) for o in outs if o[0] == first]
        expected = {(): 1.0}
        for _ in range(3):
            expected = {seq + (t,): q * pt for seq, q in expected.items()
                        for t, pt in target(prompt + [first, *seq], [first, *seq]).items()}
        for seq, q in expected.items():
            freq = runs.count(seq) / len(runs)
            assert abs(freq - q) <= SIGMAS * math.sqrt(q * (1 - q) / len(runs)), (first, seq, freq, q)
        assert sum(expected.values()) == pytest.approx(1.0) and set(runs) <= set(expected)


def test_the_flag_is_declared_checked_and_reaches_the_engine():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(["--checkpoint", "x", "--speculative-tokens", "3"])
                                  ).speculative_tokens == 3
    with pytest.raises(UserError, match="--speculative-tokens must be at least 0"):
        EngineConfig("x", speculative_tokens=-1).check()
