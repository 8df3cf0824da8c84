"""`roofline bench synthetic`: the engine's decode step on full-size random weights, against the bandwidth ceiling.

Builds a published shape (qwen3.5-122b-a10b, -35b-a3b, 27b) in a layout directly on the GPU
(random but sane values, nothing downloaded), installs the fast path, preallocates the cache
pool for one sequence of the longest context asked (so the memory figure includes it), and
measures in the same run:

- the device's copy bandwidth (a large device-to-device copy, bytes read + written);
- bytes read per token, counted from the engine's own tensors (weights by class, routed
  experts at top-k of E, GDN state read and written, KV per context token);
- decode time per token at batch 1 at each context (median of repeats of the whole engine
  step: inputs copied in, the captured graph replayed, the next token read back), tok/s and
  the fraction of the ceiling (bytes per token / copy bandwidth, over the step time);
- the step time for M = 2..4 tokens per sequence (the MTP verify step) against M = 1, on distinct
  token ids (rows routed independently, as a verify step's drafts are) and on one id repeated (the
  rows route alike: M = 1's bytes, so what the extra rows cost the kernels);
- a breakdown: each component (attention, GDN, routed experts, shared expert, LM head)
  captured as its own graph over all layers; "rest" is the whole step minus their sum;
- the MTP draft step and the tok/s of MTP-k at stated acceptance rates, labelled modelled
  (random weights say nothing about acceptance);
- prefill through the engine (a fresh sequence's prompt and first token, llama-bench's "pp");
- the engine's own decode loop (`Engine.step`: sampling, each token read back, length checks),
  greedy and with Qwen3.5's recommended sampling, with async scheduling off and on: the speed
  a user of one stream gets, and whether launching the next step ahead hides the host's part;
- peak GPU memory.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.loader import plan_model
from ..checkpoint.random import random_tensor
from ..checkpoint.reader import TensorInfo
from ..checkpoint.shapes import PLANNED, describe_layout, layout_tensors, shape_config
from ..config import ModelConfig
from ..engine.cache import CachePool, SlotCache
from ..engine.engine import Engine, freeze_startup_heap
from ..engine.graphs import DecodeGraphs
from ..engine.sampling import SamplingParams
from ..engine.speculative import SpeculativeConfig
from ..kernels.dispatch import INT4_GEMM_KINDS, install_fast_path, install_weight_kernel, int4_gemm_wanted, use_int4_gemm
from ..model.layers import SlotBatch
from ..quant.base import LinearWeight
from .ceiling import TokenBytes, token_bytes

log = logging.getLogger("roofline.bench")

# The issue's default layout: public INT4 (experts, attention, GDN), shared experts FP8, INT8 LM head.
DEFAULT_LAYOUT = "hybrid"
DECODE_ROUNDS = 3  # timed rounds over the context rows, their median reported (decode_rows)


def build_synthetic_model(shape: str, formats: dict[str, str], device, dtype=None, layers: int | None = None,
                          seed: int = 0):
    """The model of `shape` with every weight in its `formats` storage, filled with random values on `device`; in
    `dtype`, by default bf16 on CUDA and fp32 elsewhere (the kernels' CPU dry runs: the interpreter gets bf16 wrong)."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(shape_config(shape, layers), source=f"shape {shape}")
    model, _, report = plan_model(cfg, layout_tensors(cfg, formats), device, dtype)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearWeight):
                for buf_name, buf in module.named_buffers(recurse=False):
                    buf.copy_(random_tensor(f"{name}.{buf_name}", buf.dtype, tuple(buf.shape), seed, module.in_features, device))
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, param.dtype, tuple(param.shape), seed, None, device))
    model.to(device)
    return model, report


def engine_token_bytes(model) -> TokenBytes:
    """Bytes per decoded token from the tensors the model holds (the ceiling's rules, the engine's tensors)."""
    tensors = {name: TensorInfo(name, PLANNED, t.dtype, tuple(t.shape))
               for name, t in [*model.named_parameters(), *model.named_buffers()] if t.dim() and "rotary" not in name}
    return token_bytes(model.config, tensors)


def measure_copy_bandwidth(device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (median of repeats)."""
    if torch.device(device).type != "cuda":  # the interpreter's dry run (tests): a small copy, wall-clock timed
        nbytes, repeats = min(nbytes, 64 << 20), min(repeats, 3)
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (device_ms(lambda: dst.copy_(src), repeats, warmup=3) / 1e3)


def _median_ms(fn, repeats: int, warmup: int = 3) -> float:
    """Median wall time of `fn` (which ends in a host sync) in ms, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def device_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median device time of `fn` (timed with CUDA events, each call alone), in ms; the wall time without CUDA."""
    if not torch.cuda.is_available():
        return _median_ms(fn, repeats, warmup=0)
    times = []
    for _ in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])


def _graph_ms(fn, repeats: int) -> float:
    """Median device time of `fn` captured alone as a CUDA graph, in ms per call (run eagerly without CUDA)."""
    if not torch.cuda.is_available():
        return device_ms(fn, repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return device_ms(graph.replay, repeats)


@dataclass
class SyntheticRun:
    model: torch.nn.Module
    pool: CachePool
    graphs: DecodeGraphs
    cache: SlotCache
    mtp_pool: CachePool | None


def fill_context(run: SyntheticRun, context: int, seed: int = 0) -> None:
    """Pretend the sequence holds `context` tokens: random KV up to there, random GDN state."""
    gen = torch.Generator(run.model.device).manual_seed(seed)
    slot = run.cache.slot
    for kv in (*run.pool.keys.values(), *run.pool.values.values()):
        kv[slot, :context].normal_(generator=gen)
    for state in run.cache.recurrent.values():  # views of the pool's rows that hold the sequence's state now
        state.normal_(generator=gen).mul_(0.01)
    run.cache.num_tokens = 0
    run.cache.advance(context)


def step_ids(vocab: int, m: int, distinct: bool) -> list[int]:
    """Token ids of a timed m-token step: one id repeated (the rows route alike, so the step reads M = 1's experts:
    what more rows cost the kernels), or m distinct ids (the rows route independently, as a verify step's last
    token and drafts do: the experts a real verify step reads)."""
    if not distinct or m == 1:
        return [1] * m
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(m))[:m].tolist()


def decode_ms(run: SyntheticRun, m: int, repeats: int, rollback: bool = False, distinct: bool = False) -> tuple[float, float]:
    """(engine step ms: inputs in, graph replay, argmax read back; replay alone ms): one sequence, m tokens
    (`step_ids`). With `rollback` the step writes the GDN states to the spare buffers and saves each position's
    step record, as the engine's MTP verify does. Without graphs (the interpreter's dry run) there is no replay: the
    step's time twice, no warm-up."""
    ids = step_ids(run.model.config.vocab_size, m, distinct)

    def step():
        buf = run.graphs.run(ids, [run.cache], m, rollback=rollback)
        buf.logits[:m].argmax(-1).tolist()

    step_ms = _median_ms(step, repeats, warmup=3 if run.graphs.use_graphs else 0)
    if not run.graphs.use_graphs:
        return step_ms, step_ms
    buf = run.graphs.run(ids, [run.cache], m, rollback=rollback)
    return step_ms, device_ms(buf.graph.replay, repeats)


def in_rounds(measures: dict, rounds: int) -> dict:
    """Each measure (a call that times once and returns {field: ms}) taken `rounds` times, the keys in alternating
    order round by round (forward, backward, forward...): per key, each field's median and every round's values
    under "rounds". Timed once, right after its capture, a graph of this bench read ~0.15 ms slow on an H100
    (session 42, benchmarks/graph_order.py: 8K after 0 3.739 ms, the same graph 3.580 in later rounds; 0 after 8K
    3.589 against 3.448), and the first round at times reads ~0.03 ms fast, at times ~0.05 slow: capture every
    graph before the first round."""
    keys = list(measures)
    taken = {key: [] for key in keys}
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            taken[key].append(measures[key]())
    return {key: {**{f: statistics.median(t[f] for t in got) for f in got[0]}, "rounds": got} for key, got in taken.items()}


def decode_rows(run: SyntheticRun, contexts, repeats: int, rounds: int) -> dict[int, dict]:
    """Per context: {"step_ms", "replay_ms": medians over `rounds` rounds (`in_rounds`), "rounds": each round's
    pair}, every context's graph captured first."""
    for context in contexts:
        run.graphs.buffers_for(1, 1, context + 1)  # captured where new (a step at `context` meets this bucket)

    def at(context: int) -> dict:
        fill_context(run, context)
        step, replay = decode_ms(run, 1, repeats)
        return {"step_ms": step, "replay_ms": replay}

    return in_rounds({c: functools.partial(at, c) for c in contexts}, rounds)


def verify_rows(run: SyntheticRun, rollback_run: SyntheticRun | None, ms, repeats: int, rounds: int) -> dict:
    """The M-token steps at the cache's length, per (m, "distinct" | "repeated" ids, rollback): the step ms, median
    over `rounds` rounds (`in_rounds`), every graph captured first. Without the rollback on `run`; with it (the
    verify step as an engine with MTP runs it) on `rollback_run`, whose DecodeGraphs holds those buckets apart
    (DecodeGraphs keys a bucket without the rollback, and one with it replaces one without); None: no such rows."""
    runs = {False: run} if rollback_run is None else {False: run, True: rollback_run}
    cases = [(m, ids, rollback) for m in ms for rollback in runs for ids in ("distinct", "repeated")]
    for m, _, rollback in cases:
        runs[rollback].graphs.buffers_for(1, m, runs[rollback].cache.num_tokens + m, rollback)

    def step(m: int, ids: str, rollback: bool) -> dict:
        return {"step_ms": decode_ms(runs[rollback], m, repeats, rollback=rollback, distinct=ids == "distinct")[0]}

    return in_rounds({case: functools.partial(step, *case) for case in cases}, rounds)


def distinct_experts(run: SyntheticRun, m: int, distinct: bool = False) -> float | None:
    """Mean number of distinct routed experts per MoE layer that the timed m-token step (`step_ids`) reads (each
    row routes on its own, so a step reads up to m x top_k experts a layer): the same step run once eagerly, with
    the MoE blocks' routing recorded. None for a dense model or where the blocks record nothing. One token reads
    exactly its top_k (top-k picks distinct experts): no step is run for it (a whole eager step in CI's dry run)."""
    from ..kernels.blocks import recording_routes

    if not run.model.config.is_moe:
        return None
    if m == 1:
        return run.model.config.num_experts_per_tok
    eager = DecodeGraphs(run.model, run.pool, 1, use_graphs=False)
    with recording_routes() as routes:
        eager.run(step_ids(run.model.config.vocab_size, m, distinct), [run.cache], m)
    return statistics.mean(len(torch.unique(r)) for r in routes) if routes else None


def _each_int4_gemm(model, weights: str):
    """Each INT4 many-rows path (`INT4_GEMM_KINDS`) that some of `model`'s INT4 `weights` ("experts": routed
    experts, which alone change a prefill; "any": dense ones too) take, with the model switched to it; None once
    where none does. Afterwards the model is back on the path ROOFLINE_INT4_GEMM asks for."""
    try:
        any_taken = False
        for kind in INT4_GEMM_KINDS:
            counts = use_int4_gemm(model, kind)
            if counts["experts"] if weights == "experts" else sum(counts.values()):
                any_taken = True
                yield kind
        if not any_taken:
            yield None
    finally:
        use_int4_gemm(model, int4_gemm_wanted())


def batch_decode(model, shapes=((8, 1), (8, 3)), repeats: int = 10, capacity: int = 2048, warmup: int = 3) -> list[dict]:
    """Decode steps of B sequences x M tokens (batched serving; M > 1: MTP verify rows), context ~16, by each INT4
    many-rows path (`INT4_GEMM_KINDS`): past 4 dense rows the default dequantises each INT4 weight per step, past 16
    expert rows it loops over experts and runs without a CUDA graph; "triton" keeps such steps on one kernel and in a
    graph. Per row: the step (inputs in, replay or eager run, argmax read back), whether it was captured, and the
    tokens it carries per second. A pool of its own (B slots of `capacity` tokens)."""
    cfg = model.config
    rows = []
    for kind in _each_int4_gemm(model, "any"):
        pool = CachePool(cfg, cfg.layer_types, max(b for b, _ in shapes), capacity, model.device, model.dtype)
        graphs = DecodeGraphs(model, pool, pool.num_slots, use_graphs=model.device.type == "cuda")
        for b, m in shapes:
            caches = [pool.acquire() for _ in range(b)]
            for cache in caches:
                cache.advance(16)
            ids = [1] * (b * m)

            def step(caches=caches, ids=ids, m=m):
                buf = graphs.run(ids, caches, m)
                buf.logits[: len(ids)].argmax(-1).tolist()

            ms = _median_ms(step, repeats, warmup)
            captured = graphs.buffers_for(b, m, 16 + m)[0].graph is not None
            rows.append({"sequences": b, "m": m, "rows": b * m, "int4_gemm": kind, "step_ms": ms, "cuda_graph": captured,
                         "row_tokens_per_s": b * m / ms * 1e3})
            for cache in caches:
                pool.release(cache)
        del graphs, pool
    return rows


def breakdown_ms(run: SyntheticRun, context: int, repeats: int) -> dict[str, float]:
    """Each component captured alone over all layers (batch 1, one token), summed by class, in ms."""
    model, pool, dev = run.model, run.pool, run.model.device
    x = torch.randn(1, model.config.hidden_size, device=dev, dtype=model.dtype)
    batch = SlotBatch(pool, torch.tensor([run.cache.slot], dtype=torch.int32, device=dev),
                      torch.tensor([context], device=dev), torch.tensor([context + 1], dtype=torch.int32, device=dev),
                      1, min(pool.max_len, max(1024, 1 << context.bit_length())),
                      state_in=torch.tensor([run.cache.state_row], dtype=torch.int32, device=dev))
    totals = dict.fromkeys(COMPONENTS[:-1], 0.0)
    for layer in model.model.layers:
        full = layer.layer_type == "full_attention"
        mixer = layer.self_attn if full else layer.linear_attn
        totals["attention" if full else "gdn"] += _graph_ms(lambda: mixer(layer.input_layernorm(x), batch), repeats)
        moe = layer.mlp
        if hasattr(moe, "experts"):
            totals["routed experts"] += _graph_ms(lambda: moe.experts(x, *moe.route(x)), repeats)
            totals["shared expert"] += _graph_ms(lambda: moe.shared_expert(x), repeats)  # its gate logit comes with the router's
        else:
            totals["dense mlp"] = totals.get("dense mlp", 0.0) + _graph_ms(lambda: moe(x), repeats)
    totals["lm head"] = _graph_ms(lambda: model.logits(model.model.norm(x)), repeats)
    return totals


def kernel_profile(replay, overlapped: bool, steps: int = 5, first: int = 80) -> dict:
    """The kernels one replay of a captured step runs, from the CUDA profiler: per kernel name the launches and
    device time per step, their sum against the step's wall time (the difference is launch gaps), and the first
    `first` kernels of one step in order with the idle time before each. `overlapped`: the kernels ran with
    programmatic dependent launch, so each one's time includes its wait for the previous kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time_total > 0),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return {"note": "the profiler recorded no kernels inside the graph replays"}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time_total)
    per_step = len(kernels) / steps
    busy = sum(e.device_time_total for e in kernels) / steps
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / steps
    one = kernels[: int(per_step)]
    order = [{"name": e.name[:80], "us": round(e.device_time_total, 2),
              "idle_before_us": round(e.time_range.start - prev.time_range.end, 2) if prev else 0.0}
             for prev, e in zip([None, *one[:first]], one[:first])]
    table = sorted(({"name": n[:80], "launches": len(t) / steps, "us": sum(t) / steps} for n, t in by_name.items()),
                   key=lambda row: -row["us"])
    return {"kernels_per_step": per_step, "kernel_us_per_step": busy, "span_us_per_step": span,
            "by_kernel": table, "first_kernels": order, "programmatic_dependent_launch": overlapped,
            "note": "kernel times from the CUDA profiler over graph replays; span - kernel time = idle gaps" + (
                "; with programmatic dependent launch the kernels overlap: each time includes the wait for the previous "
                "kernel and the sum exceeds the span (ROOFLINE_PDL=0 gives a per-kernel breakdown)" if overlapped else "")}


DRAFT_VOCAB = 32768  # a draft LM head over the first 32K token ids (the acceptance it keeps is not measured here)
COMPONENTS = ("attention", "gdn", "routed experts", "shared expert", "lm head", "rest")


def draft_ms(run: SyntheticRun, repeats: int, vocab: int | None = None) -> float | None:
    """One MTP draft step for one sequence (head layer, norm, LM head, argmax) as a captured graph, in ms.
    With `vocab`, the LM head reads only its first `vocab` rows (a draft over the most frequent tokens)."""
    model = run.model
    if model.mtp is None or run.mtp_pool is None:
        return None
    dev = model.device
    cache = run.mtp_pool.acquire()
    ids = torch.tensor([1], device=dev)
    hidden = torch.randn(1, model.config.hidden_size, device=dev, dtype=model.dtype)
    batch = SlotBatch(run.mtp_pool, torch.tensor([cache.slot], dtype=torch.int32, device=dev), torch.tensor([0], device=dev),
                      torch.tensor([1], dtype=torch.int32, device=dev), 1, 1024)
    head = model.lm_head
    if vocab is not None:
        head = model.lm_head.take_rows(torch.arange(vocab, device=dev))
        install_weight_kernel(head)
    try:
        return _graph_ms(lambda: head(model.mtp_slot_forward(ids, hidden, batch)).argmax(-1), repeats)
    finally:
        run.mtp_pool.release(cache)


TARGETS_SHAPE = "qwen3.5-122b-a10b"  # the shape issue 4's targets are set on (H200)


def issue_targets(r: dict) -> list[dict]:
    """Issue 4's end-to-end targets against this run, for the 122B shape (others: []): each row's figure, what the
    target asks, met or missed and by how much; a row whose figure this run did not measure is left out. The INT8
    LM head's and the grouped experts' targets (fractions of copy bandwidth) are kernel figures:
    benchmarks/kernels.py."""
    if r["shape"] != TARGETS_SHAPE or r.get("layers"):
        return []
    rows = []

    def add(name: str, got: float, want: float, at_least: bool, unit: str = "") -> None:
        met = got >= want if at_least else got <= want
        rows.append({"target": name, "got": got, "want": want, "at_least": at_least, "met": met,
                     "short_by": 0.0 if met else abs(want - got), "unit": unit})

    for context, want in ((0, 0.70), (32768, 0.60)):
        row = next((d for d in r["decode"] if d["context"] == context), None)
        if row:
            add(f"decode at context {context}, fraction of the ceiling", row["fraction_of_ceiling"], want, True)
    m3 = next((t for t in r["tokens_per_sequence"] if t["m"] == 3 and t.get("token_ids") == "distinct"), None)
    if m3:
        add("verify step M=3 (distinct ids) vs M=1", m3["vs_m1"], 1.6, False, "x")
    by_k = r.get("mtp", {}).get("verify_step_ms", {})
    rollback = by_k.get(2, by_k.get("2"))  # an int key in the run, a string once written as JSON and read back
    if rollback:
        add("verify step M=3 as the engine runs it (rollback saves) vs M=1", rollback / r["tokens_per_sequence"][0]["step_ms"],
            1.6, False, "x")
    if r.get("peak_memory_bytes") and r["capacity_tokens"] >= 262144:
        add("peak GPU memory with a 256K-token context, GB", r["peak_memory_bytes"] / 1e9, 100.0, False)
    return rows


def modelled_mtp(decode_1: float, verify: dict[int, float], draft: float, acceptance: tuple[float, ...]) -> list[dict]:
    """tok/s of MTP-k from measured step times and stated acceptance rates (modelled, not measured)."""
    rows = []
    for k, verify_ms in sorted(verify.items()):
        if k > len(acceptance):
            continue
        tokens = 1 + sum(acceptance[:k])
        step = verify_ms + k * draft
        rows.append({"k": k, "acceptance": list(acceptance[:k]), "tokens_per_step": tokens, "step_ms": step,
                     "tok_s": 1e3 * tokens / step, "speedup": tokens * decode_1 / step, "modelled": True})
    return rows


# The engine loop's sampling: greedy, and Qwen3.5's recommended thinking-mode sampling (a top-k/top-p filter
# over the whole vocabulary every token).
ENGINE_SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}}


def _one_sequence_engine(model, max_model_len: int, **engine_args) -> Engine:
    """An engine on the synthetic model for one sequence at a time, decoding through its pooled caches and graphs."""
    return Engine(model, None, Path("synthetic"), max_model_len=max_model_len, pooled_decode=True, max_num_seqs=1,
                  **engine_args)


@contextlib.contextmanager
def collector_pauses():
    """The garbage collector's runs inside the block, as a list of (generation, ms) filled when it exits."""
    pauses, started = [], {}

    def note(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            pauses.append((info["generation"], (time.perf_counter() - started.pop("t")) * 1e3))

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


def _engine_steps(model, tokens: int, warmup: int, prompt_tokens: int, sampling: dict, **engine_args):
    """Decode one sequence through `Engine.step` after a short prompt, its graphs captured first: (engine, sequence,
    timing: mean ms per step after `warmup` steps, steps timed, the slowest of them, the garbage collector's runs and
    ms over the whole loop)."""
    engine = _one_sequence_engine(model, prompt_tokens + tokens + 1, **engine_args)
    engine.capture_graphs()  # as serve does: no step below waits for a capture (the last plain steps near the length
    # limit met a new bucket and took 170 ms on an H100, +0.7 ms on the mean MTP step)
    freeze_startup_heap()  # as serve does
    seq = engine.add([1] * prompt_tokens, SamplingParams(max_tokens=tokens, ignore_eos=True, **sampling))
    stamps = []
    with collector_pauses() as pauses:
        while engine.sequences:
            if engine.step():
                stamps.append(time.perf_counter())
    steady = stamps[min(warmup, len(stamps) // 2):]
    gaps = [(b - a) * 1e3 for a, b in zip(steady, steady[1:])] or [0.0]
    timing = {"ms": (steady[-1] - steady[0]) / max(1, len(steady) - 1) * 1e3, "steps": len(steady) - 1,
              "slowest_step_ms": max(gaps), "gc_runs": len(pauses), "gc_ms": sum(ms for _, ms in pauses)}
    return engine, seq, timing


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The index of the first token where `tokens` and `reference` differ (the shorter one's length where one is a
    prefix of the other), None where they are equal."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def engine_loop(model, tokens: int = 256, warmup: int = 16, prompt_tokens: int = 16, mtp: int = 2) -> list[dict]:
    """Per sampling mode and async scheduling off / on: ms per token of `Engine.step` decoding one sequence, the
    steps launched ahead, and whether the tokens equal those with async scheduling off (they must). With an MTP
    head, one more row: greedy MTP-`mtp` steps (random weights: acceptance near 0, so this is the step's cost)."""
    rows, greedy_tokens = [], None
    for name, sampling in ENGINE_SAMPLING.items():
        tokens_off = None  # the run with async scheduling off comes first
        for on in (False, True):
            engine, seq, t = _engine_steps(model, tokens, warmup, prompt_tokens, sampling, async_scheduling=on)
            rows.append({"sampling": name, "async_scheduling": on, "tokens": len(seq.output_ids), "ms_per_token": t["ms"],
                         "slowest_step_ms": t["slowest_step_ms"], "gc_runs": t["gc_runs"], "gc_ms": t["gc_ms"],
                         "tok_s": 1e3 / t["ms"], "steps_launched_ahead": engine.steps_launched_ahead,
                         "tokens_equal_async_off": seq.output_ids == tokens_off if on else None})
            tokens_off = seq.output_ids
            if name == "greedy" and not on:
                greedy_tokens = seq.output_ids
    if model.mtp is not None and mtp:
        engine, seq, t = _engine_steps(model, tokens, warmup, prompt_tokens, ENGINE_SAMPLING["greedy"],
                                       speculative=SpeculativeConfig(mtp))
        spec = engine.speculator
        rows.append({"sampling": "greedy", "mtp": mtp, "tokens": len(seq.output_ids), "ms_per_step": t["ms"],
                     "steps": t["steps"], "slowest_step_ms": t["slowest_step_ms"], "gc_runs": t["gc_runs"],
                     "gc_ms": t["gc_ms"],
                     "tokens_per_step": spec.mean_accepted_length(), "acceptance": spec.acceptance_rates(),
                     "tokens_equal_without_mtp": seq.output_ids == greedy_tokens,
                     "first_difference_without_mtp": first_difference(seq.output_ids, greedy_tokens)})
    return rows


def engine_prefill(model, prompts=(4096,), repeats: int = 3, warmup_tokens: int = 512) -> list[dict]:
    """Prompt processing through `Engine.step` (llama-bench's "pp"): per prompt length, the median time of the
    step that prefills a fresh sequence and samples its first token (time to first token, no queueing), after
    one `warmup_tokens` prompt that compiles the prefill kernels. The median of 3 leaves out a first run that still
    tunes kernels for a new length (fla's autotuning is per shape: a median of 2 averaged it in, H200 session 14).
    A model with INT4 routed experts is timed with each INT4 many-rows path (`INT4_GEMM_KINDS`: dequantise + torch
    with the experts in a loop, the Triton GEMM with the experts grouped); each row says which, and whether its
    first token is the first path's. Prompts prefill in chunks of the engine's default max_num_batched_tokens; on
    CUDA each row has the peak memory of its prefills (the caller's peak is kept)."""
    vocab = model.config.vocab_size
    engine = _one_sequence_engine(model, max(*prompts, warmup_tokens) + 2)
    cuda = model.device.type == "cuda"
    rows = []
    for kind in _each_int4_gemm(model, "experts"):
        for index, n in enumerate((warmup_tokens, *prompts)):
            ids = [(7919 * i + 13) % vocab for i in range(n)]  # varied ids, the same every run
            times = []
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(repeats if index else 1):
                seq = engine.add(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                start = time.perf_counter()
                while engine.sequences:
                    engine.step()  # one step: the prefill and its first token, read back
                times.append((time.perf_counter() - start) * 1e3)
            if index:
                ms = statistics.median(times)
                first = next((r["first_token"] for r in rows if r["prompt_tokens"] == n), seq.output_ids[0])
                rows.append({"prompt_tokens": n, "int4_gemm": kind, "ms": ms, "tok_s": n / ms * 1e3,
                             "first_token": seq.output_ids[0], "first_token_as_first_kind": seq.output_ids[0] == first,
                             "max_num_batched_tokens": engine.max_num_batched_tokens,
                             "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None})
    return rows


def _pool_bytes(pool: CachePool, kernel: int, m: int = 1) -> tuple[int, int]:
    """(GDN state bytes an m-token step of one slot reads and writes: the recurrent states read and written once,
    the K-1 conv inputs before the step read from the ring and its m written; KV bytes read per context token)."""
    recurrent = sum(t[0].numel() * t.element_size() for t in pool.recurrent.values())
    conv = sum((kernel - 1 + m) * t.shape[-1] * t.element_size() for t in pool.conv.values())
    return 2 * recurrent + conv, pool.kv_bytes_per_token


def _step_bytes(run: SyntheticRun, tb: TokenBytes, m: int, step_ms: float, copy_bw: float, distinct: bool = False) -> dict:
    """What an m-token step at context 0 reads, with the routed experts it really touches (distinct_experts) in
    place of one token's top_k, and that against its time: why a verify step costs what it does."""
    experts = distinct_experts(run, m, distinct)
    if experts is None:
        return {}
    state, _ = _pool_bytes(run.pool, run.model.config.linear_conv_kernel_dim, m)
    nbytes = tb.weights + tb.experts_stored * (experts - tb.top_k) / tb.num_experts + state
    return {"distinct_experts_per_layer": experts, "bytes": nbytes,
            "fraction_of_ceiling": nbytes / copy_bw / (step_ms / 1e3)}


def measured_part(result: dict, name: str, measure, progress) -> bool:
    """result[name] = measure(); if it raises (a prefill out of memory, say), the error goes to result["errors"]
    instead, with the section's name, so the parts measured before and after it are still written; the command
    then exits non-zero. Returns whether the part was measured."""
    try:
        result[name] = measure()
        return True
    except Exception as exc:  # any failure: recorded by name in the result and reported, never dropped
        message = f"{type(exc).__name__}: {exc}"
        result.setdefault("errors", []).append({"part": name, "error": message[:2000]})
        progress(f"{name} FAILED, not measured: {message[:500]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return False


def run_synthetic(shape: str, formats: dict[str, str], contexts=(0, 8192, 32768), verify_tokens=(2, 3, 4),
                  repeats: int = 50, acceptance=(0.95, 0.80), layers: int | None = None, capacity: int = 262144,
                  device: str = "cuda", progress=print, profile: bool = False, engine_tokens: int = 256,
                  prefill=(4096,), batches=((8, 1), (8, 3))) -> dict:
    """Everything the module docstring lists, as a JSON-ready dict. On device "cpu" under TRITON_INTERPRET=1 (the
    tests' dry run of every part on the tiny shape) the kernels run in the interpreter in fp32, nothing is captured
    or profiled, times are wall-clock and no peak memory is recorded."""
    from ..errors import UserError
    from .environment import environment

    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UserError("bench synthetic measures the CUDA decode path: no CUDA device here")
    result = {"benchmark": "synthetic", "shape": shape, "layers": layers, "environment": environment(device)}
    copy_bw = measure_copy_bandwidth(device)
    progress(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    start = time.perf_counter()
    model, _ = build_synthetic_model(shape, formats, device, layers=layers)
    cfg = model.config
    result["layout"] = describe_layout(formats, cfg)
    progress(f"built {shape} ({result['layout']}) with random weights in {time.perf_counter() - start:.1f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peak while serving: weights, cache pool, graphs (not the build's temporaries)
    fast = install_fast_path(model, allow_cpu=not cuda)
    if not fast.graph_ready:
        raise UserError("the decode step cannot be captured: " + ("; ".join(fast.graph_blockers) or "no fast path"))
    capacity = max(capacity, max(contexts) + max(verify_tokens, default=1) + 1)
    # two GDN state buffers: the verify rows run with the rollback, as the engine does with MTP
    pool = CachePool(cfg, cfg.layer_types, 1, capacity, device, model.dtype, state_buffers=2)
    mtp_pool = CachePool(cfg, ["full_attention"], 1, capacity, device, model.dtype) if model.mtp is not None else None
    run = SyntheticRun(model, pool, DecodeGraphs(model, pool, 1, use_graphs=cuda), pool.acquire(), mtp_pool)

    tb = engine_token_bytes(model)
    state_bytes, kv_per_token = _pool_bytes(pool, cfg.linear_conv_kernel_dim)
    result.update({
        "copy_bandwidth": copy_bw,
        "kernels": dict(fast.installed),
        "int4_order": fast.int4_order,
        "capacity_tokens": capacity,
        "bytes": {"weights_per_token": tb.weights, "routed_experts_stored": tb.experts_stored, "dense": tb.dense,
                  "lm_head": tb.lm_head, "embed_row": tb.embed_row, "gdn_state_rw": state_bytes,
                  "kv_per_context_token": kv_per_token, "note": "INT4 zero points counted though symmetric kernels skip them"},
    })
    rows = []
    # one round without graphs: the dry run's interpreter steps are slow, and it has no GPU transient to outlast
    rounds = DECODE_ROUNDS if cuda else 1
    for context, row in decode_rows(run, contexts, repeats, rounds).items():
        step, replay = row["step_ms"], row["replay_ms"]
        per_token = tb.weights + state_bytes + kv_per_token * context
        ceiling = copy_bw / per_token
        rows.append({"context": context, "step_ms": step, "replay_ms": replay, "tok_s": 1e3 / step,
                     "bytes_per_token": per_token, "ceiling_tok_s": ceiling, "fraction_of_ceiling": 1e3 / step / ceiling,
                     "rounds": row["rounds"]})
        progress(f"context {context}: {1e3 / step:.1f} tok/s ({step:.3f} ms/token, graph {replay:.3f} ms), "
                 f"ceiling {ceiling:.0f} tok/s -> {rows[-1]['fraction_of_ceiling']:.2f}")
    result["decode"] = rows

    fill_context(run, 0)
    at_zero = next(((r["step_ms"], r["replay_ms"]) for r in rows if r["context"] == 0), None) or decode_ms(run, 1, repeats)
    # M rows twice: distinct ids (a real verify step's bytes: the target's figure) and one id repeated (M = 1's
    # bytes); with an MTP head also as the engine's verify runs them, saving for the rollback (on graphs of their own)
    rollback_run = None
    if run.mtp_pool is not None:
        rollback_run = SyntheticRun(model, pool, DecodeGraphs(model, pool, 1, use_graphs=cuda), run.cache, mtp_pool)
    m_steps = verify_rows(run, rollback_run, verify_tokens, repeats, rounds)
    verify = {1: at_zero[0], **{m: m_steps[m, "distinct", False]["step_ms"] for m in verify_tokens}}
    repeated = {m: m_steps[m, "repeated", False]["step_ms"] for m in verify_tokens}

    def m_row(m: int, ids: str, ms: float) -> dict:
        row = {"m": m, "token_ids": ids, "step_ms": ms, "vs_m1": ms / verify[1],
               **_step_bytes(run, tb, m, ms, copy_bw, distinct=ids == "distinct")}
        return row if m == 1 else {**row, "rounds": [t["step_ms"] for t in m_steps[m, ids, False]["rounds"]]}

    result["tokens_per_sequence"] = [m_row(1, "one", verify[1])] + [
        row for m in sorted(repeated) for row in (m_row(m, "distinct", verify[m]), m_row(m, "repeated", repeated[m]))]
    progress("step time by tokens per sequence, distinct ids (one id repeated): " + ", ".join(
        f"M={m} {ms:.3f} ms" + (f" ({repeated[m]:.3f})" if m > 1 else "") for m, ms in sorted(verify.items())))

    parts = breakdown_ms(run, 0, repeats)
    whole = at_zero[1]
    parts["rest"] = whole - sum(parts.values())
    result["breakdown_ms"] = {"whole_step_graph": whole, **parts,
                              "note": "each component captured alone over all layers; rest = whole step - their sum"}
    draft = draft_ms(run, repeats)
    if draft is not None:
        # the verify step as the engine runs it: distinct ids, saving the GDN states a rejected draft rolls back to
        verify_k = {m - 1: m_steps[m, "distinct", True]["step_ms"] for m in verify_tokens}
        draft_vocab = min(DRAFT_VOCAB, cfg.vocab_size)  # a small vocabulary (the tiny shape) is its own subset
        small = draft_ms(run, repeats, draft_vocab)
        result["mtp"] = {"draft_step_ms": draft, "verify_step_ms": verify_k,
                         "verify_step_ms_without_rollback": {m - 1: ms for m, ms in verify.items() if m > 1},
                         "verify_step_ms_repeated_id": {m - 1: m_steps[m, "repeated", True]["step_ms"]
                                                        for m in verify_tokens},
                         "verify_rounds": {m - 1: [t["step_ms"] for t in m_steps[m, "distinct", True]["rounds"]]
                                           for m in verify_tokens},
                         "modelled": modelled_mtp(verify[1], verify_k, draft, acceptance),
                         "draft_vocab": draft_vocab, "draft_step_ms_small_vocab": small,
                         "modelled_small_vocab": modelled_mtp(verify[1], verify_k, small, acceptance)}
    if batches and measured_part(result, "batch_decode", lambda: batch_decode(model, batches, repeats), progress):
        progress("batched decode: " + ", ".join(f"{r['sequences']}x{r['m']} ({r['int4_gemm']}) {r['step_ms']:.2f} ms"
                                                 f"{'' if r['cuda_graph'] else ' eager'}" for r in result["batch_decode"]))
    peak_before_prefill = torch.cuda.max_memory_allocated() if cuda else None
    if prefill and measured_part(result, "prefill", lambda: engine_prefill(model, prefill), progress):
        progress("prefill: " + ", ".join(f"{r['prompt_tokens']} tokens{' (int4 gemm: %s)' % r['int4_gemm'] if r['int4_gemm'] else ''} "
                                         f"{r['ms']:.0f} ms ({r['tok_s']:.0f} tok/s)" for r in result["prefill"]))
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peak_memory_bytes stays the decode path's: prefill rows have their own
    if engine_tokens and measured_part(result, "engine_loop", lambda: engine_loop(model, engine_tokens), progress):
        for row in result["engine_loop"]:
            if "mtp" in row and "mtp" in result and row["mtp"] in result["mtp"]["verify_step_ms"]:
                k = row["mtp"]  # what the step's captured parts add up to: verify(k + 1) + k drafts
                row["modelled_step_ms"] = result["mtp"]["verify_step_ms"][k] + k * result["mtp"]["draft_step_ms"]
        progress("engine loop: " + ", ".join(f"{r['sampling']} async {'on' if r['async_scheduling'] else 'off'} "
                                             f"{r['tok_s']:.1f} tok/s" for r in result["engine_loop"] if "mtp" not in r))
    # Last: after the profiler has run, every graph launch in the process costs more host time (H100, session 19: the
    # verify step 6.30 ms measured after it, 5.34 in a fresh process), which the MTP and engine-loop rows would carry.
    if profile and cuda:  # the one-token step, and the MTP-2 verify step (M = 3) beside it: which kernels its extra time is in
        for m, key in ((1, "kernel_profile"), (3, "kernel_profile_m3")):
            if m == 1 or m in verify_tokens:
                # a real verify's routing; with an MTP head its rollback saves too, as the engine runs it
                r, rollback = (rollback_run, True) if m > 1 and rollback_run is not None else (run, False)
                buf = r.graphs.run(step_ids(cfg.vocab_size, m, distinct=True), [r.cache], m, rollback=rollback)
                result[key] = kernel_profile(buf.graph.replay, "programmatic dependent launch" in fast.installed)
                kp = result[key]
                progress(f"profile M={m}: {kp.get('kernels_per_step', 0):.0f} kernels per step, {kp.get('kernel_us_per_step', 0) / 1e3:.3f}"
                         f" ms busy in a {kp.get('span_us_per_step', 0) / 1e3:.3f} ms span")
    result["peak_memory_bytes"] = max(peak_before_prefill, torch.cuda.max_memory_allocated()) if cuda else None
    result["pool_bytes"] = pool.nbytes + (mtp_pool.nbytes if mtp_pool else 0)
    result["graph_captures"] = run.graphs.captures  # what a step that meets a new bucket waits for
    result["targets"] = issue_targets(result)
    return result


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"  # results written before a field existed


def _aside(parts: list[str]) -> str:
    said = [p for p in parts if p]
    return f" ({', '.join(said)})" if said else ""


def _what_is_next(r: dict) -> str:
    """What the breakdown says about a missed target: the step against its bytes at the copy bandwidth, and the
    components in order of their time."""
    b = r["breakdown_ms"]
    bytes_ms = r["decode"][0]["bytes_per_token"] / r["copy_bandwidth"] * 1e3
    parts = sorted(((c, b[c]) for c in COMPONENTS if c in b and c != "rest"), key=lambda p: -p[1])
    return (f"The step's graph takes {b['whole_step_graph']:.3f} ms at context {r['decode'][0]['context']} against "
            f"{bytes_ms:.3f} ms for its bytes at the copy bandwidth; by component (each captured alone): "
            + ", ".join(f"{c} {ms:.3f} ms" for c, ms in parts)
            + ". benchmarks/NOTES-kernels.md has what each kernel costs against its bytes and what is being tried.")


def format_report(r: dict) -> str:
    gb = 1e9
    lines = [f"{r['shape']}{' (first %d layers)' % r['layers'] if r['layers'] else ''}, {r['layout']}; "
             f"{r['environment']['device']}, commit {r['environment']['commit']}",
             f"copy bandwidth {r['copy_bandwidth'] / gb:.0f} GB/s; weights read per token {r['bytes']['weights_per_token'] / gb:.2f} GB, "
             f"GDN state {r['bytes']['gdn_state_rw'] / 1e6:.0f} MB, KV {r['bytes']['kv_per_context_token']} B per context token",
             f"INT4 qweights in {r.get('int4_order', 'gptq')} order",
             "", "| context | GB/token | ceiling tok/s | tok/s | ms/token | graph ms | of ceiling |", "|---|---|---|---|---|---|---|"]
    for row in r["decode"]:
        lines.append(f"| {row['context']} | {row['bytes_per_token'] / gb:.2f} | {row['ceiling_tok_s']:.0f} | {row['tok_s']:.1f} | "
                     f"{row['step_ms']:.3f} | {row['replay_ms']:.3f} | {row['fraction_of_ceiling']:.2f} |")
    lines += ["", "| tokens per sequence (M) | token ids | step ms | vs M=1 | distinct experts a layer | GB read | of ceiling |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {t['m']} | {t.get('token_ids', 'repeated')} | {t['step_ms']:.3f} | {t['vs_m1']:.2f}x | "
              + (f"{t['distinct_experts_per_layer']:.1f} | {t['bytes'] / gb:.2f} | {t['fraction_of_ceiling']:.2f} |"
                 if "bytes" in t else "- | - | - |") for t in r["tokens_per_sequence"]]
    b = r["breakdown_ms"]
    lines += ["", "| component (context 0) | ms | share |", "|---|---|---|"]
    lines += [f"| {c} | {b[c]:.3f} | {b[c] / b['whole_step_graph']:.0%} |" for c in COMPONENTS if c in b]
    lines.append(f"| whole step (graph) | {b['whole_step_graph']:.3f} | |")
    if "mtp" in r:
        rb = r["mtp"].get("verify_step_ms_without_rollback")  # absent before session 14: verify rows without it
        rep = r["mtp"].get("verify_step_ms_repeated_id")  # absent before session 15: verify rows repeated one id
        lines += ["", f"MTP draft step {r['mtp']['draft_step_ms']:.3f} ms; verify steps "
                      + ("of distinct ids " if rep else "of one id repeated ")
                      + ("saving the GDN states for the rollback, as the engine runs them" if rb else
                         "(not saving the rollback's GDN states)") + ": " + ", ".join(
                          f"k={k} {ms:.3f} ms" + _aside([f"{rb[k]:.3f} without" if rb and k in rb else "",
                                                          f"{rep[k]:.3f} on one id" if rep and k in rep else ""])
                          for k, ms in sorted(r["mtp"]["verify_step_ms"].items()))
                  + ". Modelled from those (stated acceptance, not measured):",
                  "| k | acceptance | tokens/step | ms/step | tok/s | vs no MTP |", "|---|---|---|---|---|---|"]
        lines += [f"| {m['k']} | {', '.join(f'{a:.2f}' for a in m['acceptance'])} | {m['tokens_per_step']:.2f} | {m['step_ms']:.3f} | "
                  f"{m['tok_s']:.0f} | {m['speedup']:.2f}x |" for m in r["mtp"]["modelled"]]
        lines += [f"With the draft LM head over the first {r['mtp']['draft_vocab']} ids: draft step "
                  f"{r['mtp']['draft_step_ms_small_vocab']:.3f} ms; modelled at the same acceptance: "
                  + ", ".join(f"k={m['k']} {m['tok_s']:.0f} tok/s ({m['speedup']:.2f}x)" for m in r["mtp"]["modelled_small_vocab"])]
    if "by_kernel" in r.get("kernel_profile", {}):
        kp = r["kernel_profile"]
        lines += ["", f"Kernels per step (profiler): {kp['kernels_per_step']:.0f} launches, {kp['kernel_us_per_step'] / 1e3:.3f} ms "
                      f"busy in a {kp['span_us_per_step'] / 1e3:.3f} ms span"
                  + (" (overlapping under programmatic dependent launch: times include each kernel's wait)"
                     if kp.get("programmatic_dependent_launch") else ""),
                  "| kernel | launches/step | us/step | us/step at M=3 |", "|---|---|---|---|"]
        m3 = {k["name"]: k["us"] for k in r.get("kernel_profile_m3", {}).get("by_kernel", [])}
        lines += [f"| {k['name']} | {k['launches']:.0f} | {k['us']:.1f} | "
                  f"{'%.1f' % m3[k['name']] if k['name'] in m3 else '-'} |" for k in kp["by_kernel"][:25]]
        if m3:
            lines.append(f"(M=3 step: {r['kernel_profile_m3']['kernel_us_per_step'] / 1e3:.3f} ms busy in a "
                         f"{r['kernel_profile_m3']['span_us_per_step'] / 1e3:.3f} ms span)")
    if r.get("prefill"):
        lines += ["", "Prefill through Engine.step (a fresh sequence's prompt and its first token):",
                  "| prompt tokens | INT4 many-rows path | ms (time to first token) | tok/s | first token as the first row's | "
                  "peak GiB |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['prompt_tokens']} | {p['int4_gemm'] or '-'} | {p['ms']:.1f} | {p['tok_s']:.0f} | "
                  f"{'yes' if p['first_token_as_first_kind'] else 'NO'} | {_gib(p['peak_memory_bytes'])} |"
                  for p in r["prefill"]]
    if r.get("batch_decode"):
        lines += ["", "Decode steps of several sequences (B x M rows; M > 1: MTP verify), by INT4 many-rows path:",
                  "| B x M | INT4 many-rows path | step ms | CUDA graph | row tokens/s |", "|---|---|---|---|---|"]
        lines += [f"| {d['sequences']} x {d['m']} | {d['int4_gemm'] or '-'} | {d['step_ms']:.3f} | "
                  f"{'yes' if d['cuda_graph'] else 'no'} | {d['row_tokens_per_s']:.0f} |" for d in r["batch_decode"]]
    if r.get("engine_loop"):
        lines += ["", "Engine decode loop (Engine.step, one sequence, context ~0; the step above reads its token before "
                      "the next launch; graphs captured first, as serve does):", "| sampling | async scheduling | tok/s | "
                      "ms/token | slowest step ms | steps launched ahead | tokens as with it off |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {e['sampling']} | {'on' if e['async_scheduling'] else 'off'} | {e['tok_s']:.1f} | {e['ms_per_token']:.3f} | "
                  f"{_ms(e.get('slowest_step_ms'))} | {e['steps_launched_ahead']} of {e['tokens'] - 1} | "
                  f"{'-' if e['tokens_equal_async_off'] is None else 'yes' if e['tokens_equal_async_off'] else 'NO'} |"
                  for e in r["engine_loop"] if "mtp" not in e]
        collected = [e for e in r["engine_loop"] if "gc_runs" in e]
        if collected:
            lines.append("Garbage collector during each loop (rows in order): " + ", ".join(
                f"{e['gc_runs']} runs {e['gc_ms']:.1f} ms" for e in collected))
        for e in r["engine_loop"]:
            if "mtp" in e:
                lines.append(f"MTP-{e['mtp']} greedy through Engine.step: {e['ms_per_step']:.3f} ms per step"
                             + (f" (its captured parts: {e['modelled_step_ms']:.3f} ms)" if "modelled_step_ms" in e else "")
                             + (f", the slowest {e['slowest_step_ms']:.3f} ms" if "slowest_step_ms" in e else "")
                             + f", {e['tokens_per_step']:.2f} tokens per step (random weights: acceptance "
                             f"{', '.join(f'{a:.2f}' for a in e['acceptance'])}); tokens "
                             + ("as" if e["tokens_equal_without_mtp"] else "NOT as") + " without MTP"
                             + (f" from token {e['first_difference_without_mtp']} of {e['tokens']}"
                                if e.get("first_difference_without_mtp") is not None else ""))
    lines.append(f"\npeak GPU memory {_gib(r['peak_memory_bytes'])} GiB (cache pool for {r['capacity_tokens']} tokens: "
                 f"{r['pool_bytes'] / 2**30:.2f} GiB)")
    if r.get("graph_captures"):
        slowest = max(r["graph_captures"], key=lambda c: c["seconds"])
        lines.append(f"CUDA graph captures: {len(r['graph_captures'])}, the slowest {slowest['seconds']:.2f} s (batch "
                     f"{slowest['batch']} x {slowest['m']}, span {slowest['span']}, kernels compiled first where new) in "
                     "this benchmark's lazily captured runner; serve and chat capture every bucket at start (--lazy-capture: "
                     "a step meeting a new bucket waits this long)")
    if r.get("targets"):
        lines += ["", "Issue 4's targets (set on the H200; the INT8 LM head's and the grouped experts' are kernel figures: "
                      "benchmarks/kernels.py):", "| target | measured | asked | |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['got']:.2f}{t['unit']} | {'>=' if t['at_least'] else '<='} {t['want']:.2f}{t['unit']} | "
                  + ("met" if t["met"] else f"MISSED by {t['short_by']:.2f}{t['unit']}") + " |" for t in r["targets"]]
        if not all(t["met"] for t in r["targets"]):
            lines.append(_what_is_next(r))
    lines += [f"NOT MEASURED: {e['part']} failed: {e['error'][:300]}" for e in r.get("errors", [])]
    return "\n".join(lines)
