"""`roofline ceiling`: the bandwidth ceiling of a model layout on a machine, without a checkpoint."""

from __future__ import annotations

import json

from .checkpoint import add_ceiling_args, add_layout_args, ceiling_options, layout_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ceiling", help="physical tok/s ceiling of a model layout on a machine (bandwidth / bytes per token)",
        description="Bytes read per decoded token and the bandwidth ceiling, from a named shape and layout "
                    "(no download) or from a checkpoint's headers.")
    p.add_argument("--model", required=True, metavar="SHAPE_OR_DIR",
                   help="qwen3.5-122b-a10b, qwen3.5-35b-a3b, qwen3.5-397b-a17b, qwen3.5-27b, tiny; or a checkpoint "
                        "folder / HF id in the local cache (its own tensors, unless --layout is given)")
    p.add_argument("--layers", type=int, help="shapes only: count only the first N decoder layers")
    add_layout_args(p, default=None)
    add_ceiling_args(p)
    p.set_defaults(func=cmd_ceiling)


def cmd_ceiling(args) -> int:
    from ..bench.ceiling import bytes_summary, ceiling_table, class_table, model_token_bytes, report_dict

    title, cfg, tb = model_token_bytes(args.model, layout_from_args(args) if _layout_given(args) else None, args.layers)
    opts = ceiling_options(args)
    if args.json:
        print(json.dumps({"model": title, **report_dict(tb, opts["chosen"], opts["contexts"], opts["mtp"], opts["acceptance"])}, indent=2))
        return 0
    print(title)
    print()
    print(class_table(tb))
    print()
    print(bytes_summary(tb, cfg, opts["contexts"]))
    print()
    print(ceiling_table(tb, opts["chosen"], opts["contexts"], opts["mtp"], opts["acceptance"]))
    return 0


def _layout_given(args) -> bool:
    return any(getattr(args, k) is not None for k in ("layout", "experts", "attention", "gdn", "shared", "mlp", "lm_head"))
