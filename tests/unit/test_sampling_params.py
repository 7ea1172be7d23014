"""OpenAI's presence_penalty, frequency_penalty and logit_bias in the batched sampler (engine/sampling.py), and the
engine's per-request counts of generated tokens they read; n choices drawn side by side."""

import threading

import pytest
import torch

from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import InvalidParam, SamplingBatch, SamplingParams, adjust, sample
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)
V = 50


def batch_of(params: list[SamplingParams], generated: list[list[int]], steps=None) -> SamplingBatch:
    """The batch the engine builds, its counts made from each penalized row's generated tokens."""
    counts = [torch.bincount(torch.tensor(g, dtype=torch.int64), minlength=V).float()
              if p.presence_penalty or p.frequency_penalty else None for p, g in zip(params, generated)]
    return SamplingBatch.build(params, list(range(len(params))), steps or [len(g) for g in generated], "cpu", counts)


def test_penalties_change_the_logits_exactly_as_openai_defines_them():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    generated = [[4, 4, 4, 7, 9], [4, 1], [2, 2]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0),
              SamplingParams()]  # a row without penalties, in the same batch, is unchanged
    adjusted = adjust(logits, batch_of(params, generated))
    expected = logits.clone()
    for row, (p, tokens) in enumerate(zip(params, generated)):
        for token in set(tokens):
            expected[row, token] -= tokens.count(token) * p.frequency_penalty + p.presence_penalty
    assert torch.equal(adjusted, expected)
    # The distribution a sampled row draws from is the softmax of these logits: token 4, generated three times,
    # loses exp(-(0.5 + 3 * 0.25)) of its odds against a token never generated.
    ratio = (adjusted[0].softmax(-1)[4] / adjusted[0].softmax(-1)[0]) / (logits[0, 4] - logits[0, 0]).exp()
    assert ratio.item() == pytest.approx(torch.tensor(-(0.5 + 3 * 0.25)).exp().item(), rel=1e-5)


def test_a_large_logit_bias_makes_greedy_pick_its_token_and_a_negative_one_bans_it():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    favourite = int(logits[0].argmin())
    params = [SamplingParams(temperature=0, logit_bias={favourite: 100}),
              SamplingParams(temperature=0, logit_bias={int(logits[1].argmax()): -100})]
    tokens, _, _ = sample(logits, SamplingBatch.build(params, [0, 0], [0, 0], "cpu"))
    assert tokens[0] == favourite
    assert tokens[1] == logits[1].topk(2).indices[1]  # the banned favourite gives way to the runner-up


def test_logprobs_are_the_models_own_distribution_before_bias():
    logits = torch.randn(1, V)
    params = [SamplingParams(temperature=0, logit_bias={3: 100}, logprobs=2)]
    tokens, chosen, top = sample(logits, SamplingBatch.build(params, [0], [0], "cpu"))
    assert tokens.item() == 3
    assert chosen.item() == pytest.approx(logits[0].log_softmax(-1)[3].item())
    assert top.indices[0].tolist() == logits[0].topk(2).indices.tolist()


@pytest.mark.parametrize("field, value, problem", [
    ("presence_penalty", 2.5, "between -2.0 and 2.0"), ("frequency_penalty", -3.0, "between -2.0 and 2.0"),
    ("frequency_penalty", float("nan"), "between"), ("logit_bias", {5: 100.5}, "between -100.0 and 100.0"),
    ("logit_bias", {5: float("nan")}, "between"), ("logprobs", 21, "between 0 and 20"),
])
def test_out_of_range_settings_name_their_field(field, value, problem):
    with pytest.raises(InvalidParam, match=problem) as e:
        SamplingParams(**{field: value}).check()
    assert e.value.param == field


def test_n_choices_from_different_seeds_differ_and_greedy_ones_agree():
    torch.manual_seed(2)
    logits = torch.randn(1, V).expand(4, V)  # four choices of one prompt: the same logits
    sampled = SamplingBatch.build([SamplingParams(temperature=1.0)] * 4, [10, 11, 12, 13], [0] * 4, "cpu")
    draws = [sample(logits, sampled)[0].tolist() for _ in range(2)]
    assert draws[0] == draws[1]  # each seed reproduces its token
    assert len(set(draws[0])) > 1
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 4, [10, 11, 12, 13], [0] * 4, "cpu")
    assert set(sample(logits, greedy)[0].tolist()) == {int(logits[0].argmax())}


@pytest.fixture(scope="module")
def engine(tiny_export):
    tok = load_tokenizer(tiny_export)
    engine = Engine(load_pretrained(tiny_export), tok, max_batch=3, eos_id=find_eos_token_id(tok)).start()
    yield engine
    engine.stop()


def greedy_by_hand(model, prompt: list[int], steps: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with the penalties applied as OpenAI writes them, a whole forward per token, no cache."""
    out: list[int] = []
    for _ in range(steps):
        ids = torch.tensor([prompt + out])
        logits = model(ids)[0, -1].float()
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
        out.append(int(logits.argmax()))
    return out


def test_the_engine_counts_each_requests_tokens_across_steps(engine, tiny_export):
    """Penalized requests beside an unpenalized one, decoded together: each follows its own counts."""
    prompts = [engine.encode("the quick brown"), engine.encode("hello"), engine.encode("the quick brown")]
    settings = [(-2.0, 0.5), (0.5, -1.5), (0.0, 0.0)]  # negative: repeats, which a random model rarely makes
    steps = 16
    plain = load_pretrained(tiny_export)
    expected = [greedy_by_hand(plain, p, steps, *s) for p, s in zip(prompts, settings)]
    assert expected[0] != expected[2]  # the penalty changes what this prompt decodes to
    assert decode_together(engine, [
        (p, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, presence_penalty=pres,
                           frequency_penalty=freq)) for p, (pres, freq) in zip(prompts, settings)]) == expected


def test_plain_greedy_rows_pick_what_the_full_sampler_picks(engine, tiny_export):
    """A step whose rows are all plain greedy takes the argmax without building the sampler's settings
    (SamplingParams.argmax_only); a row asking for logprobs makes the step run the full sampler."""
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    assert plain.argmax_only and not full.argmax_only
    prompts = [engine.encode("the quick brown"), engine.encode("hello")]
    expected = [greedy_by_hand(load_pretrained(tiny_export), p, 12, 0.0, 0.0) for p in prompts]
    assert decode_together(engine, [(p, plain) for p in prompts]) == expected
    assert decode_together(engine, [(p, full) for p in prompts]) == expected


def decode_together(engine, items: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """The token ids each (prompt ids, params) generates, all submitted at once (one continuous batch)."""
    done = [[] for _ in items]
    finished = [threading.Event() for _ in items]

    def collector(i):
        def on_event(d):
            done[i].extend(d.token_ids)
            if d.finish_reason is not None:
                finished[i].set()
        return on_event

    engine.submit_many(items, [collector(i) for i in range(len(items))])
    for event in finished:
        while not event.wait(1.0):
            assert engine.alive
    return done


def test_the_engine_refuses_logit_bias_outside_the_vocabulary(engine):
    from scalenlp.engine.decoder_engine import RequestError

    vocab = engine.model.args.vocab_size
    with pytest.raises(RequestError, match=rf"in \[0, {vocab}\); got \[{vocab}\]") as e:
        engine.check([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
