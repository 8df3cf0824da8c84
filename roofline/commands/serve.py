"""`roofline serve [MODEL]`: the OpenAI-compatible HTTP server (flags named as vLLM's)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

from ..errors import UserError
from .flags import add_engine_args, add_speculative_args, engine_options, parse_speculative_config, start_engine

log = logging.getLogger("roofline.serve")

def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page",
                       description="Serve MODEL over an OpenAI-compatible API (and a chat page at /). "
                                   "Flags are named as vLLM's, so a vLLM launch line carries over.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder, Hugging Face id or cache path (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use in `model` (default: MODEL as given, or roofline-tiny)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "half", "float32", "float"],
                   help="compute dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together at most (default 16)")
    p.add_argument("--max-queued-requests", type=int, default=64,
                   help="requests that may wait for admission; beyond this they get HTTP 429 (0: refuse at once when full; default 64)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory (of available RAM on cpu) the server may use, weights included on cuda (default 0.9)")
    p.add_argument("--kv-cache-memory-bytes", default=None,
                   help="bytes for KV cache + GDN state, e.g. 8GiB (overrides --gpu-memory-utilization)")
    p.add_argument("--api-key", default=os.environ.get("ROOFLINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ROOFLINE_API_KEY, else none)")
    p.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"],
                   help="qwen3: thinking goes to reasoning_content (default); none: raw text in content")
    p.add_argument("--tool-call-parser", default="qwen3_coder", choices=["qwen3_coder", "qwen3_xml", "hermes", "none"],
                   help="parse <tool_call> blocks into tool_calls (default qwen3_coder; the three formats share one parser)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM compatibility (tool calls are parsed whenever a parser is set)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the model's")
    add_speculative_args(p)
    add_engine_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="accepted for vLLM compatibility: roofline runs on one device (only 1)")
    p.set_defaults(func=run_serve)


# -- flag parsing -------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(value: str) -> int:
    match = _SIZE.match(value)
    if not match:
        raise UserError(f"--kv-cache-memory-bytes: cannot read {value!r} as a size (examples: 4000000000, 512MiB, 8G)")
    number, unit, binary = match.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** " kmgt".index(unit.lower() or " "))


def validate_args(args) -> None:
    if args.tensor_parallel_size != 1:
        raise UserError("--tensor-parallel-size: roofline runs a model on one device; use 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.max_num_seqs < 1:
        raise UserError("--max-num-seqs must be at least 1")
    if args.max_queued_requests < 0:
        raise UserError("--max-queued-requests must be 0 or more")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UserError("--max-model-len must be at least 2")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0..65535, got {args.port}")


def cache_budget(args, engine) -> int:
    """Bytes admission may reserve for KV cache + GDN state."""
    import torch

    if args.kv_cache_memory_bytes is not None:
        return parse_bytes(args.kv_cache_memory_bytes)
    device = engine.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # The fraction covers everything on the device: weights (already loaded) included.
        return max(0, int(total * args.gpu_memory_utilization) - (total - free))
    return int(_available_ram() * args.gpu_memory_utilization)


def pooled_max_num_seqs(memory, max_model_len: int, drafts: int, budget: int, asked: int) -> int:
    """How many sequences the CUDA-graph decode path can preallocate within `budget` (at most `asked`): each slot holds
    a full context (no paging yet), with MTP also the head's KV, a second GDN state buffer and the verify's rollback
    saves."""
    fixed = memory.pooled_bytes(max_model_len, 0, drafts)
    slot = memory.pooled_bytes(max_model_len, 1, drafts) - fixed
    if fixed + slot > budget:
        raise UserError(f"the CUDA-graph decode path preallocates {_gib(fixed + slot)} for one sequence at "
                        f"--max-model-len {max_model_len} (KV cache and GDN state"
                        + (f", the MTP head's KV and the verify's rollback saves for {drafts} draft tokens" if drafts else "")
                        + f"), but {_gib(budget)} is left: lower --max-model-len"
                        + (" or the number of speculative tokens" if drafts else ""))
    fits = min(asked, (budget - fixed) // slot)
    if fits < asked:
        log.warning("--max-num-seqs %d lowered to %d: the CUDA-graph decode path preallocates a full context per "
                    "sequence (%s each); lower --max-model-len for more sequences", asked, fits, _gib(slot))
    return fits


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def _gib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


# -- the command --------------------------------------------------------------------------

def run_serve(args) -> int:
    validate_args(args)
    speculative = parse_speculative_config(args)
    budget_override = parse_bytes(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes is not None else None
    chat_template = None
    if args.chat_template:
        try:
            chat_template = open(args.chat_template, encoding="utf-8").read()
        except OSError as exc:
            raise UserError(f"--chat-template: cannot read {args.chat_template}: {exc.strerror}") from None

    import uvicorn

    from ..engine.engine import Engine
    from ..hub import resolve_model
    from ..server.app import ServerConfig, create_app
    from ..server.scheduler import CacheMemory

    sock = bind_socket(args.host, args.port)  # before loading: a busy port fails in a second, not after minutes
    model_dir = resolve_model(args.model)
    dtype = {"auto": None, "half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    log.info("loading the model from %s ...", model_dir)
    start = time.monotonic()
    try:
        engine = Engine.from_pretrained(str(model_dir), device=args.device, dtype=dtype, max_model_len=args.max_model_len,
                                        speculative=speculative, **engine_options(args))
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load {model_dir}: {exc}") from exc
    params = sum(p.numel() for p in engine.model.parameters())
    log.info("loaded in %.1f s: %.1fM parameters on %s (%s), context %d tokens",
             time.monotonic() - start, params / 1e6, engine.device, engine.model.dtype, engine.max_model_len)
    if chat_template is not None:
        if engine.tokenizer is None:
            raise UserError("--chat-template: this model has no tokenizer.json")
        engine.tokenizer.chat_template = chat_template
    if speculative:
        log.info("MTP speculative decoding: %d draft token(s) per step", speculative.num_speculative_tokens)

    memory = CacheMemory.for_model(engine.model.config, engine.model.dtype)
    budget = budget_override if budget_override is not None else cache_budget(args, engine)
    full = memory.sequence_bytes(engine.max_model_len)
    if full > budget:
        fits = memory.max_tokens_within(budget)
        raise_flag = "--kv-cache-memory-bytes" if budget_override is not None else "--gpu-memory-utilization"
        advice = f"use --max-model-len {fits} or less, or raise {raise_flag}" if fits >= 16 else f"raise {raise_flag}"
        raise UserError(
            f"one sequence of --max-model-len {engine.max_model_len} tokens needs {_gib(full)} of KV cache and GDN state, "
            f"but {'--kv-cache-memory-bytes gives' if budget_override is not None else 'what is left after the weights is'} {_gib(budget)}; {advice}")
    log.info("KV + state memory: %s budget, %d bytes per token + %d per sequence: %d sequences of full context at once",
             _gib(budget), memory.kv_bytes_per_token, memory.state_bytes_per_sequence, budget // full)
    max_num_seqs = args.max_num_seqs
    if engine.pooled_decode:  # each slot holds a full context (no paging yet): as many as the budget holds
        drafts = engine.speculator.k_max if engine.speculator else 0
        max_num_seqs = pooled_max_num_seqs(memory, engine.max_model_len, drafts, budget, args.max_num_seqs)
        engine.max_num_seqs = max_num_seqs
    start_engine(engine, args)  # before the server takes requests: none waits for a graph capture

    names = args.served_model_name or [args.model if args.model else "roofline-tiny"]
    config = ServerConfig(
        served_model_names=names, api_key=args.api_key or None, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, max_num_seqs=max_num_seqs, max_queued_requests=args.max_queued_requests,
        cache_budget_bytes=budget,
    )
    app = create_app(engine, config)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines%s", args.host,
                    "" if config.api_key else " with no API key (set --api-key)")
    level = logging.getLogger().getEffectiveLevel()
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=logging.getLevelName(level).lower(),
        access_log=level <= logging.INFO, timeout_graceful_shutdown=3, log_config=None,
    ))
    asyncio.run(_serve(server, sock, names[0]))
    return 0


def bind_socket(host: str, port: int):
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (is another server running there? choose another --port)" if exc.errno == 98 else ""
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


async def _serve(server, sock, model_name: str) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
        print(f"roofline serve: {model_name} ready at {url}  (chat page: {url}/ , OpenAI API: {url}/v1)", flush=True)
    await task
    if not server.started:
        raise UserError(f"the server could not start on {server.config.host}:{server.config.port} (see the log above; is the port in use?)")
