"""Per-row symmetric INT8, the LM head's load-time format: `weight int8 [N, K]`, `weight_scale [N, 1]`.

w[n, k] = q[n, k] * weight_scale[n], scale = absmax(row) / 127, q = round(w / scale) in -127..127.
Quantised from the BF16 checkpoint at load (`Int8RowWeight.from_dense`), it halves the LM head's
bytes (1.5 GB -> 0.76 GB at 122B), and a row-wise scale is precise enough there because each
row is read whole for every token. Tensor names follow vLLM's compressed-tensors channel-wise
INT8 (so `roofline checkpoint quantize --lm-head int8` writes what the loader reads).
The fast kernel is roofline.kernels.int8_lm_head.
"""

from __future__ import annotations

import logging

import torch

from .base import LinearWeight, PartLayout, stacked

log = logging.getLogger("roofline.quant")


def quantize_int8_rows(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32, chunk_rows: int = 8192):
    """Round-to-nearest per-row INT8 of a [N, K] weight -> (int8 [N, K], scale [N, 1]).

    Works through `chunk_rows` rows at a time, so the fp32 temporaries stay small next to the
    weight (a 248320 x 3072 head would otherwise need 3 GB of fp32 at once).
    """
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, 1, dtype=scale_dtype, device=weight.device)
    for start in range(0, n, chunk_rows):
        w = weight[start : start + chunk_rows].float()
        s = (w.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
        scale[start : start + chunk_rows] = s.to(scale_dtype)
        q[start : start + chunk_rows] = (w / scale[start : start + chunk_rows].float()).round().clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8RowWeight(LinearWeight):
    FORMAT = "int8-row"
    SUFFIXES = ("weight", "weight_scale")
    LAYOUT = {"weight": PartLayout(n_axis=-2), "weight_scale": PartLayout(n_axis=-2)}
    STORAGE = {"weight": "weight", "weight_scale": "weight_scale"}

    def __init__(self, out_features, in_features, num_experts=0, *, scale_dtype=torch.float32, device=None):
        super().__init__(out_features, in_features, num_experts)
        e = num_experts
        self.register_buffer("weight", torch.empty(stacked(e, out_features, in_features), dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(stacked(e, out_features, 1), dtype=scale_dtype, device=device))

    @classmethod
    def from_dense(cls, weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> "Int8RowWeight":
        """Quantise a dense [N, K] weight (any float dtype, any device) into a new Int8RowWeight on its device."""
        n, k = weight.shape
        fmt = cls(n, k, scale_dtype=scale_dtype, device=weight.device)
        q, scale = quantize_int8_rows(weight, scale_dtype)
        fmt.weight.copy_(q)
        fmt.weight_scale.copy_(scale)
        return fmt

    def expected_part_shape(self, suffix, out_features):
        return (out_features, self.in_features) if suffix == "weight" else (out_features, 1)

    def take_rows(self, rows):
        if self.num_experts:
            raise NotImplementedError("expert weights cannot be cut to a subset of rows")
        out = Int8RowWeight(len(rows), self.in_features, scale_dtype=self.weight_scale.dtype, device=self.weight.device)
        out.weight.copy_(self.weight[rows])
        out.weight_scale.copy_(self.weight_scale[rows])
        return out

    def dequantize(self, expert=None):
        weight, scale = self.weight, self.weight_scale
        if self.num_experts and expert is not None:
            weight, scale = weight[expert], scale[expert]
        return weight.float() * scale.float()


def quantize_lm_head_int8(model) -> None:
    """Swap a dense LM head for per-row INT8 at load: half the bytes of the largest single read."""
    head = model.lm_head
    if head.FORMAT != "dense":
        log.info("LM head already %s in the checkpoint", head.FORMAT)
        return
    model.lm_head = Int8RowWeight.from_dense(head.weight)
    log.info("LM head quantised to INT8 per row at load: %.0f -> %.0f MiB (opt out: --no-int8-lm-head)",
             head.nbytes / 2**20, model.lm_head.nbytes / 2**20)
