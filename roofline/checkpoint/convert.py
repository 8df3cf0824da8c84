"""Tensor-level conversions between checkpoint layouts and formats (used by tools and tests).

Names here are canonical (`model.layers...`, `lm_head.weight`, `mtp...`); `publish_names`
produces the layouts found on the Hub.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from ..quant import quantize_fp8_block, quantize_int4
from .classes import module_class

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def split_fused_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`experts.gate_up_proj [E, 2I, H]` -> per-expert `experts.{e}.gate_proj.weight`, `.up_proj.weight`."""
    match = _FUSED_EXPERTS.match(name)
    if not match:
        yield name, tensor
        return
    parent, kind = match.groups()
    for e in range(tensor.shape[0]):
        if kind == "down_proj":
            yield f"{parent}.{e}.down_proj.weight", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{parent}.{e}.gate_proj.weight", gate
            yield f"{parent}.{e}.up_proj.weight", up


def publish_names(
    tensors: Iterable[tuple[str, torch.Tensor]], nested: bool = False, per_expert: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Canonical tensors -> a published layout: experts fused or per expert, flat or `model.language_model.`."""
    for name, tensor in tensors:
        parts = split_fused_experts(name, tensor) if per_expert else [(name, tensor)]
        for part_name, part in parts:
            if nested and part_name.startswith("model."):
                part_name = "model.language_model." + part_name[len("model.") :]
            yield part_name, part


def quantize_linear(name: str, weight: torch.Tensor, fmt: str, group_size: int = 128, block=(128, 128)):
    """One `<base>.weight` -> the tensors of `fmt` (bf16 | int4 | fp8)."""
    base = name[: -len(".weight")]
    if fmt == "int4":
        for suffix, tensor in quantize_int4(weight, group_size).items():
            yield f"{base}.{suffix}", tensor
    elif fmt == "fp8":
        q, scale = quantize_fp8_block(weight, block)
        yield f"{base}.weight", q
        yield f"{base}.weight_scale_inv", scale
    elif fmt == "bf16":
        yield name, weight.to(torch.bfloat16)
    else:
        raise ValueError(f"unknown format {fmt!r} (choose bf16, int4 or fp8)")


def quantize_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], formats: dict[str, str], group_size: int = 128, block=(128, 128)
) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantise 2-D `.weight` tensors whose module class is in `formats` (class -> format); others pass through."""
    for name, tensor in tensors:
        fmt = formats.get(module_class(name))
        if fmt and name.endswith(".weight") and tensor.dim() == 2:
            yield from quantize_linear(name, tensor, fmt, group_size, block)
        else:
            yield name, tensor
