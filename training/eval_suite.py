"""The issue-3 measurements in one go, with roofline's engine (CPU fp32 by default), held-out prompts:

    python -m training.eval_suite [MODEL] [--n 100] [--n-recall 40] [--dtype bfloat16] [--json OUT]

arithmetic as the tests draw it (thinking on/off mixed), with thinking, without thinking;
recall at 3 / 10 / 30 / 100 facts (100 facts is the test's ~1K tokens); the tool call and the
answer from the tool response; MTP greedy acceptance at positions 1 and 2. `--dtype bfloat16` runs the
reference path in the dtype a GPU serves in (slower on a CPU), to see what bf16 rounding costs.
"""

from __future__ import annotations

import argparse
import json
import time

from roofline.engine.engine import Engine

from .evaluate import accuracy, greedy_outputs, heldout, mtp_acceptance, prompt_ids
from .tasks import TaskGenerator


def tool_scores(engine: Engine, n: int) -> dict:
    gen = TaskGenerator(seed=1234, split="heldout")
    convs = [gen.tool(thinking=bool(i % 2)) for i in range(n)]
    convs = [c for c in convs if c["task"] == "tool"]
    first = [dict(c, messages=c["messages"][: [m["role"] for m in c["messages"]].index("assistant") + 1]) for c in convs]
    outs = greedy_outputs(engine, first, 128)
    ok_call = 0
    for c, o in zip(convs, outs):
        text = engine.tokenizer.decode(o, skip_special_tokens=False)
        name = c["meta"]["name"]
        args = c["meta"]["arguments"]
        ok_call += f"<function={name}>" in text and all(f"<parameter={k}>\n{v}\n</parameter>" in text for k, v in args.items())
    return {"n": len(convs), "call": ok_call / max(1, len(convs)), "answer": accuracy(engine, convs, 96)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--n-recall", type=int, default=40)
    ap.add_argument("--facts", default="3,10,30,100")
    ap.add_argument("--n-tool", type=int, default=20)
    ap.add_argument("--mtp", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    engine = Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype)
    res = {}
    t0 = time.time()

    def rec(name, value):
        res[name] = value
        print(f"{name}: {value}  ({time.time() - t0:.0f}s)", flush=True)

    for f in [int(x) for x in args.facts.split(",")]:
        convs = heldout("recall", args.n_recall, n_facts=f)
        toks = sum(len(prompt_ids(engine, c)) for c in convs) / len(convs)
        rec(f"recall_{f}_facts", {"accuracy": accuracy(engine, convs, max_tokens=64), "prompt_tokens": round(toks)})
    if args.n:  # --n 0 / --n-tool 0 skip those rows
        rec("arithmetic_mixed", accuracy(engine, heldout("arithmetic", args.n)))
        rec("arithmetic_thinking", accuracy(engine, heldout("arithmetic", args.n, thinking=True)))
        rec("arithmetic_no_thinking", accuracy(engine, heldout("arithmetic", args.n, thinking=False)))
    if args.n_tool:
        rec("tool", tool_scores(engine, args.n_tool))
    if args.mtp:
        rec("mtp_acceptance", mtp_acceptance(engine, heldout("arithmetic", args.mtp, seed=99)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
