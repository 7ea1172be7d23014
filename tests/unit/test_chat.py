"""Chat: templates rendered as transformers renders them, the assistant mask for fine-tuning, generation that
ends at the end of a turn, the /v1/chat/completions route through the official `openai` client, and `scalenlp
chat` refusing a model without a template. (`scalenlp chat` on piped stdin: integration/test_commands.py; a
tensor-parallel chat model: integration/test_tensor_parallel_serving.py.)"""

import httpx
import openai
import pytest
import torch

from infer_helpers import CHATML, ServerThread, chat_tokenizer, make_hf_chat_model, run_request, serving
from scalenlp.data.chat import (
    ChatError,
    chat_template,
    encode_chat,
    end_of_turn_ids,
    render_chat,
    render_with_assistant_mask,
)
from scalenlp.data.tokenizer import load_tokenizer
from scalenlp.engine import decoder_engine
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend

torch.set_num_threads(1)

# Llama 3's shape: BOS from the template, headers, <|eot_id|> with no text after it, whitespace control.
LLAMA3 = ("{{- bos_token }}\n{%- for message in messages %}\n"
          "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}\n{%- endfor %}\n"
          "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
          "{%- endif %}\n")
# Exercises what the sandbox must offer: raise_exception, loop controls, tojson keeping non-ASCII text.
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
          "[{{ m['role'] }}] {{ m | tojson }}{{ eos_token if m['role'] == 'assistant' }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant] {% endif %}")
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "the quick brown fox, déjà vu"},
                {"role": "user", "content": "and the lazy dog?"}, {"role": "assistant", "content": "jumps over"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok"))


def engine_config(checkpoint, **kw) -> EngineConfig:
    return EngineConfig(checkpoint, dtype="float32", device="cpu", max_batch=2, **kw)


# ---- rendering ----

@pytest.mark.parametrize("template", [CHATML, LLAMA3, STRICT])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tok, transformers, template, add_generation_prompt):
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast  # noqa: N806 (the class, by its name)

    messages = CONVERSATION
    if template == STRICT:  # no system message, and a skipped turn
        messages = CONVERSATION[1:4] + [{"role": "assistant", "content": "skip"}, {"role": "user", "content": "ü"},
                                        {"role": "assistant", "content": "ok"}]
    messages = messages[:-1] if add_generation_prompt else messages
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, bos_token="<|begin_of_text|>",
                                 eos_token="<|im_end|>")
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = render_chat(messages, template, add_generation_prompt=add_generation_prompt,
                       bos_token="<|begin_of_text|>", eos_token="<|im_end|>")
    assert ours == expected and len(ours) > 40
    if template == STRICT:
        assert "\\u" not in ours and "skip" not in ours  # tojson keeps "ü"; continue skipped a message


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "messages[0] must be an object"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role is 'robot'"),
    ([{"content": "hi"}], "messages[0].role is None"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
     "messages[1].content must be a string"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content must be a string"),
])
def test_bad_messages(messages, problem):
    with pytest.raises(ChatError, match=problem.replace("[", r"\[").replace("]", r"\]")) as e:
        render_chat(messages, CHATML, add_generation_prompt=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages %}{{ m.content }", "does not parse"),
    (STRICT, "Conversation roles must alternate"),  # the template's own raise_exception
    ("{{ messages.append(messages[0]) }}", "unsafe"),  # the immutable sandbox refuses
    ("{{ messages[0]['content'] + 1 }}", "failed to render"),
])
def test_broken_templates(template, problem):
    with pytest.raises(ChatError, match=problem):
        render_chat([{"role": "assistant", "content": "hi"}], template, add_generation_prompt=True)


def test_template_and_end_of_turn_from_the_config(tok):
    with pytest.raises(ChatError, match="no chat template"):
        chat_template({"eos_token": "<|im_end|>"})
    assert chat_template({"chat_template": [{"name": "default", "template": CHATML}]}) == CHATML
    names = lambda ids: {tok.id_to_token(i) for i in ids}  # noqa: E731
    assert names(end_of_turn_ids(tok, {"chat_template": CHATML})) == {"<|im_end|>", "<|endoftext|>"}
    assert names(end_of_turn_ids(tok, {"chat_template": LLAMA3, "eos_token": {"content": "<|im_start|>"}})) \
        == {"<|eot_id|>", "<|im_start|>"}
    assert names(end_of_turn_ids(tok, {})) == {"<|endoftext|>"}


@pytest.mark.parametrize("template, end_of_turn", [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")])
def test_assistant_mask_covers_exactly_the_assistant_turns(tok, template, end_of_turn):
    variables = {"bos_token": "<|begin_of_text|>", "eos_token": None}
    ids, mask = render_with_assistant_mask(tok, CONVERSATION, template, end_of_turn=[tok.token_to_id(end_of_turn)],
                                           **variables)
    assert ids == tok.encode(render_chat(CONVERSATION, template, add_generation_prompt=False, **variables),
                             add_special_tokens=False).ids
    runs, run = [], []
    for token, marked in zip(ids + [None], mask + [False]):
        if marked:
            run.append(token)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    assert runs == [m["content"] + end_of_turn for m in CONVERSATION if m["role"] == "assistant"]
    if template == CHATML:
        assert not mask[-1] and tok.decode(ids[-1:]) == "\n"  # the newline after <|im_end|> is not trained on


def test_assistant_mask_refuses_a_template_that_rewrites_earlier_turns(tok):
    # Renders the last message differently from the others, so a prefix's render is not the whole's prefix.
    template = "{% for m in messages %}{{ m['content'] + ('!' if loop.last else '.') }}{% endfor %}"
    with pytest.raises(ChatError, match="differently once later turns follow"):
        render_with_assistant_mask(tok, CONVERSATION, template)


# ---- the engine stops at the end of a turn ----

def test_generation_stops_at_the_end_of_turn_token(hf_chat_model, monkeypatch):
    # The test edits the output projection's weight below, which the engine would otherwise hold packed for oneDNN.
    monkeypatch.setattr(decoder_engine, "pack_for_inference", lambda model: 0)
    engine = engine_from_checkpoint(engine_config(hf_chat_model))
    try:
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "hello"}], engine.tokenizer_config)
        im_end = engine.tokenizer.token_to_id("<|im_end|>")
        with torch.no_grad():  # make <|im_end|> the greedy choice: its output row doubles the first choice's
            _, tokens, _ = run_request(engine, ids, SamplingParams(max_tokens=1, temperature=0))
            engine.model.output.weight[im_end] = 2 * engine.model.output.weight[tokens[0]]
        text, tokens, finish = run_request(engine, ids, SamplingParams(max_tokens=8, temperature=0))
    finally:
        engine.stop()
    assert engine.eos_id != im_end  # the end-of-text token is another one; the template's end of turn stopped it
    assert (tokens, finish, text) == ([im_end], "stop", "")


# ---- /v1/chat/completions ----

@pytest.fixture(scope="module")
def served(hf_chat_model):
    with serving(engine_config(hf_chat_model, max_queue=8)) as pair:
        yield pair


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


QUESTION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


def test_chat_completion_with_openai_client(served, client):
    engine = served[1]
    ids = encode_chat(engine.tokenizer, QUESTION, engine.tokenizer_config)
    expected, tokens, finish = run_request(engine, ids, SamplingParams(max_tokens=12, temperature=0))
    out = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and len(out.choices) == 1
    choice = out.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", expected, finish)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(tokens))
    again = client.chat.completions.create(model="tiny", messages=QUESTION, max_completion_tokens=12, temperature=0)
    assert again.choices[0].message.content == expected


def test_chat_streaming_with_openai_client(client):
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0.9, seed=3,
                                           n=2)
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0.9, seed=3,
                                            n=2, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    for index, choice in enumerate(plain.choices):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
        assert [d.finish_reason for d in deltas][-1] == choice.finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_still_served(client):
    out = client.completions.create(model="tiny", prompt="the quick", max_tokens=4, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens >= 1


@pytest.mark.parametrize("body, status, param, problem", [
    ({"messages": []}, 400, "messages", "non-empty"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "robot"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "must be a string"),
    ({"messages": [{"role": "user", "content": "hi " * 300}]}, 400, "messages", "this server accepts at most"),
    ({}, 400, "messages", "Field required"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", "needs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "between 0 and 20"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty",
     "between -2.0 and 2.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 101}}, 400, "logit_bias",
     "between -100.0 and 100.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 1}}, 400, "logit_bias",
     "token ids of this model"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_completion_tokens": 2}, 400,
     "max_tokens", "only one"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature", "between"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "code_interpreter"}]}, 400, "tools",
     '"type": "function"'),
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "does not exist"),
])
def test_bad_chat_requests_get_openai_errors(served, body, status, param, problem):
    for stream in (False, True):
        r = httpx.post(served[0].url + "/v1/chat/completions", json={"model": "tiny", "stream": stream, **body})
        assert r.status_code == status
        err = r.json()["error"]
        assert err["param"] == param and problem in err["message"] and err["type"]


def test_openai_client_raises_on_bad_messages(client):
    with pytest.raises(openai.BadRequestError, match="robot"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])


def test_model_without_template_is_a_400(tiny_export):
    export = tiny_export
    engine = Engine(load_pretrained(export), load_tokenizer(export), max_batch=1).start()
    server = ServerThread(create_app(LocalBackend(engine, "tiny")))
    try:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        server.stop()
        engine.stop()
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


# ---- scalenlp chat ----

def test_chat_command_without_template_fails_in_one_line(tmp_path, capsys, transformers):
    from scalenlp.cli import main

    folder = make_hf_chat_model(tmp_path, template=None)
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(folder), "--dtype", "float32", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this model has no chat template") and err.count("\n") == 1


# ---- a real chat model ----

@pytest.mark.slow  # reads SmolLM2-135M: 10-30 s here
def test_smollm2_knows_the_capital_of_france():
    gguf = packaged_model("smollm2")
    engine = engine_from_checkpoint(engine_config(gguf, max_queue=4))
    server = ServerThread(create_app(LocalBackend(engine, "smollm2")))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model="smollm2", messages=question, max_tokens=24, temperature=0)
        streamed = client.chat.completions.create(model="smollm2", messages=question, max_tokens=24, temperature=0,
                                                  stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    finally:
        server.stop()
        engine.stop()
    assert "Paris" in out.choices[0].message.content and text == out.choices[0].message.content
