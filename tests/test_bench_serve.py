"""`roofline bench serve` / `bench compare` against the real `roofline serve` process (the bundled
model, else a random tiny checkpoint), plus a few small stand-in servers for the error cases
(one that streams nothing, one that breaks half-way)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roofline.cli import main
from server_fixtures import ServerProcess, model_args

MAX_MODEL_LEN = 1024
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([*model_args(tmp_path_factory), "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-num-seqs", "8", "--mtp", "2"])
    yield srv
    srv.stop()


def bench(*args) -> int:
    return main(["bench", *args])


def load(path) -> dict:
    return json.loads(path.read_text())


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def check_stream(m: dict, max_tokens: int) -> None:
    """One streamed measurement: positive, ordered and self-consistent numbers."""
    assert m["stream"] is True
    assert positive(m["wall_s"]) and positive(m["ttft_s"]) and m["ttft_s"] <= m["wall_s"]
    assert m["token_source"] == "usage" and 1 <= m["completion_tokens"] <= max_tokens
    assert m["usage_completion_tokens"] == m["completion_tokens"]
    assert positive(m["prompt_tokens"])
    # logprobs were asked for: one entry per streamed token, equal to usage (which may also count the end token)
    assert m["count_check"] in ("match", "match+end"), m
    assert m["streamed_logprobs"] == m["completion_tokens"] - (m["count_check"] == "match+end")
    times = m["delta_times_s"]
    assert len(times) == m["streamed_deltas"] <= m["completion_tokens"]
    assert times == sorted(times) and times[0] == pytest.approx(m["ttft_s"])
    assert times[-1] <= m["wall_s"]
    if m["completion_tokens"] >= 2:
        assert positive(m["decode_tok_s"])
        # (tokens - 1) / decode speed is the time after the first token: inside the request
        assert (m["completion_tokens"] - 1) / m["decode_tok_s"] <= m["wall_s"] - m["ttft_s"] + 1e-6
    assert m["e2e_tok_s"] == pytest.approx(m["completion_tokens"] / m["wall_s"], rel=1e-3)


def check_stats(s: dict, n: int) -> None:
    assert s["n"] == n
    assert 0 < s["min"] <= s["median"] <= s["max"] and s["min"] <= s["mean"] <= s["max"]


def check_environment(result: dict, url: str, label: str | None) -> None:
    env = result["environment"]
    assert result["format"] == "roofline-bench/1"
    assert env["url"] == url and env["model"] == "tiny" and env["label"] == label
    assert env["time"].endswith("+00:00") and env["roofline_version"]
    assert [m["id"] for m in env["server_models"]] == ["tiny"]


# -- the three suites against the real server ---------------------------------------------

@pytest.fixture(scope="module")
def reference_run(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = bench("serve", "--url", server.url + "/v1", "--runs", "2", "--warmup", "1", "--max-tokens-scale", "0.05",
               "--logprobs", "--label", "first", "--out", str(out / "r.json"), "--plot", str(out / "r.png"), "--quiet")
    return rc, out


def test_reference_suite_json_table_and_plot(server, reference_run, capsys):
    rc, out = reference_run
    assert rc == 0
    result = load(out / "r.json")
    check_environment(result, server.url, "first")
    assert result["complete"] is True and result["error"] is None
    assert result["settings"]["runs"] == 2 and result["settings"]["max_tokens_scale"] == 0.05
    prompts = result["suites"]["reference"]["prompts"]
    assert [p["name"] for p in prompts] == ["qa", "code", "json", "math", "long_code"]
    # max tokens 256/512/1024/64/2048 scaled by 0.05 (at least 2)
    assert [p["max_tokens"] for p in prompts] == [13, 26, 51, 3, 102]
    for p in prompts:
        assert p["status"] == "ok" and len(p["runs"]) == 2
        for run in p["runs"]:
            whole, streamed = run["nonstream"], run["stream"]
            assert whole["stream"] is False and positive(whole["wall_s"]) and whole["ttft_s"] is None
            assert 1 <= whole["completion_tokens"] <= p["max_tokens"]
            assert whole["e2e_tok_s"] == pytest.approx(whole["completion_tokens"] / whole["wall_s"], rel=1e-3)
            check_stream(streamed, p["max_tokens"])
            # temperature 0: the same answer streamed and not
            assert streamed["completion_tokens"] == whole["completion_tokens"]
            assert streamed["prompt_tokens"] == whole["prompt_tokens"]
        s = p["summary"]
        check_stats(s["ref_tok_s"], 2)
        check_stats(s["ttft_s"], 2)
        if all(r["stream"]["completion_tokens"] >= 2 for r in p["runs"]):
            check_stats(s["decode_tok_s"], 2)
        assert sum(s["token_counts"].values()) == 2
    assert (out / "r.png").read_bytes()[:8] == PNG_MAGIC
    spec = result["speculative"]  # the server runs MTP-2: its acceptance is read from /metrics
    assert len(spec["acceptance_by_position"]) == 2 and all(0 <= r <= 1 for r in spec["acceptance_by_position"])
    assert 1 <= spec["mean_accepted_length"] <= 3


def test_reference_table_is_printed(server, tmp_path, capsys):
    rc = bench("serve", "--url", server.url, "--model", "tiny", "--runs", "1", "--warmup", "0", "--max-tokens-scale", "0.02")
    captured = capsys.readouterr()
    assert rc == 0
    for word in ("tok/s (ref)", "TTFT ms", "decode tok/s", "qa", "code", "json", "math", "long_code", "mean"):
        assert word in captured.out
    # not a terminal: the progress goes to stderr one line per step (5 prompts x 2 requests)
    assert "[10/10] reference long_code: run 1 (streaming)" in captured.err


def test_context_suite_fills_and_skips(server, tmp_path):
    out = tmp_path / "c.json"
    rc = bench("serve", "--url", server.url, "--suite", "context", "--contexts", "0,300,1K,4K", "--context-max-tokens", "8",
               "--runs", "1", "--ignore-eos", "--logprobs", "--out", str(out), "--plot", str(tmp_path / "c.png"), "--quiet")
    assert rc == 0
    result = load(out)
    suite = result["suites"]["context"]
    assert suite["server_limit"] == MAX_MODEL_LEN and suite["max_tokens"] == 8
    assert suite["calibration"]["tokens_per_char"] > 0 and not suite["calibration"]["estimated"]
    levels = {lv["label"]: lv for lv in suite["levels"]}
    assert list(levels) == ["0", "300", "1K", "4K"]
    assert levels["4K"]["status"] == "skipped" and "limit of 1024" in levels["4K"]["reason"] and not levels["4K"]["runs"]
    tokens = []
    for label in ("0", "300", "1K"):
        lv = levels[label]
        assert lv["status"] == "ok" and len(lv["runs"]) == 1
        m = lv["runs"][0]
        check_stream(m, 8)
        assert m["completion_tokens"] == 8 and m["finish_reason"] == "length"  # --ignore-eos
        tokens.append(m["prompt_tokens"])
    assert tokens[0] < 200
    assert 0.85 * 300 <= tokens[1] <= 1.15 * 300  # filled to about the size asked
    # 1K does not fit with 8 new tokens: capped under the limit, and said so
    assert "filled to" in levels["1K"]["reason"]
    assert 0.85 * levels["1K"]["filled_tokens"] <= tokens[2] <= MAX_MODEL_LEN - 8
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


def test_concurrency_suite(server, tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = bench("serve", "--url", server.url, "--suite", "concurrency", "--concurrency", "1,2,4", "--runs", "1",
               "--max-tokens-scale", "0.05", "--ignore-eos", "--logprobs", "--out", str(out), "--quiet")
    assert rc == 0
    suite = load(out)["suites"]["concurrency"]
    assert [lv["streams"] for lv in suite["levels"]] == [1, 2, 4]
    for lv in suite["levels"]:
        (run,) = lv["runs"]
        streams = run["streams"]
        assert len(streams) == lv["streams"]
        for m in streams:
            check_stream(m, 13)
            assert m["completion_tokens"] == 13
        assert run["completion_tokens"] == 13 * lv["streams"]
        assert run["aggregate_tok_s"] == pytest.approx(run["completion_tokens"] / run["wall_s"], rel=1e-3)
        assert run["aggregate_decode_tok_s"] == pytest.approx(sum(m["decode_tok_s"] for m in streams))
        # simultaneous: every stream started before any finished
        assert max(m["start_s"] for m in streams) < min(m["start_s"] + m["wall_s"] for m in streams)
        check_stats(lv["summary"]["per_stream_decode_tok_s"], lv["streams"])
    assert "aggregate tok/s" in capsys.readouterr().out


def test_compare(reference_run, tmp_path, capsys):
    _, out = reference_run
    other = load(out / "r.json")
    other["environment"]["label"] = "second"
    for p in other["suites"]["reference"]["prompts"]:  # a server twice as fast
        for key in ("ref_tok_s", "decode_tok_s"):
            for stat in ("median", "mean", "min", "max"):
                p["summary"][key][stat] *= 2
    (tmp_path / "b.json").write_text(json.dumps(other))
    capsys.readouterr()
    assert bench("compare", str(out / "r.json"), str(tmp_path / "b.json")) == 0
    text = capsys.readouterr().out
    assert "A = first" in text and "B = second" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in ("qa", "long_code", "mean")}
    assert set(rows) == {"qa", "long_code", "mean"}
    assert rows["qa"].count("2.00x") == 2 and rows["mean"].count("2.00x") == 2

    (tmp_path / "x.json").write_text("{}")
    assert bench("compare", str(out / "r.json"), str(tmp_path / "x.json")) == 2
    assert "not a result of `roofline bench serve`" in capsys.readouterr().err


# -- errors -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_one_line_and_json_is_written(tmp_path, capsys):
    out = tmp_path / "u.json"
    url = f"http://127.0.0.1:{free_port()}"
    assert bench("serve", "--url", url, "--out", str(out), "--quiet") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"roofline bench: error: cannot reach the server at {url}")
    result = load(out)
    assert result["complete"] is False and "cannot reach" in result["error"] and result["suites"] == {}


def test_wrong_model_name(server, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert bench("serve", "--url", server.url, "--model", "gpt-9", "--out", str(out), "--quiet") == 2
    err = capsys.readouterr().err
    assert "does not serve the model `gpt-9`; it serves `tiny`" in err
    assert load(out)["complete"] is False


def test_bad_flags(capsys):
    assert bench("serve", "--contexts", "0,8Q", "--quiet") == 2
    assert "--contexts: cannot read '8Q'" in capsys.readouterr().err
    assert bench("serve", "--suite", "speed", "--quiet") == 2
    assert "unknown suite 'speed'" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench("serve", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png"), "--quiet") == 2
    assert "--plot needs matplotlib: pip install 'roofline[bench]'" in capsys.readouterr().err


class FakeServer:
    """A minimal stand-in OpenAI server: the first `good` streaming requests answer properly (one chunk per
    token, the last with finish_reason, as vLLM does), every later one streams no event."""

    def __init__(self, good: int):
        self.good, self.count = good, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, status, body: bytes, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.send(200, json.dumps({"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]}).encode())
                else:
                    self.send(404, b'{"error": {"message": "not found"}}')

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = min(req["max_tokens"], 5)
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                if not req.get("stream"):
                    self.send(200, json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * n},
                                                            "finish_reason": "length"}], "usage": usage}).encode())
                    return
                outer.count += 1
                if outer.count <= outer.good:
                    events = [{"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length" if i == n - 1 else None}]}
                              for i in range(n)]
                    events.append({"choices": [], "usage": usage})
                    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                else:
                    body = "data: [DONE]\n\n"
                self.send(200, body.encode(), "text/event-stream")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(good: int) -> FakeServer:
        servers.append(FakeServer(good))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_server_that_streams_nothing(fake, tmp_path, capsys):
    srv = fake(good=0)
    out = tmp_path / "n.json"
    assert bench("serve", "--url", srv.url, "--warmup", "0", "--out", str(out), "--quiet") == 2
    err = capsys.readouterr().err
    assert "roofline bench: error: the server at " + srv.url + " streamed nothing" in err
    result = load(out)
    assert result["complete"] is False and "streamed nothing" in result["error"]


def test_partial_results_are_written(fake, tmp_path, capsys):
    # qa: warmup stream, run 1 (non-streaming + streaming), run 2: its stream (the 3rd) is empty
    srv = fake(good=2)
    out = tmp_path / "p.json"
    rc = bench("serve", "--url", srv.url, "--runs", "3", "--warmup", "1", "--out", str(out), "--plot", str(tmp_path / "p.png"), "--quiet")
    assert rc == 2
    assert "streamed nothing" in capsys.readouterr().err
    result = load(out)
    assert result["complete"] is False and result["environment"]["model"] == "fake"
    (qa,) = result["suites"]["reference"]["prompts"]
    assert len(qa["runs"]) == 1  # the finished run is kept
    m = qa["runs"][0]["stream"]
    assert m["completion_tokens"] == 5 and m["count_check"] == "match" and positive(m["decode_tok_s"])
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
