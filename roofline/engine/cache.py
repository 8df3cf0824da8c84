"""Per-sequence decode state: KV for full-attention layers, conv and recurrent state for GDN layers.

The reference path keeps each sequence's state in its own small tensors, grown as tokens
arrive; the fast path replaces this with preallocated slots. Layer indices are the model's
(the MTP layer has its own `SequenceCache`).

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
        for layer, window in self.step_conv.items():
            self.conv[layer] = window[keep : keep + self.conv[layer].shape[0]].clone()
        for layer, states in self.step_recurrent.items():
            self.recurrent[layer] = states[keep - 1]
        self.num_tokens = num_tokens

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
