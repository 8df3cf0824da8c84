"""Flags shared by several commands: JSON flags (with a fix for pasted typographic quotes) and speculation."""

from __future__ import annotations

import argparse
import json

from ..engine.engine import DEFAULT_BATCHED_TOKENS
from ..engine.speculative import MAX_DRAFT_TOKENS, MTP_METHODS, SpeculativeConfig
from ..errors import UserError

# Typographic quotes pasted from forums and chat apps -> the straight ones JSON needs.
_CURLY = {"\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
          "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'"}
_EXAMPLE = '\'{"method":"mtp","num_speculative_tokens":2}\''


def parse_json_flag(flag: str, value: str) -> dict:
    """A JSON object flag; typographic quotes get an error that shows the corrected line."""
    if any(ch in value for ch in _CURLY):
        fixed = "".join(_CURLY.get(ch, ch) for ch in value)
        hint = ""
        try:
            json.loads(fixed)
        except json.JSONDecodeError:
            hint = " (and check the rest of the JSON)"
        raise UserError(f"{flag} contains typographic quotes (“ ” ‘ ’), which JSON does not accept. "
                        f"Use straight quotes{hint}: {flag} '{fixed}'")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} is not valid JSON ({exc.msg} at character {exc.pos}): {value}\n"
                        f"  example: {flag} {_EXAMPLE}") from None
    if not isinstance(parsed, dict):
        raise UserError(f"{flag} must be a JSON object, got {type(parsed).__name__}: {value}")
    return parsed


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags of the CUDA fast path, shared by serve, chat and generate."""
    p.add_argument("--no-int8-lm-head", action="store_true",
                   help="keep the LM head as the checkpoint stores it (default on CUDA: quantised to INT8 per row at load)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode eagerly on per-sequence caches (as vLLM's flag; for debugging)")
    p.add_argument("--lazy-capture", action="store_true",
                   help="capture each CUDA graph bucket when a decode step first needs it: a faster start, but that step "
                        "waits for the capture (~0.2-1 s; a longer context or one more concurrent request meets a new "
                        "bucket mid-answer). Default: every bucket (batch x tokens per sequence x attention span) at start")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each decode step's tokens before launching the next (default: the next step is launched "
                        "from the sampled tokens on the device while the host reads them)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_BATCHED_TOKENS, metavar="N",
                   help=f"prompt tokens prefilled per step at most, across sequences (default {DEFAULT_BATCHED_TOKENS}): "
                        "longer prompts are prefilled in chunks over several steps, which bounds prefill memory; "
                        "decode tokens come on top")


def start_engine(engine, args: argparse.Namespace) -> None:
    """What serve, chat and generate do once the engine is loaded (serve: and its sequence count settled): capture
    every CUDA graph bucket unless --lazy-capture, then freeze the startup heap out of the garbage collector."""
    from ..engine.engine import freeze_startup_heap

    if not args.lazy_capture:
        engine.capture_graphs()  # a no-op without the pooled (CUDA-graph) decode path
    freeze_startup_heap()


def engine_options(args: argparse.Namespace) -> dict:
    """Engine.from_pretrained keywords from add_engine_args' flags; None lets the engine decide by device."""
    return {"int8_lm_head": False if args.no_int8_lm_head else None, "cuda_graphs": False if args.enforce_eager else None,
            "async_scheduling": not args.no_async_scheduling, "max_num_batched_tokens": args.max_num_batched_tokens}


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, help=f"MTP speculative decoding, as vLLM: {_EXAMPLE}")
    p.add_argument("--mtp", type=int, default=None, metavar="K", help="shorthand for --speculative-config with K draft tokens (1-4)")


def parse_speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.mtp is not None and args.speculative_config is not None:
        raise UserError("give either --mtp or --speculative-config, not both")
    if args.mtp is not None:
        return _speculative("--mtp", {"method": "mtp", "num_speculative_tokens": args.mtp})
    if args.speculative_config is None:
        return None
    return _speculative("--speculative-config", parse_json_flag("--speculative-config", args.speculative_config))


def _speculative(flag: str, config: dict) -> SpeculativeConfig:
    method = config.get("method")
    if method not in MTP_METHODS:
        raise UserError(f"{flag}: method {method!r} is not supported; roofline knows \"mtp\" (aliases: {', '.join(MTP_METHODS[1:])})")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens", "model", "draft_vocab_size"})
    if unknown:
        raise UserError(f"{flag}: unknown key(s) {', '.join(unknown)}; roofline reads method, num_speculative_tokens "
                        "and draft_vocab_size")
    vocab = config.get("draft_vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise UserError(f"{flag}: draft_vocab_size must be a positive integer (e.g. 32768), got {vocab!r}")
    k = config.get("num_speculative_tokens", 1)
    if k == "auto":
        return SpeculativeConfig(MAX_DRAFT_TOKENS, auto=True, draft_vocab_size=vocab)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise UserError(f"{flag}: num_speculative_tokens must be an integer from 1 to {MAX_DRAFT_TOKENS} or \"auto\", got {k!r}")
    return SpeculativeConfig(k, draft_vocab_size=vocab)
