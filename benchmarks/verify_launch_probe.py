"""Two checks of `bench synthetic`'s numbers in a fresh process (CUDA, 122B shape; session 19, H100):

1. The verify step with and without the rollback saves (step ms, graph replay ms, host time of a graph launch): the
   bench measured its verify rows after its kernel profile, and there they came out ~1 ms slower (6.30 against 5.34 ms
   here): the profiler slows every later launch in the process. The bench now profiles last.
2. The engine loop's MTP row, step by step, with graphs captured lazily as the bench then did: the mean carried a
   170 ms capture near the length limit (the first plain step). The bench's engine loop now captures first.

    OUT=dir python benchmarks/verify_launch_probe.py   # writes dir/probe.json
"""
import json
import os
import statistics
import time

import torch

from roofline.bench.synthetic import (DEFAULT_LAYOUT, SyntheticRun, build_synthetic_model, decode_ms, fill_context,
                                      step_ids, ENGINE_SAMPLING, _one_sequence_engine)
from roofline.checkpoint.shapes import resolve_layout
from roofline.engine.cache import CachePool
from roofline.engine.graphs import DecodeGraphs
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import SpeculativeConfig
from roofline.kernels.dispatch import install_fast_path


def main():
    out = {}
    model, _ = build_synthetic_model("qwen3.5-122b-a10b", resolve_layout(DEFAULT_LAYOUT, {"lm_head": "int8"}), "cuda")
    install_fast_path(model)
    pool = CachePool(model.config, model.config.layer_types, 1, 4096, model.device, model.dtype)
    cache = pool.acquire()
    fill_context(SyntheticRun(model, pool, None, cache, None), 0)
    graphs = DecodeGraphs(model, pool, 1, use_graphs=True)
    run = SyntheticRun(model, pool, graphs, cache, None)
    rows = []
    for m, rb in ((1, False), (3, False), (3, True), (2, True), (2, False)):
        step, graph = decode_ms(run, m, 10, rollback=rb, distinct=m > 1)
        buf = graphs.run(step_ids(model.config.vocab_size, m, m > 1), [cache], m, rollback=rb)
        torch.cuda.synchronize()
        launches = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter(); buf.graph.replay(); launches.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        rows.append({"m": m, "rollback": rb, "step_ms": step, "graph_ms": graph, "launch_host_us": statistics.median(launches)})
        print(rows[-1], flush=True)
    out["verify"] = rows
    del graphs, run
    torch.cuda.empty_cache()
    # (2) the engine loop's MTP row, per step
    engine = _one_sequence_engine(model, 16 + 256 + 1, speculative=SpeculativeConfig(2))
    engine.add([1] * 16, SamplingParams(max_tokens=256, ignore_eos=True, **ENGINE_SAMPLING["greedy"]))
    stamps, walls = [], []
    while engine.sequences:
        t0 = time.perf_counter()
        r = engine.step()
        walls.append((time.perf_counter() - t0) * 1e3)
        if r:
            stamps.append(time.perf_counter())
    steady = stamps[16:]
    iv = [(b - a) * 1e3 for a, b in zip(steady, steady[1:])]
    out["engine_mtp"] = {"mean_ms": statistics.mean(iv), "median_ms": statistics.median(iv), "max_ms": max(iv),
                         "slowest": sorted(range(len(iv)), key=lambda i: -iv[i])[:5],
                         "slowest_ms": sorted(iv)[-5:], "steps": len(walls), "captures": engine.graphs.captures,
                         "draft_captures": engine.speculator.draft_graphs.captures, "walls_over_20ms": [(i, w) for i, w in enumerate(walls) if w > 20]}
    print(json.dumps(out["engine_mtp"], indent=1))
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
