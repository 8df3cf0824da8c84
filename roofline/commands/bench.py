"""`roofline bench ...`: benchmarks. Each subcommand is one `add_<name>(sub)` function below,
listed in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: measure a running server, compare results",
                              description="Benchmarks. `roofline bench serve` measures any OpenAI-compatible server "
                                          "(roofline, vLLM, llama.cpp, SGLang); `roofline bench compare` puts two runs side by side.")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    for add in SUBCOMMANDS:
        add(sub)


# -- bench serve --------------------------------------------------------------------------

def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="measure a running OpenAI-compatible server (tok/s, TTFT, context, concurrency)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Measure a running OpenAI-compatible server the way the reference system's benchmark "
                                   "does (five chat prompts, temperature 0, completion tokens / wall time) and what it "
                                   "hides: time to first token apart from decode speed, speed as the context fills, "
                                   "and under concurrency.",
                       epilog="suites:\n"
                              "  reference    the five prompts (Q&A 256 max tokens, code 512, JSON 1024, math 64, long code 2048):\n"
                              "               non-streaming tok/s (the reference figure), streaming TTFT and decode tok/s\n"
                              "  context      decode tok/s and TTFT with the prompt filled to --contexts tokens\n"
                              "  concurrency  --concurrency simultaneous streams: per-stream and aggregate tok/s\n\n"
                              "example:\n"
                              "  roofline bench serve --url http://127.0.0.1:8000 --out r.json --plot r.png")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000; a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name to request (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("ROOFLINE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $ROOFLINE_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--suite", action="append", default=None, metavar="NAME",
                   help="reference (default), context, concurrency, or all; repeat or comma-separate for several")
    p.add_argument("--runs", type=int, default=3, help="measured runs of each prompt / level (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed requests first: per prompt in the reference suite, once for concurrency (default 1)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write every measurement and the environment here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG plot (needs matplotlib: pip install 'roofline[bench]')")
    p.add_argument("--label", default=None, help="a name for this run (shown in tables, plots and `bench compare`)")
    p.add_argument("--max-tokens-scale", type=float, default=1.0,
                   help="multiply every max_tokens by this (e.g. 0.1 for a quick check; at least 2 tokens each; default 1)")
    p.add_argument("--contexts", default="0,8K,32K,128K",
                   help="context suite: prompt sizes in tokens, K = 1024 (default 0,8K,32K,128K)")
    p.add_argument("--context-max-tokens", type=int, default=None,
                   help="context suite: max tokens generated per request (default 256, times --max-tokens-scale)")
    p.add_argument("--concurrency", default="1,2,4,8", help="concurrency suite: numbers of simultaneous streams (default 1,2,4,8)")
    p.add_argument("--no-thinking", action="store_true",
                   help="send chat_template_kwargs {enable_thinking: false} (Qwen3 templates; default: the server's default)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (vLLM, SGLang, llama.cpp, roofline) so every request generates max_tokens")
    p.add_argument("--logprobs", action="store_true",
                   help="ask for logprobs, so streamed tokens are counted exactly (one entry per token) and checked "
                        "against usage; costs the server a little time")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any byte of a response (default 600)")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=cmd_serve)


def _suites(values: list[str] | None) -> list[str]:
    from ..bench.suites import SUITES

    names = []
    for value in values or ["reference"]:
        for name in value.replace(" ", "").split(","):
            if name == "all":
                names += SUITES
            elif name in SUITES:
                names.append(name)
            else:
                raise UserError(f"--suite: unknown suite {name!r}; choose from {', '.join(SUITES)} or all")
    return list(dict.fromkeys(names))


def settings_from_args(args):
    from ..bench.suites import Settings, parse_int_list

    if args.runs < 1:
        raise UserError("--runs must be at least 1")
    if args.warmup < 0:
        raise UserError("--warmup must be 0 or more")
    if not args.max_tokens_scale > 0:
        raise UserError("--max-tokens-scale must be above 0")
    if args.context_max_tokens is not None and args.context_max_tokens < 2:
        raise UserError("--context-max-tokens must be at least 2")
    if args.timeout <= 0:
        raise UserError("--timeout must be above 0")
    return Settings(
        runs=args.runs, warmup=args.warmup, max_tokens_scale=args.max_tokens_scale,
        contexts=parse_int_list(args.contexts, "--contexts", sizes=True, minimum=0),
        context_max_tokens=args.context_max_tokens,
        concurrency=parse_int_list(args.concurrency, "--concurrency", minimum=1),
        thinking=False if args.no_thinking else None, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def cmd_serve(args) -> int:
    from ..bench import report
    from ..bench.client import Client
    from ..bench.suites import Bench

    suites = _suites(args.suite)
    settings = settings_from_args(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - checked now, not after the measurements
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'roofline[bench]' (or pip install matplotlib)") from None

    client = Client(args.url, api_key=args.api_key, timeout=args.timeout)
    result = report.new_result(client, args.label, settings)
    progress = report.Progress(0, enabled=not args.quiet)
    bench = Bench(client, settings, result, progress)
    try:
        client.discover(args.model)
        result["environment"] = report.environment(client, args.label)
        progress.total = max(1, sum(getattr(bench, f"steps_{name}")() for name in suites))
        for name in suites:
            getattr(bench, f"run_{name}")()
            progress.close()
            result["notes"] = bench.notes
            print(render_suite(result, name), flush=True)
        result["speculative"] = client.speculative_stats()
        if result["speculative"]:
            spec = result["speculative"]
            print(f"MTP speculation (server totals): acceptance by draft position "
                  f"{', '.join(f'{r:.2f}' for r in spec['acceptance_by_position'])}; "
                  f"{spec['mean_accepted_length']:.2f} tokens per verify step")
        result["complete"] = True
    except (UserError, KeyboardInterrupt) as exc:
        progress.close()
        result["notes"] = bench.notes
        result["error"] = str(exc) if isinstance(exc, UserError) else "interrupted (Ctrl-C)"
        _save(result, args, partial=True)
        raise
    _save(result, args, partial=False)
    if bench.notes:
        print("\n".join("note: " + n for n in bench.notes))
    return 0


def render_suite(result: dict, name: str) -> str:
    from ..bench import report

    suite = result["suites"][name]
    env = result["environment"]
    head = f"\n{env.get('model') or '(default model)'} at {env['url']}" + (f"  [{env['label']}]" if env.get("label") else "")
    body = {"reference": lambda: report.reference_table(suite, result["settings"]["runs"]),
            "context": lambda: report.context_table(suite),
            "concurrency": lambda: report.concurrency_table(suite)}[name]()
    return head + "\n" + body + "\n"


def _save(result: dict, args, partial: bool) -> None:
    from ..bench import report

    tag = " (partial results)" if partial else ""
    if args.out:
        report.write_json(result, args.out)
        print(f"wrote {args.out}{tag}", file=sys.stderr)
    if args.plot and result["suites"]:
        try:
            report.plot(result, args.plot)
            print(f"wrote {args.plot}{tag}", file=sys.stderr)
        except UserError:
            if not partial:
                raise
        except Exception as exc:  # noqa: BLE001 - a plot failure must not hide the measurement error
            if not partial:
                raise
            print(f"could not plot the partial results: {exc}", file=sys.stderr)


# -- bench compare ------------------------------------------------------------------------

def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="two `bench serve` results side by side, with ratios",
                       description="Print two JSON results of `roofline bench serve` side by side: the medians of each "
                                   "suite both contain, and B / A.")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from ..bench import report

    a, b = report.load_result(args.a), report.load_result(args.b)
    print(report.compare(a, b, args.a, args.b), end="")
    return 0


# -- bench synthetic ----------------------------------------------------------------------

def add_synthetic(sub) -> None:
    from ..checkpoint.shapes import SHAPES
    from .checkpoint import add_layout_args

    p = sub.add_parser("synthetic", help="the engine's CUDA decode step on full-size random weights, against the ceiling",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Build a published shape with random weights directly on the GPU (no download) and "
                                   "measure in one run: copy bandwidth, bytes per token from the engine's tensors, decode "
                                   "tok/s at batch 1 per context and its fraction of the ceiling, step time for M = 2..4 "
                                   "tokens per sequence (MTP verify), a breakdown by component, the MTP draft step and "
                                   "modelled MTP-k tok/s at stated acceptance, and peak GPU memory.",
                       epilog="example:\n  roofline bench synthetic --shape qwen3.5-122b-a10b --out r.json")
    p.add_argument("--shape", required=True, choices=[s for s in SHAPES if s != "tiny"], help="model shape")
    add_layout_args(p, default="hybrid")
    p.set_defaults(lm_head="int8")  # the default: public INT4 + FP8 shared experts + INT8 LM head
    p.add_argument("--contexts", default="0,8K,32K", help="contexts to decode at, K = 1024 (default 0,8K,32K)")
    p.add_argument("--verify-tokens", default="2,3,4", help="tokens per sequence to time against one (default 2,3,4)")
    p.add_argument("--acceptance", default="0.95,0.80", help="stated MTP acceptance per draft position for the modelled "
                                                             "MTP tok/s (default 0.95,0.80, as reported on the 122B)")
    p.add_argument("--capacity", default="256K", help="tokens of KV cache preallocated for the sequence (default 256K)")
    p.add_argument("--repeats", type=int, default=50, help="timed repeats per measurement, median reported (default 50)")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (a quick check)")
    p.add_argument("--profile", action="store_true", help="also list the kernels of one captured step (CUDA profiler): "
                                                           "launches and device time per kernel, and the idle gaps")
    p.add_argument("--prefill", default="4K", help="prompt lengths to time prefill at, K = 1024 (default 4K; 0 skips it)")
    p.add_argument("--engine-tokens", type=int, default=256,
                   help="tokens the engine's own decode loop generates per mode (greedy / sampled, async scheduling "
                        "off / on); 0 skips it (default 256)")
    p.add_argument("--batch-decode", default="8x1,8x3", metavar="BxM,...",
                   help="decode steps of B sequences x M tokens to time by each INT4 many-rows path (default 8x1,8x3: "
                        "8 sequences, plain and with MTP-2 verify rows; 0 skips them)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the result here")
    p.set_defaults(func=cmd_synthetic)


def parse_batch_shapes(value: str) -> list[tuple[int, int]]:
    """'8x1,8x3' -> [(8, 1), (8, 3)]; '0' -> []."""
    if value.strip() == "0":
        return []
    shapes = []
    for item in value.split(","):
        b, sep, m = item.strip().partition("x")
        if not (sep and b.isdigit() and m.isdigit() and int(b) >= 1 and 1 <= int(m) <= 5):
            raise UserError(f"--batch-decode: {item.strip()!r} is not BxM with B >= 1 sequences and M in 1..5 tokens "
                            "(e.g. 8x3), or 0")
        shapes.append((int(b), int(m)))
    return shapes


def cmd_synthetic(args) -> int:
    import json

    from ..bench.ceiling import parse_acceptance
    from ..bench.suites import parse_int_list
    from ..bench.synthetic import format_report, run_synthetic
    from .checkpoint import layout_from_args

    contexts = parse_int_list(args.contexts, "--contexts", sizes=True)
    verify = parse_int_list(args.verify_tokens, "--verify-tokens", minimum=2)
    capacity = parse_int_list(args.capacity, "--capacity", sizes=True, minimum=1)[0]
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    prefill = [n for n in parse_int_list(args.prefill, "--prefill", sizes=True, minimum=0) if n]
    batches = parse_batch_shapes(args.batch_decode)
    if args.engine_tokens != 0 and args.engine_tokens < 32:
        raise UserError("--engine-tokens must be 0 (skip) or at least 32 (the first 16 tokens are warm-up)")
    result = run_synthetic(args.shape, layout_from_args(args), contexts, verify, args.repeats,
                           parse_acceptance(args.acceptance), args.layers, capacity,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True), profile=args.profile,
                           engine_tokens=args.engine_tokens, prefill=prefill, batches=batches)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    print(format_report(result))
    if result.get("errors"):
        print(f"bench synthetic: {', '.join(e['part'] for e in result['errors'])} failed (the JSON's \"errors\" has "
              "why); the other parts were measured", file=sys.stderr)
        return 1
    return 0


# `roofline bench <name>`: one add_<name>(sub) per subcommand.
SUBCOMMANDS = [add_serve, add_compare, add_synthetic]
