"""Unquantised weights (BF16/FP16/FP32 in the checkpoint), stored in the compute dtype."""

from __future__ import annotations

import torch

from .base import LinearWeight, PartLayout, stacked


class DenseWeight(LinearWeight):
    FORMAT = "dense"
    SUFFIXES = ("weight",)
    LAYOUT = {"weight": PartLayout(n_axis=-2)}
    STORAGE = {"weight": "weight"}

    def __init__(self, out_features, in_features, num_experts=0, *, dtype=torch.float32, device=None):
        super().__init__(out_features, in_features, num_experts)
        self.register_buffer("weight", torch.empty(stacked(num_experts, out_features, in_features), dtype=dtype, device=device))

    def expected_part_shape(self, suffix, out_features):
        return (out_features, self.in_features)

    def dequantize(self, expert=None):
        return self.weight if expert is None or not self.num_experts else self.weight[expert]

    def take_rows(self, rows):
        if self.num_experts:
            raise NotImplementedError("expert weights cannot be cut to a subset of rows")
        out = DenseWeight(len(rows), self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        out.weight.copy_(self.weight[rows])
        return out
