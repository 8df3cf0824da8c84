"""INT8 per-row LM head: logits[M, V] = (x[M, H] @ q^T) * scale[V], up to 4 token rows in one launch.

Layout (roofline.quant.int8, no repack): weight int8 [V, H] row-major, weight_scale [V, 1]. Each
program owns BV vocabulary rows and walks H with 16-byte loads along the row (lanes along H);
every weight tile is read once and multiplied with all M token rows, so M = 2..4 (the MTP verify
batch) costs the same bytes as M = 1. Per-lane partial sums stay in registers until one cross-lane
reduction at the end, and the row scale multiplies once. V is large (248320), so the grid needs
no split of H.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET


def int8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Plain PyTorch of the same math, in fp32: (x @ q^T) * scale, rounded to out_dtype (x's dtype by default)."""
    y = (x.float() @ weight.float().t()) * scale.float().reshape(1, -1)
    return y.to(out_dtype or x.dtype)


@triton.jit
def _int8_rows_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, V, H,
    BM: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, EVEN_H: tl.constexpr,
):
    pid = tl.program_id(0)
    v = pid * BV + tl.arange(0, BV)
    v_mask = v < V
    m = tl.arange(0, BM)
    m_mask = m < M
    hh = tl.arange(0, BH)
    acc = tl.zeros([BM, BV, BH], dtype=tl.float32)
    w_rows = w_ptr + v.to(tl.int64)[:, None] * H
    for h0 in range(0, H, BH):
        h = h0 + hh
        if EVEN_H:
            w = tl.load(w_rows + h[None, :], mask=v_mask[:, None], other=0)
            x = tl.load(x_ptr + m[:, None] * H + h[None, :], mask=m_mask[:, None], other=0)
        else:
            hmask = h < H
            w = tl.load(w_rows + h[None, :], mask=v_mask[:, None] & hmask[None, :], other=0)
            x = tl.load(x_ptr + m[:, None] * H + h[None, :], mask=m_mask[:, None] & hmask[None, :], other=0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    scale = tl.load(s_ptr + v, mask=v_mask, other=0).to(tl.float32)
    y = tl.sum(acc, axis=2) * scale[None, :]
    tl.store(out_ptr + m[:, None] * V + v[None, :], y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & v_mask[None, :])


def default_config(m: int) -> dict:
    if INTERPRET:
        return {"BV": 16, "BH": 32, "num_warps": 1}
    return {"BV": 16, "BH": 256, "num_warps": 4}


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, out_dtype=None, out=None,
                config: dict | None = None) -> torch.Tensor:
    """logits = (x @ q^T) * scale for x [..., H] with 1..4 rows, q int8 [V, H], scale [V] or [V, 1]."""
    v, h = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, h).contiguous()
    m = x2.shape[0]
    if not 1 <= m <= 4:
        raise ValueError(f"int8_matmul reads each weight tile once for 1..4 rows, got {m}")
    cfg = default_config(m)
    cfg.update(config or {})
    if out is None:
        out = torch.empty(m, v, dtype=out_dtype or x.dtype, device=x.device)
    _int8_rows_kernel[(triton.cdiv(v, cfg["BV"]),)](
        x2, weight, scale.reshape(-1), out, m, v, h,
        BM=max(1, 1 << (m - 1).bit_length()), BV=cfg["BV"], BH=cfg["BH"], EVEN_H=h % cfg["BH"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
    )
    return out.reshape(*lead, v)
