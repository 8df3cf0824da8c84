"""The server's parsers and bookkeeping on crafted text (random weights never write these):
reasoning split, Qwen3 XML tool calls, flag parsing, request validation, memory accounting, metrics."""

import argparse
import asyncio
import json
import random

import pytest

pytest.importorskip("fastapi", reason="the server's request handling needs fastapi (a main dependency; the GPU machine "
                    "runs the kernel tests without it)")

from roofline.commands.flags import parse_speculative_config  # noqa: E402
from roofline.commands.serve import parse_bytes  # noqa: E402
from roofline.errors import UserError  # noqa: E402
from roofline.server.app import ChatPrep, ChatText  # noqa: E402
from roofline.server.metrics import Metrics  # noqa: E402
from roofline.server.protocol import APIError, ChatCompletionRequest, parse_request  # noqa: E402
from roofline.server.reasoning import ReasoningSplitter, split_reasoning  # noqa: E402
from roofline.server.tools import ToolCallParser, collect, delta_to_openai, parse_tool_calls, typed_value  # noqa: E402
from server_fixtures import model_dir  # noqa: E402

WEATHER = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "scale": {"type": "number"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "where": {"type": "object"},
                "note": {"type": ["string", "null"]},
                "code": {"type": "string"},
                "level": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
        },
    },
}, {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

CALL = (
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nSan José, CA\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=scale>\n1.5\n</parameter>\n"
    "<parameter=metric>\nfalse\n</parameter>\n"
    "<parameter=hours>\n[6, 12]\n</parameter>\n"
    "<parameter=where>\n{\"lat\": 37.3, \"tags\": [\"a\"]}\n</parameter>\n"
    "<parameter=note>\nnull\n</parameter>\n"
    "<parameter=code>\n007\n</parameter>\n"
    "<parameter=level>\n2\n</parameter>\n"
    "<parameter=extra>\nline one\nline two\n</parameter>\n"
    "</function>\n</tool_call>"
)
CALL_ARGS = {"city": "San José, CA", "days": 3, "scale": 1.5, "metric": False, "hours": [6, 12],
             "where": {"lat": 37.3, "tags": ["a"]}, "note": None, "code": "007", "level": 2, "extra": "line one\nline two"}


def chunks(text: str, seed: int):
    """`text` cut at random places (1-6 characters), as tokens arrive."""
    rng = random.Random(seed)
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        yield text[i : i + n]
        i += n


def stream_split(text: str, starts_in_reasoning: bool, seed: int):
    splitter = ReasoningSplitter(starts_in_reasoning)
    parts = [p for c in chunks(text, seed) for p in splitter.feed(c)] + splitter.flush()
    reasoning = "".join(c for k, c in parts if k == "reasoning")
    return reasoning or None, "".join(c for k, c in parts if k == "content")


# -- reasoning -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, starts, want", [
    ("I should greet.\n</think>\n\nHello there!", True, ("I should greet.", "Hello there!")),
    ("<think>\nPlan.\n</think>\n\nAnswer.", False, ("Plan.", "Answer.")),
    ("  <think>Plan.</think>Answer.", False, ("Plan.", "Answer.")),
    ("Just an answer.\n", False, (None, "Just an answer.\n")),
    ("\n\nStill thinking when cut off", True, ("Still thinking when cut off", "")),
    ("", True, (None, "")),
    ("a < b </thin and on", True, ("a < b </thin and on", "")),
    ("Think.\n\n</think>\n\n", True, ("Think.", "")),
    # the agent-stalling case: a tool call inside an unclosed <think> ends reasoning
    ("I need the weather.\n\n<tool_call>\n<function=now>\n</function>\n</tool_call>", True,
     ("I need the weather.", "<tool_call>\n<function=now>\n</function>\n</tool_call>")),
    ("Answer with <think> inside", False, (None, "Answer with <think> inside")),
])
def test_reasoning_split_streaming_equals_whole(text, starts, want):
    assert split_reasoning(text, starts) == want
    for seed in range(5):
        assert stream_split(text, starts, seed) == want
    # and one character at a time
    splitter = ReasoningSplitter(starts)
    parts = [p for ch in text for p in splitter.feed(ch)] + splitter.flush()
    assert ("".join(c for k, c in parts if k == "reasoning") or None, "".join(c for k, c in parts if k == "content")) == want


def test_reasoning_never_emits_a_partial_tag():
    splitter = ReasoningSplitter(True)
    out = []
    for ch in "abc</think>def":
        out += splitter.feed(ch)
    assert all("<" not in chunk for _, chunk in out)
    assert [k for k, _ in out] == ["reasoning"] * 3 + ["content"] * 3


# -- tool calls ------------------------------------------------------------------------------

def test_xml_tool_call_typed_by_schema():
    content, calls = parse_tool_calls("Let me check.\n\n" + CALL, WEATHER)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == CALL_ARGS
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("seed", range(6))
def test_tool_call_stream_deltas_add_up_to_the_whole(seed):
    text = "Checking two cities.\n\n" + CALL + "\n" + CALL.replace("San José, CA", "Oslo") + "\n<tool_call>\n<function=now>\n</function>\n</tool_call>\n"
    whole_content, whole_calls = parse_tool_calls(text, WEATHER)
    parser = ToolCallParser(WEATHER)
    items = [item for c in chunks(text, seed) for item in parser.feed(c)] + parser.flush()
    content, calls = collect(items)
    assert content == whole_content == "Checking two cities."
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert [c.name for c in calls] == ["get_weather", "get_weather", "now"]
    assert json.loads(calls[1].arguments)["city"] == "Oslo" and calls[2].arguments == "{}"
    # OpenAI delta shape: the first delta of a call carries id, type and name; later ones only arguments
    deltas = [delta_to_openai(item) for kind, item in items if kind == "tool"]
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1, 2]
    assert all(d["type"] == "function" and d["function"]["name"] for d in firsts)
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas if "id" not in d)
    # each parameter is its own fragment: arguments stream as the call is written
    assert sum(1 for d in deltas if d["index"] == 0) >= len(CALL_ARGS)


def test_tool_calls_text_edge_cases():
    assert parse_tool_calls("no tools here  \n", WEATHER) == ("no tools here  \n", [])
    assert parse_tool_calls("a <tool_call> b", WEATHER) == ("a <tool_call> b", [])  # not a call
    assert parse_tool_calls("x <tool_call>\n<func", WEATHER) == ("x <tool_call>\n<func", [])  # cut before the name
    # cut inside a parameter: the call is closed with what was complete
    content, calls = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<parameter=city>\nPar", WEATHER)
    assert content == "" and json.loads(calls[0].arguments) == {"days": 4}
    # hermes JSON body (older Qwen3 templates)
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', WEATHER)
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    # a value that does not fit its schema stays text
    assert typed_value("three", {"type": "integer"}) == "three"
    assert typed_value("{'a': 1}", {"type": "object"}) == {"a": 1}
    assert typed_value("7", None) == "7"


def test_forced_tool_call_prefix():
    """tool_choice named: the server writes the call's opening into the prompt; the parser starts from it."""
    content, calls = parse_tool_calls("<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>", WEATHER,
                                      prefix="<tool_call>\n<function=get_weather>\n")
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Lima"}
    content, calls = parse_tool_calls("now>\n</function>\n</tool_call>", WEATHER, prefix="<tool_call>\n<function=")
    assert calls[0].name == "now" and calls[0].arguments == "{}"


def test_chat_pipeline_tool_call_inside_unclosed_think():
    prep = ChatPrep([1], None, starts_in_reasoning=True, reasoning=True, tools=WEATHER, tool_prefix="")
    text = "The user wants weather. I'll call the tool.\n" + CALL
    for seed in range(4):
        pipeline = ChatText(prep)
        items = [item for c in chunks(text, seed) for item in pipeline.feed(c)] + pipeline.feed("", final=True)
        reasoning = "".join(i for k, i in items if k == "reasoning")
        content, calls = collect([(k, i) for k, i in items if k != "reasoning"])
        assert reasoning == "The user wants weather. I'll call the tool."
        assert content == "" and len(calls) == 1 and json.loads(calls[0].arguments) == CALL_ARGS
        assert pipeline.made_tool_call


# -- flags -----------------------------------------------------------------------------------

def test_speculative_config_curly_quotes_error_shows_the_fix():
    def parse(value):
        return parse_speculative_config(argparse.Namespace(mtp=None, speculative_config=value))

    with pytest.raises(UserError) as exc:
        parse("{\u201cmethod\u201d:\u201cmtp\u201d,\u201cnum_speculative_tokens\u201d:2}")
    message = str(exc.value)
    assert "typographic quotes" in message
    assert "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'" in message
    assert parse('{"method":"mtp","num_speculative_tokens":2}').num_speculative_tokens == 2
    assert parse('{"method":"qwen3_next_mtp"}').num_speculative_tokens == 1
    for bad, words in [('{"method":"mtp",', "not valid JSON"), ('{"method":"eagle3"}', "not supported"),
                       ('{"method":"mtp","num_speculative_tokens":0}', "1 to 4"), ("[1]", "JSON object")]:
        with pytest.raises(UserError, match=words):
            parse(bad)


def test_parse_bytes():
    assert parse_bytes("1000") == 1000
    assert parse_bytes("2KiB") == 2048 and parse_bytes("2k") == 2000 and parse_bytes("1.5GiB") == 3 * 2**29
    with pytest.raises(UserError):
        parse_bytes("lots")


# -- request validation ----------------------------------------------------------------------

@pytest.mark.parametrize("body, param, code", [
    (b'{"messages": [{"role": "user", "content": "hi"}', None, "invalid_json"),
    (b"[1, 2]", None, "invalid_type"),
    (b"", None, "invalid_json"),
    (b'{"model": "m"}', "messages", "missing_required_parameter"),
    (b'{"messages": []}', "messages", "invalid_value"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role", "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "0.7"}', "temperature", "invalid_type"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens", "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}', "top_logprobs", "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": 3}', "stop", "invalid_type"),
])
def test_request_validation_errors(body, param, code):
    with pytest.raises(APIError) as exc:
        parse_request(ChatCompletionRequest, body)
    error = exc.value.body()["error"]
    assert exc.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code and error["message"]


def test_unknown_fields_are_ignored():
    req = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x", "id": 7}], "some_ui_field": 1}')
    assert req.messages[0].content == "x"


# -- memory accounting and scheduling ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from roofline.engine.engine import Engine

    return Engine.from_pretrained(str(model_dir(tmp_path_factory)), device="cpu", dtype="float32", max_model_len=256)


def test_cache_memory_formula_matches_engine_tensors(engine):
    from roofline.server.scheduler import CacheMemory, cache_bytes

    memory = CacheMemory.for_model(engine.model.config, engine.model.dtype)
    params = engine.default_params(temperature=0.0, max_tokens=9, ignore_eos=True)
    seq = engine.add(list(range(5, 25)), params)
    while seq.finish_reason is None:
        engine.step()
    kv, state = cache_bytes(seq)
    tokens = seq.cache.num_tokens  # prompt + all outputs but the last (not fed back yet)
    assert tokens == 20 + 9 - 1
    assert kv + state == memory.sequence_bytes(tokens)
    assert kv == memory.kv_bytes_per_token * tokens and state == memory.state_bytes_per_sequence
    engine.cancel(seq)
    assert seq.cache.nbytes == 0


def test_scheduler_admission_fifo_and_cancel(engine):
    """max_num_seqs and the memory budget bound admission; the rest queue FIFO or are refused."""
    from roofline.server.scheduler import QueueFull, Scheduler

    async def scenario():
        metrics = Metrics("t")
        probe = Scheduler(engine, max_num_seqs=2, max_queued=1, budget_bytes=1, metrics=metrics)
        one = probe.reservation(10, 20)
        scheduler = Scheduler(engine, max_num_seqs=2, max_queued=1, budget_bytes=10 * one, metrics=metrics)
        scheduler.start(asyncio.get_running_loop())
        try:
            params = lambda n: engine.default_params(temperature=0.0, max_tokens=n, ignore_eos=True)
            a = scheduler.submit(list(range(3, 13)), params(20))
            b = scheduler.submit(list(range(4, 14)), params(20))
            c = scheduler.submit(list(range(5, 15)), params(3))  # third: max_num_seqs=2, so it queues
            assert c.state == "waiting" and a.state != "waiting" and b.state != "waiting"
            with pytest.raises(QueueFull, match="max-num-seqs 2"):
                scheduler.submit([1, 2, 3], params(1))
            first = await asyncio.wait_for(a.__anext__(), 30)
            assert first.token_id >= 0
            a.cancel()  # frees a slot: c is admitted
            got_c = [e async for e in c]
            assert len(got_c) == 3 and got_c[-1].finish_reason == "length"
            got_b = [e async for e in b]
            assert len(got_b) == 20
            rest = [e async for e in a]  # tokens made before the cancel, then a quiet end
            assert all(e.finish_reason is None for e in rest) and a.finish_reason == "abort"
            await asyncio.sleep(0.05)
            assert scheduler.counts() == (0, 0) and scheduler.reserved == 0
            assert not engine.sequences
        finally:
            scheduler.stop()
        # memory-bound: room for exactly one such sequence
        tight = Scheduler(engine, max_num_seqs=8, max_queued=0, budget_bytes=one, metrics=metrics)
        tight.start(asyncio.get_running_loop())
        try:
            x = tight.submit(list(range(3, 13)), engine.default_params(temperature=0.0, max_tokens=20))
            with pytest.raises(QueueFull, match="KV/state memory"):
                tight.submit(list(range(3, 13)), engine.default_params(temperature=0.0, max_tokens=20))
            [e async for e in x]
        finally:
            tight.stop()

    asyncio.run(scenario())


def test_metrics_text_format():
    m = Metrics('tiny "model"')
    m.http_request("/v1/chat/completions", 200)
    m.first_token(0.03)
    m.inter_token(0.004)
    m.request_finished("stop", 11, 5, 0.2)
    m.set_gauges(roofline_num_requests_running=2, roofline_kv_cache_bytes=1024)
    text = m.render()
    assert 'roofline_http_requests_total{model_name="tiny \\"model\\"",route="/v1/chat/completions",status="200"} 1' in text
    assert 'roofline_time_to_first_token_seconds_bucket{model_name="tiny \\"model\\"",le="0.05"} 1' in text
    assert 'roofline_time_to_first_token_seconds_bucket{model_name="tiny \\"model\\"",le="0.025"} 0' in text
    assert 'le="+Inf"} 1' in text and "roofline_prompt_tokens_total" in text
    assert "# TYPE roofline_inter_token_latency_seconds histogram" in text
    assert 'roofline_kv_cache_bytes{model_name="tiny \\"model\\""} 1024' in text
    for line in text.splitlines():  # every sample line: name{labels} value
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))
            assert "{" in name and name.endswith("}")


def test_scheduler_survives_an_engine_fault(engine, monkeypatch):
    """A failing step fails the requests in flight (500 for them) and the next request is served."""
    from roofline.server.scheduler import Scheduler

    real_step, calls = engine.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real_step()

    async def scenario():
        scheduler = Scheduler(engine, max_num_seqs=4, max_queued=4, budget_bytes=1 << 30, metrics=Metrics("t"))
        scheduler.start(asyncio.get_running_loop())
        try:
            params = engine.default_params(temperature=0.0, max_tokens=5, ignore_eos=True)
            doomed = scheduler.submit(list(range(3, 9)), params)
            with pytest.raises(RuntimeError, match="simulated device fault"):
                [e async for e in doomed]
            assert not engine.sequences and scheduler.reserved == 0
            fine = [e async for e in scheduler.submit(list(range(3, 9)), params)]
            assert len(fine) == 5 and fine[-1].finish_reason == "length"
            assert scheduler.thread.is_alive()
        finally:
            scheduler.stop()

    monkeypatch.setattr(engine, "step", flaky_step)
    asyncio.run(scenario())
