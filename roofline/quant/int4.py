"""AutoRound / GPTQ INT4 (`auto_gptq` packing), as published checkpoints store it.

Per linear of out N, in K, group g:
  qweight int32 [K/8, N]   eight 4-bit values along K, lowest k in the lowest nibble
  qzeros  int32 [K/g, N/8] eight 4-bit zero points along N, stored as zero-1 (GPTQ v1)
  scales  fp16  [K/g, N]
  w[n, k] = (q[k, n] - zero[k//g, n]) * scale[k//g, n]
Symmetric checkpoints store every zero nibble as 7 (real zero 8).

The CUDA fast path may keep qweight block-repacked (`block_qweight`; by default without MTP, see kernels/dispatch.py):
the same words ordered [N/32, K/128, 16, 32], so each warp-step of the tensor-core kernels (16
packed rows x 32 columns of one group) is 2 KB of contiguous memory. `Int4Weight.blocked` says so,
and its reference path reads the weight back through `unblock_qweight`.
"""

from __future__ import annotations

import torch

from .base import LinearWeight, PartLayout, stacked

PACK = 8  # nibbles per int32


def _shifts(device) -> torch.Tensor:
    """0, 4, ..., 28, made on the device (a host tensor cannot be copied in during CUDA-graph capture)."""
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[..., R, C] int32 holding 8 nibbles along R -> [..., 8R, C] values 0..15."""
    nib = (packed.unsqueeze(-2) >> _shifts(packed.device).view(-1, 1)) & 0xF  # [..., R, 8, C]
    return nib.reshape(*packed.shape[:-2], packed.shape[-2] * PACK, packed.shape[-1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """[..., R, C] int32 holding 8 nibbles along C -> [..., R, 8C]."""
    nib = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 0xF  # [..., R, C, 8]
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_rows: [..., 8R, C] values 0..15 -> [..., R, C] int32."""
    v = values.to(torch.int64).reshape(*values.shape[:-2], values.shape[-2] // PACK, PACK, values.shape[-1])
    packed = (v << _shifts(v.device).to(torch.int64).view(-1, 1)).sum(-2)
    return _to_int32(packed)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_cols: [..., R, 8C] -> [..., R, C] int32."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // PACK, PACK)
    return _to_int32((v << _shifts(v.device).to(torch.int64)).sum(-1))


def _to_int32(packed64: torch.Tensor) -> torch.Tensor:
    # Values up to 2^32-1 wrap into int32's range exactly as the checkpoint's bit patterns.
    return torch.where(packed64 >= 2**31, packed64 - 2**32, packed64).to(torch.int32)


def block_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [..., K/8, N] -> the same words ordered [..., N/32, K/128, 16, 32], returned in the input's shape.

    A column range [32a, 32b) of the result is its rows a..b of the [N/32, ...] order, so a merged
    projection's parts stay contiguous views of the blocked whole. Needs K % 128 == 0 and N % 32 == 0."""
    *lead, kp, n = qweight.shape
    blocks = qweight.reshape(*lead, kp // 16, 16, n // 32, 32)
    nd = blocks.dim()
    return blocks.permute(*range(nd - 4), nd - 2, nd - 4, nd - 3, nd - 1).contiguous().view(qweight.shape)


def blocked_columns(blocked: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of a blocked [K/8, N] qweight (multiples of 32) as a contiguous view, itself in
    block_qweight's order: rows start/32 .. stop/32 of the [N/32, ...] order."""
    kp, n = blocked.shape
    return blocked.view(n // 32, -1)[start // 32 : stop // 32].view(kp, stop - start)


def unblock_qweight(blocked: torch.Tensor) -> torch.Tensor:
    """Inverse of block_qweight: back to the GPTQ order (a new tensor)."""
    *lead, kp, n = blocked.shape
    blocks = blocked.reshape(*lead, n // 32, kp // 16, 16, 32)
    nd = blocks.dim()
    return blocks.permute(*range(nd - 4), nd - 3, nd - 2, nd - 4, nd - 1).contiguous().view(blocked.shape)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, sym: bool = True) -> dict[str, torch.Tensor]:
    """Round-to-nearest INT4 of a [N, K] weight into the published tensors (qweight, qzeros, scales)."""
    n, k = weight.shape
    if k % group_size or k % PACK or n % PACK:
        raise ValueError(f"INT4 needs K ({k}) divisible by the group size {group_size} and by 8, N ({n}) by 8")
    w = weight.float().reshape(n, k // group_size, group_size)
    if sym:
        scale = w.abs().amax(-1) / 7.5  # codes -8..7 map to 0..15 around zero 8; fp16 stores it
        scale = torch.where(scale == 0, torch.ones_like(scale), scale).half().float()
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        # zero 0 cannot be stored in GPTQ v1's zero-1 encoding; keep zeros in 1..15
        zero = (-lo / scale).round().clamp(1, 15)
    q = (w / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    q = q.reshape(n, k).t().contiguous()  # [K, N]
    return {
        "qweight": pack_rows(q),
        "qzeros": pack_cols((zero.t().to(torch.int32) - 1) & 0xF),
        "scales": scale.t().contiguous().half(),
    }


class Int4Weight(LinearWeight):
    FORMAT = "int4"
    SUFFIXES = ("qweight", "qzeros", "scales")
    OPTIONAL_SUFFIXES = ("g_idx",)
    LAYOUT = {
        "qweight": PartLayout(n_axis=-1),
        "qzeros": PartLayout(n_axis=-1, n_per_index=PACK),
        "scales": PartLayout(n_axis=-1),
    }
    STORAGE = {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"}

    def __init__(self, out_features, in_features, num_experts=0, *, group_size=128, scale_dtype=torch.float16, device=None):
        super().__init__(out_features, in_features, num_experts)
        if in_features % group_size or in_features % PACK or out_features % PACK:
            raise ValueError(
                f"INT4 linear [{out_features}, {in_features}]: K must be divisible by group size {group_size} and 8, N by 8"
            )
        self.group_size = group_size
        self.blocked = False  # qweight in block_qweight's order (set by the CUDA fast path)
        groups = in_features // group_size
        e = num_experts
        self.register_buffer("qweight", torch.empty(stacked(e, in_features // PACK, out_features), dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.empty(stacked(e, groups, out_features // PACK), dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(stacked(e, groups, out_features), dtype=scale_dtype, device=device))

    def expected_part_shape(self, suffix, out_features):
        groups = self.in_features // self.group_size
        return {
            "qweight": (self.in_features // PACK, out_features),
            "qzeros": (groups, out_features // PACK),
            "scales": (groups, out_features),
            "g_idx": (self.in_features,),
        }[suffix]

    def load_optional(self, suffix, tensor):
        # act-order checkpoints permute groups; only the trivial ordering is supported
        trivial = torch.arange(self.in_features, device=tensor.device) // self.group_size
        if not torch.equal(tensor.to(torch.int64), trivial):
            raise ValueError("g_idx is not the trivial k // group_size ordering (act-order INT4 is not supported)")

    def dequantize(self, expert=None):
        qweight, qzeros, scales = self.qweight, self.qzeros, self.scales
        if self.num_experts and expert is not None:
            qweight, qzeros, scales = qweight[expert], qzeros[expert], scales[expert]
        if self.blocked:  # after picking the expert: each expert is blocked on its own, unblock only its words
            qweight = unblock_qweight(qweight)
        q = unpack_rows(qweight)  # [..., K, N]
        zero = unpack_cols(qzeros) + 1  # [..., K/g, N]
        g = self.group_size
        w = (q.unflatten(-2, (-1, g)) - zero.unsqueeze(-2)).float() * scales.float().unsqueeze(-2)
        # [..., N, K] contiguous, as dequantize_int4 (the fast path's prefill weight) writes it: F.linear then takes the
        # same BLAS kernel on both paths and gives the same bits (MKL on AVX-512 rounds differently for a transposed view)
        return w.flatten(-3, -2).transpose(-1, -2).contiguous()
