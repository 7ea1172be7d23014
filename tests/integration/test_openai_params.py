"""The request parameters real OpenAI clients send, through the official `openai` client against a live server on
a tiny chat model (infer_helpers.make_hf_chat_model): presence and frequency penalties, logit_bias, n choices, chat logprobs, and a request without
``model``."""

import httpx
import openai
import pytest
import torch

from infer_helpers import serving
from scalenlp.engine.config import EngineConfig

torch.set_num_threads(1)
CHAT = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def served(hf_chat_model):
    with serving(EngineConfig(hf_chat_model, dtype="float32", device="cpu", max_batch=4)) as pair:
        yield pair


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def test_penalties_pick_the_best_penalized_token_at_every_step(client):
    """Logprobs are the model's own; with 20 alternatives per step the greedy choice must be the one whose logit,
    less frequency * count + presence for each token already generated, is highest."""
    presence, frequency = -1.5, 0.5  # a negative presence penalty makes repeats, which a random model rarely does
    out = client.completions.create(model="tiny", prompt="the quick", max_tokens=16, temperature=0, logprobs=20,
                                    presence_penalty=presence, frequency_penalty=frequency,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt="the quick", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text != plain.choices[0].text
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 16
    for step, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        before = lp.tokens[:step]

        def score(t):
            return top[t] - (frequency * before.count(t) + presence if t in before else 0.0)

        assert token in top and score(token) == max(score(t) for t in top)


def test_a_large_logit_bias_takes_every_greedy_step(client, served):
    engine = served[1]
    token = engine.encode(" fox")[0]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == engine.tokenizer.decode([token] * 6)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == engine.tokenizer.decode([token] * 3)


def test_n_chat_choices_each_their_own_sequence(client):
    kw = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "seed": 7, "n": 3}
    sampled = client.chat.completions.create(temperature=1.0, **kw)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1
    greedy = client.chat.completions.create(temperature=0, **kw)
    assert len({c.message.content for c in greedy.choices}) == 1
    chunks = list(client.chat.completions.create(temperature=1.0, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    for choice in sampled.choices:  # each streamed index adds up to its choice, the same seed + index
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == choice.index)
        assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens
    assert sampled.usage.prompt_tokens == greedy.usage.prompt_tokens  # one prompt, counted once for its n choices


def test_chat_logprobs_in_the_chat_shape_streamed_and_not(client):
    kw = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    # The tokens' bytes make the text, parts of characters included (this random model writes some).
    assert b"".join(map(bytes, (t.bytes for t in content))).decode(errors="replace").startswith(
        out.choices[0].message.content)
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.logprob == max(a.logprob for a in t.top_logprobs)  # greedy: the chosen token is the most likely
    streamed = list(client.chat.completions.create(stream=True, **kw))
    assert [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] == content
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_a_request_without_model_gets_the_one_model_served(client):
    out = client.chat.completions.create(model=openai.NOT_GIVEN, messages=CHAT, max_tokens=4)
    assert out.model == "tiny" and out.choices[0].message.content is not None
    assert client.completions.create(model=openai.NOT_GIVEN, prompt="hi", max_tokens=2).model == "tiny"


@pytest.mark.parametrize("body, param, problem", [
    ({"presence_penalty": -2.1}, "presence_penalty", "between -2.0 and 2.0"),
    ({"frequency_penalty": 3}, "frequency_penalty", "between -2.0 and 2.0"),
    ({"logit_bias": {"12": -100.5}}, "logit_bias", "between -100.0 and 100.0"),
    ({"logit_bias": {"the": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1000000": 5}}, "logit_bias", "token ids of this model"),
    ({"n": 0}, "n", "between 1 and"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
])
def test_bad_values_are_openai_shaped_400s_naming_the_param(served, client, body, param, problem):
    for stream in (False, True):
        r = httpx.post(served[0].url + "/v1/completions",
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and problem in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match=problem):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, **body)
