"""Qwen3 tool calls in model text -> OpenAI `tool_calls`, streamed as deltas.

Qwen3.5 (the `qwen3_coder` / `qwen3_xml` format) writes

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; they become JSON typed by the tool's JSON schema (a
"string" stays text, "integer" becomes a number, "object" is parsed, ...). The older Qwen3
(`hermes`) body, `{"name": ..., "arguments": {...}}` inside `<tool_call>`, is accepted too.

Streaming: a call is announced (index, id, name) once `<function=NAME>` is complete; each
parameter is sent as an `arguments` fragment when its `</parameter>` arrives; `</function>`
closes the object. The fragments concatenate to exactly the non-streaming `arguments`, and
the non-streaming result is this same parser fed the whole text at once.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_FUNCTION_HEAD = re.compile(r"<function=([^>\n]*)>")
_PARAM_HEAD = re.compile(r"<parameter=([^>\n]*)>")
_MAX_HEAD = 512  # a `<function=...>` / `<parameter=...>` head longer than this is not one


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with name
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: its parameters' JSON schema `properties`}."""
    schemas = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name"):
            params = function.get("parameters") or {}
            schemas[function["name"]] = params.get("properties") or {} if isinstance(params, dict) else {}
    return schemas


class ToolCallParser:
    """feed(text) / flush() -> [("content", str) | ("tool", ToolCallDelta)]."""

    def __init__(self, tools: list[dict] | None = None, prefix: str = ""):
        self.schemas = tool_schemas(tools)
        self.buffer = ""
        self.state = "text"  # text | head | params | tail | json
        self.num_calls = 0
        self.params_sent = 0
        self.held_space = ""  # content's trailing whitespace: dropped if a tool call follows
        self.space_before_call = ""
        self.skip_space = False  # drop whitespace right after a tool call
        self.current: ToolCallDelta | None = None
        # Text the server wrote into the prompt (a forced tool call's opening): parsed as if
        # the model had written it, its output handed out with the first real text.
        self.pending = self.feed(prefix) if prefix else []

    # -- public --------------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        out, self.pending = getattr(self, "pending", []), []
        while self.buffer and self._step(out):
            pass
        return out

    def flush(self) -> list[tuple[str, Any]]:
        out, self.pending = self.pending, []
        if self.state == "text":
            self._content(out, self.buffer, final=True)
        elif self.state == "head":
            self.state, self.held_space = "text", self.space_before_call  # never became a call: show it as text
            self._content(out, TOOL_OPEN + self.buffer, final=True)
        elif self.state == "json":
            if not self._json_call(out, self.buffer):
                self.held_space = self.space_before_call
                self._content(out, TOOL_OPEN + self.buffer, final=True)
        elif self.state == "params":
            self._close_arguments(out)  # an unfinished parameter is left out
        self.buffer, self.state = "", "text"
        return out

    # -- states --------------------------------------------------------------------------
    def _step(self, out) -> bool:
        """Consume what can be consumed; False when more text is needed."""
        if self.state == "text":
            if self.skip_space:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return False
                self.skip_space = False
            index = self.buffer.find(TOOL_OPEN)
            if index < 0:
                keep = _partial_suffix(self.buffer, TOOL_OPEN)
                self._content(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            self._content(out, self.buffer[:index])
            self.space_before_call, self.held_space = self.held_space, ""
            self.buffer, self.state = self.buffer[index + len(TOOL_OPEN) :], "head"
            return True
        if self.state == "head":
            stripped = self.buffer.lstrip()
            if stripped.startswith("{"):
                self.buffer, self.state = stripped, "json"
                return True
            match = _FUNCTION_HEAD.match(stripped)
            if match:
                self.current = ToolCallDelta(self.num_calls, new_call_id(), match.group(1).strip(), "")
                self.num_calls += 1
                self.params_sent = 0
                out.append(("tool", self.current))
                self.buffer, self.state = stripped[match.end() :], "params"
                return True
            if len(stripped) < _MAX_HEAD and (FUNCTION_OPEN.startswith(stripped) or (stripped.startswith(FUNCTION_OPEN) and ">" not in stripped)):
                return False  # the head is still arriving
            self.state, self.held_space = "text", self.space_before_call  # not a tool call after all
            self._content(out, TOOL_OPEN)
            return True
        if self.state == "params":
            hits = [(i, t) for t in (PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE) if (i := self.buffer.find(t)) >= 0]
            if not hits:
                keep = max(_partial_suffix(self.buffer, t) for t in (PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE))
                self.buffer = self.buffer[len(self.buffer) - keep :]  # stray text inside a call is dropped
                return False
            index, tag = min(hits)
            self.buffer = self.buffer[index:]
            if tag == PARAM_OPEN:
                head = _PARAM_HEAD.match(self.buffer)
                end = self.buffer.find(PARAM_CLOSE)
                if head is None or end < 0:
                    if head is None and (">" in self.buffer[:_MAX_HEAD] or len(self.buffer) >= _MAX_HEAD):
                        self.buffer = self.buffer[len(PARAM_OPEN) :]  # malformed head: skip it
                        return True
                    return False
                name = head.group(1).strip()
                raw = self.buffer[head.end() : end]
                self.buffer = self.buffer[end + len(PARAM_CLOSE) :]
                self._argument(out, name, raw)
                return True
            self._close_arguments(out)
            if tag == FUNCTION_CLOSE:
                self.buffer, self.state = self.buffer[len(FUNCTION_CLOSE) :], "tail"
            else:
                self.buffer, self.state, self.skip_space = self.buffer[len(TOOL_CLOSE) :], "text", True
            return True
        if self.state == "tail":
            hits = [(i, t) for t in (TOOL_CLOSE, TOOL_OPEN) if (i := self.buffer.find(t)) >= 0]
            if not hits:
                keep = max(_partial_suffix(self.buffer, TOOL_CLOSE), _partial_suffix(self.buffer, TOOL_OPEN))
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            index, tag = min(hits)
            self.buffer = self.buffer[index + len(TOOL_CLOSE) :] if tag == TOOL_CLOSE else self.buffer[index:]
            self.state, self.skip_space = "text", True
            return True
        if self.state == "json":
            end = self.buffer.find(TOOL_CLOSE)
            if end < 0:
                return False
            body, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CLOSE) :]
            if not self._json_call(out, body):
                self.held_space = self.space_before_call
                self._content(out, TOOL_OPEN + body + TOOL_CLOSE)
            self.state, self.skip_space = "text", True
            return True
        raise AssertionError(self.state)

    # -- output --------------------------------------------------------------------------
    def _content(self, out, text: str, final: bool = False) -> None:
        """Content with its trailing whitespace held back: whitespace before a tool call is dropped."""
        body = text.rstrip()
        if body:
            out.append(("content", self.held_space + body))
            self.held_space = text[len(body) :]
        else:
            self.held_space += text
        if final:
            if self.held_space and not self.num_calls:
                out.append(("content", self.held_space))
            self.held_space = ""

    def _argument(self, out, name: str, raw: str) -> None:
        value = _strip_one_newline(raw)
        schema = self.schemas.get(self.current.name, {}).get(name)
        fragment = ("{" if self.params_sent == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        out.append(("tool", ToolCallDelta(self.current.index, arguments=fragment + json.dumps(typed_value(value, schema), ensure_ascii=False))))
        self.params_sent += 1

    def _close_arguments(self, out) -> None:
        if self.current is not None:
            out.append(("tool", ToolCallDelta(self.current.index, arguments="}" if self.params_sent else "{}")))
        self.current = None

    def _json_call(self, out, body: str) -> bool:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append(("tool", ToolCallDelta(self.num_calls, new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False))))
        self.num_calls += 1
        return True


def parse_tool_calls(text: str, tools: list[dict] | None = None, prefix: str = "") -> tuple[str, list[ToolCall]]:
    """Non-streaming: (content, tool calls), exactly what the streamed deltas add up to."""
    parser = ToolCallParser(tools, prefix)
    return collect(parser.feed(text) + parser.flush())


def collect(items) -> tuple[str, list[ToolCall]]:
    content, calls = [], []
    for kind, item in items:
        if kind == "content":
            content.append(item)
        elif item.id is not None:
            calls.append(ToolCall(item.id, item.name, item.arguments))
        else:
            calls[item.index].arguments += item.arguments
    return "".join(content), calls


# -- typing parameter values by the tool's JSON schema -----------------------------------

def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    types = schema.get("type")
    found = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found += _schema_types(sub)
    if not found and "enum" in schema:
        found = sorted({_json_type(v) for v in schema["enum"]})
    if not found and ("properties" in schema):
        found = ["object"]
    return found


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "null" if value is None else "object"


_ORDER = ("null", "boolean", "integer", "number", "object", "array", "string")


def typed_value(raw: str, schema: Any) -> Any:
    """The parameter's text as the JSON value its schema asks for; text when it doesn't fit."""
    types = _schema_types(schema)
    text = raw.strip()
    for kind in sorted(set(types), key=lambda t: _ORDER.index(t) if t in _ORDER else len(_ORDER)):
        if kind == "string":
            return raw
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                try:
                    number = float(text)
                    if number.is_integer():
                        return int(number)
                except ValueError:
                    pass
        if kind == "number":
            try:
                number = float(text)
                return int(text) if re.fullmatch(r"[-+]?\d+", text) else number
            except ValueError:
                pass
        if kind in ("object", "array"):
            for load in (json.loads, ast.literal_eval):
                try:
                    value = load(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                if isinstance(value, dict if kind == "object" else (list, tuple)):
                    return list(value) if isinstance(value, tuple) else value
    return raw  # no schema, or a value that fits none of its types


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _partial_suffix(text: str, tag: str) -> int:
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def delta_to_openai(delta: ToolCallDelta) -> dict:
    """One entry of a streamed `delta.tool_calls`."""
    if delta.id is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}
