"""Structured output and tool calling: constrained decoding through llguidance (engine/grammar.py), OpenAI's
response_format, and tools / tool_choice parsed back into tool_calls (serving/tools.py), through the engine, raw
HTTP and the official `openai` client."""

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer_helpers import CHATML, ServerThread, make_export, make_hf_chat_model, run_request
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.grammar import json_schema_grammar, lark_grammar
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained
from scalenlp.models.packaged import packaged_model
from scalenlp.serving.app import create_app
from scalenlp.serving.backend import LocalBackend
from scalenlp.serving.tools import HERMES, LLAMA_JSON, ToolUse

torch.set_num_threads(1)


# ---- JSON schemas drawn by Hypothesis: whatever a tiny random model writes under one parses and validates ----

NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
# Bounded strings, numbers and arrays: a random model inside an unbounded string may never close it.
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 100}, st.integers(-100, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda values: {"enum": values},
              st.lists(st.one_of(st.text("xyz ", max_size=4), st.integers(-9, 9), st.booleans()), min_size=1,
                       max_size=4, unique=True)),
)


def _object(children):
    def build(props, required_flags):
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, keep in zip(names, required_flags) if keep]}

    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda flags: build(props, flags)))


SCHEMAS = _object(st.recursive(
    LEAVES, lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        _object(inner)), max_leaves=6))


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """A random tiny model whose logits are nearly flat (logit_scale 1), so that sampling wanders over everything
    the grammar allows, with room for long outputs."""
    export = make_export(tmp_path_factory.mktemp("flat"), logit_scale=1.0, max_seq_len=512)
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, max_batch=2, eos_id=find_eos_token_id(tok)).start()
    yield engine
    engine.stop()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_constrained_output_always_parses_and_matches_the_schema(tiny_engine, schema, seed):
    ids = tiny_engine.encode("hello world")
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                            grammar=json_schema_grammar(schema, "response_format"))
    text, _, finish = run_request(tiny_engine, ids, params)
    assert finish == "stop", text  # the grammar completed: the request ended there
    jsonschema.validate(json.loads(text), schema)


def test_only_rows_with_a_grammar_are_masked(tiny_engine):
    """In a batch of three rows the middle one has a grammar: the others keep their logits, and it keeps those
    of exactly the tokens that can start its JSON."""
    from scalenlp.engine.grammar import Grammars, constrain

    grammars = Grammars(tiny_engine.tokenizer, tiny_engine.model.args.vocab_size, tiny_engine.stop_ids)
    try:
        constraint = grammars.start(json_schema_grammar({"type": "boolean"}, "x"))
        logits = torch.randn(3, tiny_engine.model.args.vocab_size)
        out = constrain([None, constraint, None], logits)
    finally:
        grammars.close()
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    kept = out[1].isfinite().nonzero().flatten().tolist()
    assert torch.equal(out[1, kept], logits[1, kept])
    starts = {tiny_engine.tokenizer.decode([t]) for t in kept}
    assert starts and all("true".startswith(s) or "false".startswith(s) for s in starts), starts


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA_JSON])
def test_forced_tool_calls_parse_back_in_each_format(tiny_engine, tool_format):
    """Under the grammar of tool_choice "required" (parallel calls allowed where the format has them) the output is
    calls to the given tools with arguments that match their parameters, in Hermes' and in Llama 3.1's format."""
    tools = ToolUse([WEATHER, TIME], "required", parallel=True, format=tool_format)
    by_name = {t["function"]["name"]: t for t in tools.tools}
    ids = tiny_engine.encode("hello world")
    for seed in range(4):
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                                grammar=lark_grammar(tools.grammar(), "tools"))
        text, _, finish = run_request(tiny_engine, ids, params)
        fields, reason = tools.reply(text, finish)
        assert reason == "tool_calls" and fields["content"] is None, text
        for call in fields["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, by_name[call["function"]["name"]]["function"]["parameters"])


def test_text_that_is_not_a_call_stays_content():
    for tool_format, text in [
            (HERMES, "it is sunny"), (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
            (HERMES, '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'),
            (HERMES, "<tool_call>\n5\n</tool_call>"), (LLAMA_JSON, "5"), (LLAMA_JSON, '{"name": "get_weather"}')]:
        tools = ToolUse([WEATHER], "auto", parallel=True, format=tool_format)
        assert tools.reply(text, "stop") == ({"content": text}, "stop")


def test_llama_calls_with_python_tag_or_arguments_parse():
    tools = ToolUse([WEATHER], "auto", parallel=True, format=LLAMA_JSON)
    for text in ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}',
                 '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'):
        fields, finish = tools.reply(text, "stop")
        assert finish == "tool_calls" and json.loads(fields["tool_calls"][0]["function"]["arguments"])["city"] == "Oslo"


def test_streamed_content_passes_on_and_calls_are_held():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    stream = ToolUse([WEATHER], "auto", parallel=True, format=HERMES).stream()
    pieces = ["Let me ", "check. <tool", "_call>\n{", call[len("<tool_call>\n{"):]]
    assert [stream.feed(p) for p in pieces] == ["Let me ", "check. ", "", ""]
    rest, calls, finish = stream.end("stop")
    assert (rest, finish, [c["function"]["name"] for c in calls]) == ("", "tool_calls", ["get_weather"])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    # A "<" that turns out not to open a call is sent once that is known, or when the choice ends.
    stream = ToolUse([WEATHER], "auto", parallel=True, format=HERMES).stream()
    assert [stream.feed(p) for p in ["a <", "b", " <tool"]] == ["a ", "<b", " "]
    assert stream.end("length") == ("<tool", [], "length")
    llama = ToolUse([WEATHER], "auto", parallel=True, format=LLAMA_JSON).stream()
    assert [llama.feed(p) for p in [" ", ' {"name": "get_weather", ', '"parameters": {"city": "P", "days": 1}}']] == [
        "", "", ""]
    assert llama.end("stop")[1][0]["function"]["name"] == "get_weather"


# ---- the server: response_format, tools, and their errors ----

# A Qwen2.5-style template with tools (Hermes format), written for this test: the tools' signatures in the system
# turn, calls as <tool_call>{"name", "arguments"}</tool_call>, tool results back in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}\n\n"
    "You may call these functions:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant\n{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


def serve_qwen2(root, template: str):
    """A server of a tiny random Qwen2 (flat logits, room for tool prompts) whose tokenizer config carries
    ``template``; stopped on leaving."""
    folder = make_hf_chat_model(root, template, logit_scale=1.0, family="Qwen2", max_positions=1024)
    engine = engine_from_checkpoint(EngineConfig(folder, dtype="float32", device="cpu", max_batch=2, max_queue=8))
    backend = LocalBackend(engine, "tiny")
    server = ServerThread(create_app(backend))
    yield server
    server.stop()
    backend.close()
    engine.stop()


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory, transformers):
    yield from serve_qwen2(tmp_path_factory.mktemp("qwen_tools"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def chatml_server(tmp_path_factory, transformers):
    """The same model with SmolLM2's template, which has no tools."""
    yield from serve_qwen2(tmp_path_factory.mktemp("qwen_chatml"), CHATML)


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def arguments_valid(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_call_round_trip_with_the_openai_client(qwen_server):
    client = client_of(qwen_server)
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=2)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    arguments_valid(call, {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[call.function.name])
    # The result goes back with the assistant's call; the model answers in words.
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], tool_choice="auto",
                                           max_tokens=6, temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str)
    # The conversation with the call and its result is longer than the question alone: both were rendered.
    assert final.usage.prompt_tokens > out.usage.prompt_tokens


def test_named_function_and_streaming(qwen_server):
    client = client_of(qwen_server)
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=200,
              temperature=0.8, seed=4, tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "tool_calls"
    arguments = arguments_valid(out.choices[0].message.tool_calls[0], TIME)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    assert len(calls) == 1 and calls[0].index == 0
    assert arguments_valid(calls[0], TIME) == arguments  # the same seed: the same call


def test_auto_tool_choice_streams_its_text(qwen_server):
    """A model that answers in words under tool_choice auto streams them as it would without tools."""
    client = client_of(qwen_server)
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert whole.message.tool_calls is None and "".join(texts) == whole.message.content and len(texts) > 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_tools_reach_the_template(qwen_server):
    client = client_of(qwen_server)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1)
    without = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                             max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens == without.usage.prompt_tokens


def test_json_schema_response_format_over_http(qwen_server):
    schema = WEATHER["function"]["parameters"]
    body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}}
    for route, extra in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "weather:"})):
        if extra:
            body = {k: v for k, v in body.items() if k != "messages"} | extra
        r = httpx.post(qwen_server.url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), schema)


def error_of(server, body: dict, route: str = "/v1/chat/completions") -> dict:
    r = httpx.post(server.url + route, json={"model": "tiny", "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "yaml"}}, "response_format", '"yaml"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=a)b"}}}}}], "tool_choice": "required"}, "tools", "look-around"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
])
def test_bad_structured_requests_are_one_400_each(qwen_server, body, param, words):
    error = error_of(qwen_server, body)
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"], error


def test_tools_with_a_template_without_them_is_a_400(chatml_server):
    error = error_of(chatml_server, {"tools": [WEATHER]})
    assert error["param"] == "tools" and "does not render tools" in error["message"]


# ---- SmolLM2: real text under a grammar ----

class City(pydantic.BaseModel):
    name: str
    country: str
    is_capital: bool


@pytest.mark.slow
def test_smollm2_json_object_and_the_openai_parse_helper():
    engine = engine_from_checkpoint(EngineConfig(packaged_model("smollm2"), dtype="float32", device="cpu",
                                                 max_batch=2, max_queue=4))
    server = ServerThread(create_app(LocalBackend(engine, "smollm2")))
    try:
        client = client_of(server)
        ask = [{"role": "user", "content": "Describe Paris as a JSON object: its name, its country, and whether it is a capital."}]
        out = client.chat.completions.create(model="smollm2", messages=ask, response_format={"type": "json_object"},
                                             max_tokens=80, temperature=0)
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
        parsed = client.chat.completions.parse(model="smollm2", messages=ask, response_format=City, max_tokens=80,
                                               temperature=0)
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and city.name
    finally:
        server.stop()
        engine.stop()
