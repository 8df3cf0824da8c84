"""The pooled decode step, captured as CUDA graphs and replayed: one launch per token on a GPU.

A decode step for B sequences x M tokens (M > 1: a speculative verify) has fixed shapes, so
it is captured once per bucket (B rounded up to a power of two, M, and the attention span
rounded up to a power of two) and replayed with new inputs copied into its static buffers.
Padding rows run on the pool's scratch GDN slot and its reserved KV positions (CachePool). On a CPU (tests run the kernels in Triton's
interpreter) the same step runs eagerly, so the captured code is the tested code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.dispatch import MAX_EXPERT_TOKENS, TRITON_GRAPH_ROWS
from ..model.layers import SlotBatch
from .cache import CachePool, SlotCache, step_record_size

log = logging.getLogger("roofline.engine")

MIN_SPAN = 1024  # smallest attention-span bucket


def _bucket(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, n - 1).bit_length())


def _all_buckets(first: int, cap: int) -> list[int]:
    """Every bucket `_bucket(n, cap)` gives for first <= n <= cap, ascending."""
    buckets = [_bucket(first, cap)]
    while buckets[-1] < cap:
        buckets.append(_bucket(buckets[-1] + 1, cap))
    return buckets


class StepInputs:
    """The step's integer inputs as views of one device buffer, filled from one (pinned) host buffer by one copy.

    Why: six small copies from pageable memory, each from a new tensor, cost ~0.1-0.3 ms of host time per
    token while the GPU waited (5-10% of a 4 ms H200 step). Layout: int64 ids, positions, kv_positions
    ([B*M] each), then int32 slots, lengths, kv_slots, state_in, state_out ([B] each) in the same bytes.
    """

    def __init__(self, b: int, m: int, device: torch.device):
        rows, n32 = b * m, 5 * b
        size = 3 * rows + (n32 + 1) // 2
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None  # the last copy out of `host`
        h64 = self.host.numpy()
        h32 = h64[3 * rows :].view(np.int32)
        self.ids_h, self.positions_h, self.kv_positions_h = h64[:rows], h64[rows : 2 * rows], h64[2 * rows : 3 * rows]
        self.slots_h, self.lengths_h, self.kv_slots_h = h32[:b], h32[b : 2 * b], h32[2 * b : 3 * b]
        self.state_in_h, self.state_out_h = h32[3 * b : 4 * b], h32[4 * b : n32]
        d32 = self.device_buffer[3 * rows :].view(torch.int32)
        self.ids, self.positions, self.kv_positions = self.device_buffer[:rows], self.device_buffer[rows : 2 * rows], \
            self.device_buffer[2 * rows : 3 * rows]
        self.slots, self.lengths, self.kv_slots = d32[:b], d32[b : 2 * b], d32[2 * b : 3 * b]
        self.state_in, self.state_out = d32[3 * b : 4 * b], d32[4 * b : n32]  # GDN state rows read / written

    def writable(self) -> "StepInputs":
        """Wait until the previous copy has read the host buffer (normally long done: the caller read its results)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self

    def upload(self) -> None:
        self.device_buffer.copy_(self.host, non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()


@dataclass
class StepBuffers:
    """Static inputs and outputs of one bucket's graph."""

    inputs: StepInputs
    rollback: dict[int, torch.Tensor] | None  # layer -> step records view
    records: torch.Tensor | None = None  # the storage its records views are of (gdn_replay reads it whole)
    hidden_in: torch.Tensor | None = None  # [B*M, H] the MTP head's hidden input
    hidden: torch.Tensor | None = None  # [B*M, H] post-norm
    logits: torch.Tensor | None = None  # [B*M, V] fp32
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Runs the pooled decode step for a batch of `SlotCache`s: of the main model, or with `mtp` of
    the MTP head (which also takes a hidden state per token).

    A verify step with a rollback (`rollback=True`) reads each sequence's GDN state from its current buffer and
    writes the new state to the other (the pool has two: CachePool's `state_buffers`), saving per GDN layer and
    position but the last the step's records (gdn_decode's `step_records`: k, d and decay, 40 KB on the 122B); `keep`
    then switches the sequence to the new state, or, where drafts were rejected, rebuilds the kept tokens' state from
    the old one (`gdn_replay`, one launch); the conv rings need nothing, they hold the inputs by position. The records
    live in one storage that every bucket views: steps run one at a time and `keep` reads a step's records before the
    next step runs. `rollback_rows` (sequences x drafts) reserves it up front, so the engine's memory is known at
    start; a larger step grows it."""

    def __init__(self, model, pool: CachePool, max_batch: int, use_graphs: bool, mtp: bool = False, logits=None,
                 rollback_rows: int = 0):
        self.model, self.pool, self.max_batch, self.use_graphs, self.mtp = model, pool, max_batch, use_graphs, mtp
        self.logits = logits or model.logits  # hidden -> fp32 logits (the MTP head's may cover part of the vocabulary)
        self.buffers: dict[tuple[int, int, int], StepBuffers] = {}
        self.mempool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0
        self.captures: list[dict] = []  # per captured bucket: its key and the seconds its warm-up and capture took
        self.records: torch.Tensor | None = None  # [GDN layers, R, record_size] fp32: the verify's step records
        self.replay_compiled = False
        if rollback_rows:
            self._reserve_saves(rollback_rows)

    @property
    def saves_nbytes(self) -> int:
        return 0 if self.records is None else self.records.numel() * self.records.element_size()

    def _reserve_saves(self, rows: int) -> None:
        """A new storage of `rows` positions' saves (buckets captured on an older one keep it alive)."""
        dev, pool = self.model.device, self.pool
        if pool.recurrent_all is None:
            return
        layers, _, hv, dk, dv = pool.recurrent_all.shape
        self.records = torch.zeros(layers, rows, step_record_size(self._k_heads(), dk, hv, dv), dtype=torch.float32,
                                   device=dev)

    def _k_heads(self) -> int:
        return self.model.config.linear_num_key_heads

    def _rollback_views(self, b: int, m: int) -> dict[int, torch.Tensor]:
        """Per GDN layer, [b, m-1, ...] views of the saves' storage (contiguous prefixes), grown first if too small."""
        self.pool.require_spare_state()
        rows = b * (m - 1)
        if self.records is None or self.records.shape[1] < rows:
            self._reserve_saves(rows)
        return {layer: self.records[i, :rows].view(b, m - 1, -1) for i, layer in enumerate(self.pool.conv)}

    def _new_buffers(self, b: int, m: int, rollback: bool) -> StepBuffers:
        dev, pool = self.model.device, self.pool
        pad_slot, pad_start = pool.pad_kv
        inputs = StepInputs(b, m, dev)  # every row padding until run() fills them: the warm-up and capture touch no sequence
        inputs.ids_h[:] = 0
        inputs.slots_h[:] = pool.pad_slot
        inputs.state_in_h[:] = inputs.state_out_h[:] = pool.state_row(pool.pad_slot)
        inputs.positions_h[:] = np.tile(np.arange(m), b)
        inputs.lengths_h[:] = m
        inputs.kv_slots_h[:] = pad_slot
        inputs.kv_positions_h[:] = pad_start + np.tile(np.arange(m), b)
        inputs.upload()
        buffers = StepBuffers(
            inputs=inputs,
            rollback=None,
            hidden_in=torch.zeros(b * m, self.model.config.hidden_size, dtype=self.model.dtype, device=dev) if self.mtp else None,
        )
        if rollback and m > 1:
            buffers.rollback = self._rollback_views(b, m)
            buffers.records = self.records  # a later, larger step may grow the storage: this bucket keeps its own
            if self.use_graphs and not self.replay_compiled:  # compile it now, not at the first rejected draft
                # the padding slot's rows: nothing reads them
                self._replay(buffers, pool.state_row(pool.pad_slot), pool.state_row(pool.pad_slot, 1), 0, 1)
                self.replay_compiled = True
        return buffers

    def _replay(self, buf: StepBuffers, row_in: int, row_out: int, first_record: int, kept: int) -> None:
        from ..kernels.gdn_decode import gdn_replay

        gdn_replay(self.pool.recurrent_all, buf.records, self._k_heads(), row_in, row_out, first_record, kept)

    def _body(self, buf: StepBuffers, m: int, span: int) -> None:
        i = buf.inputs
        batch = SlotBatch(self.pool, i.slots, i.positions, i.lengths, m, span, buf.rollback, i.kv_slots, i.kv_positions,
                          i.state_in, i.state_out)
        if self.mtp:
            buf.hidden = self.model.mtp_slot_forward(i.ids, buf.hidden_in, batch)
        else:
            buf.hidden = self.model.slot_forward(i.ids, batch)
        buf.logits = self.logits(buf.hidden)

    def _capture(self, buf: StepBuffers, m: int, span: int) -> None:
        """Warm up (compiles the kernels, sizes their workspaces) on the scratch slot, then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body(buf, m, span)
        torch.cuda.current_stream().wait_stream(stream)
        buf.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(buf.graph, pool=self.mempool):
            self._body(buf, m, span)

    def buffers_for(self, batch: int, m: int, longest: int, rollback: bool = False) -> tuple[StepBuffers, int, int]:
        """The (possibly new) bucket for `batch` sequences of `m` tokens whose longest cache will hold `longest`."""
        if batch > self.max_batch:
            raise ValueError(f"{batch} sequences exceed the graph runner's batch limit {self.max_batch}")
        b = _bucket(batch, self.max_batch)
        span = _bucket(max(longest, MIN_SPAN), self.pool.max_len)
        key = (b, m, span)
        buf = self.buffers.get(key)
        if buf is None or (rollback and buf.rollback is None and m > 1):
            buf = self._new_buffers(b, m, rollback)
            # Past the expert kernels' rows the routed experts loop and read the device back, unless the fast path's
            # INT4 GEMM takes them (kernels.dispatch.use_int4_gemm sets the model's max_graph_rows).
            max_rows = getattr(self.model, "max_graph_rows", MAX_EXPERT_TOKENS)
            if self.use_graphs and b * m <= max_rows:
                start = time.perf_counter()
                self._capture(buf, m, span)  # the first step of a new bucket waits for this (a new span mid-answer too)
                seconds = time.perf_counter() - start
                self.captures.append({"batch": b, "m": m, "span": span, "seconds": seconds})
                log.info("captured the decode step as a CUDA graph in %.2f s: batch %d, %d token(s) per sequence, span %d",
                         seconds, b, m, span)
            elif self.use_graphs:
                log.info("decode steps of batch %d x %d token(s) run eagerly, not as a CUDA graph: %d rows exceed %d "
                         "(ROOFLINE_INT4_GEMM=triton captures up to %d)", b, m, b * m, max_rows, TRITON_GRAPH_ROWS)
            self.buffers[key] = buf
        return buf, b, span

    def prepare(self, ms: list[int], rollback: bool = False) -> int:
        """Make now (on a GPU: capture) every bucket of `ms` tokens per sequence that a step can meet, each batch
        bucket up to `max_batch` by each attention span up to the pool's capacity, so no step waits for a capture
        mid-answer (a new span's capture took 0.2-0.3 s on an H100, and up to 10 s where it compiled kernels
        first). Returns how many buckets were new."""
        before = len(self.buffers)
        spans = _all_buckets(MIN_SPAN, self.pool.max_len)
        for b in _all_buckets(1, self.max_batch):
            for m in ms:
                for span in spans:
                    self.buffers_for(b, m, span, rollback)
        return len(self.buffers) - before

    def run(self, ids: list[int] | torch.Tensor, caches: list[SlotCache], m: int, rollback: bool = False,
            hidden: torch.Tensor | None = None) -> StepBuffers:
        """One step: `ids` holds m tokens per cache, sequence-major (`hidden`, [len(ids), H], for the MTP head),
        as a host list or as a device tensor (the tokens the previous step sampled, which the host has not
        read yet: copied into the step's inputs on the device). Caches are not advanced (the caller decides how
        many tokens to keep). Returns the bucket's buffers (rows past len(ids) are padding)."""
        n = len(caches)
        longest = max(c.num_tokens for c in caches) + m
        buf, b, span = self.buffers_for(n, m, longest, rollback)
        pad_slot, pad_start = self.pool.pad_kv
        i = buf.inputs.writable()
        starts = np.array([c.num_tokens for c in caches] + [0] * (b - n), dtype=np.int64)
        on_device = isinstance(ids, torch.Tensor)
        i.ids_h[: len(ids)] = 0 if on_device else ids
        i.ids_h[len(ids) :] = 0
        i.positions_h[:] = (starts[:, None] + np.arange(m)).reshape(-1)
        i.kv_positions_h[:] = i.positions_h
        i.kv_positions_h[n * m :] += pad_start  # padding rows write past every sequence's end
        i.slots_h[:n] = [c.slot for c in caches]
        i.slots_h[n:] = self.pool.pad_slot
        i.state_in_h[:n] = [c.state_row for c in caches]
        # a verify with a rollback writes the new states to the spare buffers; keep() switches to them
        i.state_out_h[:n] = [c.spare_state_row for c in caches] if buf.rollback is not None else i.state_in_h[:n]
        i.kv_slots_h[:n] = i.slots_h[:n]
        i.kv_slots_h[n:] = pad_slot
        i.lengths_h[:] = starts + m
        i.upload()
        if on_device:
            i.ids[: len(ids)].copy_(ids)
        if self.mtp:
            buf.hidden_in[: len(ids)].copy_(hidden)
        if buf.graph is not None:
            buf.graph.replay()
            self.replays += 1
        else:
            self._body(buf, m, span)
        return buf

    def keep(self, buf: StepBuffers, index: int, cache: SlotCache, m: int, kept: int) -> None:
        """Advance `cache` (row `index` of the last step) by the first `kept` of its m tokens. After a verify with a
        rollback the sequence's state is in its spare buffer: with every token kept that is the state; with fewer,
        the kept tokens' state is rebuilt there from the state before the step (gdn_replay)."""
        if kept < m and buf.rollback is None:
            raise RuntimeError("this step saved no rollback state")
        if buf.rollback is not None:
            if kept < m:
                self._replay(buf, cache.state_row, cache.spare_state_row, index * (m - 1), kept)
            cache.flip_state()
        cache.advance(kept)
