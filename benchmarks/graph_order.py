"""Experiment: does a decode graph's speed depend on which graphs were captured before it into the same memory pool?

    PYTHONPATH=$PWD python benchmarks/graph_order.py [--shape qwen3.5-122b-a10b] [--contexts 0,8192,32768]
        [--rounds 3] [--repeats 30] [--capacity 262144] [--out FILE]
        (CUDA; JSON to FILE, else graph_order.json in $OUT, else in benchmarks/results/)

Why (session 42, one H100): `bench synthetic` reads its second context row ~0.17 ms slower than the same context as
its first row (0 then 8K: 3.767 / 3.771 / 3.756 ms graph; 8K alone 3.579 / 3.572 / 3.586; 8K then 0: the 0 row 3.601
/ 3.613 against 3.43 first), and its third row (32K after 0 and 8K) not. The bench captures each row's graph lazily
into one DecodeGraphs (one CUDA graph memory pool), as a server does for all its buckets at start. On one model
build, in one process:
- `shared`: one DecodeGraphs, each context's graph captured in `contexts` order (the bench's way);
- `own pool`: each context's graph captured by a DecodeGraphs of its own (ab_step's way);
- `server`: one DecodeGraphs that captures every one-token span bucket up to the capacity first (`prepare`, as
  `serve` does at start), then each context's bucket from those;
then `rounds` rounds re-time every graph of every set (`synthetic.in_rounds`: order reversed every other round),
each behind a `fill_context` of its context. A slow graph that stays slow in every round is the graph (its capture
or its memory); one slow only when first timed is the moment.
"""

from __future__ import annotations

import argparse
import functools


def run_order(shape: str, contexts: list[int], rounds: int, repeats: int, capacity: int, layers: int | None = None,
              device: str = "cuda", progress=print) -> dict:
    import torch

    from roofline.bench.environment import environment
    from ab_step import one_sequence_setup  # beside this script (its folder is on sys.path when it runs)
    from roofline.bench.synthetic import SyntheticRun, decode_ms, fill_context, in_rounds
    from roofline.engine.graphs import DecodeGraphs

    if capacity < max(contexts) + 8:
        raise ValueError(f"--capacity {capacity} leaves no room past the {max(contexts)}-token context")
    cuda = torch.device(device).type == "cuda"
    model, fast, pool, cache = one_sequence_setup(shape, device, capacity, layers)

    def graph_ms(graphs: DecodeGraphs, context: int) -> float:
        run = SyntheticRun(model, pool, graphs, cache, None)
        fill_context(run, context)
        return decode_ms(run, 1, repeats)[1]  # captures the bucket where it is new, then times its replay

    shared = DecodeGraphs(model, pool, 1, use_graphs=cuda)
    own = {c: DecodeGraphs(model, pool, 1, use_graphs=cuda) for c in contexts}
    server = DecodeGraphs(model, pool, 1, use_graphs=cuda)
    sets = {"shared": lambda c: shared, "own pool": lambda c: own[c], "server": lambda c: server}
    first = {name: {} for name in sets}
    for c in contexts:
        first["shared"][c] = graph_ms(shared, c)
        progress(f"shared   context {c}: {first['shared'][c]:.3f} ms (first timing, captured just before)")
    for c in contexts:
        first["own pool"][c] = graph_ms(own[c], c)
        progress(f"own pool context {c}: {first['own pool'][c]:.3f} ms")
    server.prepare([1])
    for c in contexts:
        first["server"][c] = graph_ms(server, c)
        progress(f"server   context {c}: {first['server'][c]:.3f} ms ({len(server.buffers)} buckets captured first)")

    def timing(graphs: DecodeGraphs, context: int) -> dict:
        return {"graph_ms": graph_ms(graphs, context)}

    # every set's graph of a context one after another, the order reversed every other round
    timed = in_rounds({(c, name): functools.partial(timing, sets[name](c), c) for c in contexts for name in sets}, rounds)
    later = {name: {c: [t["graph_ms"] for t in timed[c, name]["rounds"]] for c in contexts} for name in sets}
    for r in range(rounds):
        progress(f"round {r}: " + "; ".join(f"{name} " + " / ".join(f"{later[name][c][r]:.3f}" for c in contexts)
                                            for name in sets))
    return {"benchmark": "graph_order", "shape": shape, "layers": layers, "contexts": contexts, "capacity": capacity,
            "environment": environment(device), "kernels": dict(fast.installed), "rounds": rounds, "repeats": repeats,
            "first_ms": first, "rounds_ms": later,
            "median_ms": {name: {c: timed[c, name]["graph_ms"] for c in contexts} for name in sets},
            "note": "graph = device time of one captured one-token step's replay (median of repeats); first_ms: "
                    "timed right after its capture, in the order of contexts; rounds_ms: every graph again"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-122b-a10b")
    ap.add_argument("--contexts", default="0,8192,32768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--capacity", type=int, default=262144)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    result = run_order(args.shape, contexts, args.rounds, args.repeats, args.capacity, args.layers)
    for name, per in result["median_ms"].items():
        print(f"{name:9s} first " + " / ".join(f"{result['first_ms'][name][c]:.3f}" for c in contexts)
              + "; rounds " + " / ".join(f"{per[c]:.3f}" for c in contexts) + " ms")
    from kernels import write_result

    write_result("graph_order", result, args.out)


if __name__ == "__main__":
    main()
