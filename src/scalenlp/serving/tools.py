"""Tool calling in chat completions: the request's ``tools`` checked and handed to the checkpoint's chat template,
the grammar that forces a tool call (``tool_choice`` "required" or a named function), and the model's text parsed
back into OpenAI's ``tool_calls``.

A model writes tool calls in the format its chat template teaches it, which is read off the template:
  - Hermes / Qwen2.5: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
  - Llama 3.1 (JSON tool calling): ``{"name": ..., "parameters": {...}}``.
A template that never refers to ``tools`` cannot show them to the model, and a request with tools is refused.
``tool_choice`` "none" leaves the tools out of the prompt and the output unparsed, as a request without tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from scalenlp.engine.grammar import COMPACT

HERMES, LLAMA_JSON = "hermes", "llama3_json"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A request's tools that cannot be used as sent (HTTP 400); ``param`` names the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tool_format(template: str) -> str:
    """Which tool-call format ``template`` (a chat template's text) teaches; a 400 when it renders no tools or
    writes calls in a format this server does not parse."""
    import jinja2
    import jinja2.meta

    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
                                                      .parse(template))
    except jinja2.TemplateSyntaxError:
        names = set()  # rendering reports the syntax error itself
    if "tools" not in names:
        raise ToolError("this model's chat template does not render tools, so the model cannot be shown them; "
                    "send the request without tools, or serve a checkpoint whose template defines them (Qwen2.5, "
                    "Llama 3.1, Hermes)", "tools")
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template:
        return LLAMA_JSON
    raise ToolError("this model's chat template renders tools but teaches a tool-call format this server does "
                    "not parse (it parses Hermes/Qwen <tool_call>{...}</tool_call> and Llama 3.1 JSON); send the "
                    "request without tools", "tools")


@dataclass
class ToolUse:
    """A chat request's tools, checked: ``choice`` is "auto", "required" or a function's name."""

    tools: list[dict]
    choice: str
    parallel: bool
    format: str | None = None  # set once the backend has read its template

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) of the calls this request must make."""
        functions = [t["function"] for t in self.tools if not self.forced or self.choice in ("required",
                                                                                            t["function"]["name"])]
        key = "arguments" if self.format == HERMES else "parameters"
        one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                                 key: f.get("parameters") or _NO_PARAMETERS},
                               "required": ["name", key], "additionalProperties": False} for f in functions],
                    "x-guidance": COMPACT}
        call = f"%json {json.dumps(one_call)}"
        if self.format == HERMES:
            call = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        # Llama 3.1's JSON format has one call per turn.
        more = ' ("\\n" call)*' if self.parallel and self.format == HERMES else ""
        return f"start: call{more}\ncall: {call}\n"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(the text's content outside tool calls or None, its tool calls in OpenAI's shape); text that does not
        parse as calls to these tools is all content."""
        names = {t["function"]["name"] for t in self.tools}
        if self.format == HERMES:
            bodies, content = _HERMES_CALL.findall(text), text.split(HERMES_START, 1)[0].strip()
        else:  # Llama 3.1 may open the call with <|python_tag|>
            bodies, content = [text.strip().removeprefix(PYTHON_TAG)], ""
        calls = []
        for body in bodies:
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict):
                return text, []
            # Llama's template asks for "parameters", but its models write "arguments" as often.
            key = "parameters" if self.format == LLAMA_JSON and "parameters" in call else "arguments"
            if not (call.get("name") in names and isinstance(call.get(key), dict)):
                return text, []
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call[key], ensure_ascii=False)}})
        return (content or None, calls) if calls else (text, [])

    def reply(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message's fields for ``text`` (content, and tool_calls when it made some) and the
        choice's finish reason ("tool_calls" when it did)."""
        content, calls = self.parse(text)
        if not calls:
            return {"content": content}, finish_reason
        return {"content": content, "tool_calls": calls}, "tool_calls"

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's text under a ToolUse: content passes on as it comes, and what may be a tool call is
    held until the choice ends (all of it when a call is forced)."""

    def __init__(self, tools: ToolUse):
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of ``text`` passed on
        self.calling = tools.forced  # from here on the text is held

    def feed(self, text: str) -> str:
        """The content of ``text`` (the choice's next piece) that can be sent now."""
        self.text += text
        if self.calling:
            return ""
        end = len(self.text)
        if self.tools.format == HERMES:
            start = self.text.find(HERMES_START, self.sent)
            if start >= 0:
                self.calling, end = True, start
            else:  # the text may end with the first characters of a call's tag
                end -= next((k for k in range(len(HERMES_START) - 1, 0, -1) if self.text.endswith(HERMES_START[:k])), 0)
        else:  # Llama 3.1's call is the whole message, a JSON object
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.calling = True
            if self.calling or not head:
                return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def end(self, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """When the choice ends: (its content not sent yet, its tool calls, its finish reason)."""
        _, calls = self.tools.parse(self.text)
        if calls:  # the content before the calls went out as it came
            return "", calls, "tool_calls"
        return self.text[self.sent:], [], finish_reason


def tool_use(req) -> ToolUse | None:
    """The request's tools and tool_choice, checked (400s naming the field); None when no tool is to be used."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice asks for a tool call, but the request has no tools", "tool_choice")
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                            f'{{...}}}}}}', "tools")
        if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise ToolError("tools must have distinct function names", "tools")
    if choice is None or choice in ("auto", "required"):
        choice = choice or "auto"
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in names:
            raise ToolError(f"tool_choice names the function {choice!r}, which is not among the tools "
                            f"({', '.join(names)})", "tool_choice")
    else:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    return ToolUse(list(tools), choice, req.parallel_tool_calls is not False)


def template_messages(messages: Any) -> Any:
    """The messages as chat templates take them: an assistant's tool call arguments as an object, not the JSON
    string OpenAI's API sends (Qwen's and Llama's templates write them with ``tojson``)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_template_call(c, i, j) for j, c in enumerate(calls)]}
        out.append(m)
    return out


def _template_call(call: Any, i: int, j: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("arguments"), str)):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON; send the arguments "
                        f"string the tool call came with", "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}
