"""Placeholders for weights the loader fills in.

The model declares each linear as a `LinearSlot` (shape only). The checkpoint loader decides
the storage format per tensor (dense, INT4, FP8, ...) and swaps the slot for a `LinearWeight`
of that format, so model code never mentions formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SlotPart:
    """One checkpoint linear that fills rows [row_offset, row_offset + rows) of a slot."""

    name: str  # checkpoint base name, e.g. "model.layers.0.mlp.experts.3.up_proj"
    expert: int | None
    row_offset: int
    rows: int


class LinearSlot(nn.Module):
    """A linear `[out_features, in_features]` (optionally stacked over experts) awaiting its weights."""

    def __init__(self, out_features: int, in_features: int, num_experts: int = 0, split_rows: tuple[str, ...] = ()):
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.num_experts = num_experts
        # For fused expert slots: the per-expert checkpoint linears stacked along the rows, e.g.
        # ("gate_proj", "up_proj") for the experts' gate_up slot.
        self.split_rows = split_rows

    def parts(self, checkpoint_name: str) -> list[SlotPart]:
        """Per-expert checkpoint linears that make this slot (the fused 3-D layout is handled by the loader)."""
        if not self.num_experts:
            return [SlotPart(checkpoint_name, None, 0, self.out_features)]
        parent = checkpoint_name.rsplit(".", 1)[0]  # "...mlp.experts"
        names = self.split_rows or (checkpoint_name.rsplit(".", 1)[1],)
        rows = self.out_features // len(names)
        return [
            SlotPart(f"{parent}.{e}.{name}", e, i * rows, rows)
            for e in range(self.num_experts)
            for i, name in enumerate(names)
        ]

    def fused_name(self, checkpoint_name: str) -> str:
        """The official BF16 layout's single 3-D tensor for all experts: `experts.gate_up_proj` / `experts.down_proj`."""
        return checkpoint_name + "_proj"

    def forward(self, *args, **kwargs):
        raise RuntimeError("weights not loaded: load the model with roofline.checkpoint.load_model")

    def extra_repr(self) -> str:
        return f"out={self.out_features}, in={self.in_features}, experts={self.num_experts}"


def plain_parameter(*shape: int, fp32: bool = False) -> nn.Parameter:
    """A non-linear tensor (norm weight, conv kernel, ...) filled by the loader.

    The loader holds it in the compute dtype, or in fp32 when `fp32` (the GDN decay parameters,
    which the reference computes in fp32 whatever the model dtype).
    """
    param = nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
    param.keep_fp32 = fp32
    return param
