"""MTP speculation on the bundled model: tok/s for k = 0..4 with its real acceptance.

    python benchmarks/speculative.py [--device cpu|cuda] [--prompts N] [--repeats R] [--out FILE]

Greedy generation of held-out arithmetic answers, all prompts decoding together; every k
must produce exactly the k = 0 tokens (checked). Reports tok/s (median over repeats),
acceptance per draft position and tokens per verify step. On a GPU the engine decodes as it
serves (pooled caches, draft and verify steps as CUDA graphs); on a CPU, the reference path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from roofline.bench.environment import environment  # noqa: E402
from roofline.engine.engine import Engine  # noqa: E402
from roofline.engine.sampling import SamplingParams  # noqa: E402
from roofline.engine.speculative import SpeculativeConfig  # noqa: E402
from training.evaluate import heldout, prompt_ids  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=max_tokens)) for p in prompts]
    while engine.sequences:
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return [s.output_ids for s in seqs], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    base = Engine.from_pretrained(None, device=args.device)
    prompts = [prompt_ids(base, c) for c in heldout("arithmetic", args.prompts, seed=7)]
    rows, reference = [], None
    for k in range(5):
        engine = Engine(base.model, base.tokenizer, base.model_dir, speculative=SpeculativeConfig(k) if k else None,
                        pooled_decode=base.pooled_decode, max_num_seqs=args.prompts)
        run(engine, prompts[:1], 8)  # warm-up
        if engine.speculator:
            engine.speculator.drafted, engine.speculator.accepted = [0] * k, [0] * k
        times = []
        for _ in range(args.repeats):
            outputs, seconds = run(engine, prompts, args.max_tokens)
            times.append(seconds)
            reference = reference or outputs
            if outputs != reference:
                raise SystemExit(f"k={k}: greedy output differs from k=0: speculation is broken")
        tokens = sum(len(o) for o in outputs)
        row = {"k": k, "tokens": tokens, "seconds_median": statistics.median(times), "tok_per_s": tokens / statistics.median(times)}
        if engine.speculator:
            row["acceptance_by_position"] = [round(r, 4) for r in engine.speculator.acceptance_rates()]
            row["tokens_per_verify_step"] = round(engine.speculator.mean_accepted_length(), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in rows:
        row["speedup_vs_k0"] = round(row["tok_per_s"] / rows[0]["tok_per_s"], 3)
    result = {"benchmark": "speculative-bundled-model", "environment": environment(base.device),
              "settings": vars(args), "identical_greedy_output": True, "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results" / f"{time.strftime('%Y-%m-%d')}-speculative-{base.device.type}-b{args.prompts}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'k':>2} {'tok/s':>8} {'x k=0':>6} {'tokens/step':>11}  acceptance by position")
    for r in rows:
        print(f"{r['k']:>2} {r['tok_per_s']:8.1f} {r['speedup_vs_k0']:6.2f} {r.get('tokens_per_verify_step', 1):>11}  {r.get('acceptance_by_position', '')}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
