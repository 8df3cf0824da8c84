"""OpenAI request models (validated with pydantic) and OpenAI-style error bodies.

Requests are parsed strictly enough to catch a client's mistakes (a string where a number
belongs, an unknown role, a negative max_tokens) and loosely enough for real clients:
unknown fields are ignored, as vLLM does, because UIs send fields of their own.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error returned to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    # Strict: "0.7" is not a number, 1 is not a string. Unknown fields are allowed and ignored.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _Sampling(_Request):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def parse_request(model: type[BaseModel], body: bytes):
    """Validate a JSON body; malformed JSON and wrong fields become 400s naming the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: pydantic.ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first['msg'])}", code="invalid_json")
    if first["type"] == "model_type" or (first["type"] == "model_attributes_type" and not first["loc"]):
        return APIError(400, "the request body must be a JSON object", code="invalid_type")
    # A union reports one error per member; name the field once, with the first reason.
    loc = _field_path(first["loc"])
    reasons = [e["msg"] for e in errors if _field_path(e["loc"]) == loc or _field_path(e["loc"]).startswith(loc + ".")]
    message = f"{loc}: {reasons[0] if reasons else first['msg']}"
    if first["type"] == "missing":
        message = f"{loc}: this field is required"
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value" if first["type"] in ("greater_than_equal", "less_than_equal", "too_short", "literal_error", "greater_than", "less_than") else "invalid_type"
    return APIError(400, message, param=loc, code=code)


def _field_path(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages.0.role', leaving out pydantic's union member tags."""
    parts = []
    for part in loc:
        if isinstance(part, str) and (part in ("str", "int", "float", "bool", "none", "list", "dict") or part.startswith(("list[", "dict[", "literal[", "function-", "NamedToolChoice"))):
            continue
        parts.append(str(part))
    return ".".join(parts)
