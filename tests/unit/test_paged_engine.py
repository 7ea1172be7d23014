"""The engine's paged KV cache (models.decoder.KVCache, engine.kv_blocks): the logits it samples from against a
no-cache forward, and the same greedy text whatever the pool size (preemption), the prefix cache and the token
budget (chunked prefill)."""

import threading

import pytest
import torch

from infer_helpers import count_calls, generate, wait
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.engine.decoder_engine import PREFILL_PADDING, Engine, RequestError, padding_groups
from scalenlp.engine.kv_blocks import BlockPool, block_keys
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models import paged_attention
from scalenlp.models.flavors import build_model, model_args

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BLOCK = 4
# Three prompts opening with the same 13 tokens (three full blocks of 4), and two others, of mixed lengths.
SHARED = list(range(3, 16))
PROMPTS = [SHARED + [40, 41], SHARED + [50], SHARED + [60, 61, 62, 63, 64, 65], [7, 8], list(range(20, 39))]
CONFIGS = {
    "llama": {},
    # Mistral-like: every layer attends within a window shorter than the sequences.
    "windowed": {"sliding_window": 6, "local_layers": (0, 1)},
    # Gemma-like: capped scores and logits, one local layer beside a global one.
    "softcapped": {"attn_softcap": 2.0, "logit_softcap": 5.0, "sliding_window": 5, "local_layers": (0,)},
}


@pytest.fixture(scope="module")
def tok(tiny_export):
    return load_tokenizer(tiny_export)


def make_engine(tok, config="llama", **kw):
    torch.manual_seed(0)
    model = build_model(model_args("debug", vocab_size=tok.get_vocab_size(), **CONFIGS[config]))
    return Engine(model, tok, eos_id=None, block_size=BLOCK, **kw).start()


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "gather"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_paged_logits_equal_a_forward_without_cache(tok, config, kernel, monkeypatch):
    """Every logit row the engine samples from, against the same model's full forward over the sequence so far:
    mixed prompt lengths, prefix hits (the second wave), blocks evicted and reused (a pool of 12 blocks for 10
    requests, 6 for the windowed model), preemption, and prompts computed in chunks (a budget of 6 tokens); decode steps through the C++
    kernel (models/paged_attention.cpp) and through the generic gather + attention path."""
    if kernel:
        assert paged_attention.available(), "the paged decode kernel did not build (see the warning above)"
    else:
        monkeypatch.setattr(paged_attention, "available", lambda: False)
    # A model whose every layer is windowed gives back the blocks before each request's window, which leaves 12
    # blocks enough for all: it gets 6, so that requests still contend for them.
    engine = make_engine(tok, config, kv_cache_tokens=(6 if config == "windowed" else 12) * BLOCK, token_budget=6)
    seen = []
    sample = engine._sample

    def recording(requests, logits):
        seen.extend((r.prompt_ids + r.output_ids, row.clone()) for r, row in zip(requests, logits))
        return sample(requests, logits)

    monkeypatch.setattr(engine, "_sample", recording)
    preempted = count_calls(monkeypatch, engine, "_preempt")
    try:
        generate(engine, PROMPTS + PROMPTS, GREEDY, waves=2)
    finally:
        engine.stop()
    assert preempted and engine.blocks.hit_tokens > 0
    with torch.no_grad():
        for tokens, logits in seen:
            expected = engine.model(torch.tensor([tokens]))[0, -1]
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_equals_attention_over_the_gathered_rows(dtype):
    """The kernel on scattered blocks (grouped-query heads, a window, a soft cap) against plain float32 attention
    over each row's keys gathered in order. A bfloat16 pool is read as it is and summed in float32: the result
    is within bfloat16's rounding of the float32 reference."""
    torch.manual_seed(0)
    assert paged_attention.available(), "the paged decode kernel did not build (see the warning above)"
    B, H, Hkv, D, bs, blocks = 3, 4, 2, 16, 4, 12
    q = torch.randn(B, H, 1, D).to(dtype)
    k, v = torch.randn(blocks * bs, Hkv, D).to(dtype), torch.randn(blocks * bs, Hkv, D).to(dtype)
    table = torch.randperm(blocks)[:B * 4].view(B, 4)
    lengths = torch.tensor([5, 16, 11])
    for window, softcap in [(0, 0.0), (6, 0.0), (0, 3.0)]:
        got = paged_attention.decode_attention(q, k, v, table, lengths, bs, 0.25, softcap, window)
        assert got.dtype == dtype
        for b in range(B):
            n = int(lengths[b])
            slots = torch.cat([torch.arange(int(i) * bs, (int(i) + 1) * bs) for i in table[b]])[:n]
            first = max(0, n - window) if window else 0
            keys = k[slots[first:]].float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # (H, n, D)
            values = v[slots[first:]].float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
            scores = q[b].float() @ keys.transpose(1, 2) * 0.25  # (H, 1, n)
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            expected = scores.softmax(-1) @ values  # (H, 1, D)
            tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
            torch.testing.assert_close(got[b].float(), expected, **tol, msg=f"row {b}, window {window}")


def test_greedy_text_is_the_same_with_or_without_prefix_caching_chunking_and_room(tok, monkeypatch):
    def run(**kw):
        engine = make_engine(tok, **kw)
        preempted = count_calls(monkeypatch, engine, "_preempt")
        try:
            return generate(engine, PROMPTS + PROMPTS, GREEDY, waves=2), engine.blocks.hit_rate, len(preempted)
        finally:
            engine.stop()

    expected, hit_rate, preempted = run(prefix_caching=False)
    assert hit_rate == 0 and not preempted
    cached, hit_rate, _ = run()
    assert cached == expected and hit_rate > 0
    assert run(token_budget=3)[0] == expected  # prompts in chunks of 3 or fewer tokens, beside the decodes
    # Room for one sequence at a time (8 blocks): the others are preempted and computed again, text unchanged.
    squeezed, _, preempted = run(kv_cache_tokens=8 * BLOCK, max_batch=8)
    assert squeezed == expected and preempted


def test_prompts_of_very_different_lengths_are_not_padded_to_the_longest(tok, monkeypatch):
    """Prompts computed in the same step go into one forward only while its padding stays within PREFILL_PADDING:
    a 40-token and a 6-token prompt in one forward computed 2 x 40 positions for 46 prompt tokens. The text is
    what each prompt gets alone."""
    long, short = list(range(20, 60)), [7, 8, 9, 10, 11, 12]
    engine = make_engine(tok, token_budget=64)
    prefills = []
    forward = engine._forward

    def recording(requests, counts, model, drafts=None):
        if max(counts) > 1:  # a decode step computes one position a request (no speculative tokens here)
            prefills.append(counts)
        return forward(requests, counts, model, drafts)

    monkeypatch.setattr(engine, "_forward", recording)
    try:
        together = generate(engine, [long, short], GREEDY)
        alone = [generate(engine, [p], GREEDY)[0] for p in (long, short)]
    finally:
        engine.stop()
    assert sorted(prefills[:2]) == [[6], [40]]  # the two prompts together: two forwards
    assert all(len(c) * max(c) <= PREFILL_PADDING * sum(c) for c in prefills)
    assert together == alone


def test_padding_groups_batch_similar_lengths_and_put_the_cheapest_first():
    assert padding_groups([32, 35, 30, 33]) == [[0, 1, 2, 3]]  # 4 x 35 positions for 130 tokens: one forward
    assert padding_groups([1500, 532]) == [[1], [0]]  # together: 3,000 positions for 2,032 tokens
    assert padding_groups([1500, 30, 1400, 31]) == [[1, 3], [0, 2]]
    assert padding_groups([]) == []


def test_a_request_larger_than_the_whole_cache_is_refused_in_one_line(tok):
    engine = make_engine(tok, kv_cache_tokens=8 * BLOCK)
    try:
        with pytest.raises(RequestError) as refused:
            engine.submit(list(range(3, 30)), SamplingParams(max_tokens=6), lambda d: None)
        message = str(refused.value)
        assert "\n" not in message and "KV cache holds 32 positions" in message and "--kv-cache-tokens" in message
        engine.submit(list(range(3, 29)), SamplingParams(max_tokens=6), lambda d: None)  # exactly the pool: taken
    finally:
        engine.stop()


def test_cached_blocks_are_shared_counted_and_evicted_least_recently_used():
    pool = BlockPool(4, 2)  # three blocks besides the null block
    seed = b"0"
    a, b = block_keys([1, 2, 3, 4], 2, 2, seed), block_keys([1, 2, 9, 9], 2, 2, seed)
    assert a[0] == b[0] and a[1] != b[1]  # the same first block; the second differs
    assert block_keys([1, 2, 3, 4], 2, 2, b"1") != a  # another adapter: other keys
    first = [pool.allocate(), pool.allocate()]
    for block, key in zip(first, a):
        pool.register(block, key)
    assert pool.lookup(b) == [first[0]]  # shared while the first holder runs
    pool.release(first)
    pool.release([first[0]])
    assert pool.available == 3  # both cached and idle, plus the free one
    pool.lookup(a[:1])  # first[0] used again, so first[1] is now the least recently used...
    pool.release([first[0]])
    taken = [pool.allocate(), pool.allocate()]  # ...the free block, then the LRU cached one
    assert taken[1] == first[1] and pool.lookup(a) == [first[0]]


def test_a_decode_step_whose_requests_are_all_preempted_for_an_older_prompt(tok, monkeypatch):
    """A long prompt computed a token per step (budget 2, one for the decode) holds most blocks; a request after
    it decodes from a one-token prompt until it needs a block that is not there, and is the one preempted: the
    step then has no decode left, and both requests still finish with their greedy text."""
    long, short = list(range(3, 27)), [5]
    roomy = make_engine(tok)
    try:
        expected = generate(roomy, [long, short], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    finally:
        roomy.stop()
    engine = make_engine(tok, kv_cache_tokens=8 * BLOCK, token_budget=2)
    preempted = count_calls(monkeypatch, engine, "_preempt")
    try:
        outs = [[], []]
        done = [threading.Event(), threading.Event()]
        for i, (prompt, n) in enumerate(((long, 2), (short, 10))):
            engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                          lambda d, i=i: (outs[i].extend(d.token_ids), d.finish_reason and done[i].set()))
        for event in done:
            wait(engine, event)
    finally:
        engine.stop()
    assert preempted and preempted[0][0].prompt_ids == short
    assert outs == [expected[0][:2], expected[1]]


def test_requests_arriving_together_compute_their_shared_prefix_once(tok):
    """Three prompts opening with the same three full blocks, submitted at once: the first computes them, the
    other two wait for it and take them from the cache, with the text they would have had alone."""
    engine = make_engine(tok)
    try:
        together = generate(engine, PROMPTS[:3], GREEDY)
        assert engine.blocks.hit_tokens == 2 * 3 * BLOCK
    finally:
        engine.stop()
    alone = make_engine(tok, prefix_caching=False)
    try:
        assert together == generate(alone, PROMPTS[:3], GREEDY)
    finally:
        alone.stop()
