"""INT4 (GPTQ layout, either qweight order) -> a dense [N, K] weight in one launch: the prefill path's weights.

Prefill and other calls with more rows than the decode kernels take multiply by the dequantised
weight (`F.linear`). `Int4Weight.dequantize` builds it from ~15 PyTorch ops with int32 and fp32
temporaries [K, N] (~30 bytes per weight of traffic, and the launches of each op): the MoE prefill
does it for every routed expert of every layer, 256 x 48 x 2 weights on the 122B. This kernel
reads the packed words, zero points and scales once and writes the result in the caller's dtype,
with the reference's arithmetic ((q - zero) * scale in fp32, then rounded), so it is bit for bit
`Int4Weight.dequantize(expert).to(dtype)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET


@triton.jit
def qword_offset(r, c, K, QW_ROW, BLOCKED: tl.constexpr):
    """Offsets of the packed words at packed rows r and columns c (broadcast against each other) of a [K/8, N]
    qweight in GPTQ order (row stride QW_ROW) or in block_qweight's [N/32, K/128, 16, 32] order."""
    if BLOCKED:
        return ((c // 32) * (K // 128) + r // 16) * 512 + (r % 16) * 32 + c % 32
    return r * QW_ROW + c


@triton.jit
def _dequant_kernel(qw_ptr, qz_ptr, sc_ptr, out_ptr, K, N, QW_ROW, QZ_ROW, SC_ROW, GROUP: tl.constexpr,
                    BLOCKED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    c = tl.program_id(0) * BN + tl.arange(0, BN)  # output rows (the weight's N)
    k = tl.program_id(1) * BK + tl.arange(0, BK)  # along K: contiguous in the output
    mask = (c < N)[:, None] & (k < K)[None, :]
    word = qword_offset((k // 8)[None, :], c[:, None], K, QW_ROW, BLOCKED)
    q = (tl.load(qw_ptr + word, mask=mask, other=0) >> ((k % 8) * 4)[None, :]) & 0xF
    g = k // GROUP
    zw = tl.load(qz_ptr + g[None, :] * QZ_ROW + (c // 8)[:, None], mask=mask, other=0)
    zero = ((zw >> ((c % 8) * 4)[:, None]) & 0xF) + 1  # stored as zero - 1 (GPTQ v1)
    scale = tl.load(sc_ptr + g[None, :] * SC_ROW + c[:, None], mask=mask, other=0).to(tl.float32)
    w = (q - zero).to(tl.float32) * scale
    tl.store(out_ptr + c[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(weight, expert: int | None, dtype: torch.dtype) -> torch.Tensor:
    """`weight.dequantize(expert).to(dtype)` of an `Int4Weight` (expert None for a plain linear), in one launch.
    The tensors may be column views of a merged projection's (unit stride along N; a blocked part is a contiguous
    run of the blocked whole)."""
    qweight, qzeros, scales = weight.qweight, weight.qzeros, weight.scales
    if weight.num_experts and expert is not None:
        qweight, qzeros, scales = qweight[expert], qzeros[expert], scales[expert]
    n, k = weight.out_features, weight.in_features
    if any(t.stride(-1) != 1 for t in (qweight, qzeros, scales)) or (weight.blocked and not qweight.is_contiguous()):
        raise ValueError(f"dequantize_int4: [{n}, {k}] INT4 tensors need unit stride along N")
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    bn, bk = (16, 32) if INTERPRET else (32, 128)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        qweight, qzeros, scales, out, k, n, qweight.stride(-2), qzeros.stride(-2), scales.stride(-2),
        GROUP=weight.group_size, BLOCKED=weight.blocked, BN=bn, BK=bk,
        num_warps=1 if INTERPRET else 4,
    )
    return out
