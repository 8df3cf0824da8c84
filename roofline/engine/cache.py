"""Per-sequence decode state: KV for full-attention layers, conv and recurrent state for GDN layers.

The reference path keeps each sequence's state in its own small tensors, grown as tokens
arrive (`SequenceCache`). The CUDA-graph path needs fixed addresses instead: a `CachePool`
preallocates every layer's state for a number of slots, and a `SlotCache` is a sequence's
view of one slot, so eager prefill and captured decode steps read and write the same memory.
Layer indices are the model's (the MTP layer has its own cache and pool).

Speculative decoding verifies several tokens in one step and may keep only some of them.
With `record_steps` on, GDN layers remember their state after every token of the step, so
`truncate` can return to exactly the state after the last accepted token.
"""

from __future__ import annotations

import torch


class SequenceCache:
    def __init__(self, record_steps: bool = False):
        self.num_tokens = 0  # tokens processed so far (the next token's position)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [T, kv_heads, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [K-1, conv_dim], last pre-conv inputs
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [v_heads, k_dim, v_dim] fp32
        self.record_steps = record_steps
        self.step_start = 0
        self.step_conv: dict[int, torch.Tensor] = {}  # layer -> [K-1 + t, conv_dim] window of the last step
        self.step_recurrent: dict[int, list[torch.Tensor]] = {}  # layer -> state after each token of the last step

    def begin_step(self) -> None:
        self.step_start = self.num_tokens
        self.step_conv.clear()
        self.step_recurrent.clear()

    def stop_recording(self) -> None:
        self.record_steps = False
        self.step_conv.clear()
        self.step_recurrent.clear()

    def conv_window(self, layer: int, history: int) -> torch.Tensor | None:
        """The conv inputs of the `history` positions before the next token (None before the first step)."""
        return self.conv.get(layer)

    def set_conv(self, layer: int, window: torch.Tensor, history: int) -> None:
        """After a step's conv: `window` holds the inputs of positions num_tokens - history .. num_tokens + t - 1
        (the history it read, then its t tokens'); the cache keeps the last `history`."""
        self.conv[layer] = window[-history:].clone()

    def set_recurrent(self, layer: int, state: torch.Tensor) -> None:
        self.recurrent[layer] = state

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k])
            v = torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def truncate(self, num_tokens: int) -> None:
        """Forget every token from position `num_tokens` on.

        KV alone can be cut anywhere; GDN state only back to a token of the last step, and only
        if that step was recorded.
        """
        if num_tokens == self.num_tokens:
            return
        keep = num_tokens - self.step_start
        gdn_ok = not self.conv or (self.record_steps and 0 < keep <= self.num_tokens - self.step_start)
        if not 0 <= num_tokens < self.num_tokens or not gdn_ok:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the last step covered {self.step_start}..{self.num_tokens}")
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][:num_tokens]
            self.values[layer] = self.values[layer][:num_tokens]
        self._rewind_conv(keep)
        for layer, states in self.step_recurrent.items():
            self.set_recurrent(layer, states[keep - 1])
        self.num_tokens = num_tokens

    def _rewind_conv(self, keep: int) -> None:
        """The conv windows after the first `keep` tokens of the last (recorded) step."""
        steps = self.num_tokens - self.step_start
        for layer, window in self.step_conv.items():
            self.conv[layer] = window[keep : keep + window.shape[0] - steps].clone()

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.state_nbytes

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the keys and values this sequence holds, counted from the tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    @property
    def state_nbytes(self) -> int:
        """Bytes of its GDN conv windows and recurrent states."""
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.recurrent.values()))


def step_record_size(num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int) -> int:
    """fp32 values of what one token of a GDN verify step records for the rollback (kernels.gdn_decode's
    step_records): each key head's normalised k [Hk, dk], then each value head's delta d [Hv, dv], then its decay
    [Hv]."""
    return num_k_heads * k_dim + num_v_heads * v_dim + num_v_heads


def conv_ring_rows(kernel: int) -> int:
    """Rows of a pool slot's GDN conv ring (position p in row p mod R): a power of two (the kernel takes the row as
    a mask) with room for the K-1 inputs a step reads and the most tokens a step writes, CachePool.PAD_TOKENS."""
    need = kernel - 1 + CachePool.PAD_TOKENS
    return 1 << (need - 1).bit_length()


class CachePool:
    """Decode state for `num_slots` sequences, allocated once: what CUDA graphs index by slot.

    keys/values [S, max_len + PAD_TOKENS, kv_heads, head_dim] per full-attention layer (model
    dtype); conv [S + 1, R, conv_dim] (a ring by position, R = conv_ring_rows(K)) and recurrent
    [(S + 1) x state_buffers, v_heads, k_dim, v_dim] fp32 per GDN layer, the layers' recurrent states views of one
    tensor (`recurrent_all`, which `gdn_replay` takes whole). With two state buffers (MTP speculation) slot s's state
    lives in row 2s + parity: a verify step reads the current buffer and writes the other, so the state before the
    step survives for the rollback (SlotCache.flip_state).
    The padding rows of a batch bucket need somewhere harmless to write: for GDN state
    the extra slot `pad_slot` (a few hundred MB at most), for keys and values the last
    PAD_TOKENS positions of slot 0, which no sequence reaches (a whole extra KV slot would cost
    a full context: 6.4 GB at 256K tokens on the 122B).
    """

    PAD_TOKENS = 8  # >= the most tokens a sequence has in one step (1 + the most drafts)

    def __init__(self, cfg, layer_types: list[str], num_slots: int, max_len: int, device, dtype: torch.dtype,
                 state_buffers: int = 1):
        if state_buffers not in (1, 2):
            raise ValueError(f"state_buffers must be 1 or 2, got {state_buffers}")
        self.max_len, self.num_slots, self.state_buffers = max_len, num_slots, state_buffers
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        slots = num_slots + 1
        gdn = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        self.recurrent_all = torch.zeros(
            len(gdn), slots * state_buffers, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, dtype=torch.float32, device=device,
        ) if gdn else None
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                shape = (num_slots, max_len + self.PAD_TOKENS, cfg.num_key_value_heads, cfg.head_dim)
                self.keys[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.values[i] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                self.conv[i] = torch.zeros(slots, conv_ring_rows(cfg.linear_conv_kernel_dim), cfg.linear_conv_dim,
                                           dtype=dtype, device=device)
                self.recurrent[i] = self.recurrent_all[gdn.index(i)]
        self.pad_slot = num_slots  # GDN state of padding rows (state row pad_slot * state_buffers)
        self.pad_kv = (0, max_len)  # (slot, first position) of padding rows' keys and values
        self.free = list(range(num_slots))
        # one slot's bytes per position, every layer's keys and values (what a token of context holds)
        self.kv_bytes_per_token = sum(t[0, 0].numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def require_spare_state(self) -> None:
        """Raise unless each slot has a second GDN state buffer, the one a verify step with a rollback writes to."""
        if self.state_buffers < 2:
            raise RuntimeError("this cache pool keeps one GDN state buffer per slot: a verify step with a rollback "
                               "needs two (CachePool(state_buffers=2), as the engine allocates with MTP)")

    def state_row(self, slot: int, parity: int = 0) -> int:
        """The row of `slot`'s GDN state in buffer `parity` (in every layer's recurrent pool)."""
        if not 0 <= parity < self.state_buffers:
            self.require_spare_state()  # parity 1 of a one-buffer pool: the error that says why
            raise ValueError(f"GDN state buffer {parity} of a pool with {self.state_buffers}")
        return slot * self.state_buffers + parity

    def acquire(self, record_steps: bool = False) -> "SlotCache":
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} cache slots are in use")
        return SlotCache(self, self.free.pop(0), record_steps)

    def release(self, cache: "SlotCache") -> None:
        if cache.slot not in self.free:
            self.free.insert(0, cache.slot)  # reused first


class SlotCache(SequenceCache):
    """A sequence's view of one `CachePool` slot: the reference code's dicts hold views of the pool,
    and writes go through to it."""

    def __init__(self, pool: CachePool, slot: int, record_steps: bool = False):
        self.pool, self.slot = pool, slot
        self.parity = 0  # which of the pool's state buffers holds the state (one buffer: always 0)
        self._kv_stale = True
        super().__init__(record_steps)
        for layer, conv in pool.conv.items():
            self.conv[layer] = conv[slot].zero_()
        # each buffer's views, cut once: with MTP keep() switches buffers every verify step, where cutting a view per
        # GDN layer (36 on the 122B) would be host time while the GPU waits
        self._state_views = [{layer: state[pool.state_row(slot, p)] for layer, state in pool.recurrent.items()}
                             for p in range(pool.state_buffers)]
        self.recurrent = self._state_views[0]
        for state in self.recurrent.values():
            state.zero_()

    @property
    def state_row(self) -> int:
        """The pool row that holds this sequence's GDN state now."""
        return self.pool.state_row(self.slot, self.parity)

    @property
    def spare_state_row(self) -> int:
        """The row a verify step writes its new state to (the other buffer; raises where the pool keeps one)."""
        return self.pool.state_row(self.slot, 1 - self.parity)

    def flip_state(self) -> None:
        """After a verify step wrote the state to the spare row: that row holds it now."""
        self.pool.require_spare_state()
        self.parity = 1 - self.parity
        self.recurrent = self._state_views[self.parity]

    # The KV views are cut when read, not at every step: a captured decode step never reads them, and cutting
    # two views per attention layer cost ~40 us of host time per token and sequence.
    @property
    def keys(self) -> dict[int, torch.Tensor]:
        self._refresh_kv()
        return self._keys

    @keys.setter
    def keys(self, views: dict[int, torch.Tensor]) -> None:
        self._keys = views

    @property
    def values(self) -> dict[int, torch.Tensor]:
        self._refresh_kv()
        return self._values

    @values.setter
    def values(self, views: dict[int, torch.Tensor]) -> None:
        self._values = views

    def _refresh_kv(self) -> None:
        if not self._kv_stale:
            return
        self._kv_stale = False
        for layer in self.pool.keys:
            self._keys[layer] = self.pool.keys[layer][self.slot, : self.num_tokens]
            self._values[layer] = self.pool.values[layer][self.slot, : self.num_tokens]

    def _ring_rows(self, layer: int, start: int, end: int) -> torch.Tensor:
        ring = self.conv[layer]
        return torch.arange(start, end, device=ring.device) % ring.shape[0]

    def conv_window(self, layer: int, history: int) -> torch.Tensor:
        """From the slot's ring (zeros before position 0: a slot's ring is cleared when acquired)."""
        return self.conv[layer][self._ring_rows(layer, self.num_tokens - history, self.num_tokens)]

    def set_conv(self, layer: int, window: torch.Tensor, history: int) -> None:
        """The step's inputs to their ring rows (a prefill longer than the ring: its last R)."""
        ring = self.conv[layer]
        new = window[history:][-ring.shape[0] :]
        end = self.num_tokens + window.shape[0] - history
        ring[self._ring_rows(layer, end - new.shape[0], end)] = new

    def _rewind_conv(self, keep: int) -> None:
        """Nothing to restore: the ring holds every input by position, and the rows the next step reads (the kept
        tokens' and older) are where the step wrote them."""

    def set_recurrent(self, layer: int, state: torch.Tensor) -> None:
        self.recurrent[layer].copy_(state)

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.num_tokens + k.shape[0]
        if end > self.pool.max_len:
            raise ValueError(f"cache slot holds {self.pool.max_len} tokens; this step needs {end}")
        keys, values = self.pool.keys[layer][self.slot], self.pool.values[layer][self.slot]
        keys[self.num_tokens : end] = k
        values[self.num_tokens : end] = v
        self.keys[layer], self.values[layer] = keys[:end], values[:end]
        return self.keys[layer], self.values[layer]

    @property
    def kv_nbytes(self) -> int:
        """What the views hold, without cutting them (the server's gauges read this every step)."""
        return self.pool.kv_bytes_per_token * self.num_tokens

    def advance(self, num_tokens: int) -> None:
        """After a step that wrote the pool directly (a captured graph): count its tokens."""
        self.num_tokens += num_tokens
        self._kv_stale = True

    def truncate(self, num_tokens: int) -> None:
        super().truncate(num_tokens)
        self._kv_stale = True
