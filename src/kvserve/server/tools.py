"""Tool calls (OpenAI's `tools` / `tool_choice`): how the tools reach the model
through its chat template, the constraint that makes a forced call parse, and
the parser that turns the output into `message.tool_calls`, whole or as
streamed deltas.

The call format is Hermes' (Qwen, SmolLM and most open chat templates with
tools use it): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
A template that renders `tools` itself gets them as the `tools` variable,
as Hugging Face passes them; any other template gets them in a system
message, with earlier calls written back in the same format.

- `auto`: the model may answer or call; tagged calls that parse become
  tool calls, the rest of the text stays content.
- `required`: the output is constrained to a JSON array of
  `{"name", "parameters"}` objects, each validated by its function's schema.
- a named function: the output is constrained to that function's arguments
  (its `parameters` schema), as vLLM does, so the arguments always parse.
- `none`: the tools are not shown and nothing is parsed.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvserve.contract import InvalidParameter, StructuredOutput

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TAGGED_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)",
                          re.DOTALL)
ANY_OBJECT_SCHEMA: dict = {"type": "object"}
CALL_ID_HEX_CHARS = 24


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ParsedOutput(NamedTuple):
    content: str | None
    calls: list[ParsedCall]


@dataclass(frozen=True)
class ToolSet:
    """A chat request's tools and its tool_choice, validated.

    tools: the request's tool definitions as plain dicts
      ({"type": "function", "function": {"name", "description", "parameters"}});
    choice: "auto", "required" or "named" ("none" builds no ToolSet);
    forced_name: the named function, for choice "named".
    """

    tools: tuple[dict, ...]
    choice: str
    forced_name: str | None = None
    parallel: bool = True

    @classmethod
    def of_request(cls, tools: Sequence[Any] | None, tool_choice: Any,
                   parallel_tool_calls: bool | None) -> ToolSet | None:
        """The ToolSet of a request's fields (pydantic models or dicts), None
        when no tool can be called; InvalidParameter names a bad field."""
        defs = tuple(_plain(t) for t in tools or ())
        names = [d["function"]["name"] for d in defs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        _require(not duplicates, "tools", f"function names must be unique, repeated: {', '.join(duplicates)}")
        choice = _plain(tool_choice) if tool_choice is not None else ("auto" if defs else "none")
        if choice == "none":
            return None
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            _require(name in names, "tool_choice", f"names function {name!r}, which is not among the tools")
            return cls(defs, "named", name, parallel_tool_calls is not False)
        _require(bool(defs), "tool_choice", f"{choice!r} needs at least one tool in `tools`")
        return cls(defs, choice, None, parallel_tool_calls is not False)

    @property
    def schema_hash(self) -> str:
        """sha256 of the tool definitions and the choice (the versions' tool schema hash)."""
        text = json.dumps([self.tools, self.choice, self.forced_name], ensure_ascii=False,
                          separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def function(self, name: str) -> dict:
        return next(d["function"] for d in self.tools if d["function"]["name"] == name)

    # ---- the prompt ----------------------------------------------------------

    def prompt(self, messages: list[dict], chat_template: str | None) -> tuple[list[dict], dict]:
        """(messages, extra template variables) that show the tools to the model."""
        if chat_template is not None and "tools" in chat_template:
            return messages, {"tools": list(self.tools)}
        return [self._system_message(messages)] + [_with_calls_as_text(m) for m in _rest(messages)], {}

    def _system_message(self, messages: list[dict]) -> dict:
        own = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
        signatures = "\n".join(json.dumps(d, ensure_ascii=False) for d in self.tools)
        text = (f"{own}You may call functions to help with the user's request. The functions are "
                f"described inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n")
        if self.choice == "named":
            text += f"Call the function {self.forced_name} now: answer with its arguments as one JSON object."
        elif self.choice == "required":
            text += ('Call one or more of them now: answer with a JSON array of '
                     '{"name": <function name>, "parameters": <arguments object>} objects.')
        else:
            text += (f'To call a function, answer with {TOOL_CALL_OPEN}{{"name": <function name>, '
                     f'"arguments": <arguments object>}}{TOOL_CALL_CLOSE}, one per call.')
        return {"role": "system", "content": text}

    # ---- the constraint ------------------------------------------------------

    def constraint(self) -> StructuredOutput | None:
        """What the output must be for `required` and a named function; None for `auto`."""
        if self.choice == "named":
            assert self.forced_name is not None
            return StructuredOutput("json", self._parameters(self.forced_name))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": d["function"]["name"]},
                                 "parameters": self._parameters(d["function"]["name"])}}
                 for d in self.tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", schema)

    def _parameters(self, name: str) -> dict:
        parameters = self.function(name).get("parameters")
        return parameters if parameters else ANY_OBJECT_SCHEMA

    # ---- the output ----------------------------------------------------------

    def parse(self, text: str) -> ParsedOutput:
        """The calls in a whole output and the content left beside them."""
        if self.choice == "named":
            assert self.forced_name is not None
            return ParsedOutput(None, [ParsedCall(self.forced_name, text)])
        if self.choice == "required":
            calls = _array_calls(text)
            return ParsedOutput(None, calls) if calls is not None else ParsedOutput(text, [])
        return _tagged_calls(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Turns one choice's text deltas into content and tool-call deltas
    that, joined, are what `ToolSet.parse` gives for the whole text.

    A named function's arguments stream as they are generated (the first
    delta carries the call's id and name). `required` calls and `auto`'s
    tagged calls are parsed whole when the output ends: a call is only known
    to parse once it is complete. In `auto`, content streams until a tag
    may begin (text that could start `<tool_call>` is held back)."""

    def __init__(self, tool_set: ToolSet) -> None:
        self.tool_set = tool_set
        self._text = ""
        self._sent_content = 0  # characters of _text already sent as content
        self._named_started = False
        self._in_calls = False
        self.num_calls = 0

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for a piece of new text."""
        self._text += delta
        choice = self.tool_set.choice
        if choice == "named":
            return "", self._named_delta(delta)
        if choice == "required":
            return "", []
        return self._content_before_tag(), []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the output ends: content, then the calls parsed whole."""
        if self.tool_set.choice == "named":
            return "", ([] if self._named_started else self._named_delta(""))
        parsed = self.tool_set.parse(self._text)
        deltas = [call_delta(i, call, new_call_id()) for i, call in enumerate(parsed.calls)]
        self.num_calls = len(deltas)
        content = parsed.content or ""
        rest = content[self._sent_content:] if content.startswith(self._text[:self._sent_content]) else ""
        return rest, deltas

    def _named_delta(self, delta: str) -> list[dict]:
        if self._named_started:
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        self._named_started = True
        self.num_calls = 1
        assert self.tool_set.forced_name is not None
        return [call_delta(0, ParsedCall(self.tool_set.forced_name, delta), new_call_id())]

    def _content_before_tag(self) -> str:
        if self._in_calls:
            return ""  # everything from the first tag on is parsed at the end
        text = self._text
        tag = text.find(TOOL_CALL_OPEN, max(0, self._sent_content - len(TOOL_CALL_OPEN)))
        self._in_calls = tag >= 0
        end = tag if tag >= 0 else len(text) - _partial_tag_length(text)
        if end <= self._sent_content:
            return ""
        out = text[self._sent_content:end]
        self._sent_content = end
        return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(CALL_ID_HEX_CHARS // 2)


def call_delta(index: int, call: ParsedCall, call_id: str) -> dict:
    """A tool call's first streamed delta (also the whole call when its arguments are complete)."""
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def message_tool_calls(calls: list[ParsedCall]) -> list[dict]:
    """`message.tool_calls` of a whole response."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _tagged_calls(text: str) -> ParsedOutput:
    """Hermes-style calls; a block that is not a call object stays content."""
    calls, content, pos = [], [], 0
    for match in _TAGGED_CALL.finditer(text):
        call = _call_object(match.group(1), "arguments")
        if call is None:
            continue
        content.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    content.append(text[pos:])
    rest = "".join(content)
    return ParsedOutput(rest if rest.strip() else None, calls)


def _array_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call_of(item, "parameters") for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _call_object(text: str, arguments_key: str) -> ParsedCall | None:
    try:
        return _call_of(json.loads(text), arguments_key)
    except ValueError:
        return None


def _call_of(item: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag_length(text: str) -> int:
    """Characters at the end of `text` that could begin TOOL_CALL_OPEN."""
    for length in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def _rest(messages: list[dict]) -> list[dict]:
    return messages[1:] if messages and messages[0]["role"] == "system" else messages


def _with_calls_as_text(message: dict) -> dict:
    """An earlier assistant turn's tool calls written into its content, for a
    template that does not render `tool_calls` itself."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(f'{TOOL_CALL_OPEN}{{"name": {json.dumps(c["function"]["name"])}, '
                   f'"arguments": {c["function"]["arguments"]}}}{TOOL_CALL_CLOSE}' for c in calls)
    return {**message, "content": (message.get("content") or "") + text}


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if dump is not None else value


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
