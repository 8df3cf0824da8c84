"""The engine API used by the CLI and the server: sequences in, tokens and text out.

Every `step()` runs one forward over all active sequences (new ones with their prompt, running
ones with their last token), samples one token per sequence, and reports what each sequence
produced. Admission control and HTTP live in the server; this owns model state.

Chunked prefill: a step takes at most `max_num_batched_tokens` prompt tokens (default 8192; vLLM's
flag of that name also counts decode tokens, which come on top here). A longer prompt, or several prompts
arriving together, are prefilled over several steps while running sequences keep decoding in the
same steps, and a sequence samples its first token in the step that completes its prompt. The step's
activations are bounded by the chunk, not the prompt: whole, a 256K-token prompt on the 122B
would make a single [256K, 20480] projection output of 10.7 GB.

Async scheduling (pooled decode, on by default): before the host reads a step's tokens, the
engine launches the next decode step with those tokens as its input straight from the device,
so the GPU runs it while the host reads, detokenizes, checks stops and streams. A sequence that
stops on the token read drops its row of the step launched ahead (one wasted row, as vLLM's
async scheduling). Steps that need the last token on the host first (penalties, the MTP head)
run one at a time; the log says so.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import load_model
from ..errors import UserError
from ..hub import resolve_model
from ..kernels.dispatch import FastPath, install_fast_path
from ..quant.int8 import quantize_lm_head_int8
from ..model import Qwen35ForCausalLM
from .cache import CachePool, SequenceCache, SlotCache
from .graphs import DecodeGraphs
from .sampling import SampleResult, Sampler, SamplingParams, TopLogprobs, device_tensor, make_generator
from .speculative import MAX_DRAFT_TOKENS, DraftState, MtpSpeculator, SpeculativeConfig
from .stops import StopStringMatcher
from .tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_BATCHED_TOKENS = 8192  # prompt tokens per step (chunked prefill)

log = logging.getLogger("roofline.engine")


def _check_batched_tokens(n: int | None) -> None:
    if n is not None and n < 1:
        raise UserError(f"--max-num-batched-tokens must be at least 1, got {n}")


class PromptTooLong(ValueError):
    def __init__(self, prompt_tokens: int, max_model_len: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens; the context limit is {max_model_len}")
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len


@dataclass
class TokenEvent:
    """What one sequence produced in one step."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None
    text: str  # newly completed text (may be empty while a character or stop string is pending)
    finish_reason: str | None  # "stop" | "length" | None while running


@dataclass(eq=False)  # identity: `seq in sequences` must not compare prompts (ms per step with long, equal ones)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None for checkpoints without a tokenizer (ids only)
    stops: StopStringMatcher
    generator: torch.Generator | None
    request_id: int = 0
    cache: SequenceCache = field(default_factory=SequenceCache)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    draft: DraftState | None = None  # MTP head state when speculative decoding is on

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the cache yet."""
        return self.cache.num_tokens < len(self.prompt_ids)

    @property
    def pending_ids(self) -> list[int]:
        """Tokens the model has not seen yet: the rest of the prompt, then the last sampled token."""
        seen = self.cache.num_tokens
        return self.prompt_ids[seen:] if seen < len(self.prompt_ids) else self.output_ids[-1:]


class LaunchedStep:
    """A step whose sampled tokens the host has not read: their device tensor (the next step's input ids,
    never read by the host) and pinned host copies with an event that marks them done."""

    def __init__(self, sequences: list[Sequence], sample: SampleResult, pending: list[list[int]] | None,
                 draft_rows: list[torch.Tensor | None]):
        self.sequences, self.token_ids = sequences, sample.token_ids
        self.pending, self.draft_rows = pending, draft_rows  # for the MTP head: each sequence's input ids, hidden rows
        top = sample.top_logprobs
        self._wanted = top.wanted
        tensors = [sample.token_ids, sample.logprobs, *(() if top.values is None else (top.values, top.ids))]
        self._ready = None
        if sample.token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tensors

    def read(self) -> list[tuple[int, float, list[tuple[int, float]] | None]]:
        """Per sequence (token, logprob, top logprobs); waits for this step's sampling, not for a step after it."""
        if self._ready is not None:
            self._ready.synchronize()
        values, ids = self._host[2:] or (None, None)
        top = TopLogprobs(values, ids, self._wanted).rows()
        return list(zip(self._host[0].tolist(), self._host[1].tolist(), top))


def freeze_startup_heap() -> None:
    """Put every object alive now (the model's modules and tensors, the caches, the captured graphs' buffers) out of
    the garbage collector's reach, as vLLM does once it has started: a full collection, which Python runs every so
    many allocations, then walks only what serving allocates, not the whole startup heap, in the middle of a decode
    step (H100: session 19's engine-loop rows had single steps of 13-15 ms; with the freeze, session 20, the slowest
    was 3.9-4.2 ms and the MTP step 0.5 ms shorter)."""
    gc.collect()
    gc.freeze()


def pool_capacity(max_model_len: int) -> int:
    """Positions a pooled cache slot holds: a verify or padded draft step may run past the length limit."""
    return max_model_len + MAX_DRAFT_TOKENS + 1


class Engine:
    def __init__(
        self,
        model: Qwen35ForCausalLM,
        tokenizer: Tokenizer | None,
        model_dir: Path,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        pooled_decode: bool = False,
        max_num_seqs: int = 8,
        async_scheduling: bool = True,
        max_num_batched_tokens: int | None = DEFAULT_BATCHED_TOKENS,
    ):
        _check_batched_tokens(max_num_batched_tokens)
        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        self.max_num_batched_tokens = max_num_batched_tokens  # prompt tokens per step; None: whole prompts
        self.eos_token_ids = set(tokenizer.eos_token_ids if tokenizer else model.config.eos_token_id)
        self.max_model_len = min(max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.sampler = Sampler()
        keep = [*(tokenizer.added_token_ids if tokenizer else []), *self.eos_token_ids]  # always draftable
        self.speculator = MtpSpeculator(model, self.sampler, speculative, keep) if speculative else None
        # Pooled decode: caches preallocated per slot (a full context each: no paging), decode steps through
        # DecodeGraphs (CUDA graphs on a GPU). Allocated at the first request, so a server can still lower
        # max_num_seqs to what its memory budget holds.
        self.pooled_decode, self.max_num_seqs = pooled_decode, max_num_seqs
        self.pool = self.mtp_pool = self.graphs = None
        self.async_scheduling = async_scheduling  # with pooled decode: see the module docstring
        self._in_flight: LaunchedStep | None = None  # a decode step launched ahead, its tokens not yet read
        self.steps_launched_ahead = 0  # how often async scheduling applied (the benchmark reports it)
        self._penalties_logged = False
        self.generation_config = model_dir / "generation_config.json"
        self.sequences: list[Sequence] = []
        self._ids = itertools.count(1)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        fast_path: bool = True,
        int8_lm_head: bool | None = None,
        cuda_graphs: bool | None = None,
        max_num_seqs: int = 8,
        async_scheduling: bool = True,
        max_num_batched_tokens: int | None = DEFAULT_BATCHED_TOKENS,
    ) -> "Engine":
        """`cuda_graphs`: decode through preallocated caches and captured CUDA graphs (default: on CUDA when
        the fast path can capture the step). On a CPU with TRITON_INTERPRET=1 (tests) it runs the same pooled
        step eagerly through the kernels' interpreter."""
        _check_batched_tokens(max_num_batched_tokens)  # before the minutes a large model takes to load
        model_dir = resolve_model(model)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        net, _ = load_model(model_dir, device, torch_dtype)
        if int8_lm_head is None:
            int8_lm_head = device.startswith("cuda")  # the CPU path stays the unquantised oracle
        if int8_lm_head:
            quantize_lm_head_int8(net)
        else:
            log.info("LM head kept as stored (%s)", net.lm_head.FORMAT)
        fast = install_fast_path(net, allow_cpu=bool(cuda_graphs)) if fast_path else FastPath()
        if not fast_path:
            log.info("fast path off: running the PyTorch reference path")
        pooled = cuda_graphs if cuda_graphs is not None else (device.startswith("cuda") and fast.graph_ready)
        if pooled and not fast.graph_ready:
            raise UserError("CUDA graphs need the fast path's kernels on every layer: "
                            + ("; ".join(fast.graph_blockers) or "the fast path is not installed (see the log)"))
        if device.startswith("cuda") and not pooled:
            log.warning("CUDA graphs off: %s; decode runs eagerly and is launch-bound",
                        "; ".join(fast.graph_blockers) or "turned off" if fast.installed else "no fast path")
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(model_dir)
        else:
            log.warning("%s has no tokenizer.json: token ids in and out only, no text", model_dir)
            tokenizer = None
        return cls(net, tokenizer, model_dir, max_model_len, speculative, pooled_decode=pooled, max_num_seqs=max_num_seqs,
                   async_scheduling=async_scheduling, max_num_batched_tokens=max_num_batched_tokens)

    def ensure_pools(self) -> None:
        """Allocate the pooled-decode caches (once) for `max_num_seqs` sequences."""
        if not self.pooled_decode or self.pool is not None:
            return
        cfg, model, max_num_seqs = self.model.config, self.model, self.max_num_seqs
        capacity = pool_capacity(self.max_model_len)
        use_graphs = model.device.type == "cuda"
        try:
            # with MTP two GDN state buffers per slot: a verify writes the new state to the other (the rollback's)
            self.pool = CachePool(cfg, cfg.layer_types, max_num_seqs, capacity, model.device, model.dtype,
                                  state_buffers=2 if self.speculator else 1)
            if self.speculator:
                self.mtp_pool = CachePool(cfg, ["full_attention"], max_num_seqs, capacity, model.device, model.dtype)
            # each verify saves every GDN layer's step records after each draft, for the rollback
            self.graphs = DecodeGraphs(model, self.pool, max_num_seqs, use_graphs,
                                       rollback_rows=max_num_seqs * self.speculator.k_max if self.speculator else 0)
        except torch.OutOfMemoryError:
            self.pool = self.mtp_pool = None
            raise UserError(
                f"the preallocated KV cache and GDN state for {max_num_seqs} sequences of {self.max_model_len} tokens"
                f"{' (and the MTP verify rollback saves)' if self.speculator else ''} do not fit in device memory: lower "
                "--max-num-seqs or --max-model-len" + (" or the number of speculative tokens" if self.speculator else "")
            ) from None
        total = self.pool.nbytes + (self.mtp_pool.nbytes if self.mtp_pool else 0) + self.graphs.saves_nbytes
        if self.speculator:
            self.speculator.graphs = self.graphs
            self.speculator.draft_graphs = DecodeGraphs(model, self.mtp_pool, max_num_seqs, use_graphs, mtp=True,
                                                        logits=self.speculator.draft_logits)
        if not self.async_scheduling:
            scheduling = "off (--no-async-scheduling): the device waits while the host reads each token"
        elif self.speculator:
            scheduling = "off with MTP speculation: each verify's accepted tokens decide the next step's inputs"
        else:
            scheduling = "on: the next decode step is launched before the host reads the last token"
        log.info("pooled decode: %d slots x %d tokens, %.2f GiB of KV cache, GDN state and rollback saves; %s; async "
                 "scheduling %s",
                 max_num_seqs, self.max_model_len, total / 2**30, "CUDA graphs per batch bucket" if use_graphs else "eager (no CUDA)",
                 scheduling)

    def capture_graphs(self) -> dict | None:
        """Make every decode-step bucket now, as vLLM captures its graphs at start: plain steps (one token), and with
        MTP the verify steps (k + 1 tokens for each k the engine may draft) and the head's forwards (1..k + 1 pairs),
        for every batch bucket and attention span. Otherwise the first step meeting a new bucket (a longer context
        mid-answer, one more concurrent request) waits for its capture. Allocates the pools first. Returns the
        buckets made, the seconds and the GPU memory it took (None without pooled decode)."""
        self.ensure_pools()
        if self.graphs is None:
            return None
        cuda = self.device.type == "cuda"
        if cuda:  # ~0.2-0.3 s a bucket once the kernels are compiled: a large server's start takes a minute or more
            log.info("capturing the decode step's CUDA graphs for up to %d sequences and %d tokens of context "
                     "(--lazy-capture: each when a step first needs it instead) ...", self.max_num_seqs, self.max_model_len)
        start, before = time.perf_counter(), torch.cuda.memory_allocated(self.device) if cuda else 0
        try:
            buckets = self.graphs.prepare([1])
            if self.speculator:
                ks = range(1, self.speculator.k_max + 1) if self.speculator.chooser else [self.speculator.k_max]
                buckets += self.graphs.prepare([k + 1 for k in ks], rollback=True)
                buckets += self.speculator.draft_graphs.prepare(list(range(1, max(ks) + 2)))
        except torch.OutOfMemoryError:
            raise UserError(f"capturing the decode step's CUDA graphs for {self.max_num_seqs} sequences of "
                            f"{self.max_model_len} tokens ran out of GPU memory: lower --max-model-len (serve: or --max-num-seqs), "
                            "or pass --lazy-capture (each bucket is captured when a step first needs it)") from None
        made = {"buckets": buckets, "seconds": time.perf_counter() - start,
                "bytes": torch.cuda.memory_allocated(self.device) - before if cuda else 0}
        log.info("made %d decode-step buckets (batch x tokens per sequence x attention span) in %.1f s%s", made["buckets"],
                 made["seconds"], f", {made['bytes'] / 2**20:.0f} MiB of GPU memory" if cuda else " (eager: no CUDA)")
        return made

    @property
    def device(self) -> torch.device:
        return self.model.device

    def default_params(self, **overrides) -> SamplingParams:
        """Sampling defaults from the checkpoint's generation_config.json, overridden by given values."""
        source = self.generation_config if self.generation_config.is_file() else {}
        return SamplingParams.from_generation_config(source, **overrides)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLong(len(prompt_ids), self.max_model_len)
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.model.config.vocab_size - 1})")
        seq = Sequence(
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
            stops=StopStringMatcher(params.stop),
            generator=make_generator(params.seed, self.device),
            request_id=next(self._ids),
            draft=DraftState() if self.speculator else None,
        )
        self.ensure_pools()
        if self.pool:
            seq.cache = self.pool.acquire()
            if seq.draft:
                seq.draft.cache = self.mtp_pool.acquire()
        self.sequences.append(seq)
        return seq

    def _release(self, seq: Sequence) -> None:
        """Give a finished or cancelled sequence's slots back, once (a later cancel must not free a slot that
        another sequence holds by then)."""
        if isinstance(seq.cache, SlotCache):
            self.pool.release(seq.cache)
            seq.cache = SequenceCache()
        if seq.draft and isinstance(seq.draft.cache, SlotCache):
            self.mtp_pool.release(seq.draft.cache)
            seq.draft.cache = SequenceCache()

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence and its caches at once (client gone)."""
        if seq in self.sequences:
            self.sequences.remove(seq)
        self._release(seq)
        seq.cache = SequenceCache()
        seq.draft = None

    def step(self) -> list[tuple[Sequence, TokenEvent]]:
        """One step for all active sequences; finished sequences leave the engine.

        Without speculation: one forward, one token per sequence. With it, sequences past
        their prompt draft and verify (up to k+1 tokens each); new sequences prefill. A step
        launched ahead (async scheduling) is read first, and on its own.
        """
        if self._in_flight is not None:
            return self._finish_in_flight()
        active = list(self.sequences)
        speculating = [s for s in active if self._can_speculate(s)]
        plain = [s for s in active if s not in speculating]
        events = self._speculative_step(speculating) if speculating else []
        return events + (self._plain_step(plain) if plain else [])

    def _can_speculate(self, seq: Sequence) -> bool:
        room = self.max_model_len - len(seq.prompt_ids) - len(seq.output_ids)
        return (seq.draft is not None and not seq.prefilling and seq.draft.ready_to_draft()
                and room > self.speculator.k_max)

    def _forward(self, active: list[Sequence], pending: list[list[int]] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's pending tokens (host lists, or one device token each) through the model: (hidden [N, H]
        of every token, logits of each sequence's last token). Decoding sequences go through the pooled step
        when there is one; prompts are prefilled eagerly (into the same pool)."""
        if self.graphs and (isinstance(pending, torch.Tensor) or all(len(p) == 1 for p in pending)):
            caches = [s.cache for s in active]
            ids = pending if isinstance(pending, torch.Tensor) else [p[0] for p in pending]
            buf = self.graphs.run(ids, caches, 1)
            for i, cache in enumerate(caches):
                self.graphs.keep(buf, i, cache, 1, 1)
            return buf.hidden[: len(active)], buf.logits[: len(active)]
        ends = list(itertools.accumulate(len(p) for p in pending))
        ids = device_tensor([t for p in pending for t in p], self.device)
        hidden = self.model(ids, [len(p) for p in pending], [s.cache for s in active])
        return hidden, self.model.logits(hidden[device_tensor(ends, self.device) - 1])

    def _step_tokens(self, active: list[Sequence]) -> list[list[int]]:
        """Each sequence's tokens this step: its last token, or as much of the rest of its prompt as the step's
        `max_num_batched_tokens` leaves, in order of arrival ([] when nothing is left: it waits a step)."""
        budget = self.max_num_batched_tokens
        tokens = []
        for seq in active:
            pending = seq.pending_ids
            if seq.prefilling and budget is not None:
                pending = pending[:budget]
                budget -= len(pending)
            tokens.append(pending)
        return tokens

    def _launch(self, active: list[Sequence], pending: list[list[int]] | None = None,
                device_ids: torch.Tensor | None = None) -> LaunchedStep | None:
        """Forward each sequence's `pending` tokens (or, from a step launched ahead, `device_ids`: one token each)
        and sample on the device for the sequences whose prompt is complete after it (None when there are none);
        nothing is read back here."""
        finishing = ([True] * len(active) if pending is None
                     else [len(p) == len(s.pending_ids) for s, p in zip(active, pending)])
        starts = [s.cache.num_tokens for s in active]
        hidden, logits = self._forward(active, device_ids if device_ids is not None else pending)
        rows: dict[int, torch.Tensor] = {}
        if pending is not None and any(s.draft is not None for s in active):
            ends = list(itertools.accumulate(len(p) for p in pending))
            chunked = []
            for i, seq in enumerate(active):  # the MTP head will see these positions before its next draft
                if seq.draft is not None:
                    rows[i] = hidden[ends[i] - len(pending[i]) : ends[i]].clone()  # a graph's output buffer is reused
                if seq.draft is not None and not finishing[i]:  # a prompt chunk: the token after it is the prompt's
                    self.speculator.extend(seq.draft, rows[i], pending[i], seq.prompt_ids[starts[i] + len(pending[i])])
                    chunked.append(seq.draft)
            self.speculator.catch_up(chunked)  # one head forward for every sequence that prefilled a chunk
        done = [i for i, f in enumerate(finishing) if f]
        if not done:
            return None
        sampling = [active[i] for i in done]
        if len(done) < len(active):
            logits = logits[device_tensor(done, logits.device)]
        params = [s.params for s in sampling]
        sample = self.sampler.sample(
            logits,
            params,
            [s.prompt_ids + s.output_ids for s in sampling] if any(p.penalised for p in params) else None,
            [len(s.prompt_ids) for s in sampling],
            [s.generator for s in sampling],
        )
        return LaunchedStep(sampling, sample, None if pending is None else [pending[i] for i in done],
                            [rows.get(i) for i in done])

    def _emit(self, launched: LaunchedStep) -> list[tuple[Sequence, TokenEvent]]:
        """Read a launched step's tokens into its sequences. A sequence that finished or was cancelled after the
        step was launched ahead drops its row."""
        events = []
        for i, (seq, (token, logprob, top)) in enumerate(zip(launched.sequences, launched.read())):
            if seq not in self.sequences:
                continue
            if seq.draft is not None:
                self.speculator.extend(seq.draft, launched.draft_rows[i], launched.pending[i], token)
            events.append((seq, self._append(seq, token, logprob, top)))
        return self._retire(events)

    def _plain_step(self, active: list[Sequence]) -> list[tuple[Sequence, TokenEvent]]:
        decoding = [s for s in active if not s.prefilling]
        if self.graphs and decoding and len(decoding) < len(active):  # prefills run eagerly, decodes in the graph
            prefilling = [s for s in active if s not in decoding]
            return self._plain_step(decoding) + self._plain_step(prefilling)
        tokens = self._step_tokens(active)
        running = [s for s, t in zip(active, tokens) if t]
        launched = self._launch(running, [t for t in tokens if t]) if running else None
        if launched is None:
            return []
        if self.graphs and len(running) == len(self.sequences) and not any(s.prefilling for s in running):
            self._in_flight = self._launch_ahead(launched)
        return self._emit(launched)

    def _finish_in_flight(self) -> list[tuple[Sequence, TokenEvent]]:
        """Read the step launched ahead, first launching the one after it unless a new sequence waits for its
        prefill (it joins at the next step)."""
        launched, self._in_flight = self._in_flight, None
        if all(s in launched.sequences for s in self.sequences):
            self._in_flight = self._launch_ahead(launched)
        return self._emit(launched)

    def _launch_ahead(self, launched: LaunchedStep) -> LaunchedStep | None:
        """The decode step after `launched` for its sequences that will still run after its tokens, with those
        tokens as input ids straight from the device; None when there is none or async scheduling cannot apply
        (with MTP speculation the head needs each plain step's tokens and hidden states: see ensure_pools' log)."""
        if not self.async_scheduling or self.speculator:
            return None
        rows = [i for i, s in enumerate(launched.sequences)
                if s in self.sequences and not self._at_length_limit(s, len(s.output_ids) + 1)]
        if not rows:
            return None
        following = [launched.sequences[i] for i in rows]
        if any(s.params.penalised for s in following):
            if not self._penalties_logged:
                self._penalties_logged = True
                log.info("async scheduling off for steps where a repetition, presence or frequency penalty needs the "
                         "last token on the host; they run one at a time")
            return None
        ids = launched.token_ids
        if len(rows) < len(launched.sequences):
            ids = ids[device_tensor(rows, ids.device)]
        self.steps_launched_ahead += 1
        return self._launch(following, device_ids=ids)

    def _at_length_limit(self, seq: Sequence, outputs: int) -> bool:
        """Whether `seq` stops by length once it holds `outputs` generated tokens."""
        return bool(seq.params.max_tokens and outputs >= seq.params.max_tokens) or len(seq.prompt_ids) + outputs >= self.max_model_len

    def _speculative_step(self, active: list[Sequence]) -> list[tuple[Sequence, TokenEvent]]:
        start = time.perf_counter()
        self.speculator.begin_step()
        params = [s.params for s in active]
        # Only a penalty reads the history (a copy of each context, every step, otherwise).
        histories = [s.prompt_ids + s.output_ids for s in active] if any(p.penalised for p in params) else None
        prompt_lens = [len(s.prompt_ids) for s in active]
        generators = [s.generator for s in active]
        drafts, qs = self.speculator.draft([s.draft for s in active], params, histories, prompt_lens, generators)
        verified = self.speculator.verify(
            [s.cache for s in active], [s.output_ids[-1] for s in active], drafts, qs,
            [s.draft for s in active], params, histories, prompt_lens, generators,
        )
        events = []
        for seq, result in zip(active, verified):
            for token, logprob, top in zip(result.tokens, result.logprobs, result.top):
                events.append((seq, self._append(seq, token, logprob, top)))
                if seq.finish_reason:
                    break  # tokens after a stop are dropped; the sequence leaves with its caches
        self.speculator.end_step(time.perf_counter() - start)  # the verify results were read: the device is done
        return self._retire(events)

    def _retire(self, events):
        for seq, event in events:
            if event.finish_reason and seq in self.sequences:
                self.sequences.remove(seq)
                self._release(seq)
        return events

    def _append(self, seq: Sequence, token: int, logprob: float, top) -> TokenEvent:
        seq.output_ids.append(token)
        p = seq.params
        detok = seq.detokenizer
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"  # the stop token's own text is not part of the answer
            chunk = detok.flush() if detok else ""
        else:
            chunk = detok.add(token) if detok else ""
            if self._at_length_limit(seq, len(seq.output_ids)):
                seq.finish_reason = "length"
                chunk += detok.flush() if detok else ""
        text, stopped = seq.stops.feed(chunk)
        if stopped:
            seq.finish_reason = "stop"
        elif seq.finish_reason:
            text += seq.stops.flush()
        return TokenEvent(token, logprob, top, text, seq.finish_reason)

    def generate(self, prompt_ids: list[int], params: SamplingParams):
        """Run one sequence to the end, yielding a TokenEvent per generated token."""
        seq = self.add(prompt_ids, params)
        try:
            while seq.finish_reason is None:
                for s, event in self.step():
                    if s is seq:
                        yield event
        finally:
            self.cancel(seq)
