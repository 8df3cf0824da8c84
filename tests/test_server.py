"""`roofline serve` as users run it: the real server process on a loopback port, driven by the
official `openai` client (and raw HTTP where the exact bytes matter). No mocks on this path."""

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from server_fixtures import ServerProcess, model_args, model_dir, wait_until

openai = pytest.importorskip("openai", reason="the server tests drive the server with the official openai client (pip install openai)")

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
USER = [{"role": "user", "content": "Tell me a joke about atoms."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([*model_args(tmp_path_factory), "--served-model-name", "tiny", "roofline-tiny",
                         "--api-key", API_KEY, "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN),
                         "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


def reasoning_of(obj):
    return getattr(obj, "reasoning_content", None)


def collect_stream(stream):
    """(content, reasoning, finish_reason, usage, tool_calls, chunks) from a chat stream."""
    content, reasoning, finish, usage, calls, n = [], [], None, None, {}, 0
    for chunk in stream:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(reasoning_of(delta) or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(content), "".join(reasoning) or None, finish, usage, [calls[i] for i in sorted(calls)], n


# -- basics ----------------------------------------------------------------------------------

def test_startup_health_models_and_speculative_notice(server, client):
    assert server.get("/health")[0] == 200
    names = [m.id for m in client.models.list().data]
    assert names == ["tiny", "roofline-tiny"]
    assert "MTP speculative decoding: 2 draft token(s) per step" in server.log
    assert "ready at http://127.0.0.1:" in server.log


def test_chat_completion_and_usage(client):
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == "tiny" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 12


@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_equals_non_streaming_at_temperature_0(client, thinking):
    kwargs = dict(model="tiny", messages=USER, max_tokens=24, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    content, reasoning, finish, usage, calls, n = collect_stream(stream)
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert reasoning == reasoning_of(message)
    assert finish == whole.choices[0].finish_reason
    assert usage.model_dump() == whole.usage.model_dump()
    assert n >= 3  # role chunk, text chunks, finish chunk, usage chunk: really streamed


def test_reasoning_goes_to_reasoning_content(client):
    on = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0)
    off = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for out in (on, off):
        assert "<think>" not in (out.choices[0].message.content or "") and "</think>" not in (out.choices[0].message.content or "")
    # Thinking on: the template opens <think>, so the answer starts as reasoning.
    assert reasoning_of(on.choices[0].message) or on.choices[0].finish_reason == "stop"
    # Thinking off: the template closes an empty think block; text is the answer.
    assert reasoning_of(off.choices[0].message) is None
    assert off.choices[0].message.content or off.choices[0].finish_reason == "stop"


def test_sampling_fields_seed_stop_and_logprobs(client):
    kwargs = dict(model="tiny", messages=USER, max_tokens=16, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    a = client.chat.completions.create(**kwargs, temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5)
    b = client.chat.completions.create(**kwargs, temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5)
    assert a.choices[0].message.content == b.choices[0].message.content

    greedy = client.chat.completions.create(**kwargs, temperature=0, logprobs=True, top_logprobs=3)
    text = greedy.choices[0].message.content
    entries = greedy.choices[0].logprobs.content
    assert len(entries) == greedy.usage.completion_tokens - (greedy.choices[0].finish_reason == "stop")
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy takes the top token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    if len(text) >= 8:  # a stop string cuts the answer just before it
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = client.chat.completions.create(**kwargs, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.index(stop)]
    # max_completion_tokens wins over max_tokens
    short = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=20, max_completion_tokens=3)
    assert short.usage.completion_tokens <= 3


# -- tools -----------------------------------------------------------------------------------

def test_tools_reach_the_template_and_a_tool_round_trip_is_accepted(client):
    base = dict(model="tiny", messages=USER, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**base)
    with_tools = client.chat.completions.create(**base, tools=[WEATHER_TOOL])
    none_choice = client.chat.completions.create(**base, tools=[WEATHER_TOOL], tool_choice="none")
    # the tool schema is rendered into the prompt (tool_choice none leaves it out)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert none_choice.usage.prompt_tokens == plain.usage.prompt_tokens

    # A named tool_choice starts the call in the prompt: the answer is that tool call.
    forced = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=8,
                                            temperature=0, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = forced.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)

    # the same, streamed: deltas add up to the same call
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=8,
                                            temperature=0, tools=[WEATHER_TOOL], stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, _, finish, _, calls, _ = collect_stream(stream)
    assert finish == choice.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    # next turn: the assistant's call and the tool's answer are accepted and rendered
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})},
    ]
    after = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=6, temperature=0)
    short = client.chat.completions.create(model="tiny", messages=messages[:1], tools=[WEATHER_TOOL], max_tokens=6, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result are in the prompt

    # tool_choice required also yields a 200 (the call is started in the prompt)
    required = client.chat.completions.create(model="tiny", messages=messages[:1], tools=[WEATHER_TOOL], tool_choice="required", max_tokens=6, temperature=0)
    assert required.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- completions -----------------------------------------------------------------------------

def test_completions_route(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs)
    assert whole.usage.completion_tokens <= 10
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        parts += [c.text for c in chunk.choices]
    assert "".join(parts) == choice.text and usage.completion_tokens == whole.usage.completion_tokens
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + choice.text
    ids = client.completions.create(model="tiny", prompt=[5, 17, 99, 3], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4
    default = client.completions.create(model="tiny", prompt="Hello", temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


# -- errors ----------------------------------------------------------------------------------

def check_error(status_body, status, param=None, code=None, words=()):
    got_status, body = status_body
    assert got_status == status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    for word in words:
        assert word in error["message"], error
    return error


def test_error_cases_are_4xx_json_and_the_server_keeps_serving(server, client):
    chat = "/v1/chat/completions"
    ok = {"model": "tiny", "messages": USER, "max_tokens": 2}
    check_error(server.post(chat, '{"model": "tiny", "messages": [', auth()), 400, code="invalid_json", words=("malformed JSON",))
    check_error(server.post(chat, "[]", auth()), 400, code="invalid_type")
    check_error(server.post(chat, {**ok, "temperature": "hot"}, auth()), 400, "temperature", "invalid_type")
    check_error(server.post(chat, {**ok, "messages": "hi"}, auth()), 400, "messages")
    check_error(server.post(chat, {"model": "tiny"}, auth()), 400, "messages", "missing_required_parameter")
    check_error(server.post(chat, {**ok, "messages": [{"role": "robot", "content": "x"}]}, auth()), 400, "messages.0.role")
    check_error(server.post(chat, {**ok, "model": "gpt-9"}, auth()), 404, "model", "model_not_found", words=("gpt-9", "tiny"))
    check_error(server.post(chat, {**ok, "temperature": -1}, auth()), 400, "temperature", words=(">= 0",))
    check_error(server.post(chat, {**ok, "top_p": 1.5}, auth()), 400, "top_p")
    check_error(server.post(chat, {**ok, "max_tokens": 0}, auth()), 400, "max_tokens")
    check_error(server.post(chat, {**ok, "presence_penalty": 3}, auth()), 400, "presence_penalty")
    check_error(server.post(chat, {**ok, "logprobs": True, "top_logprobs": 99}, auth()), 400, "top_logprobs")
    check_error(server.post(chat, {**ok, "n": 2}, auth()), 400, "n")
    check_error(server.post(chat, {**ok, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, auth()),
                400, "tool_choice", words=("nope",))
    check_error(server.post(chat, {**ok, "messages": [*USER, {"role": "system", "content": "late"}]}, auth()), 400, "messages")
    # a prompt longer than the context, with the numbers
    limit = client.models.list().data[0].max_model_len  # MAX_MODEL_LEN unless the model's own is smaller
    assert limit <= MAX_MODEL_LEN
    long = [{"role": "user", "content": "hello world " * limit}]
    error = check_error(server.post(chat, {**ok, "messages": long}, auth()), 400, "messages", "context_length_exceeded", words=(str(limit),))
    assert any(ch.isdigit() for ch in error["message"].split("has", 1)[1])
    check_error(server.post(chat, {**ok, "max_tokens": limit}, auth()), 400, "max_tokens", "context_length_exceeded", words=(str(limit),))
    # API key: missing or wrong
    check_error(server.post(chat, ok), 401, code="invalid_api_key", words=("Authorization",))
    check_error(server.post(chat, ok, {"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    status, text = server.get("/v1/models")
    check_error((status, json.loads(text)), 401)
    # unknown route and completions errors
    status, text = server.get("/v1/nothing-here", auth())
    check_error((status, json.loads(text)), 404)
    check_error(server.post("/v1/completions", {"model": "tiny", "prompt": [1, 10**9]}, auth()), 400, "prompt")
    check_error(server.post("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, auth()), 400, "prompt")
    # the official client maps them to its exception types
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=USER)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    # and it keeps serving
    assert server.get("/health")[0] == 200
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices[0].finish_reason
    assert "Traceback" not in server.log


# -- concurrency, cancellation, memory ------------------------------------------------------

def test_eight_concurrent_streams_two_abandoned(server, client):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    abandoned = {1, 5}
    kwargs = dict(model="tiny", temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    expected = {i: client.chat.completions.create(messages=[{"role": "user", "content": p}], max_tokens=24, **kwargs).choices[0].message.content
                for i, p in enumerate(prompts) if i not in abandoned}
    before = server.metrics()
    aborts_before = before.get('roofline_requests_finished_total{model_name="tiny",finish_reason="abort"}', 0)
    results, errors, peak = {}, [], {"running": 0}
    barrier = threading.Barrier(8)

    def run(i):
        try:
            barrier.wait(timeout=30)
            stream = client.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}], stream=True,
                                                    max_tokens=400 if i in abandoned else 24, **kwargs)
            if i in abandoned:
                for n, _ in enumerate(stream):
                    if n == 3:
                        break
                stream.close()  # the client goes away mid-stream
                results[i] = "abandoned"
            else:
                results[i] = collect_stream(stream)
        except Exception as exc:  # reported below
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        peak["running"] = max(peak["running"], server.metrics()["roofline_num_requests_running"])
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not errors, errors
    assert peak["running"] >= 4  # they really decoded together
    for i in range(8):
        if i in abandoned:
            assert results[i] == "abandoned"
        else:
            content, reasoning, finish, _, _, _ = results[i]
            assert finish == "length" and content == expected[i], (i, content, expected[i])
    # cancelled at once: memory back to its baseline, and the abandoned ones counted as aborted
    metrics = wait_until(lambda: (lambda m: m if m["roofline_num_requests_running"] == 0 and m["roofline_kv_cache_bytes"] == 0 else None)(server.metrics()), timeout=20)
    assert metrics, server.metrics()
    assert metrics["roofline_gdn_state_bytes"] == 0 and metrics["roofline_cache_reserved_bytes"] == 0
    assert metrics['roofline_requests_finished_total{model_name="tiny",finish_reason="abort"}'] >= aborts_before + 2
    assert server.get("/health")[0] == 200


def test_non_streaming_client_disconnect_cancels(server):
    """A client that gives up on a long non-streaming request frees its sequence."""
    before = server.metrics()
    aborts = before.get('roofline_requests_finished_total{model_name="tiny",finish_reason="abort"}', 0)
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=1.0)
    body = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 450, "ignore_eos": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **auth()})
    assert wait_until(lambda: server.metrics()["roofline_num_requests_running"] == 1, timeout=10)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_until(lambda: server.metrics()["roofline_num_requests_running"] == 0, timeout=10), server.metrics()
    m = server.metrics()
    assert m["roofline_kv_cache_bytes"] == 0
    assert m['roofline_requests_finished_total{model_name="tiny",finish_reason="abort"}'] == aborts + 1


def test_metrics_names(server):
    status, text = server.get("/metrics")
    assert status == 200
    for name in ("roofline_http_requests_total", "roofline_prompt_tokens_total", "roofline_generation_tokens_total",
                 "roofline_time_to_first_token_seconds_bucket", "roofline_inter_token_latency_seconds_bucket",
                 "roofline_num_requests_running", "roofline_num_requests_waiting", "roofline_kv_cache_bytes",
                 "roofline_gdn_state_bytes", "roofline_cache_budget_bytes",
                 # the server runs with MTP-2 speculation
                 'roofline_spec_decode_acceptance_rate{model_name="tiny",position="2"}',
                 "roofline_spec_decode_mean_accepted_length"):
        assert name in text, name


# -- admission bounded by memory: queue, then 429 -------------------------------------------

def test_memory_bounded_admission_queues_then_refuses(tmp_path_factory):
    import torch

    from roofline.config import load_config
    from roofline.server.scheduler import CacheMemory

    config = load_config(model_dir(tmp_path_factory))
    limit = min(512, config.max_position_embeddings)  # long enough that the two long streams outlast the test's steps
    memory = CacheMemory.for_model(config, torch.float32)
    one = memory.sequence_bytes(limit)
    budget = 2 * one + memory.sequence_bytes(1) // 2  # two whole-context sequences; no room for even a short third
    srv = ServerProcess([*model_args(tmp_path_factory), "--max-model-len", str(limit), "--kv-cache-memory-bytes", str(budget),
                         "--max-queued-requests", "1", "--served-model-name", "m"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert srv.metrics()["roofline_cache_budget_bytes"] == budget
        long = dict(model="m", messages=USER, stream=True, extra_body={"ignore_eos": True})  # no max_tokens: reserves the whole context
        a = client.chat.completions.create(**long)
        b = client.chat.completions.create(**long)
        next(iter(a)), next(iter(b))  # both admitted and streaming
        m = srv.metrics()
        assert m["roofline_num_requests_running"] == 2 and m["roofline_cache_reserved_bytes"] == 2 * one
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(out=client.chat.completions.create(model="m", messages=USER, max_tokens=3)))
        waiter.start()
        assert wait_until(lambda: srv.metrics()["roofline_num_requests_waiting"] == 1, timeout=10)
        with pytest.raises(openai.RateLimitError) as refused:  # queue full: 429 at once
            client.chat.completions.create(model="m", messages=USER, max_tokens=3)
        assert refused.value.status_code == 429 and "retry later" in refused.value.message
        a.close()  # frees room: the queued request runs
        waiter.join(timeout=30)
        assert queued["out"].choices[0].finish_reason in ("stop", "length")
        b.close()
        assert wait_until(lambda: srv.metrics()["roofline_cache_reserved_bytes"] == 0, timeout=10)
        assert srv.get("/health")[0] == 200
    finally:
        srv.stop()


def test_chunked_prefill_answers_as_whole_prompt_prefill(client, tmp_path_factory):
    """A server prefilling 4 prompt tokens a step answers a temperature-0 request (and two at once) as the main
    server, which prefills each prompt in one step."""
    kwargs = dict(messages=USER, max_tokens=10, temperature=0)
    want = client.chat.completions.create(model="tiny", **kwargs).choices[0].message
    srv = ServerProcess([*model_args(tmp_path_factory), "--served-model-name", "m", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-batched-tokens", "4"])
    try:
        chunked = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(chunked.chat.completions.create(model="m", **kwargs)))
                   for _ in range(2)]  # two prompts share each step's 4 tokens
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert len(answers) == 2 and answers[0].usage.prompt_tokens > 8
        for out in answers:
            got = out.choices[0].message
            assert (got.content, reasoning_of(got)) == (want.content, reasoning_of(want))
    finally:
        srv.stop()


def test_cli_errors_are_one_line(tmp_path_factory):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "roofline.cli", "serve", *args], capture_output=True, text=True, timeout=120)

    curly = serve("--speculative-config", "{\u201cmethod\u201d:\u201cmtp\u201d,\u201cnum_speculative_tokens\u201d:1}")
    assert curly.returncode == 2 and "Traceback" not in curly.stderr
    assert "'{\"method\":\"mtp\",\"num_speculative_tokens\":1}'" in curly.stderr
    model = model_args(tmp_path_factory)
    too_small = serve(*model, "--port", "0", "--kv-cache-memory-bytes", "100KiB", "--device", "cpu")
    assert too_small.returncode == 2 and "--max-model-len" in too_small.stderr and "Traceback" not in too_small.stderr
