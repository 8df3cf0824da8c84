"""The HTTP server: OpenAI-compatible routes over the engine, a chat page, health and metrics.

The app owns HTTP only: requests are validated and rendered to prompt ids here, then handed
to the Scheduler, whose single thread drives the engine; tokens come back through per-request
queues and leave as JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine, TokenEvent
from ..engine.sampling import SamplingParams
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, parse_request
from .reasoning import ReasoningSplitter
from .scheduler import QueueFull, RequestHandle, Scheduler, SchedulerStopped
from .tools import ToolCallParser, delta_to_openai

log = logging.getLogger("roofline.server")

STATIC_DIR = Path(__file__).parent / "static"
_TEMPLATE_RESERVED = {"messages", "tools", "add_generation_prompt", "documents"}
_MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    reasoning_parser: str = "qwen3"  # qwen3 | none
    tool_call_parser: str = "qwen3_coder"  # qwen3_coder | qwen3_xml | hermes | none
    max_num_seqs: int = 16
    max_queued_requests: int = 64
    cache_budget_bytes: int = 1 << 30
    extra_model_info: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    metrics = Metrics(config.model_name)
    metrics.speculator = engine.speculator
    scheduler = Scheduler(engine, max_num_seqs=config.max_num_seqs, max_queued=config.max_queued_requests,
                          budget_bytes=config.cache_budget_bytes, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="roofline", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.scheduler, app.state.metrics, app.state.config = engine, scheduler, metrics, config
    app.add_middleware(_CountRequests, metrics=metrics)
    chat_page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    created = int(time.time())

    # -- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(error_body(message, kind, None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"), status_code=500)

    def check_auth(request: Request) -> None:
        if not config.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", "authentication_error", None, "invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "incorrect API key", "authentication_error", None, "invalid_api_key")

    def check_model(name: str | None) -> str:
        if name is None or name in config.served_model_names:
            return name or config.model_name
        served = ", ".join(f"`{n}`" for n in config.served_model_names)
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}", "not_found_error", "model", "model_not_found")

    # -- plain routes ----------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(chat_page)

    @app.get("/health")
    async def health():
        if scheduler.thread is None or not scheduler.thread.is_alive():
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "roofline", "root": str(engine.model_dir),
                 "max_model_len": engine.max_model_len, **config.extra_model_info} for name in config.served_model_names]
        return {"object": "list", "data": data}

    # -- generation ------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req = parse_request(ChatCompletionRequest, await request.body())
        model = check_model(req.model)
        prep = await asyncio.to_thread(_prepare_chat, engine, config, req)
        handle = submit(scheduler, prep.prompt_ids, prep.params)
        if req.stream:
            return _sse(_stream_chat(request, handle, prep, model, req, engine))
        return await _complete_chat(request, handle, prep, model, engine)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req = parse_request(CompletionRequest, await request.body())
        model = check_model(req.model)
        prompt_ids, prompt_text = await asyncio.to_thread(_completion_prompt, engine, req)
        params = _sampling_params(engine, req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_tokens=len(prompt_ids))
        handle = submit(scheduler, prompt_ids, params)
        echo = prompt_text if req.echo else ""
        if req.stream:
            return _sse(_stream_completion(request, handle, model, req, engine, echo))
        return await _complete_completion(request, handle, model, req, engine, echo)

    return app


def submit(scheduler: Scheduler, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
    try:
        return scheduler.submit(prompt_ids, params)
    except QueueFull as exc:
        raise APIError(429, str(exc), "rate_limit_error", None, "server_at_capacity") from None
    except SchedulerStopped as exc:
        raise APIError(503, str(exc), "server_error", None, "shutting_down") from None


# -- request preparation ---------------------------------------------------------------------

@dataclass
class ChatPrep:
    prompt_ids: list[int]
    params: SamplingParams
    starts_in_reasoning: bool
    reasoning: bool  # split reasoning from content
    tools: list[dict] | None  # parse tool calls against these (None: no parsing)
    tool_prefix: str  # forced tool call opening written into the prompt


def _prepare_chat(engine: Engine, config: ServerConfig, req: ChatCompletionRequest) -> ChatPrep:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, f"{engine.model_dir} has no tokenizer.json: use /v1/completions with token ids", param="messages")
    _unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs", code="invalid_value")

    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    names = [t["function"]["name"] for t in tools or []]
    if choice is not None and choice != "none" and choice != "auto" and not tools:
        raise APIError(400, "tool_choice: needs a non-empty `tools` list", param="tool_choice", code="invalid_value")
    if not isinstance(choice, (str, type(None))) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: the function `{choice.function.name}` is not among the tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
    parse_tools = tools is not None and choice != "none" and config.tool_call_parser != "none"

    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(_TEMPLATE_RESERVED & kwargs.keys())
    if bad:
        raise APIError(400, f"chat_template_kwargs: {', '.join(bad)} cannot be set here", param="chat_template_kwargs", code="invalid_value")
    messages = [_template_message(m) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools if choice != "none" else None, add_generation_prompt=True, **kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages", code="invalid_value") from None

    prefix = ""
    if parse_tools and (choice == "required" or not isinstance(choice, (str, type(None)))):
        # No grammar-constrained decoding yet: a forced call is started in the prompt, with
        # thinking closed first, and the model writes the rest.
        if text.rstrip().endswith("<think>"):
            text = text.rstrip() + "\n\n</think>\n\n"
        prefix = "<tool_call>\n<function=" + ("" if choice == "required" else f"{choice.function.name}>\n")
        text += prefix
    reasoning = config.reasoning_parser == "qwen3"
    starts_in_reasoning = reasoning and not prefix and text.rstrip().endswith("<think>")
    prompt_ids = tokenizer.encode(text)
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = _sampling_params(engine, req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_tokens=len(prompt_ids))
    return ChatPrep(prompt_ids, params, starts_in_reasoning, reasoning, tools if parse_tools else None, prefix)


def _unsupported(req) -> None:
    if req.n != 1:
        raise APIError(400, "n: only n=1 is supported", param="n", code="invalid_value")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise APIError(400, f"response_format {fmt.get('type')!r} is not supported (no constrained decoding yet)", param="response_format", code="unsupported_parameter")


def _template_message(message) -> dict:
    m = message.model_dump(exclude_none=True)
    if m["role"] == "developer":
        m["role"] = "system"
    for call in m.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            # OpenAI clients send arguments as JSON text; templates iterate them as a mapping.
            try:
                parsed = json.loads(function["arguments"] or "{}")
            except json.JSONDecodeError:
                continue
            if isinstance(parsed, dict):
                function["arguments"] = parsed
    return m


def _sampling_params(engine: Engine, req, *, max_tokens: int | None, logprobs: int | None, prompt_tokens: int) -> SamplingParams:
    limit = engine.max_model_len
    if prompt_tokens >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} tokens",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        field_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the request needs {prompt_tokens + max_tokens} "
                            f"({prompt_tokens} in the prompt, {max_tokens} for the completion): lower {field_name} to at most {limit - prompt_tokens}",
                       param=field_name, code="context_length_exceeded")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise APIError(400, "seed: must fit in 64 bits", param="seed", code="invalid_value")
    vocab = engine.model.config.vocab_size
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="stop_token_ids", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    overrides = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed")}
    try:
        params = engine.default_params(**overrides, max_tokens=max_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                                       ignore_eos=req.ignore_eos, logprobs=logprobs)
        return params.validate()
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name, code="invalid_value") from None


def _completion_prompt(engine: Engine, req: CompletionRequest) -> tuple[list[int], str]:
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    _unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: send one prompt per request (batched prompts are not supported)", param="prompt", code="invalid_value")
        prompt = prompt[0]
    tokenizer = engine.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, f"{engine.model_dir} has no tokenizer.json: send the prompt as token ids", param="prompt")
        ids, text = tokenizer.encode(prompt), prompt
    else:
        vocab = engine.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt", code="invalid_value")
        ids, text = list(prompt), tokenizer.decode(prompt) if tokenizer else ""
    if not ids:
        raise APIError(400, "prompt: the prompt is empty", param="prompt", code="invalid_value")
    return ids, text


# -- responses -------------------------------------------------------------------------------

class ChatText:
    """Model text -> reasoning / content / tool-call deltas; streaming and not share it."""

    def __init__(self, prep: ChatPrep):
        self.splitter = ReasoningSplitter(prep.starts_in_reasoning) if prep.reasoning else None
        self.tools = ToolCallParser(prep.tools, prep.tool_prefix) if prep.tools is not None else None
        self.made_tool_call = False

    def feed(self, text: str, final: bool = False) -> list[tuple[str, Any]]:
        parts = self.splitter.feed(text) if self.splitter else [("content", text)]
        if final and self.splitter:
            parts += self.splitter.flush()
        out = []
        for kind, chunk in parts:
            if kind == "content" and self.tools:
                out += self.tools.feed(chunk)
            else:
                out.append((kind, chunk))
        if final and self.tools:
            out += self.tools.flush()
        self.made_tool_call |= any(kind == "tool" for kind, _ in out)
        return out


class TokenLogprobs:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.end_ids = set(engine.eos_token_ids)

    def wanted(self, event: TokenEvent, params: SamplingParams) -> bool:
        """A logprob entry per token whose text is part of the output (not a final stop token)."""
        ends = event.finish_reason == "stop" and (event.token_id in self.end_ids or event.token_id in params.stop_token_ids)
        return params.logprobs is not None and not ends

    def token_bytes(self, token_id: int) -> bytes:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return str(token_id).encode()
        piece = tokenizer.id_to_token(token_id) or ""
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece) and tokenizer.decode([token_id]) != piece:
            return bytes(table[ch] for ch in piece)
        return tokenizer.decode([token_id]).encode("utf-8")

    def chat_entry(self, event: TokenEvent) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

        return {**item(event.token_id, event.logprob), "top_logprobs": [item(t, lp) for t, lp in event.top_logprobs or []]}


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


_BYTE_DECODER: dict[str, int] | None = None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel the request as soon as its client goes away (frees its memory at once)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(request: Request, handle: RequestHandle):
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        yield
    finally:
        watcher.cancel()
        handle.cancel()  # a no-op when it finished


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, SchedulerStopped):
        return APIError(503, str(exc), "server_error", None, "shutting_down")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    return APIError(500, str(exc), "server_error", None, "internal_error")


def _finish(reason: str | None, made_tool_call: bool) -> str | None:
    return "tool_calls" if reason == "stop" and made_tool_call else reason


async def _complete_chat(request: Request, handle: RequestHandle, prep: ChatPrep, model: str, engine: Engine):
    text, logprobs = ChatText(prep), TokenLogprobs(engine)
    reasoning, content, calls, entries = [], [], [], []
    async with _cancel_on_disconnect(request, handle):
        try:
            async for event in handle:
                for kind, item in text.feed(event.text, final=event.finish_reason is not None):
                    if kind == "reasoning":
                        reasoning.append(item)
                    elif kind == "content":
                        content.append(item)
                    elif item.id is not None:
                        calls.append({"id": item.id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
                    else:
                        calls[item.index]["function"]["arguments"] += item.arguments
                if logprobs.wanted(event, prep.params):
                    entries.append(logprobs.chat_entry(event))
        except Exception as exc:
            raise _engine_error(exc) from None
    if handle.finish_reason == "abort":
        return Response(status_code=499)  # the client is gone; nobody reads this
    message = {"role": "assistant", "content": "".join(content) or (None if calls else ""), "reasoning_content": "".join(reasoning) or None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": {"content": entries} if prep.params.logprobs is not None else None,
                     "finish_reason": _finish(handle.finish_reason, text.made_tool_call)}],
        "usage": _usage(len(prep.prompt_ids), handle.num_generated),
    }


def _sse(generator) -> StreamingResponse:
    return StreamingResponse(generator, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream_chat(request: Request, handle: RequestHandle, prep: ChatPrep, model: str, req: ChatCompletionRequest, engine: Engine):
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    text, logprobs = ChatText(prep), TokenLogprobs(engine)
    want_logprobs = prep.params.logprobs is not None

    def chunk(delta: dict, finish=None, entries=None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": entries} if want_logprobs and entries is not None else None, "finish_reason": finish}
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return _data(body)

    async with _cancel_on_disconnect(request, handle):
        yield chunk({"role": "assistant", "content": ""})
        pending: list[dict] = []
        try:
            async for event in handle:
                if logprobs.wanted(event, prep.params):
                    pending.append(logprobs.chat_entry(event))
                for kind, item in text.feed(event.text, final=event.finish_reason is not None):
                    if kind == "tool":
                        delta = {"tool_calls": [delta_to_openai(item)]}
                    else:
                        delta = {"reasoning_content" if kind == "reasoning" else "content": item}
                    yield chunk(delta, entries=pending)
                    pending = []
        except Exception as exc:
            error = _engine_error(exc)
            yield _data(error.body())
            yield "data: [DONE]\n\n"
            return
        if handle.finish_reason == "abort":
            return
        yield chunk({}, finish=_finish(handle.finish_reason, text.made_tool_call), entries=pending if pending else None)
        if include_usage:
            yield _data({"id": ident, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                         "usage": _usage(len(prep.prompt_ids), handle.num_generated)})
        yield "data: [DONE]\n\n"


class CompletionLogprobs:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, engine: Engine, offset: int):
        self.lp = TokenLogprobs(engine)
        self.offset = offset

    def entry(self, event: TokenEvent) -> dict:
        token = self.lp.token_bytes(event.token_id).decode("utf-8", errors="replace")
        top = {}
        for t, lp in event.top_logprobs or []:
            top[self.lp.token_bytes(t).decode("utf-8", errors="replace")] = _finite(lp)
        out = {"tokens": [token], "token_logprobs": [_finite(event.logprob)], "top_logprobs": [top], "text_offset": [self.offset]}
        self.offset += len(event.text)
        return out

    @staticmethod
    def merge(entries: list[dict]) -> dict:
        return {key: [v for e in entries for v in e[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def _complete_completion(request: Request, handle: RequestHandle, model: str, req: CompletionRequest, engine: Engine, echo: str):
    texts, entries = [echo], []
    lp = CompletionLogprobs(engine, len(echo))
    async with _cancel_on_disconnect(request, handle):
        try:
            async for event in handle:
                if lp.lp.wanted(event, handle.params):
                    entries.append(lp.entry(event))
                texts.append(event.text)
        except Exception as exc:
            raise _engine_error(exc) from None
    if handle.finish_reason == "abort":
        return Response(status_code=499)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": "".join(texts), "logprobs": CompletionLogprobs.merge(entries) if req.logprobs is not None else None,
                     "finish_reason": handle.finish_reason}],
        "usage": _usage(len(handle.prompt_ids), handle.num_generated),
    }


async def _stream_completion(request: Request, handle: RequestHandle, model: str, req: CompletionRequest, engine: Engine, echo: str):
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    lp = CompletionLogprobs(engine, len(echo))

    def chunk(text: str, finish=None, entries=None) -> str:
        body = {"id": ident, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": CompletionLogprobs.merge(entries) if entries is not None and req.logprobs is not None else None,
                             "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return _data(body)

    async with _cancel_on_disconnect(request, handle):
        if echo:
            yield chunk(echo)
        try:
            async for event in handle:
                entries = [lp.entry(event)] if lp.lp.wanted(event, handle.params) else []
                yield chunk(event.text, finish=event.finish_reason, entries=entries)
        except Exception as exc:
            yield _data(_engine_error(exc).body())
            yield "data: [DONE]\n\n"
            return
        if handle.finish_reason == "abort":
            return
        if include_usage:
            yield _data({"id": ident, "object": "text_completion", "created": created, "model": model, "choices": [],
                         "usage": _usage(len(handle.prompt_ids), handle.num_generated)})
        yield "data: [DONE]\n\n"


class _CountRequests:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and eat disconnects)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.http_request(getattr(route, "path", "other"), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
