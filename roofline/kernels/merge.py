"""Projections that read the same input, merged into one weight so a decode step runs one launch for them.

vLLM merges the same groups at load (qkv_proj, gate_up_proj, GDN's in_proj_qkvz / in_proj_ba). Here it
happens when the fast path is installed, and only between weights of one format with the same settings
(an INT4 q_proj beside a BF16 k_proj stays apart): the merged tensors are allocated, the parts copied in,
and each part's storage becomes a view into them, so no second copy stays and peak memory grows by one
group at most. A part used on its own (prefill, the reference path) reads its view; a part called for
1..4 decode rows runs the merged kernel and takes its slice of the output (INT4 views are not
contiguous, and its kernels want the packed rows whole).

The merged weight is held by a `Projections` object, not registered as a submodule, so the model's
buffers and bytes-per-token counts see each tensor once.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from functools import partial

import torch

from ..quant import LinearWeight
from .dispatch import MAX_DECODE_ROWS, many_rows_forward, row_count

_SETTINGS = ("group_size", "block")  # format settings that must agree (INT4 group, FP8 scale block)


def merge_blocker(weights: list[LinearWeight]) -> str | None:
    """Why these weights cannot be merged, or None."""
    first = weights[0]
    if any(type(w) is not type(first) for w in weights):
        return "formats differ: " + ", ".join(w.FORMAT for w in weights)
    if any(w.num_experts or w.in_features != first.in_features for w in weights):
        return "expert weights or different input sizes"
    for name in _SETTINGS:
        if len({getattr(w, name, None) for w in weights}) > 1:
            return f"{name} differs"
    for suffix, buf in first.STORAGE.items():
        per = first.LAYOUT[suffix].n_per_index
        if any(w.out_features % per for w in weights[:-1]):
            return f"{buf}: a part's rows do not fill whole blocks of {per}"
        if len({getattr(w, buf).dtype for w in weights}) > 1:
            return f"{buf} dtypes differ"
    return None


def merge_linears(weights: list[LinearWeight]) -> LinearWeight:
    """One weight whose output rows are the parts' rows in order; the parts' storage becomes views into it."""
    first = weights[0]
    merged = copy.copy(first)
    merged.__dict__.pop("forward", None)  # a kernel installed on the first part is not the merged one's
    merged._buffers = OrderedDict()
    merged.out_features = sum(w.out_features for w in weights)
    for suffix, buf in first.STORAGE.items():
        axis = first.LAYOUT[suffix].n_axis
        whole = torch.cat([getattr(w, buf) for w in weights], dim=axis)
        merged.register_buffer(buf, whole)
        start = 0
        for w in weights:
            size = getattr(w, buf).shape[axis]
            w._buffers[buf] = whole.narrow(axis, start, size)
            start += size
    return merged


def _part_forward(merged: LinearWeight, start: int, stop: int, part: LinearWeight, x: torch.Tensor,
                  expert: int | None = None) -> torch.Tensor:
    if 1 <= row_count(x) <= MAX_DECODE_ROWS:
        return merged(x)[..., start:stop]
    return many_rows_forward(part, x, expert)


class Projections:
    """Linears that read the same input, called together: `proj(x)` -> one output per part, in order.

    Merged into one weight (one launch) where `merge_blocker` allows, else each part runs alone."""

    def __init__(self, weights: list[LinearWeight], install_kernel):
        self.parts = list(weights)
        self.sizes = [w.out_features for w in weights]
        self.blocker = merge_blocker(self.parts)
        self.merged = None
        if self.blocker is None:
            self.merged = merge_linears(self.parts)
            install_kernel(self.merged)
            start = 0
            for w, size in zip(self.parts, self.sizes):
                if w.FORMAT != "dense":  # dense views are contiguous row blocks: F.linear reads them as they are
                    w.forward = partial(_part_forward, self.merged, start, start + size, w)
                start += size

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.merged is None:
            return [w(x) for w in self.parts]
        return list(self.merged(x).split(self.sizes, dim=-1))
