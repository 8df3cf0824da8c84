"""Per-sequence decode state: KV for full-attention layers, conv and recurrent state for GDN layers.

The reference path keeps each sequence's state in its own small tensors, grown as tokens
arrive; the fast path replaces this with preallocated slots. Layer indices are the model's
(the MTP layer has its own `SequenceCache`).
"""

from __future__ import annotations

import torch


class SequenceCache:
    def __init__(self):
        self.num_tokens = 0  # tokens processed so far (the next token's position)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [T, kv_heads, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [K-1, conv_dim], last pre-conv inputs
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [v_heads, k_dim, v_dim] fp32

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k])
            v = torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return k, v

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
