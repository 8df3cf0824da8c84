"""Where an MTP step through `Engine.step` spends its time, on the synthetic model (CUDA).

Session 13 measured greedy MTP-2 through the engine at 9.58 ms a step on the 122B where its captured parts (the M = 3
verify graph and two draft graphs) add up to 6.23 ms. This runs the same loop under torch.profiler, with the
speculator's and the graph runner's methods labelled, and prints per step: wall time, GPU kernel time (busy) and
the labelled regions' host time, then the host ops and GPU kernels that take the most. JSON under $OUT (or
benchmarks/results/): profile-mtp-engine.json, or with --no-profile profile-mtp-engine-unprofiled.json.

    python benchmarks/profile_mtp_engine.py --shape qwen3.5-122b-a10b [--layers N] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kernels import write_result
from roofline.bench.environment import environment
from roofline.bench.synthetic import ENGINE_SAMPLING, _one_sequence_engine, build_synthetic_model
from roofline.checkpoint.shapes import resolve_layout
from roofline.engine.graphs import DecodeGraphs
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import MtpSpeculator, SpeculativeConfig
from roofline.kernels._common import pdl_supported
from roofline.kernels.dispatch import install_fast_path

LABELLED = [(MtpSpeculator, "draft"), (MtpSpeculator, "verify"), (MtpSpeculator, "_head"), (MtpSpeculator, "_accept"),
            (MtpSpeculator, "catch_up"),
            (MtpSpeculator, "_verify_forward"), (DecodeGraphs, "run"), (DecodeGraphs, "keep"),
            (DecodeGraphs, "buffers_for")]


def label_methods():
    """Wrap each LABELLED method in a profiler range named after it."""
    for cls, name in LABELLED:
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapped(*args, __fn=fn, __name=f"{cls.__name__}.{name}", **kwargs):
            with record_function(__name):
                return __fn(*args, **kwargs)

        setattr(cls, name, wrapped)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-122b-a10b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--mtp", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true", help="only the unprofiled step times and graph launch costs")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the context limit, which sets the attention spans captured at start (default: what the steps "
                         "need, one span); e.g. 131072 for what capture_graphs costs a server on an 80 GB card")
    args = ap.parse_args()
    formats = resolve_layout("hybrid", {"lm_head": "int8"})  # bench synthetic's default layout
    model, _ = build_synthetic_model(args.shape, formats, "cuda", layers=args.layers)
    fast = install_fast_path(model)
    label_methods()
    engine = _one_sequence_engine(model, args.max_model_len or 16 + args.warmup * 4 + args.steps * 4 + 64,
                                  speculative=SpeculativeConfig(args.mtp))
    captured = engine.capture_graphs()  # as serve does; what it costs at start on this shape
    print(f"capture_graphs: {captured['buckets']} buckets in {captured['seconds']:.1f} s, "
          f"{captured['bytes'] / 2**20:.0f} MiB", flush=True)
    engine.add([1] * 16, SamplingParams(max_tokens=10**6, ignore_eos=True, **ENGINE_SAMPLING["greedy"]))
    for _ in range(args.warmup):  # the prefill, then steps that compile what the captures did not
        engine.step()
    torch.cuda.synchronize()
    walls = step_walls(engine, args.steps)  # without the profiler, whose tracing slows graph launches
    meta = {"shape": args.shape, "layers": args.layers, "mtp": args.mtp, "environment": environment(model.device),
            "int4_order": fast.int4_order, "pdl": pdl_supported(model.device),
            "capture_graphs": captured,
            "unprofiled_step_ms_median": sorted(walls)[len(walls) // 2], "unprofiled_step_ms": walls}
    # Before the profiler: once it has run, every graph launch in the process costs far more host time (H100, session
    # 19: the M = 3 verify graph's launch 401 us measured after it, 6 us in a fresh process). Its replays move the
    # sequence's caches, which only changes the random tokens of the profiled steps.
    meta["graph_launches"] = graph_launches(engine)
    if args.no_profile:
        print(json.dumps(meta, indent=1))
        write_result("profile-mtp-engine-unprofiled", meta)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        walls = step_walls(engine, args.steps, label="Engine.step")
        torch.cuda.synchronize()
    result = summarise(prof, walls, meta)
    print(f"{args.shape}: MTP-{args.mtp} through Engine.step, median {result['step_ms_median']:.2f} ms a step, "
          f"GPU kernels {result['gpu_kernel_ms_per_step']:.2f} ms a step")
    for key in ("host_ranges_ms_per_step", "gpu_ranges_ms_per_step"):
        print(key, json.dumps({k: round(v, 3) for k, v in result[key].items()}))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    write_result("profile-mtp-engine", result)
    print("last step:", json.dumps(result["last_step"], indent=1))
    print(f"unprofiled: median {meta['unprofiled_step_ms_median']:.2f} ms a step; graph launches onto an idle GPU:")
    for g in result["graph_launches"]:
        print(json.dumps(g))


def step_walls(engine, steps: int, label: str | None = None) -> list[float]:
    """ms of each of `steps` engine steps, each in a profiler range named `label` where given."""
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        with record_function(label) if label else contextlib.nullcontext():
            engine.step()
        walls.append((time.perf_counter() - start) * 1e3)
    return walls


def graph_launches(engine) -> list[dict]:
    """Per captured graph: the host time of one replay launched onto an idle GPU and the GPU time it takes (median
    of 10), without the profiler. A launch's host time is GPU idle time wherever the host launches after the GPU
    drained (the verify graph after the drafts' launches, the next step's drafts after the outcome read)."""
    graphs = []
    for name, runner in (("main", engine.graphs), ("mtp head", engine.speculator.draft_graphs)):
        for (b, m, span), buf in runner.buffers.items():
            if buf.graph is None:
                continue
            host, gpu = [], []
            for _ in range(10):
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                t = time.perf_counter()
                buf.graph.replay()
                host.append((time.perf_counter() - t) * 1e6)
                end.record()
                torch.cuda.synchronize()
                gpu.append(begin.elapsed_time(end) * 1e3)
            graphs.append({"graph": name, "batch": b, "m": m, "span": span, "launch_host_us": sorted(host)[5],
                           "gpu_us": sorted(gpu)[5]})
    return graphs


def summarise(prof, walls: list[float], meta: dict) -> dict:
    """The profile of len(walls) engine steps, per step: wall times, GPU kernel time, the labelled ranges on the host
    and on the GPU, the host ops and GPU kernels that take the most, and the last step's timeline."""
    n = len(walls)
    events = prof.events()
    # The profiler also puts each labelled range on the GPU's timeline (a user annotation spanning the GPU work
    # launched inside it): host ranges, GPU ranges and kernels are kept apart here.
    host_ranges = [e for e in events if e.device_type == CPU and labelled(e.name)]
    gpu_ranges = [e for e in events if e.device_type == CUDA and labelled(e.name)]
    kernels = [e for e in events if e.device_type == CUDA and not labelled(e.name)]
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    result = {
        **meta, "steps": n,
        "step_ms_median": sorted(walls)[n // 2], "step_ms": walls,
        "gpu_kernel_ms_per_step": sum(e.device_time for e in kernels) / n / 1e3,
        "host_ranges_ms_per_step": per_name(host_ranges, n),
        "gpu_ranges_ms_per_step": per_name(gpu_ranges, n),
        "host_ops_self_ms_per_step": [{"op": e.key, "calls": e.count / n, "ms": e.self_cpu_time_total / n / 1e3}
                                      for e in host[:25] if not labelled(e.key)],
        "gpu_kernels_ms_per_step": sorted(({"kernel": k[:90], "calls": c / n, "ms": t / n / 1e3}
                                           for k, (c, t) in _totals(kernels).items()), key=lambda r: -r["ms"])[:25],
    }
    result["last_step"] = last_step_timeline(events)
    return result


CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def labelled(name: str) -> bool:
    return name.split(".")[0] in ("Engine", "MtpSpeculator", "DecodeGraphs")


def _totals(events) -> dict[str, tuple[int, float]]:
    """name -> (count, summed duration in us)."""
    totals: dict[str, tuple[int, float]] = {}
    for e in events:
        count, us = totals.get(e.name, (0, 0.0))
        totals[e.name] = (count + 1, us + e.time_range.elapsed_us())
    return totals


def per_name(events, steps: int) -> dict[str, float]:
    return {name: us / steps / 1e3 for name, (_, us) in _totals(events).items()}


def last_step_timeline(events) -> dict:
    """The last Engine.step: its labelled host ranges and their GPU ranges (start offset and length, us), and the
    GPU's kernels in bursts (less than 5 us apart), so idle stretches and what the host did meanwhile show."""
    steps = [e for e in events if e.name == "Engine.step" and e.device_type == CPU]
    if not steps:
        return {}
    t0, t1 = steps[-1].time_range.start, steps[-1].time_range.end

    def ranges(device):
        return sorted(({"name": e.name, "at": round(e.time_range.start - t0, 1), "us": round(e.time_range.elapsed_us(), 1)}
                       for e in events if e.device_type == device and labelled(e.name) and e.name != "Engine.step"
                       and t0 <= e.time_range.start <= t1 + 10_000), key=lambda r: r["at"])

    kernels = sorted((e for e in events if e.device_type == CUDA and not labelled(e.name)
                      and e.time_range.start >= t0 - 50), key=lambda e: e.time_range.start)
    bursts = []
    for e in kernels:
        start, end = e.time_range.start - t0, e.time_range.end - t0
        if bursts and start - bursts[-1]["end"] < 5:
            bursts[-1]["end"] = max(bursts[-1]["end"], end)
            bursts[-1]["kernels"] += 1
        else:
            bursts.append({"start": start, "end": end, "kernels": 1, "first": e.name[:60]})
    for b in bursts:
        b["start"], b["end"] = round(b["start"], 1), round(b["end"], 1)
    return {"host_us": round(t1 - t0, 1), "host_ranges": ranges(CPU), "gpu_ranges": ranges(CUDA), "gpu_bursts": bursts[:60]}


if __name__ == "__main__":
    main()
