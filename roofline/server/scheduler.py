"""Continuous batching for the server: one thread drives `Engine.step()`, requests talk to it
through a lock-protected admission state and per-request asyncio queues.

Admission: a request is admitted when fewer than `max_num_seqs` sequences run and the KV +
GDN-state memory it may need (prompt + max_tokens, reserved up front) fits in the budget
beside the reservations already made. Otherwise it waits in a FIFO queue of at most
`max_queued` requests, or is refused (HTTP 429) when that queue is full. Reserving the
worst case means a running sequence never has to be preempted; the cost is that requests
without max_tokens reserve up to the context limit.

Cancellation (client gone) drops the sequence from the engine before its next step, which
frees its caches, and hands its reservation to the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..engine.cache import CachePool, conv_ring_rows, step_record_size
from ..engine.engine import Engine, Sequence, TokenEvent, pool_capacity
from ..engine.sampling import SamplingParams
from .metrics import Metrics

log = logging.getLogger("roofline.server")


@dataclass(frozen=True)
class CacheMemory:
    """Bytes of decode state per sequence, from the model's shapes (as the reference cache holds them)."""

    kv_bytes_per_token: int  # keys + values of every full-attention layer
    state_bytes_per_sequence: int  # conv window + fp32 recurrent state of every GDN layer
    layer_kv_bytes_per_token: int  # keys + values of one attention layer (the MTP head's cache)
    recurrent_bytes_per_sequence: int  # the fp32 recurrent states alone (the verify's second buffer)
    rollback_bytes_per_draft: int  # a verify position's step records, every GDN layer
    ring_bytes_per_sequence: int  # what the pool's conv rings hold beyond those windows (CachePool), every GDN layer

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype) -> "CacheMemory":
        element = torch.empty((), dtype=dtype).element_size()
        full = sum(t == "full_attention" for t in cfg.layer_types)
        linear = len(cfg.layer_types) - full
        kv = 2 * cfg.num_key_value_heads * cfg.head_dim * element
        history = cfg.linear_conv_kernel_dim - 1
        conv = history * cfg.linear_conv_dim * element
        ring = (conv_ring_rows(cfg.linear_conv_kernel_dim) - history) * cfg.linear_conv_dim * element
        recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        record = step_record_size(cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                                  cfg.linear_value_head_dim) * 4
        return cls(full * kv, linear * (conv + recurrent), kv, linear * recurrent, linear * record, linear * ring)

    def sequence_bytes(self, num_tokens: int) -> int:
        return self.state_bytes_per_sequence + self.kv_bytes_per_token * num_tokens

    def max_tokens_within(self, budget: int) -> int:
        """The longest single sequence whose state fits in `budget` bytes."""
        return max(0, (budget - self.state_bytes_per_sequence) // max(1, self.kv_bytes_per_token))

    def pooled_bytes(self, max_model_len: int, slots: int, mtp_drafts: int = 0) -> int:
        """What the CUDA-graph decode path preallocates (Engine.ensure_pools) for `slots` sequences: per slot a whole
        context's KV (and a few positions more) and GDN state, with MTP speculation of `mtp_drafts` tokens also the
        head's KV (one attention layer), a second recurrent-state buffer and the verify's rollback saves (the step
        records of each draft); once, the padding rows' GDN slot (both buffers). GDN conv state as the pool holds it:
        rings by position."""
        tokens = pool_capacity(max_model_len) + CachePool.PAD_TOKENS
        head_kv = self.layer_kv_bytes_per_token if mtp_drafts else 0
        state = (self.state_bytes_per_sequence + self.ring_bytes_per_sequence
                 + (self.recurrent_bytes_per_sequence if mtp_drafts else 0))
        per_slot = tokens * (self.kv_bytes_per_token + head_kv) + state + mtp_drafts * self.rollback_bytes_per_draft
        return slots * per_slot + state


def cache_bytes(seq: Sequence) -> tuple[int, int]:
    """(KV bytes, GDN state bytes) a sequence holds now, counted from its tensors."""
    return seq.cache.kv_nbytes, seq.cache.state_nbytes


class QueueFull(Exception):
    pass


class SchedulerStopped(Exception):
    pass


_END = object()  # queue marker: the request was cancelled


class RequestHandle:
    """One generation request. Iterate it (in the event loop) for its TokenEvents."""

    def __init__(self, scheduler: "Scheduler", prompt_ids: list[int], params: SamplingParams, reserve: int):
        self.scheduler = scheduler
        self.prompt_ids, self.params, self.reserve = prompt_ids, params, reserve
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_generated = 0
        self.seq: Sequence | None = None
        self.state = "new"  # new | waiting | admitted | running | done
        self.cancelled = False
        self.finish_reason: str | None = None

    def cancel(self) -> None:
        """Stop generating (client gone or stream abandoned); idempotent."""
        self.scheduler.cancel(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _END:
            self.finish_reason = self.finish_reason or "abort"
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finish_reason = "error"
            raise item
        if item.finish_reason:
            self.finish_reason = item.finish_reason
        return item


class Scheduler:
    def __init__(self, engine: Engine, *, max_num_seqs: int, max_queued: int, budget_bytes: int, metrics: Metrics):
        self.engine = engine
        self.max_num_seqs, self.max_queued, self.budget = max_num_seqs, max_queued, budget_bytes
        self.memory = CacheMemory.for_model(engine.model.config, engine.model.dtype)
        self.metrics = metrics
        self.cond = threading.Condition()
        # Guarded by `cond`:
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.to_add: list[RequestHandle] = []
        self.to_cancel: list[RequestHandle] = []
        self.admitted = 0  # to_add + running
        self.reserved = 0
        self.stopping = False
        # Engine thread only:
        self.running: dict[int, RequestHandle] = {}  # Sequence.request_id -> handle
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._publish_gauges(0, 0)

    # -- event loop side -----------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="roofline-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread:
            self.thread.join(timeout)

    def reservation(self, prompt_tokens: int, max_tokens: int | None) -> int:
        limit = self.engine.max_model_len
        return self.memory.sequence_bytes(min(limit, prompt_tokens + (max_tokens or limit)))

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Admit now, queue, or raise QueueFull. Called in the event loop."""
        handle = RequestHandle(self, prompt_ids, params, self.reservation(len(prompt_ids), params.max_tokens))
        with self.cond:
            if self.stopping:
                raise SchedulerStopped("the server is shutting down")
            if not self.waiting and self._fits(handle):
                self._admit(handle)
            elif len(self.waiting) < self.max_queued:
                handle.state = "waiting"
                self.waiting.append(handle)
            else:
                raise QueueFull(
                    f"the server is at capacity ({self.admitted} running of --max-num-seqs {self.max_num_seqs}, "
                    f"{_gib(self.reserved)} of {_gib(self.budget)} KV/state memory reserved, "
                    f"{len(self.waiting)} queued of --max-queued-requests {self.max_queued}); retry later"
                )
            self._publish_gauges_locked()
            self.cond.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        with self.cond:
            if handle.cancelled or handle.state == "done":
                return
            handle.cancelled = True
            if handle.state == "waiting":
                self.waiting.remove(handle)
                handle.state = "done"
            elif handle.state == "admitted":
                self.to_add.remove(handle)
                self._release(handle)
            elif handle.state == "running":
                self.to_cancel.append(handle)
            self._publish_gauges_locked()
            self.cond.notify_all()
        handle.queue.put_nowait(_END)
        self.metrics.request_finished("abort", len(handle.prompt_ids), handle.num_generated, time.monotonic() - handle.arrival)

    def counts(self) -> tuple[int, int]:
        with self.cond:
            return self.admitted, len(self.waiting)

    # -- admission (under cond) ----------------------------------------------------------
    def _fits(self, handle: RequestHandle) -> bool:
        return self.admitted < self.max_num_seqs and self.reserved + handle.reserve <= self.budget

    def _admit(self, handle: RequestHandle) -> None:
        handle.state = "admitted"
        self.admitted += 1
        self.reserved += handle.reserve
        self.to_add.append(handle)

    def _release(self, handle: RequestHandle) -> None:
        if handle.state in ("admitted", "running"):
            self.admitted -= 1
            self.reserved -= handle.reserve
        handle.state = "done"
        while self.waiting and self._fits(self.waiting[0]):
            self._admit(self.waiting.popleft())

    def _publish_gauges_locked(self) -> None:
        self.metrics.set_gauges(
            roofline_num_requests_running=self.admitted,
            roofline_num_requests_waiting=len(self.waiting),
            roofline_cache_reserved_bytes=self.reserved,
            roofline_cache_budget_bytes=self.budget,
            roofline_cache_usage_ratio=self.reserved / self.budget if self.budget else 0.0,
            roofline_max_num_seqs=self.max_num_seqs,
        )

    def _publish_gauges(self, kv: int, state: int) -> None:
        self.metrics.set_gauges(roofline_kv_cache_bytes=kv, roofline_gdn_state_bytes=state)
        with self.cond:
            self._publish_gauges_locked()

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    break
            except Exception:  # a bug in the bookkeeping must not stop the engine thread
                log.exception("engine loop error; failing the running requests and going on")
                for handle in list(self.running.values()):
                    self._fail(handle, RuntimeError("internal error in the engine loop"))
        for handle in list(self.running.values()):
            self._fail(handle, SchedulerStopped("the server is shutting down"))

    def _iteration(self) -> bool:
        """Admit, cancel, step once, deliver; False when stopping."""
        with self.cond:
            while not (self.to_add or self.to_cancel or self.stopping or self.engine.sequences):
                self.cond.wait()
            if self.stopping:
                return False
            adds, self.to_add = self.to_add, []
            cancels, self.to_cancel = self.to_cancel, []
            for handle in adds:
                handle.state = "running"
        for handle in cancels:
            self._drop(handle)
        for handle in adds:
            try:
                handle.seq = self.engine.add(handle.prompt_ids, handle.params)
                self.running[handle.seq.request_id] = handle
            except ValueError as exc:  # checked in the handler already; a last guard
                self._fail(handle, exc)
            except Exception as exc:
                log.exception("engine.add failed")
                self._fail(handle, RuntimeError(f"the engine failed: {type(exc).__name__}: {exc}"))
        if self.engine.sequences:
            try:
                events = self.engine.step()
            except Exception as exc:  # a real fault: fail the batch, keep serving
                log.exception("engine step failed; failing %d running request(s)", len(self.running))
                for handle in list(self.running.values()):
                    self._fail(handle, RuntimeError(f"the engine failed: {type(exc).__name__}: {exc}"))
                events = []
            self._deliver(events)
        self._measure()
        return True

    def _drop(self, handle: RequestHandle) -> None:
        if handle.seq is not None:
            self.engine.cancel(handle.seq)
            self.running.pop(handle.seq.request_id, None)
        with self.cond:
            self._release(handle)

    def _fail(self, handle: RequestHandle, exc: BaseException) -> None:
        self._drop(handle)
        self._post([(handle, exc)])

    def _deliver(self, events: list) -> None:
        batch = []
        for seq, event in events:
            handle = self.running.get(seq.request_id)
            if handle is None:
                continue
            batch.append((handle, event))
            if event.finish_reason:
                self.running.pop(seq.request_id, None)
                with self.cond:
                    self._release(handle)
        if batch:
            self._post(batch)

    def _post(self, batch: list) -> None:
        try:
            self.loop.call_soon_threadsafe(self._dispatch, batch)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def _dispatch(self, batch: list) -> None:
        """In the event loop: hand events to their requests and time them."""
        now = time.monotonic()
        for handle, item in batch:
            if handle.cancelled:
                continue
            if isinstance(item, TokenEvent):
                handle.num_generated += 1
                if handle.last_token_time is None:
                    self.metrics.first_token(now - handle.arrival)
                else:
                    self.metrics.inter_token(now - handle.last_token_time)
                handle.last_token_time = now
                if item.finish_reason:
                    self.metrics.request_finished(item.finish_reason, len(handle.prompt_ids), handle.num_generated, now - handle.arrival)
            else:
                self.metrics.request_finished("error", len(handle.prompt_ids), handle.num_generated, now - handle.arrival)
            handle.queue.put_nowait(item)

    def _measure(self) -> None:
        kv = state = 0
        for seq in self.engine.sequences:
            k, s = cache_bytes(seq)
            kv, state = kv + k, state + s
        self._publish_gauges(kv, state)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
