"""A measuring client for any OpenAI-compatible server (roofline, vLLM, llama.cpp, SGLang).

Plain HTTP from the standard library (no client library between the socket and the clock):
one connection per request, the clock started after the connection is made, SSE parsed line
by line as it arrives. Each request gives one `Measurement`:

- non-streaming: wall time and usage.completion_tokens (the reference system's figure);
- streaming: time to first token (first delta carrying content, reasoning or a tool call;
  the empty role chunk some servers send at once does not count), arrival time of every
  delta, and decode tok/s after the first token = (tokens - 1) / (t_last - t_first).

Tokens are counted from `usage` (requested with stream_options.include_usage). The streamed
count is recorded beside it and checked against it: the per-token logprob entries when the
request asked for logprobs (exact), else the deltas carrying text, which servers may merge
(several tokens per delta under speculative decoding, text held back at an incomplete UTF-8
character or a possible stop string) or leave out (no text for `</think>` or the end token).
Without usage the streamed count is the token count.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

from ..errors import UserError

# Delta fields that carry generated text (vLLM uses `reasoning` in newer versions).
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


class RequestFailed(Exception):
    """The server answered with an HTTP error (or an error event): status, message, code."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message, self.code = status, message, code

    @property
    def context_exceeded(self) -> bool:
        text = f"{self.code or ''} {self.message}".lower()
        return self.status in (400, 413, 422) and any(
            word in text for word in ("context_length", "context length", "maximum context", "too long",
                                      "exceeds the available context", "exceed_context", "max_model_len", "n_ctx"))


@dataclass
class Measurement:
    stream: bool
    start_s: float                        # when the request was sent, seconds since the suite's clock started
    wall_s: float                         # request sent -> last byte of the response
    connect_s: float                      # TCP (+TLS) connect, not inside wall_s
    completion_tokens: int | None         # usage when given, else the streamed delta count
    token_source: str                     # "usage" or "stream"
    prompt_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None = None           # streaming only
    decode_tok_s: float | None = None     # streaming only: tokens after the first / time after the first
    e2e_tok_s: float | None = None        # completion tokens / wall time (the reference system's figure)
    streamed_deltas: int | None = None    # deltas carrying text or a tool call
    streamed_logprobs: int | None = None  # per-token logprob entries streamed (only when logprobs were asked for)
    usage_completion_tokens: int | None = None
    count_check: str | None = None        # streamed count (logprob entries, else deltas) vs usage:
                                          # "match", "match+end" (usage also counts the end token), "differs", "no usage"
    delta_times_s: list[float] = field(default_factory=list)  # arrival of each delta, from the request

    def to_json(self) -> dict:
        out = asdict(self)
        out["delta_times_s"] = [round(t, 6) for t in self.delta_times_s]
        for key in ("start_s", "wall_s", "connect_s", "ttft_s", "decode_tok_s", "e2e_tok_s"):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        return out


def normalise_url(url: str) -> str:
    """`host:port`, `http://host:port`, `http://host:port/v1` -> `http://host:port` (+ any path prefix, without /v1)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--url: cannot read {url!r} as an http(s) URL (example: http://127.0.0.1:8000)")
    path = parts.path
    for tail in ("/chat/completions", "/completions", "/models"):
        if path.endswith(tail):
            path = path[: -len(tail)]
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Client:
    """One OpenAI-compatible server. Thread-safe: every request has its own connection."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = normalise_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path
        self.api_key = api_key
        self.timeout = timeout
        self.model: str | None = None
        self.models_info: list[dict] = []
        self.stream_options = True  # dropped if the server refuses the field
        self._limit: int | None | bool = False  # False: not read yet
        self.clock0 = time.perf_counter()

    # -- plumbing --------------------------------------------------------------------------
    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.connect()
        except (ConnectionRefusedError, socket.gaierror, socket.timeout, TimeoutError, OSError, ssl.SSLError) as exc:
            conn.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc) or type(exc).__name__)
            raise UserError(f"cannot reach the server at {self.url} ({reason}); is it running? "
                            f"(start one with `roofline serve`, or pass --url)") from None
        return conn

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _fail(self, status: int, body: bytes) -> RequestFailed:
        text = body.decode("utf-8", errors="replace").strip()
        message, code = text[:500] or "(empty body)", None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            if isinstance(err, dict):
                message = str(err.get("message") or err.get("msg") or err.get("detail") or message)
                code = err.get("code") or err.get("type")
                code = str(code) if code is not None else None
            elif isinstance(err, str):
                message = err
        if status == 401:
            return RequestFailed(status, f"the server refused the API key ({message}); pass --api-key", code)
        return RequestFailed(status, message, code)

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = self._connect()
        try:
            conn.request("GET", self.prefix + path, headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise UserError(f"the server at {self.url} dropped the connection on GET {path} ({exc or type(exc).__name__})") from None
        finally:
            conn.close()
        if resp.status == 401:
            raise UserError(str(self._fail(resp.status, body).message))
        return resp.status, body

    def get_json(self, path: str) -> dict | None:
        """GET a JSON route; None when the server does not have it (404 and other errors)."""
        status, body = self._get(path)
        if status != 200:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return None

    def speculative_stats(self) -> dict | None:
        """MTP acceptance per draft position and tokens per verify step from roofline's /metrics (None elsewhere)."""
        status, body = self._get("/metrics")
        if status != 200:
            return None
        rates, mean = {}, None
        for line in body.decode(errors="replace").splitlines():
            match = re.match(r'roofline_spec_decode_acceptance_rate\{.*position="(\d+)".*\} (\S+)$', line)
            if match:
                rates[int(match.group(1))] = float(match.group(2))
            elif line.startswith("roofline_spec_decode_mean_accepted_length{"):
                mean = float(line.rsplit(" ", 1)[1])
        if not rates:
            return None
        return {"acceptance_by_position": [rates[p] for p in sorted(rates)], "mean_accepted_length": mean}

    # -- discovery -------------------------------------------------------------------------
    def discover(self, model: str | None) -> str | None:
        """Read /v1/models, check `model` against it (or pick the first served model)."""
        listing = self.get_json("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        self.models_info = [m for m in data or [] if isinstance(m, dict)]
        ids = [str(m.get("id")) for m in self.models_info if m.get("id") is not None]
        if model is None:
            model = ids[0] if ids else None
        elif ids and model not in ids:
            served = ", ".join(f"`{i}`" for i in ids)
            raise UserError(f"the server at {self.url} does not serve the model `{model}`; it serves {served} (pass one to --model)")
        self.model = model
        return model

    def max_model_len(self) -> int | None:
        """The context limit: /v1/models `max_model_len` (roofline, vLLM, SGLang), else llama.cpp's /props n_ctx."""
        if self._limit is False:
            self._limit = self._read_limit()
        return self._limit

    def _read_limit(self) -> int | None:
        for info in self.models_info:
            if info.get("id") == self.model or self.model is None:
                for key in ("max_model_len", "context_length", "max_context_length"):
                    value = info.get(key)
                    if isinstance(value, int) and value > 0:
                        return value
        props = self.get_json("/props")
        if isinstance(props, dict):
            settings = props.get("default_generation_settings") or {}
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(n_ctx, int) and n_ctx > 0:
                return n_ctx
        return None

    # -- requests --------------------------------------------------------------------------
    def body(self, messages: list[dict], max_tokens: int, *, stream: bool, extra: dict | None = None) -> dict:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if self.model is not None:
            body["model"] = self.model
        if stream and self.stream_options:
            body["stream_options"] = {"include_usage": True}
        body.update(extra or {})
        return body

    def chat(self, messages: list[dict], max_tokens: int, *, stream: bool, extra: dict | None = None) -> Measurement:
        try:
            return self._chat(messages, max_tokens, stream=stream, extra=extra)
        except RequestFailed as exc:
            if not (stream and self.stream_options and exc.status in (400, 422) and "stream_options" in exc.message):
                raise
            self.stream_options = False  # an older server: count the streamed deltas instead of usage
            return self._chat(messages, max_tokens, stream=stream, extra=extra)

    def _chat(self, messages: list[dict], max_tokens: int, *, stream: bool, extra: dict | None = None) -> Measurement:
        payload = json.dumps(self.body(messages, max_tokens, stream=stream, extra=extra)).encode()
        t_connect = time.perf_counter()
        conn = self._connect()
        t0 = time.perf_counter()
        try:
            conn.request("POST", self.prefix + "/v1/chat/completions", body=payload, headers=self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise self._fail(resp.status, resp.read())
            if stream:
                return self._read_stream(resp, t0, t0 - t_connect)
            return self._read_whole(resp, t0, t0 - t_connect)
        except (socket.timeout, TimeoutError):
            raise UserError(f"the server at {self.url} sent nothing for {self.timeout:g} s (raise --timeout for long prompts)") from None
        except (OSError, http.client.HTTPException) as exc:
            raise UserError(f"the server at {self.url} dropped the connection ({exc or type(exc).__name__})") from None
        finally:
            conn.close()

    def _read_whole(self, resp, t0: float, connect_s: float) -> Measurement:
        raw = resp.read()
        wall = time.perf_counter() - t0
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            raise UserError(f"the server at {self.url} answered a chat request with something that is not JSON: {raw[:200]!r}") from None
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or [{}]
        tokens = usage.get("completion_tokens")
        return Measurement(
            stream=False, start_s=t0 - self.clock0, wall_s=wall, connect_s=connect_s,
            completion_tokens=tokens, token_source="usage" if tokens is not None else "none",
            prompt_tokens=usage.get("prompt_tokens"), finish_reason=choices[0].get("finish_reason"),
            e2e_tok_s=tokens / wall if tokens and wall > 0 else None, usage_completion_tokens=tokens,
        )

    def _read_stream(self, resp, t0: float, connect_s: float) -> Measurement:
        times: list[float] = []
        logprob_tokens: int | None = None
        usage: dict | None = None
        finish, t_finish, events, done = None, None, 0, False
        for t, data in sse_events(resp):
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                raise UserError(f"the server at {self.url} streamed an event that is not JSON: {data[:200]!r}") from None
            events += 1
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                err = obj["error"]
                message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                raise RequestFailed(0, f"the server reported an error during the stream: {message}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                if any(delta.get(k) for k in _TEXT_FIELDS) or delta.get("tool_calls") or choice.get("text"):
                    times.append(t - t0)
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                    logprob_tokens = (logprob_tokens or 0) + len(logprobs["content"])
                if choice.get("finish_reason"):
                    finish, t_finish = choice["finish_reason"], t - t0
        wall = time.perf_counter() - t0
        if events == 0:
            kind = resp.getheader("Content-Type", "?")
            raise UserError(f"the server at {self.url} streamed nothing: no events in a {kind} response to a streaming "
                            f"chat request{' (only [DONE])' if done else ''}; does it support stream=true?")
        usage_tokens = usage.get("completion_tokens") if usage else None
        if not times and not logprob_tokens and (usage_tokens is None or usage_tokens > 1):
            said = f"usage says {usage_tokens} tokens were generated, but" if usage_tokens else f"{events} events, but"
            raise UserError(f"the server at {self.url} streamed nothing: {said} no delta carried text")
        streamed = logprob_tokens if logprob_tokens is not None else len(times)
        if usage_tokens is not None:
            tokens, source = usage_tokens, "usage"
        else:
            tokens, source = streamed, "logprobs" if logprob_tokens is not None else "deltas"
        m = Measurement(
            stream=True, start_s=t0 - self.clock0, wall_s=wall, connect_s=connect_s,
            completion_tokens=tokens, token_source=source,
            prompt_tokens=usage.get("prompt_tokens") if usage else None, finish_reason=finish,
            streamed_deltas=len(times), streamed_logprobs=logprob_tokens, usage_completion_tokens=usage_tokens,
            delta_times_s=times,
        )
        m.count_check = count_check(streamed, usage_tokens, finish)
        if times:
            m.ttft_s = times[0]
            t_end = max(times[-1], t_finish or 0.0)
            if tokens >= 2 and t_end > times[0]:
                m.decode_tok_s = (tokens - 1) / (t_end - times[0])
        m.e2e_tok_s = tokens / wall if tokens and wall > 0 else None
        return m


def count_check(streamed: int, usage: int | None, finish: str | None) -> str:
    if usage is None:
        return "no usage"
    if streamed == usage:
        return "match"
    if finish == "stop" and streamed == usage - 1:
        return "match+end"  # the end token is counted in usage but has no text
    return "differs"


def sse_events(resp):
    """(arrival time, data) per server-sent event, as the lines arrive."""
    data: list[str] = []
    t_first = None
    while True:
        line = resp.readline()
        if not line:
            break
        now = time.perf_counter()
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                yield t_first, "\n".join(data)
                data, t_first = [], None
            continue
        if line.startswith(b":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            if t_first is None:
                t_first = now
            data.append(value.decode("utf-8", errors="replace"))
    if data:
        yield t_first, "\n".join(data)
