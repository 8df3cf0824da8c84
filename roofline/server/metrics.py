"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand:
a few counters, gauges and histograms need no client library."""

from __future__ import annotations

import bisect
import math
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    """Thread-safe: the engine thread and the HTTP event loop both record here."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.http_requests: dict[tuple[str, str], int] = {}  # (route, status) -> count
        self.finished: dict[str, int] = {}  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.gauges: dict[str, float] = {}  # set by the scheduler
        self.speculator = None  # the engine's MtpSpeculator when speculative decoding is on

    def http_request(self, route: str, status: int) -> None:
        with self.lock:
            key = (route, str(status))
            self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def request_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, seconds: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.e2e.observe(seconds)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        with self.lock:
            self.itl.observe(seconds)

    def set_gauges(self, **values: float) -> None:
        with self.lock:
            self.gauges.update(values)

    def render(self) -> str:
        label = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]):
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{{{label}{',' + labels if labels else ''}}} {_number(value)}")

        def histogram(name: str, help: str, h: Histogram):
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} histogram")
            total = 0
            for bound, count in zip((*h.buckets, math.inf), h.counts):
                total += count
                lines.append(f'{name}_bucket{{{label},le="{_number(bound)}"}} {total}')
            lines.append(f"{name}_sum{{{label}}} {_number(h.sum)}")
            lines.append(f"{name}_count{{{label}}} {h.count}")

        with self.lock:
            g = dict(self.gauges)
            metric("roofline_http_requests_total", "counter", "HTTP requests by route and status code.",
                   [(f'route="{_escape(r)}",status="{s}"', n) for (r, s), n in sorted(self.http_requests.items())])
            metric("roofline_requests_finished_total", "counter", "Generation requests finished, by engine finish reason (stop, length), abort (client gone) or error.",
                   [(f'finish_reason="{r}"', n) for r, n in sorted(self.finished.items())])
            metric("roofline_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
            metric("roofline_generation_tokens_total", "counter", "Generated tokens of finished requests.", [("", self.generation_tokens)])
            histogram("roofline_time_to_first_token_seconds", "Time from request arrival to its first generated token.", self.ttft)
            histogram("roofline_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", self.itl)
            histogram("roofline_e2e_request_latency_seconds", "Time from request arrival to its end.", self.e2e)
        gauges = [
            ("roofline_num_requests_running", "Sequences admitted to the engine (decoding or about to)."),
            ("roofline_num_requests_waiting", "Requests queued for admission."),
            ("roofline_kv_cache_bytes", "Bytes of full-attention KV cache held by running sequences, counted from the engine's tensors."),
            ("roofline_gdn_state_bytes", "Bytes of Gated DeltaNet conv and recurrent state held by running sequences, counted from the engine's tensors."),
            ("roofline_cache_reserved_bytes", "KV + state bytes reserved by admitted sequences (prompt + max_tokens each)."),
            ("roofline_cache_budget_bytes", "KV + state bytes admission may reserve in total."),
            ("roofline_cache_usage_ratio", "Reserved / budget."),
            ("roofline_max_num_seqs", "Concurrent sequence limit (--max-num-seqs)."),
        ]
        for name, help in gauges:
            if name in g:
                metric(name, "gauge", help, [("", g[name])])
        if self.speculator is not None:
            spec = self.speculator
            positions = [f'position="{j + 1}"' for j in range(len(spec.drafted))]
            metric("roofline_spec_decode_draft_tokens_total", "counter", "MTP draft tokens proposed, by draft position.",
                   list(zip(positions, spec.drafted)))
            metric("roofline_spec_decode_accepted_tokens_total", "counter", "MTP draft tokens accepted, by draft position.",
                   list(zip(positions, spec.accepted)))
            metric("roofline_spec_decode_acceptance_rate", "gauge", "Accepted / proposed drafts, by draft position.",
                   list(zip(positions, spec.acceptance_rates())))
            metric("roofline_spec_decode_mean_accepted_length", "gauge", "Tokens produced per verify step (accepted drafts + 1).",
                   [("", spec.mean_accepted_length())])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
