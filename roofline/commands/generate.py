"""`roofline generate` (one prompt, scripting) and `roofline chat` (interactive terminal)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError
from .flags import add_engine_args, add_speculative_args, engine_options, parse_speculative_config, start_engine


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder, Hugging Face id or cache path (default: the bundled model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    add_speculative_args(p)
    add_engine_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: generation_config.json)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate from one prompt")
    add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object: token_ids, logprobs, text, finish_reason")
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--no-thinking", action="store_true", help="enable_thinking=False")
    chat.set_defaults(func=run_chat)


def load_engine(args):
    from ..engine.engine import Engine

    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        speculative=parse_speculative_config(args), max_num_seqs=1, **engine_options(args),  # one sequence at a time
    )
    start_engine(engine, args)
    return engine


def sampling_params(engine, args):
    fields = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop")
    params = engine.default_params(**{f: getattr(args, f) for f in fields if getattr(args, f) is not None})
    try:
        return params.validate()
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def prompt_ids(engine, args) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise UserError(f"--prompt-ids must be comma-separated integers ({exc})") from exc
    if engine.tokenizer is None:
        raise UserError(f"{engine.model_dir} has no tokenizer.json: use --prompt-ids")
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], enable_thinking=not args.no_thinking)
    return engine.tokenizer.encode(text)


def run_generate(args) -> int:
    engine = load_engine(args)
    params = sampling_params(engine, args)
    ids = prompt_ids(engine, args)
    token_ids, logprobs, text, finish = [], [], [], None
    try:
        for event in engine.generate(ids, params):
            token_ids.append(event.token_id)
            logprobs.append(event.logprob)
            text.append(event.text)
            finish = event.finish_reason
            if not args.json:
                print(event.text, end="", flush=True)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        print(json.dumps({"token_ids": token_ids, "logprobs": logprobs, "text": "".join(text), "finish_reason": finish}))
    else:
        print()
    return 0


def run_chat(args) -> int:
    from ..server.reasoning import ReasoningSplitter

    engine = load_engine(args)
    if engine.tokenizer is None:
        raise UserError(f"{engine.model_dir} has no tokenizer.json: chat needs one")
    params = sampling_params(engine, args)
    messages: list[dict] = []
    print(f"roofline chat: {engine.model_dir.name} on {engine.device}. /reset clears the conversation, /exit quits.")
    while True:
        try:
            line = input("\n> ").strip()
        except EOFError:
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages.clear()
            print("(conversation cleared)")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages, enable_thinking=not args.no_thinking)
        splitter = ReasoningSplitter(starts_in_reasoning=text.rstrip().endswith("<think>"))
        answer, mode = [], None
        dim = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")  # thinking shown faint on a terminal
        try:
            for event in engine.generate(engine.tokenizer.encode(text), params):
                for kind, chunk in splitter.feed(event.text):
                    if kind != mode:
                        sys.stdout.write("\n[thinking] " if kind == "reasoning" else "\n")
                        mode = kind
                    sys.stdout.write(f"{dim[0]}{chunk}{dim[1]}" if kind == "reasoning" else chunk)
                    if kind == "content":
                        answer.append(chunk)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n(interrupted)")
        print()
        messages.append({"role": "assistant", "content": "".join(answer).strip()})
