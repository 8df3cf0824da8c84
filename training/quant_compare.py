"""The project's quantised builds against BF16 on the same held-out prompts (issue 3's "within 2 points"):

    python -m training.quant_compare [MODEL] [--recall 160] [--arithmetic 200] [--classes] [--json OUT]

Builds the test's layout (INT4 experts / attention / GDN, FP8 shared experts, INT8 LM head) with
`roofline checkpoint quantize` and reports recall at ~1K tokens and arithmetic for BF16 and the build,
with the paired counts (right in both, only in one). --classes also quantises one class at a time
(the rest BF16) and reports recall for each: which class costs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from roofline.engine.engine import Engine
from roofline.hub import BUNDLED_MODEL

from .evaluate import greedy_outputs, heldout
from .tasks import answer_is_correct

FULL_BUILD = ["--layout", "hybrid", "--lm-head", "int8"]
ONE_CLASS = {"experts int4": ["--experts", "int4"], "attention int4": ["--attention", "int4"], "gdn int4": ["--gdn", "int4"],
             "shared fp8": ["--shared", "fp8"], "lm_head int8": ["--lm-head", "int8"]}


def build(src: str, out: Path, flags: list[str]) -> str:
    cmd = [sys.executable, "-m", "roofline.cli", "checkpoint", "quantize", src, "--out", str(out), *flags, "--no-progress", "--force"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return str(out)


def right(path: str, convs: list[dict], max_tokens: int) -> list[bool]:
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    outs = greedy_outputs(engine, convs, max_tokens)
    return [answer_is_correct(c, engine.tokenizer.decode(o, skip_special_tokens=True)) for c, o in zip(convs, outs)]


def paired(a: list[bool], b: list[bool]) -> dict:
    return {"bf16": sum(a) / len(a), "quantised": sum(b) / len(b), "n": len(a), "both": sum(x and y for x, y in zip(a, b)),
            "bf16_only": sum(x and not y for x, y in zip(a, b)), "quantised_only": sum(y and not x for x, y in zip(a, b))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(BUNDLED_MODEL))
    ap.add_argument("--recall", type=int, default=160, help="recall prompts (100 facts, ~1K tokens)")
    ap.add_argument("--arithmetic", type=int, default=200)
    ap.add_argument("--classes", action="store_true", help="also one quantised class at a time (recall only)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    recall, arithmetic = heldout("recall", args.recall, n_facts=100), heldout("arithmetic", args.arithmetic)
    t0 = time.time()
    result = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        full = build(args.model, Path(tmp) / "full", FULL_BUILD)
        base_recall = right(args.model, recall, 64)
        result["recall"] = paired(base_recall, right(full, recall, 64))
        print(f"recall at ~1K tokens: {result['recall']}  ({time.time() - t0:.0f}s)", flush=True)
        result["arithmetic"] = paired(right(args.model, arithmetic, 160), right(full, arithmetic, 160))
        print(f"arithmetic: {result['arithmetic']}  ({time.time() - t0:.0f}s)", flush=True)
        if args.classes:
            result["one_class_recall"] = {}
            for name, flags in ONE_CLASS.items():
                path = build(args.model, Path(tmp) / name.replace(" ", "-"), ["--layout", "bf16", *flags])
                result["one_class_recall"][name] = paired(base_recall, right(path, recall, 64))
                print(f"recall, {name} only: {result['one_class_recall'][name]}  ({time.time() - t0:.0f}s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
