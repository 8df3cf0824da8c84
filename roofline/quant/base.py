"""The one contract every weight format meets: a linear layer `y = x @ W^T`, held packed.

A format owns its storage tensors (registered buffers, so `.to(device)` moves them), knows
which checkpoint tensors it is made of, and computes the product. The reference `forward`
dequantises and calls `F.linear`; fast kernels replace `forward` per device, never the model.

Routed experts use the same classes with a leading expert dimension (`num_experts > 0`):
`forward(x, expert=e)` multiplies by expert e. Several checkpoint linears can fill one
format object at row offsets (an expert's `gate_proj` and `up_proj` become one `gate_up`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PartLayout:
    """Where the output dimension N lies in one stored tensor, and how many rows of N one index holds."""

    n_axis: int  # axis of N counted from the end (-1 or -2)
    n_per_index: int = 1  # e.g. 8 for INT4 zeros packed 8 per int32 along N


class LinearWeight(nn.Module):
    """Base class of weight formats. Subclasses define SUFFIXES, LAYOUT, allocate buffers, dequantize."""

    FORMAT = "abstract"
    SUFFIXES: tuple[str, ...] = ()  # checkpoint tensor suffixes that make one linear, all required
    OPTIONAL_SUFFIXES: tuple[str, ...] = ()
    LAYOUT: dict[str, PartLayout] = {}
    STORAGE: dict[str, str] = {}  # checkpoint suffix -> buffer name

    def __init__(self, out_features: int, in_features: int, num_experts: int = 0):
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.num_experts = num_experts

    # --- shape contract used by the loader ---
    def expected_part_shape(self, suffix: str, out_features: int) -> tuple[int, ...]:
        """Shape of one checkpoint tensor for a linear of `out_features` rows (one expert)."""
        raise NotImplementedError

    def check_part(self, suffix: str, tensor_shape: tuple[int, ...], out_features: int, fused_experts: bool) -> str | None:
        """None if the checkpoint tensor fits, else a description of the mismatch."""
        want = self.expected_part_shape(suffix, out_features)
        if fused_experts:
            want = (self.num_experts, *want)
        if tuple(tensor_shape) != want:
            return f"shape {list(tensor_shape)}, expected {list(want)}"
        return None

    def load_part(self, suffix: str, tensor: torch.Tensor, expert: int | None, row_offset: int) -> None:
        """Copy one checkpoint tensor into storage; `expert=None` with experts means all experts at once."""
        if suffix in self.OPTIONAL_SUFFIXES:
            return self.load_optional(suffix, tensor)
        dest = getattr(self, self.STORAGE[suffix])
        if self.num_experts and expert is not None:
            dest = dest[expert]
        layout = self.LAYOUT[suffix]
        start = row_offset // layout.n_per_index
        dest.narrow(layout.n_axis, start, tensor.shape[layout.n_axis]).copy_(tensor)

    def load_optional(self, suffix: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    # --- compute ---
    def dequantize(self, expert: int | None = None) -> torch.Tensor:
        """The weight as a dense [out, in] tensor in the compute dtype (reference path)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        return F.linear(x, self.dequantize(expert).to(x.dtype))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """An LM head's fp32 logits: its output in x's dtype, widened. The fast path may give a weight one launch that
        stores the same values (kernels.dispatch)."""
        return self(x).float()

    def take_rows(self, rows: torch.Tensor) -> "LinearWeight":
        """A new weight holding only output rows `rows` (e.g. a draft LM head over part of the vocabulary)."""
        raise NotImplementedError(f"{self.FORMAT} weights cannot be cut to a subset of rows")

    @property
    def nbytes(self) -> int:
        """Bytes of storage (all experts together)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        experts = f", experts={self.num_experts}" if self.num_experts else ""
        return f"{self.FORMAT}, out={self.out_features}, in={self.in_features}{experts}"


def stacked(num_experts: int, *shape: int) -> tuple[int, ...]:
    return (num_experts, *shape) if num_experts else tuple(shape)
