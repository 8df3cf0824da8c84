"""`roofline checkpoint build-hybrid | graft-mtp | quantize | random | inspect` (logic in roofline/checkpoint/)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..errors import UserError

SIZE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 4GB, 500MB or 2GiB")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def parse_contexts(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", part)
        if not m:
            raise argparse.ArgumentTypeError(f"{text!r}: give context lengths such as 0,32K,128K")
        out.append(int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()])
    return tuple(out)


def add_layout_args(p: argparse.ArgumentParser, default: str | None) -> None:
    from ..checkpoint.shapes import LAYOUT_HELP, LAYOUTS, LINEAR_FORMATS

    g = p.add_argument_group("layout (a preset, then per-class formats)")
    g.add_argument("--layout", choices=list(LAYOUTS), default=default, help=f"preset: {LAYOUT_HELP} (default: {default})")
    quantised = [f for f in LINEAR_FORMATS if f != "int8"]
    g.add_argument("--experts", choices=quantised, help="routed experts")
    g.add_argument("--attention", choices=quantised, help="full-attention q/k/v/o")
    g.add_argument("--gdn", choices=quantised, help="GDN in_proj_qkv, in_proj_z, out_proj")
    g.add_argument("--shared", choices=quantised, help="shared experts")
    g.add_argument("--mlp", choices=quantised, help="the dense model's MLP (27B)")
    g.add_argument("--lm-head", choices=["int8", "bf16"], help="LM head (int8: per-row symmetric)")


def layout_from_args(args) -> dict[str, str]:
    from ..checkpoint.shapes import resolve_layout

    return resolve_layout(args.layout or "int4", {"experts": args.experts, "attention": args.attention, "gdn": args.gdn,
                                                   "shared": args.shared, "dense_mlp": args.mlp, "lm_head": args.lm_head})


def add_ceiling_args(p: argparse.ArgumentParser, all_machines: bool = True) -> None:
    from ..bench.ceiling import MACHINES

    g = p.add_argument_group("ceiling")
    g.add_argument("--machine", action="append", choices=list(MACHINES),
                   help="machine(s) to show (repeatable; default: all of " + ", ".join(MACHINES) + ")")
    g.add_argument("--bandwidth", help="a custom memory bandwidth: GB/s (273) or with a unit (273G, 4.2T)")
    g.add_argument("--context", type=parse_contexts, default=(0, 32 * 1024, 128 * 1024), help="context lengths (default 0,32K,128K)")
    g.add_argument("--mtp", type=int, default=2, metavar="K", help="show MTP-1..K speculation (default 2; 0: none)")
    g.add_argument("--acceptance", help="per-position MTP acceptance rates (default 0.95,0.80 as reported on the 122B)")
    g.add_argument("--json", action="store_true", help="print the numbers as JSON")


def ceiling_options(args):
    from ..bench.ceiling import machines, parse_acceptance

    if args.mtp < 0:
        raise UserError("--mtp must be 0 or more")
    return dict(chosen=machines(args.machine, args.bandwidth), contexts=args.context, mtp=args.mtp,
                acceptance=parse_acceptance(args.acceptance))


def register(subparsers) -> None:
    from ..bench.ceiling import MACHINES

    p = subparsers.add_parser("checkpoint", help="build, convert, generate and inspect checkpoints",
                              description="Checkpoint tools: build-hybrid, graft-mtp, quantize, random, inspect.")
    sub = p.add_subparsers(dest="checkpoint_command", required=True, metavar="{build-hybrid,graft-mtp,quantize,random,inspect}")

    from ..checkpoint.hybrid import PLAN_HELP

    b = sub.add_parser("build-hybrid", help="INT4 checkpoint + shared experts (or any plan) from the FP8 one",
                       description="Build one checkpoint from the public INT4 and the official FP8 checkpoints. Default plan: "
                                   "everything as the INT4 source stores it (experts, attention, GDN in INT4; MTP head kept), "
                                   "shared experts as block FP8 from the FP8 source.")
    b.add_argument("--int4", required=True, metavar="SRC", help="INT4 checkpoint: folder, HF id or cache path")
    b.add_argument("--fp8", required=True, metavar="SRC", help="FP8 checkpoint: folder, HF id or cache path (only needed shards are read)")
    b.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist unless --force)")
    b.add_argument("--plan", metavar="FILE", help=PLAN_HELP)
    b.add_argument("--machine", choices=list(MACHINES), default="dgx-spark", help="machine for the ceiling shown (default dgx-spark)")
    _add_write_args(b)
    b.set_defaults(func=cmd_build_hybrid)

    g = sub.add_parser("graft-mtp", help="add the MTP head of SRC to DIR and list it in the index (idempotent)")
    g.add_argument("--from", dest="src", required=True, metavar="SRC", help="checkpoint with the MTP head (indexed or in an extra file)")
    g.add_argument("--into", required=True, metavar="DIR", help="checkpoint folder to add it to")
    g.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    g.set_defaults(func=cmd_graft_mtp)

    q = sub.add_parser("quantize", help="round-to-nearest from BF16 into INT4 / block FP8 / INT8 per module class",
                       description="Quantise a BF16 (or fine-tuned) checkpoint into the published formats, streaming. "
                                   "Classes already stored in the requested format are copied.")
    q.add_argument("src", metavar="SRC", help="checkpoint: folder, HF id or cache path")
    q.add_argument("--out", required=True, metavar="DIR")
    add_layout_args(q, default="hybrid")
    q.add_argument("--group-size", type=int, default=128, help="INT4 group size (default 128)")
    q.add_argument("--machine", choices=list(MACHINES), default="dgx-spark", help="machine for the ceiling shown (default dgx-spark)")
    _add_write_args(q)
    q.set_defaults(func=cmd_quantize)

    r = sub.add_parser("random", help="random-weight checkpoint of a real shape in any layout",
                       description="Write a random-weight checkpoint of a published shape (for tests, demos, benchmarks).")
    r.add_argument("--shape", required=True, help="qwen3.5-122b-a10b, qwen3.5-35b-a3b, qwen3.5-397b-a17b, qwen3.5-27b or tiny")
    r.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    add_layout_args(r, default="int4")
    r.add_argument("--mtp-file", choices=["auto", "index", "extra"], default="auto",
                   help="MTP head in the index, or in an unindexed model_extra_tensors.safetensors as the public INT4 "
                        "checkpoint has it (auto: extra for int4 experts)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("out", metavar="OUT")
    _add_write_args(r, dry_run=False)
    r.set_defaults(func=cmd_random)

    i = sub.add_parser("inspect", help="formats, sizes, bytes per token and the ceiling of a checkpoint")
    i.add_argument("dir", metavar="DIR", help="checkpoint: folder, HF id in the local cache, or cache path")
    add_ceiling_args(i)
    i.set_defaults(func=cmd_inspect)


def _add_write_args(p, dry_run: bool = True) -> None:
    if dry_run:
        p.add_argument("--dry-run", action="store_true", help="print the plan, output size, bytes per token and ceiling; write nothing")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--max-shard-size", type=parse_size, default=4 << 30, help="largest output shard (default 4GiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _finish(plan, args, label: str, **write) -> int:
    from ..bench.ceiling import MACHINES, format_bytes, token_bytes
    from ..checkpoint.build import run_build, summary_table
    from ..checkpoint.hybrid import dry_run_report

    if getattr(args, "dry_run", False):
        print(dry_run_report(plan, args.out, getattr(args, "machine", "dgx-spark"), getattr(args, "choices", None)))
        if Path(args.out).exists():
            print(f"note: {args.out} exists: the build will refuse to replace it without --force")
        return 0
    out = run_build(plan, args.out, force=args.force, max_shard_bytes=args.max_shard_size, progress=not args.no_progress,
                    label=label, **write)
    tb = token_bytes(plan.cfg, plan.canonical_tensors())
    print(summary_table(plan))
    for note in plan.notes:
        print(f"note: {note}")
    machine = MACHINES[getattr(args, "machine", None) or "dgx-spark"]
    mtp = ""
    if plan.expect_mtp:
        mtp = (f"; MTP head in {', '.join(sorted(write['unindexed']))} (not in the index, as published)"
               if write.get("unindexed") else "; MTP head kept and listed in the index")
    print(f"wrote {out}: {len(plan.outputs)} tensors, {format_bytes(plan.total_bytes)}{mtp}")
    print(f"bytes per decoded token: {format_bytes(tb.decode())} (weights {format_bytes(tb.weights)} + GDN state "
          f"{format_bytes(tb.gdn_state)}); ceiling on {machine.name}: {tb.ceiling(machine.bandwidth):.1f} tok/s at context 0")
    return 0


def cmd_build_hybrid(args) -> int:
    from ..checkpoint.hybrid import hybrid_plan, load_plan_file

    args.choices = load_plan_file(args.plan)
    plan = hybrid_plan(args.int4, args.fp8, args.choices)
    return _finish(plan, args, "build-hybrid")


def cmd_quantize(args) -> int:
    from ..checkpoint.quantize import quantize_plan

    plan = quantize_plan(args.src, layout_from_args(args), group_size=args.group_size)
    return _finish(plan, args, "quantize")


def cmd_random(args) -> int:
    from ..checkpoint.random import random_plan

    plan, extra, unindexed = random_plan(args.shape, layout_from_args(args), args.layers, args.seed, args.mtp_file)
    return _finish(plan, args, "random", extra_files=extra, unindexed=unindexed)


def cmd_graft_mtp(args) -> int:
    from ..checkpoint.graft import graft_mtp

    result = graft_mtp(args.src, args.into, dry_run=args.dry_run)
    print(result.message(args.into, args.dry_run))
    return 0


def cmd_inspect(args) -> int:
    from ..checkpoint.inspect import inspect_checkpoint

    report = inspect_checkpoint(args.dir)
    opts = ceiling_options(args)
    if args.json:
        print(json.dumps(report.as_dict(opts["chosen"], opts["contexts"], opts["mtp"], opts["acceptance"]), indent=2))
    else:
        print(report.text(opts["chosen"], opts["contexts"], opts["mtp"], opts["acceptance"]))
    return 0
