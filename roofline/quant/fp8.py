"""Block FP8 as the official `-FP8` checkpoints store it.

`weight float8_e4m3fn [N, K]` and `weight_scale_inv [ceil(N/bn), ceil(K/bk)]`, which despite
its name multiplies: w = fp8 * scale_inv[n // bn, k // bk]. The scale dtype varies by
checkpoint and is kept as stored.
"""

from __future__ import annotations

import math

import torch

from .base import LinearWeight, PartLayout, stacked

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype=torch.float32):
    """Round-to-nearest block FP8 of a [N, K] weight -> (weight fp8, weight_scale_inv)."""
    n, k = weight.shape
    bn, bk = block
    padded = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    q = (tiles / scale.float()[:, None, :, None]).reshape(padded.shape)[:n, :k].to(torch.float8_e4m3fn)
    return q, scale


class Fp8BlockWeight(LinearWeight):
    FORMAT = "fp8-block"
    SUFFIXES = ("weight", "weight_scale_inv")
    STORAGE = {"weight": "weight", "weight_scale_inv": "scale_inv"}

    def __init__(self, out_features, in_features, num_experts=0, *, block=(128, 128), scale_dtype=torch.float32, device=None):
        super().__init__(out_features, in_features, num_experts)
        self.block = tuple(block)
        bn, bk = self.block
        # The scale's rows index N in blocks of bn: fused rows must start on a block boundary.
        self.LAYOUT = {"weight": PartLayout(n_axis=-2), "weight_scale_inv": PartLayout(n_axis=-2, n_per_index=bn)}
        e = num_experts
        self.register_buffer("weight", torch.empty(stacked(e, out_features, in_features), dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer(
            "scale_inv", torch.empty(stacked(e, math.ceil(out_features / bn), math.ceil(in_features / bk)), dtype=scale_dtype, device=device)
        )

    def expected_part_shape(self, suffix, out_features):
        bn, bk = self.block
        if suffix == "weight":
            return (out_features, self.in_features)
        return (math.ceil(out_features / bn), math.ceil(self.in_features / bk))

    def dequantize(self, expert=None):
        weight, scale = self.weight, self.scale_inv
        if self.num_experts and expert is not None:
            weight, scale = weight[expert], scale[expert]
        bn, bk = self.block
        n, k = weight.shape[-2:]
        full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
        return weight.float() * full
