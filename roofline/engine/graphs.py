"""The pooled decode step, captured as CUDA graphs and replayed: one launch per token on a GPU.

A decode step for B sequences x M tokens (M > 1: a speculative verify) has fixed shapes, so
it is captured once per bucket (B rounded up to a power of two, M, and the attention span
rounded up to a power of two) and replayed with new inputs copied into its static buffers.
Padding rows run on the pool's scratch GDN slot and its reserved KV positions (CachePool). On a CPU (tests run the kernels in Triton's
interpreter) the same step runs eagerly, so the captured code is the tested code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.dispatch import MAX_EXPERT_TOKENS
from ..model.layers import SlotBatch
from .cache import CachePool, SlotCache

log = logging.getLogger("roofline.engine")

MIN_SPAN = 1024  # smallest attention-span bucket
MAX_GRAPH_ROWS = MAX_EXPERT_TOKENS  # beyond the expert kernels' rows the step runs eagerly (the reference syncs)


def _bucket(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, n - 1).bit_length())


@dataclass
class StepBuffers:
    """Static inputs and outputs of one bucket's graph."""

    ids: torch.Tensor  # [B*M]
    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B*M]
    lengths: torch.Tensor  # [B]
    kv_slots: torch.Tensor  # [B]
    kv_positions: torch.Tensor  # [B*M]
    rollback: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    hidden_in: torch.Tensor | None = None  # [B*M, H] the MTP head's hidden input
    hidden: torch.Tensor | None = None  # [B*M, H] post-norm
    logits: torch.Tensor | None = None  # [B*M, V] fp32
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Runs the pooled decode step for a batch of `SlotCache`s: of the main model, or with `mtp` of
    the MTP head (which also takes a hidden state per token)."""

    def __init__(self, model, pool: CachePool, max_batch: int, use_graphs: bool, mtp: bool = False, logits=None):
        self.model, self.pool, self.max_batch, self.use_graphs, self.mtp = model, pool, max_batch, use_graphs, mtp
        self.logits = logits or model.logits  # hidden -> fp32 logits (the MTP head's may cover part of the vocabulary)
        self.buffers: dict[tuple[int, int, int], StepBuffers] = {}
        self.mempool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0

    def _new_buffers(self, b: int, m: int, rollback: bool) -> StepBuffers:
        dev, pool = self.model.device, self.pool
        pad_slot, pad_start = pool.pad_kv
        buffers = StepBuffers(  # every row padding until run() fills them: the warm-up and capture touch no sequence
            ids=torch.zeros(b * m, dtype=torch.long, device=dev),
            slots=torch.full((b,), pool.pad_slot, dtype=torch.int32, device=dev),
            positions=torch.arange(m, device=dev).repeat(b),
            lengths=torch.full((b,), m, dtype=torch.int32, device=dev),
            kv_slots=torch.full((b,), pad_slot, dtype=torch.int32, device=dev),
            kv_positions=(pad_start + torch.arange(m, device=dev)).repeat(b),
            rollback=None,
            hidden_in=torch.zeros(b * m, self.model.config.hidden_size, dtype=self.model.dtype, device=dev) if self.mtp else None,
        )
        if rollback and m > 1:
            buffers.rollback = {
                layer: (
                    torch.empty(b, m - 1, *state.shape[1:], dtype=state.dtype, device=dev),
                    torch.empty(b, m - 1, *pool.conv[layer].shape[1:], dtype=pool.conv[layer].dtype, device=dev),
                )
                for layer, state in pool.recurrent.items()
            }
        return buffers

    def _body(self, buf: StepBuffers, m: int, span: int) -> None:
        batch = SlotBatch(self.pool, buf.slots, buf.positions, buf.lengths, m, span, buf.rollback, buf.kv_slots,
                          buf.kv_positions)
        if self.mtp:
            buf.hidden = self.model.mtp_slot_forward(buf.ids, buf.hidden_in, batch)
        else:
            buf.hidden = self.model.slot_forward(buf.ids, batch)
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
            if self.use_graphs and b * m <= MAX_GRAPH_ROWS:
                self._capture(buf, m, span)
                log.info("captured the decode step as a CUDA graph: batch %d, %d token(s) per sequence, span %d", b, m, span)
            self.buffers[key] = buf
        return buf, b, span

    def run(self, ids: list[int], caches: list[SlotCache], m: int, rollback: bool = False,
            hidden: torch.Tensor | None = None) -> StepBuffers:
        """One step: `ids` holds m tokens per cache, sequence-major (`hidden`, [len(ids), H], for the MTP head).
        Caches are not advanced (the caller decides how many tokens to keep). Returns the bucket's buffers
        (rows past len(ids) are padding)."""
        n = len(caches)
        longest = max(c.num_tokens for c in caches) + m
        buf, b, span = self.buffers_for(n, m, longest, rollback)
        dev = buf.ids.device
        pad_slot, pad_start = self.pool.pad_kv
        starts = torch.tensor([c.num_tokens for c in caches] + [0] * (b - n), dtype=torch.long)
        positions = (starts[:, None] + torch.arange(m)).reshape(-1)
        kv_positions = positions.clone()
        kv_positions[n * m :] += pad_start  # padding rows write past every sequence's end
        buf.ids.copy_(torch.tensor(list(ids) + [0] * ((b - n) * m), dtype=torch.long), non_blocking=True)
        buf.slots.copy_(torch.tensor([c.slot for c in caches] + [self.pool.pad_slot] * (b - n), dtype=torch.int32))
        buf.kv_slots.copy_(torch.tensor([c.slot for c in caches] + [pad_slot] * (b - n), dtype=torch.int32))
        buf.positions.copy_(positions.to(dev))
        buf.kv_positions.copy_(kv_positions.to(dev))
        buf.lengths.copy_((starts + m).to(torch.int32).to(dev))
        if self.mtp:
            buf.hidden_in[: len(ids)].copy_(hidden)
        if buf.graph is not None:
            buf.graph.replay()
            self.replays += 1
        else:
            self._body(buf, m, span)
        return buf

    def keep(self, buf: StepBuffers, index: int, cache: SlotCache, m: int, kept: int) -> None:
        """Advance `cache` (row `index` of the last step) by the first `kept` of its m tokens, restoring
        the GDN state saved after token kept-1 when the step went further."""
        if kept < m:
            if buf.rollback is None:
                raise RuntimeError("this step saved no rollback state")
            for layer, (states, conv) in buf.rollback.items():
                self.pool.recurrent[layer][cache.slot].copy_(states[index, kept - 1])
                self.pool.conv[layer][cache.slot].copy_(conv[index, kept - 1])
        cache.advance(kept)
