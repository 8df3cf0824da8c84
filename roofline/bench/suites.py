"""The three suites of `roofline bench serve`: reference, context, concurrency.

Each suite writes into the result dict as it goes (one entry per prompt / level, runs
appended one by one), so a failure half-way leaves every finished measurement in place
for the JSON file.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import uuid
from dataclasses import dataclass, field

from ..errors import UserError
from .client import Client, Measurement, RequestFailed

SUITES = ("reference", "context", "concurrency")


@dataclass(frozen=True)
class Prompt:
    name: str
    max_tokens: int
    text: str


# The reference system's five chat prompts: short (~30-50 tokens) requests whose answers
# run to the max_tokens of each (Q&A 256, code 512, JSON 1024, math 64, long code 2048).
REFERENCE_PROMPTS = (
    Prompt("qa", 256, "What are the main differences between TCP and UDP, and when would you choose one over "
                      "the other? Answer in a few short paragraphs."),
    Prompt("code", 512, "Write a Python function that merges overlapping intervals in a list of [start, end] pairs "
                        "and returns them sorted by start. Include type hints, a docstring and three example calls."),
    Prompt("json", 1024, "Generate a JSON array of 8 fictional employees. Each object has: id (integer), name, email, "
                         "department (Engineering, Sales, Marketing or Finance), hire_date (YYYY-MM-DD), salary "
                         "(integer), skills (array of 3 strings) and manager_id (integer or null). Output only the JSON."),
    Prompt("math", 64, "A train leaves at 09:40 and travels 312 km at 78 km/h. At what time does it arrive? "
                       "Give the answer briefly."),
    Prompt("long_code", 2048, "Write a complete Python module for a command-line todo list manager: add, list, "
                              "complete, delete and search tasks stored in a JSON file. Use argparse, dataclasses and "
                              "type hints, handle errors, add docstrings, and finish with pytest unit tests."),
)

# The context suite asks this after the filler, so decode speed is compared on one question.
CONTEXT_QUESTION = ("Explain in detail how a CPU cache hierarchy works: the levels, cache lines, associativity, "
                    "write policies and what a programmer can do to use it well.")
CONCURRENCY_PROMPT = REFERENCE_PROMPTS[0]

DEFAULT_CONTEXTS = (0, 8192, 32768, 131072)
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
# Room left under the server's limit when a level is capped to it (chat template tokens vary).
CONTEXT_MARGIN = 32


@dataclass
class Settings:
    runs: int = 3
    warmup: int = 1
    max_tokens_scale: float = 1.0
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    context_max_tokens: int | None = None  # None: 256, times max_tokens_scale; a number: as given
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    thinking: bool | None = None   # None: the server's default
    ignore_eos: bool = False
    logprobs: bool = False         # ask for logprobs in streams: an exact streamed token count

    def max_tokens(self, n: int) -> int:
        # At least 2 tokens, so decode speed after the first token is defined.
        return max(2, round(n * self.max_tokens_scale))

    def extra(self) -> dict:
        extra: dict = {}
        if self.thinking is not None:
            extra["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        if self.ignore_eos:
            extra["ignore_eos"] = True
        if self.logprobs:
            extra["logprobs"] = True
        return extra

    def to_json(self) -> dict:
        return {"runs": self.runs, "warmup": self.warmup, "max_tokens_scale": self.max_tokens_scale,
                "contexts": list(self.contexts), "context_max_tokens": self.context_max_tokens,
                "concurrency": list(self.concurrency), "temperature": 0,
                "thinking": "server default" if self.thinking is None else self.thinking, "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmM]?)$")


def parse_int_list(value: str, flag: str, *, sizes: bool = False, minimum: int = 0) -> tuple[int, ...]:
    """`0,8K,32K,128K` -> (0, 8192, 32768, 131072) (K = 1024); `1,2,4,8` -> (1, 2, 4, 8)."""
    out = []
    for part in value.replace(" ", "").split(","):
        match = _SIZE.match(part) if part else None
        if not match or (match.group(2) and not sizes):
            example = "0,8K,32K,128K" if sizes else "1,2,4,8"
            raise UserError(f"{flag}: cannot read {part!r} in {value!r} (example: {flag} {example})")
        number = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
        if number != int(number) or number < minimum:
            raise UserError(f"{flag}: {part!r} must be a whole number of at least {minimum}")
        out.append(int(number))
    return tuple(dict.fromkeys(out))


def size_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def stats(values) -> dict:
    """n, median, mean, min, max, stdev of the values that are not None."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"n": 0, "median": None, "mean": None, "min": None, "max": None, "stdev": None}
    return {"n": len(vals), "median": statistics.median(vals), "mean": statistics.fmean(vals), "min": min(vals),
            "max": max(vals), "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0}


def count_summary(measurements) -> dict:
    checks = [m.get("count_check") for m in measurements if m.get("stream")]
    return {k: checks.count(k) for k in ("match", "match+end", "differs", "no usage") if checks.count(k)}


# -- filler text for the context suite ----------------------------------------------------

_WORDS = {
    "adj": "quiet large early modern rural local annual careful central simple formal narrow stable recent "
           "public ancient northern sudden gentle broad".split(),
    "noun": "river committee harvest engine library market village budget council garden bridge report "
            "museum station forest harbour school factory orchard tunnel".split(),
    "verb": "reviewed replaced described measured repaired visited planned opened studied recorded "
            "expanded moved supported delayed improved".split(),
    "prep": "near behind across beyond beside under along".split(),
    "time": "In the spring, Last year, By the autumn, After the storm, Before the meeting, During the winter,".split(","),
}


def filler_text(chars: int, seed: int = 0) -> str:
    """Plain varied prose (seeded, so its tokens per character are stable) of about `chars` characters."""
    rng = random.Random(seed)
    w = _WORDS
    out, size = [], 0
    while size < chars:
        lead = rng.choice(w["time"]).strip()
        sentence = (f"{lead} the {rng.choice(w['adj'])} {rng.choice(w['noun'])} {rng.choice(w['verb'])} the "
                    f"{rng.choice(w['noun'])} {rng.choice(w['prep'])} the {rng.choice(w['adj'])} {rng.choice(w['noun'])}, "
                    f"and {rng.randint(2, 990)} people {rng.choice(w['verb'])} it. ")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:chars]


def context_messages(filler_chars: int, nonce: str) -> list[dict]:
    # A unique first line keeps prefix caches (vLLM, SGLang, llama.cpp) from skipping the prefill.
    if filler_chars <= 0:
        return [{"role": "user", "content": f"[{nonce}] {CONTEXT_QUESTION}"}]
    notes = filler_text(filler_chars)
    return [{"role": "user", "content": f"[{nonce}] Background notes (you may ignore them):\n\n{notes}\n\nQuestion: {CONTEXT_QUESTION}"}]


def nonce() -> str:
    return uuid.uuid4().hex[:12]


# -- the runner ---------------------------------------------------------------------------

@dataclass
class Bench:
    client: Client
    settings: Settings
    result: dict
    progress: object  # report.Progress
    notes: list[str] = field(default_factory=list)

    def chat(self, messages, max_tokens, *, stream: bool, label: str, extra: dict | None = None) -> Measurement:
        self.progress.step(label)
        try:
            return self.client.chat(messages, max_tokens, stream=stream, extra={**self.settings.extra(), **(extra or {})})
        except RequestFailed as exc:
            raise self.request_error(exc) from None

    def request_error(self, exc: RequestFailed) -> UserError:
        if exc.status == 404 and "model" in exc.message.lower():
            return UserError(f"the server at {self.client.url} does not know the model `{self.client.model}`: {exc.message}")
        if exc.status == 404:
            return UserError(f"the server at {self.client.url} has no /v1/chat/completions route (HTTP 404); "
                             f"is --url an OpenAI-compatible server? ({exc.message})")
        return UserError(f"the server at {self.client.url} refused a request: {exc}")

    # -- reference -------------------------------------------------------------------------
    def steps_reference(self) -> int:
        return len(REFERENCE_PROMPTS) * (self.settings.warmup + 2 * self.settings.runs)

    def run_reference(self) -> None:
        s = self.settings
        suite = self.result["suites"].setdefault("reference", {"prompts": []})
        for prompt in REFERENCE_PROMPTS:
            max_tokens = s.max_tokens(prompt.max_tokens)
            messages = [{"role": "user", "content": prompt.text}]
            entry = {"name": prompt.name, "max_tokens": max_tokens, "prompt": prompt.text, "status": "ok", "reason": None,
                     "runs": [], "summary": None}
            suite["prompts"].append(entry)
            try:
                for i in range(s.warmup):
                    self.stream_or_fail(messages, max_tokens, True, f"reference {prompt.name}: warmup {i + 1}")
                for i in range(s.runs):
                    whole = self.stream_or_fail(messages, max_tokens, False, f"reference {prompt.name}: run {i + 1} (non-streaming)")
                    streamed = self.stream_or_fail(messages, max_tokens, True, f"reference {prompt.name}: run {i + 1} (streaming)")
                    entry["runs"].append({"nonstream": whole.to_json(), "stream": streamed.to_json()})
                    entry["summary"] = summarise_reference(entry["runs"])
            except RequestFailed as exc:
                if not exc.context_exceeded:
                    raise self.request_error(exc) from None
                # A server whose context is shorter than prompt + max_tokens: say so, go on.
                entry["status"] = "skipped"
                entry["reason"] = f"the server refused max_tokens {max_tokens}: {exc.message}"
                self.progress.advance(s.warmup + 2 * s.runs)

    def stream_or_fail(self, messages, max_tokens, stream: bool, label: str) -> Measurement:
        """One request; request errors stay RequestFailed for the caller to judge."""
        self.progress.step(label)
        return self.client.chat(messages, max_tokens, stream=stream, extra=self.settings.extra())

    # -- context ---------------------------------------------------------------------------
    def steps_context(self) -> int:
        return min(self.settings.warmup, 1) + 2 + len(self.settings.contexts) * (1 + self.settings.runs)

    def run_context(self) -> None:
        s = self.settings
        client = self.client
        max_tokens = s.context_max_tokens or s.max_tokens(256)
        limit = client.max_model_len()
        suite = self.result["suites"].setdefault("context", {"max_tokens": max_tokens, "server_limit": limit, "levels": [], "calibration": None})
        levels = [(target, self._level(target, max_tokens, limit)) for target in s.contexts]
        suite["levels"] = [entry for _, entry in levels]
        if s.warmup:
            self.chat(context_messages(0, nonce()), max_tokens, stream=True, label="context: warmup")
        todo = [(t, e) for t, e in levels if e["status"] == "pending" and t > 0]
        calibration = self._calibrate(limit) if todo else None
        if not todo:
            self.progress.advance(2)
        suite["calibration"] = calibration
        for target, entry in levels:
            if entry["status"] == "skipped":
                self.progress.advance(1 + s.runs)
                continue
            try:
                self._run_level(target, entry, max_tokens, calibration)
            except RequestFailed as exc:
                if not exc.context_exceeded:
                    raise self.request_error(exc) from None
                entry["status"] = "skipped"
                entry["reason"] = f"the server refused it: {exc.message}"
            entry["summary"] = summarise_streams(entry["runs"])

    def _level(self, target: int, max_tokens: int, limit: int | None) -> dict:
        entry = {"target_tokens": target, "label": size_label(target), "status": "pending", "reason": None,
                 "filled_tokens": target, "prompt_tokens": None, "filler_chars": 0, "runs": [], "summary": None}
        if limit is not None and target > limit:
            entry["status"] = "skipped"
            entry["reason"] = f"exceeds the server's context limit of {limit} tokens"
        elif limit is not None and target + max_tokens + CONTEXT_MARGIN > limit:
            entry["filled_tokens"] = limit - max_tokens - CONTEXT_MARGIN
            entry["reason"] = f"filled to {entry['filled_tokens']} tokens, leaving room for {max_tokens} new ones under the limit of {limit}"
            if entry["filled_tokens"] <= 0:
                entry["status"] = "skipped"
                entry["reason"] = f"the server's context limit of {limit} tokens leaves no room for {max_tokens} new ones"
        return entry

    def _prompt_tokens(self, chars: int, label: str) -> int | None:
        """usage.prompt_tokens of the context prompt with `chars` characters of filler (a 1-token request).
        Request errors stay RequestFailed: the caller tells a too-long prompt from the rest."""
        self.progress.step(label)
        return self.client.chat(context_messages(chars, nonce()), 1, stream=False, extra=self.settings.extra()).prompt_tokens

    def _calibrate(self, limit: int | None) -> dict:
        """Tokens per character of the filler, from two 1-token requests (usage.prompt_tokens)."""
        sample = 4 * min(2048, (limit or 8192) // 2)
        try:
            base = self._prompt_tokens(0, "context: calibrating (no filler)")
            while True:
                try:
                    with_filler = self._prompt_tokens(sample, f"context: calibrating ({sample} characters of filler)")
                    break
                except RequestFailed as exc:
                    if not exc.context_exceeded or sample < 64:
                        raise
                    sample //= 4  # a tokenizer with few characters per token: a smaller sample
                    self.progress.advance(-1)
        except RequestFailed as exc:
            raise self.request_error(exc) from None
        if base is None or with_filler is None or with_filler <= base:
            self.notes.append("context: the server reports no prompt token counts; filler sized at an estimated 4 characters per token")
            return {"base_tokens": base or 0, "tokens_per_char": 0.25, "sample_chars": sample, "estimated": True}
        return {"base_tokens": base, "tokens_per_char": (with_filler - base) / sample, "sample_chars": sample, "estimated": False}

    def _run_level(self, target: int, entry: dict, max_tokens: int, cal: dict | None) -> None:
        s = self.settings
        label = f"context {entry['label']}"
        chars = 0
        if target > 0:
            fill = entry["filled_tokens"]
            chars = max(1, int((fill - cal["base_tokens"]) / cal["tokens_per_char"]))
            # One 1-token request at this size gives the exact prompt length (to correct the
            # estimate) and warms the server up on this shape.
            probe = self._prompt_tokens(chars, f"{label}: sizing")
            if probe and probe > cal["base_tokens"] and not cal["estimated"]:
                chars = max(1, int(chars * (fill - cal["base_tokens"]) / (probe - cal["base_tokens"])))
        else:
            self.progress.advance(1)
        entry["filler_chars"] = chars
        for i in range(s.runs):
            self.progress.step(f"{label}: run {i + 1}")
            try:
                m = self.client.chat(context_messages(chars, nonce()), max_tokens, stream=True, extra=s.extra())
            except RequestFailed as exc:
                if not (exc.context_exceeded and target > 0 and not entry["runs"]):
                    raise
                chars = int(chars * 0.97)  # the corrected estimate still overshot: 3% less, once
                entry["filler_chars"] = chars
                m = self.client.chat(context_messages(chars, nonce()), max_tokens, stream=True, extra=s.extra())
            entry["runs"].append(m.to_json())
            entry["prompt_tokens"] = m.prompt_tokens
            entry["status"] = "ok"
            entry["summary"] = summarise_streams(entry["runs"])

    # -- concurrency -----------------------------------------------------------------------
    def steps_concurrency(self) -> int:
        return min(self.settings.warmup, 1) + len(self.settings.concurrency) * self.settings.runs

    def run_concurrency(self) -> None:
        s = self.settings
        prompt = CONCURRENCY_PROMPT
        max_tokens = s.max_tokens(prompt.max_tokens)
        suite = self.result["suites"].setdefault("concurrency", {"prompt": prompt.text, "max_tokens": max_tokens, "levels": []})
        if s.warmup:
            self.chat([{"role": "user", "content": prompt.text}], max_tokens, stream=True, label="concurrency: warmup")
        for n in s.concurrency:
            entry = {"streams": n, "runs": [], "summary": None}
            suite["levels"].append(entry)
            for i in range(s.runs):
                self.progress.step(f"concurrency {n}: run {i + 1}")
                entry["runs"].append(self._concurrent_run(n, prompt, max_tokens))
                entry["summary"] = summarise_concurrency(entry["runs"])

    def _concurrent_run(self, n: int, prompt: Prompt, max_tokens: int) -> dict:
        barrier = threading.Barrier(n)
        results: list[Measurement | None] = [None] * n
        errors: list[BaseException] = []
        extra = self.settings.extra()

        def one(i: int) -> None:
            # Distinct first lines: n different prompts, as n users would send.
            messages = [{"role": "user", "content": f"[{nonce()}] {prompt.text}"}]
            try:
                barrier.wait(timeout=60)
                results[i] = self.client.chat(messages, max_tokens, stream=True, extra=extra)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real or errors:
            exc = (real or errors)[0]
            if isinstance(exc, RequestFailed):
                raise self.request_error(exc)
            raise exc
        done = [m for m in results if m is not None]
        t_start = min(m.start_s for m in done)
        t_end = max(m.start_s + m.wall_s for m in done)
        wall = t_end - t_start
        tokens = sum(m.completion_tokens or 0 for m in done)
        decode = [m.decode_tok_s for m in done]
        return {
            "wall_s": round(wall, 6), "completion_tokens": tokens,
            "aggregate_tok_s": tokens / wall if wall > 0 else None,
            "aggregate_decode_tok_s": sum(decode) if all(d is not None for d in decode) else None,
            "streams": [m.to_json() for m in done],
        }


# -- summaries ----------------------------------------------------------------------------

def summarise_reference(runs: list[dict]) -> dict:
    whole = [r["nonstream"] for r in runs]
    streamed = [r["stream"] for r in runs]
    return {
        "ref_tok_s": stats(m["e2e_tok_s"] for m in whole),
        "ttft_s": stats(m["ttft_s"] for m in streamed),
        "decode_tok_s": stats(m["decode_tok_s"] for m in streamed),
        "stream_e2e_tok_s": stats(m["e2e_tok_s"] for m in streamed),
        "completion_tokens": stats(m["completion_tokens"] for m in whole + streamed),
        "token_counts": count_summary(streamed),
    }


def summarise_streams(runs: list[dict]) -> dict:
    return {
        "ttft_s": stats(m["ttft_s"] for m in runs),
        "decode_tok_s": stats(m["decode_tok_s"] for m in runs),
        "prefill_tok_s": stats(m["prompt_tokens"] / m["ttft_s"] if m["prompt_tokens"] and m["ttft_s"] else None for m in runs),
        "prompt_tokens": stats(m["prompt_tokens"] for m in runs),
        "completion_tokens": stats(m["completion_tokens"] for m in runs),
        "token_counts": count_summary(runs),
    }


def summarise_concurrency(runs: list[dict]) -> dict:
    streams = [m for r in runs for m in r["streams"]]
    return {
        "aggregate_tok_s": stats(r["aggregate_tok_s"] for r in runs),
        "aggregate_decode_tok_s": stats(r["aggregate_decode_tok_s"] for r in runs),
        "per_stream_decode_tok_s": stats(m["decode_tok_s"] for m in streams),
        "per_stream_e2e_tok_s": stats(m["e2e_tok_s"] for m in streams),
        "ttft_s": stats(m["ttft_s"] for m in streams),
        "completion_tokens": stats(m["completion_tokens"] for m in streams),
        "token_counts": count_summary(streams),
    }
