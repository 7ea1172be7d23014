"""Chat templates: a conversation (a list of role/content messages) rendered to the text a chat model was
trained on, by the Jinja template its tokenizer config carries (Hugging Face's ``chat_template``).

Serving renders a conversation with ``add_generation_prompt`` and lets the model write the assistant turn;
supervised fine-tuning renders whole conversations and trains on the assistant turns only
(``render_with_assistant_mask``). Templates come with downloaded checkpoints, so they are untrusted code:
they run in Jinja's immutable sandbox, with the environment Hugging Face gives them (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII
text) so that a template renders here exactly as ``apply_chat_template`` renders it.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Collection
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from scalenlp.data.text import json_problem
from scalenlp.data.tokenizer import find_eos_token_id
from scalenlp.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
# End-of-turn tokens of common chat formats: ChatML (SmolLM2, Qwen), Llama 3, Phi-3, Gemma. One counts for a
# model when its template writes it and its tokenizer has it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class ChatError(UserError):
    """A conversation or chat template that cannot be rendered (HTTP 400 when it comes from a request)."""

    code: str | None = None  # OpenAI's error code, where one names the failure


class TemplateLimit(ChatError):
    """A render that passed a limit on untrusted template code (its time, its output, its memory)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def check_messages(messages: Any) -> None:
    """A non-empty list of {"role": one of ROLES, "content": str}; other keys (name, tool_calls) pass through. An
    assistant message that made tool calls may have no content (OpenAI's API sends null)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object with a role and a content, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role is {m.get('role')!r}; it must be one of {', '.join(ROLES)}")
        if m.get("content") is None and m["role"] == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(m.get("content"), str):
            raise ChatError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
    # Every string, other keys' too: the template may write any of them, and the tokenizer cannot encode a lone
    # surrogate.
    if (problem := json_problem(messages, "messages")) is not None:
        raise ChatError(problem)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None
    except Exception as e:  # Jinja computes constant expressions as it compiles: {{ 10**5000 }} fails here
        raise ChatError(f"the chat template does not compile: {type(e).__name__}: {e}") from None


def _render(messages: list[dict], template: str, add_generation_prompt: bool, variables: dict,
            max_bytes: int | None = None) -> str:
    compiled = _compile(template)
    parts, size = [], 0
    try:
        # Output is taken as the template writes it, so that one that writes without end stops at max_bytes.
        for part in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            size += len(part) if part.isascii() else len(part.encode("utf-8", "surrogatepass"))
            if max_bytes is not None and size > max_bytes:
                raise TemplateLimit(f"the chat template's text for this conversation passed {max_bytes} bytes, "
                                    f"the limit on a template's output (serve --template-max-bytes)",
                                    "template_output_too_large")
            parts.append(part)
    except ChatError:
        raise
    except jinja2.TemplateError as e:  # raise_exception, undefined variables, sandbox violations
        raise ChatError(f"the chat template failed to render this conversation: {e}") from None
    except MemoryError:
        raise TemplateLimit("the chat template ran out of memory rendering this conversation",
                            "template_memory") from None
    except Exception as e:  # the template is untrusted code: 1/0, endless recursion, 10**5000 printed...
        raise ChatError(f"the chat template failed to render this conversation: {type(e).__name__}: {e}") from None
    return "".join(parts)


def render_chat(messages: list[dict], template: str, *, add_generation_prompt: bool, bos_token: str | None = None,
                eos_token: str | None = None, max_bytes: int | None = None, **extra) -> str:
    """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` renders it. With
    ``add_generation_prompt`` the text ends where the assistant's next turn begins. ``extra`` becomes further
    template variables (``tools``, ``date_string``, ...). A text longer than ``max_bytes`` (UTF-8) is a
    TemplateLimit, raised as soon as the template has written that much."""
    check_messages(messages)
    return _render(messages, template, add_generation_prompt, {"bos_token": bos_token, "eos_token": eos_token, **extra},
                   max_bytes)


def special_token(tokenizer_config: dict, key: str) -> str | None:
    """The text of a special token named in a tokenizer config (``bos_token``, ``eos_token``)."""
    token = tokenizer_config.get(key)
    if isinstance(token, dict):  # written as an AddedToken: {"content": "...", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def chat_template(tokenizer_config: dict) -> str:
    """The config's chat template; ChatError when the model has none (a base model, not a chat model)."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # several named templates, as older Hugging Face configs store them
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ChatError("this model has no chat template (tokenizer_config.json has no chat_template): it is not "
                        "a chat model; use plain completions, or a checkpoint that carries a template")
    return template


def template_variables(tokenizer_config: dict) -> dict:
    """The special tokens a template may refer to, as ``apply_chat_template`` passes them."""
    return {key: special_token(tokenizer_config, key) for key in ("bos_token", "eos_token")}


def encode_chat(tokenizer: Tokenizer, messages: list[dict], tokenizer_config: dict) -> list[int]:
    """Token ids of the conversation followed by the assistant's turn opening: a chat model's prompt.
    The template writes BOS itself where the model wants one, so the tokenizer adds no special tokens."""
    text = render_chat(messages, chat_template(tokenizer_config), add_generation_prompt=True,
                       **template_variables(tokenizer_config))
    return tokenizer.encode(text, add_special_tokens=False).ids


def end_of_text_id(tokenizer: Tokenizer, tokenizer_config: dict) -> int | None:
    """The config's eos_token, else a known end-of-text token of the tokenizer; None when it has neither."""
    eos = special_token(tokenizer_config, "eos_token")
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    return eos_id if eos_id is not None else find_eos_token_id(tokenizer)


def end_of_turn_ids(tokenizer: Tokenizer, tokenizer_config: dict) -> list[int]:
    """Tokens that end an assistant turn, where generation stops: the known end-of-turn tokens the chat
    template writes (<|im_end|> for ChatML, <|eot_id|> for Llama 3), and the end-of-text token."""
    template = tokenizer_config.get("chat_template")
    template = template if isinstance(template, str) else json.dumps(template or "")
    ids = {tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS if t in template}
    ids.add(end_of_text_id(tokenizer, tokenizer_config))
    return sorted(i for i in ids if i is not None)


def assistant_spans(messages: list[dict], template: str, max_bytes: int | None = None,
                    **variables) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character span of each assistant turn in it.

    Rendered incrementally: the turn of assistant message i starts where the render of messages[:i] with
    the generation prompt ends (after "<|im_start|>assistant\\n"), and ends where the render of
    messages[:i + 1] ends (its content and the template's end-of-turn text). This needs a template whose
    renders of a conversation's prefixes are prefixes of the whole render, which is checked. Each render is
    held to ``max_bytes`` as ``render_chat``'s."""
    check_messages(messages)
    full = _render(messages, template, False, variables, max_bytes)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(messages[:i], template, True, variables, max_bytes) if i else ""
        through = _render(messages[:i + 1], template, False, variables, max_bytes)
        if not (through.startswith(start) and full.startswith(through)):
            raise ChatError(f"the chat template renders the turns before messages[{i}] differently once later "
                            f"turns follow, so the assistant's tokens cannot be told apart; use a template whose "
                            f"render of a conversation's start is the start of its render")
        spans.append((len(start), len(through)))
    return full, spans


def render_with_assistant_mask(tokenizer: Tokenizer, messages: list[dict], template: str, *,
                               end_of_turn: Collection[int] = (), **variables) -> tuple[list[int], list[bool]]:
    """(token ids of the whole conversation, True where the token belongs to an assistant turn).

    A token belongs to a turn when it starts inside the turn's character span (``assistant_spans``); a token
    that merges the end of the prompt with the start of the answer stays unmarked. A turn's mask ends at its
    last ``end_of_turn`` token when it has one, so that what the template writes after it (ChatML's newline)
    is not trained on: the model is taught to write its answer and then end its turn."""
    text, spans = assistant_spans(messages, template, **variables)
    return assistant_mask(tokenizer.encode(text, add_special_tokens=False), spans, end_of_turn)


def assistant_mask(encoding, spans: list[tuple[int, int]], end_of_turn: Collection[int]) -> tuple[list[int], list[bool]]:
    """``render_with_assistant_mask``'s ids and mask from the tokenizer's encoding of the text and its
    assistant spans (``assistant_spans``)."""
    ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
    mask = [False] * len(ids)
    k = 0
    for start, end in spans:
        while k < len(ids) and starts[k] < start:
            k += 1
        turn = []
        while k < len(ids) and starts[k] < end:
            turn.append(k)
            k += 1
        ends = [j for j in turn if ids[j] in end_of_turn]
        for j in turn[:turn.index(ends[-1]) + 1] if ends else turn:
            mask[j] = True
    return ids, mask
