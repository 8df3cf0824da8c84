"""The `roofline` command: one entry point, each subcommand defined in roofline/commands/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import UserError

# Each module defines `register(subparsers)`, adding its subcommand(s) with `func` set.
COMMAND_MODULES = [
    "roofline.commands.generate",
    "roofline.commands.checkpoint",
    "roofline.commands.ceiling",
    "roofline.commands.serve",
    "roofline.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roofline", description="Qwen3.5 inference at the memory-bandwidth ceiling")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"roofline {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
