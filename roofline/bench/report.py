"""What `roofline bench` shows and writes: progress bar, tables, JSON, PNG plots, comparisons."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

from .. import __version__
from .environment import git_commit
from ..errors import UserError

FORMAT = "roofline-bench/1"


# -- progress -----------------------------------------------------------------------------

class Progress:
    """A one-line bar on stderr when it is a terminal; one plain line per step otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self._width = 0

    def advance(self, n: int) -> None:
        self.done = max(0, min(self.total, self.done + n))

    def step(self, label: str) -> None:
        """Announce the step about to run (the bar shows what is finished)."""
        if not self.enabled:
            self.advance(1)
            return
        if self.tty:
            filled = int(24 * self.done / self.total)
            line = f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} {time.monotonic() - self.t0:5.0f}s  {label}"
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        else:
            self.stream.write(f"[{self.done + 1}/{self.total}] {label}\n")
        self.stream.flush()
        self.advance(1)

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


# -- environment and files ----------------------------------------------------------------

def environment(client, label: str | None) -> dict:
    return {
        "url": client.url,
        "model": client.model,
        "label": label,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "roofline_version": __version__,
        "roofline_commit": git_commit(),
        "client_host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "server_models": client.models_info,
    }


def new_result(client, label: str | None, settings) -> dict:
    return {"format": FORMAT, "environment": environment(client, label), "settings": settings.to_json(),
            "complete": False, "error": None, "notes": [], "suites": {}}


def write_json(result: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(result) + "\n")
    tmp.replace(path)


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def dumps(result: dict) -> str:
    """Indented JSON with lists of numbers (delta arrival times) kept on one line."""
    text = json.dumps(result, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def load_result(path: str) -> dict:
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a JSON file written by `roofline bench serve` ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UserError(f"{path}: not a result of `roofline bench serve` (no \"format\": \"{FORMAT}\")")
    return obj


# -- tables -------------------------------------------------------------------------------

def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    right = set(range(1, len(headers))) if right is None else right
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(headers))]

    def line(row):
        parts = []
        for i, c in enumerate(row):
            parts.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def num(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def ms(v) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}" if v >= 0.1 else f"{v * 1000:,.1f}"


def spread(s: dict) -> str:
    if not s or s.get("n", 0) == 0:
        return "-"
    return f"{s['min']:.1f}-{s['max']:.1f}"


def _med(summary: dict | None, key: str):
    return (summary or {}).get(key, {}).get("median")


def _counts(summary: dict | None) -> str:
    counts = (summary or {}).get("token_counts") or {}
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "-"


def reference_table(suite: dict, runs: int) -> str:
    rows, ref_all, dec_all, skipped = [], [], [], []
    for p in suite.get("prompts", []):
        if not p["runs"] and p.get("status") == "skipped":
            skipped.append(f"{p['name']:<9}  skipped: {p.get('reason')}")
            continue
        s = p.get("summary") or {}
        ref, dec = _med(s, "ref_tok_s"), _med(s, "decode_tok_s")
        if ref is not None:
            ref_all.append(ref)
        if dec is not None:
            dec_all.append(dec)
        rows.append([p["name"], p["max_tokens"], num(_med(s, "completion_tokens"), 0), num(ref), ms(_med(s, "ttft_s")),
                     num(dec), num((s.get("decode_tok_s") or {}).get("mean")), spread(s.get("decode_tok_s")),
                     f"{len(p['runs'])}", _counts(s)])
    if len(ref_all) > 1:
        rows.append(["mean", "", "", num(sum(ref_all) / len(ref_all)), "", num(sum(dec_all) / len(dec_all)) if dec_all else "-",
                     "", "", "", ""])
    head = ["prompt", "max tok", "tokens", "tok/s (ref)", "TTFT ms", "decode tok/s", "mean", "min-max", "runs", "streamed vs usage"]
    return (f"reference suite: medians over runs, temperature 0\n"
            f"  tok/s (ref) = completion tokens / wall time of a non-streaming request (the reference system's figure)\n"
            f"  decode tok/s = tokens after the first / time after the first, streaming\n"
            f"  streamed vs usage = tokens counted in the stream (logprob entries with --logprobs, else text deltas,\n"
            f"    which servers may merge or leave out) against usage.completion_tokens; tok/s uses usage\n\n"
            + table(head, rows, right=set(range(1, 9))) + "".join("\n" + line for line in skipped))


def context_table(suite: dict) -> str:
    rows = []
    for lv in suite.get("levels", []):
        if lv["status"] == "skipped" and not lv["runs"]:
            rows.append([lv["label"], "skipped: " + (lv["reason"] or "")])
            continue
        s = lv.get("summary") or {}
        rows.append([lv["label"], num(_med(s, "prompt_tokens"), 0), ms(_med(s, "ttft_s")), num(_med(s, "prefill_tok_s"), 0),
                     num(_med(s, "decode_tok_s")), spread(s.get("decode_tok_s")), len(lv["runs"]),
                     lv["reason"] or ""])
    head = ["context", "prompt tok", "TTFT ms", "prefill tok/s", "decode tok/s", "min-max", "runs", "note"]
    limit = suite.get("server_limit")
    title = (f"context suite: {suite.get('max_tokens')} new tokens after a prompt filled to each size "
             f"(server limit: {limit if limit else 'not reported'}); medians over runs")
    # Skipped rows span the columns: print them after the table's own rows.
    normal = [r for r in rows if len(r) > 2]
    skipped = [r for r in rows if len(r) == 2]
    text = title + "\n\n" + table(head, normal, right={1, 2, 3, 4, 5, 6})
    for r in skipped:
        text += f"\n{r[0]:<7}  {r[1]}"
    return text


def concurrency_table(suite: dict) -> str:
    rows, base = [], None
    for lv in suite.get("levels", []):
        s = lv.get("summary") or {}
        agg = _med(s, "aggregate_tok_s")
        if base is None and agg:
            base = agg / lv["streams"] if lv["streams"] else agg
        rows.append([lv["streams"], num(_med(s, "per_stream_decode_tok_s")), spread(s.get("per_stream_decode_tok_s")),
                     ms(_med(s, "ttft_s")), num(agg), num(_med(s, "aggregate_decode_tok_s")),
                     f"{agg / base:.2f}x" if agg and base else "-", len(lv["runs"]), _counts(s)])
    head = ["streams", "per-stream decode tok/s", "min-max", "TTFT ms", "aggregate tok/s", "sum of decode tok/s",
            "vs 1 stream", "runs", "streamed vs usage"]
    return (f"concurrency suite: {suite.get('max_tokens')} max tokens per stream, all streams started together; medians over runs\n"
            f"  aggregate tok/s = all streams' tokens / (last end - first start)\n\n" + table(head, rows, right=set(range(0, 8))))


def render(result: dict) -> str:
    env = result["environment"]
    parts = [f"roofline bench serve: {env.get('model') or '(server default model)'} at {env['url']}"
             + (f"  [{env['label']}]" if env.get("label") else "")]
    suites = result.get("suites", {})
    runs = result.get("settings", {}).get("runs")
    if "reference" in suites:
        parts.append(reference_table(suites["reference"], runs))
    if "context" in suites:
        parts.append(context_table(suites["context"]))
    if "concurrency" in suites:
        parts.append(concurrency_table(suites["concurrency"]))
    for note in result.get("notes", []):
        parts.append("note: " + note)
    return "\n\n".join(parts) + "\n"


# -- compare ------------------------------------------------------------------------------

def _ratio(a, b) -> str:
    if a in (None, 0) or b is None:
        return "-"
    return f"{b / a:.2f}x"


def _name(result: dict, path: str) -> str:
    env = result["environment"]
    return env.get("label") or Path(path).stem


def compare(a: dict, b: dict, path_a: str, path_b: str) -> str:
    na, nb = _name(a, path_a), _name(b, path_b)
    if na == nb:
        na, nb = f"A:{na}", f"B:{nb}"
    lines = [f"A = {na}: {a['environment'].get('model')} at {a['environment']['url']} ({a['environment']['time']}){'' if a.get('complete') else '  [incomplete]'}",
             f"B = {nb}: {b['environment'].get('model')} at {b['environment']['url']} ({b['environment']['time']}){'' if b.get('complete') else '  [incomplete]'}",
             "B/A: above 1 means B is faster for tok/s, slower for TTFT"]
    diff = [f"{k} {a.get('settings', {}).get(k)!r} vs {b.get('settings', {}).get(k)!r}"
            for k in ("max_tokens_scale", "context_max_tokens", "thinking", "ignore_eos", "runs")
            if a.get("settings", {}).get(k) != b.get("settings", {}).get(k)]
    if diff:
        lines.append("note: the runs' settings differ: " + "; ".join(diff))
    sa, sb = a.get("suites", {}), b.get("suites", {})
    shown = False

    def block(title, keys_a, keys_b, metrics, key_name):
        rows = []
        common = [k for k in keys_a if k in keys_b]
        for key in common:
            ea, eb = keys_a[key], keys_b[key]
            row = [key]
            for metric, fmt in metrics:
                va, vb = _med(ea, metric), _med(eb, metric)
                row += [fmt(va), fmt(vb), _ratio(va, vb)]
            rows.append(row)
        if title.startswith("reference") and len(common) > 1:
            row = ["mean"]
            for metric, fmt in metrics:
                va = [_med(keys_a[k], metric) for k in common]
                vb = [_med(keys_b[k], metric) for k in common]
                if metric == "ttft_s" or None in va or None in vb:
                    row += ["", "", ""]
                else:
                    ma, mb = sum(va) / len(va), sum(vb) / len(vb)
                    row += [fmt(ma), fmt(mb), _ratio(ma, mb)]
            rows.append(row)
        only = [k for k in list(keys_a) + list(keys_b) if (k in keys_a) != (k in keys_b)]
        head = [key_name]
        for metric, _ in metrics:
            label = METRIC_LABELS[metric]
            head += [f"{label} A", f"{label} B", "B/A"]
        text = title + "\n\n" + table(head, rows)
        if only:
            text += "\nin one file only: " + ", ".join(str(k) for k in dict.fromkeys(only))
        return text

    if "reference" in sa and "reference" in sb:
        ka = {p["name"]: p.get("summary") for p in sa["reference"].get("prompts", []) if p["runs"]}
        kb = {p["name"]: p.get("summary") for p in sb["reference"].get("prompts", []) if p["runs"]}
        lines.append("")
        lines.append(block("reference suite (medians)", ka, kb, [("ref_tok_s", num), ("decode_tok_s", num), ("ttft_s", ms)], "prompt"))
        shown = True
    if "context" in sa and "context" in sb:
        ka = {lv["label"]: lv.get("summary") for lv in sa["context"].get("levels", []) if lv["runs"]}
        kb = {lv["label"]: lv.get("summary") for lv in sb["context"].get("levels", []) if lv["runs"]}
        lines.append("")
        lines.append(block("context suite (medians)", ka, kb, [("decode_tok_s", num), ("ttft_s", ms)], "context"))
        shown = True
    if "concurrency" in sa and "concurrency" in sb:
        ka = {lv["streams"]: lv.get("summary") for lv in sa["concurrency"].get("levels", []) if lv["runs"]}
        kb = {lv["streams"]: lv.get("summary") for lv in sb["concurrency"].get("levels", []) if lv["runs"]}
        lines.append("")
        lines.append(block("concurrency suite (medians)", ka, kb, [("aggregate_tok_s", num), ("per_stream_decode_tok_s", num)], "streams"))
        shown = True
    if not shown:
        raise UserError(f"{path_a} ({', '.join(sa) or 'no suite'}) and {path_b} ({', '.join(sb) or 'no suite'}) have no suite in common")
    return "\n".join(lines) + "\n"


METRIC_LABELS = {"ref_tok_s": "tok/s(ref)", "decode_tok_s": "decode", "ttft_s": "TTFT ms",
                 "aggregate_tok_s": "aggregate", "per_stream_decode_tok_s": "per-stream"}


# -- plots --------------------------------------------------------------------------------

def plot(result: dict, path: str | os.PathLike) -> None:
    """One PNG: tok/s per prompt, against context, against concurrency (the suites that ran)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'roofline[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = result.get("suites", {})
    panels = [name for name in ("reference", "context", "concurrency") if name in suites]
    if not panels:
        raise UserError("--plot: nothing was measured, so there is nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    env = result["environment"]
    title = " - ".join(x for x in (env.get("label"), env.get("model"), env.get("url")) if x)
    fig.suptitle(f"roofline bench serve: {title}" + ("" if result.get("complete") else " (incomplete)"), fontsize=11)
    for ax, name in zip(axes[0], panels):
        {"reference": _plot_reference, "context": _plot_context, "concurrency": _plot_concurrency}[name](ax, suites[name])
    fig.tight_layout()
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _errs(summaries, key):
    med = [_med(s, key) or 0 for s in summaries]
    lo = [max(0.0, m - ((s or {}).get(key, {}).get("min") or m)) for m, s in zip(med, summaries)]
    hi = [max(0.0, ((s or {}).get(key, {}).get("max") or m) - m) for m, s in zip(med, summaries)]
    return med, [lo, hi]


def _plot_reference(ax, suite):
    prompts = suite.get("prompts", [])
    names = [p["name"] for p in prompts]
    summaries = [p.get("summary") for p in prompts]
    xs = list(range(len(names)))
    for offset, key, label in ((-0.2, "ref_tok_s", "tok/s (ref: non-streaming, tokens / wall)"),
                               (0.2, "decode_tok_s", "decode tok/s (streaming, after first token)")):
        med, err = _errs(summaries, key)
        bars = ax.bar([x + offset for x in xs], med, width=0.4, yerr=err, capsize=3, label=label)
        ax.bar_label(bars, labels=[f"{m:.1f}" if m else "" for m in med], fontsize=7, label_type="center")
    ax.set_xticks(xs, names)
    ax.set_ylabel("tok/s (median, whiskers min-max)")
    ax.set_title("reference prompts")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=1, frameon=False)


def _plot_context(ax, suite):
    levels = [lv for lv in suite.get("levels", []) if lv["runs"]]
    xs = [_med(lv["summary"], "prompt_tokens") or lv["target_tokens"] for lv in levels]
    med, err = _errs([lv["summary"] for lv in levels], "decode_tok_s")
    ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="decode tok/s", color="C0")
    ax.set_xlabel("prompt tokens (context filled)")
    ax.set_ylabel("decode tok/s", color="C0")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(xs, [(_med(lv["summary"], "ttft_s") or 0) for lv in levels], marker="s", linestyle="--", color="C1", label="TTFT s")
    twin.set_ylabel("time to first token, s", color="C1")
    twin.set_ylim(bottom=0)
    skipped = [lv["label"] for lv in suite.get("levels", []) if not lv["runs"]]
    ax.set_title("decode speed vs context" + (f" (skipped: {', '.join(skipped)})" if skipped else ""), fontsize=10)


def _plot_concurrency(ax, suite):
    levels = [lv for lv in suite.get("levels", []) if lv["runs"]]
    xs = [lv["streams"] for lv in levels]
    med, err = _errs([lv["summary"] for lv in levels], "aggregate_tok_s")
    ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="aggregate tok/s")
    med, err = _errs([lv["summary"] for lv in levels], "per_stream_decode_tok_s")
    ax.errorbar(xs, med, yerr=err, marker="s", capsize=3, label="per-stream decode tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("simultaneous streams")
    ax.set_ylabel("tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title("concurrency")
    ax.legend(fontsize=8)
