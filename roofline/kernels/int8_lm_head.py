"""INT8 per-row LM head: logits[M, V] = (x[M, H] @ q^T) * scale[V], up to 4 token rows in one launch.

Layout (roofline.quant.int8, no repack): weight int8 [V, H] row-major, weight_scale [V, 1]. Each
program owns BV vocabulary rows and walks H with 16-byte loads along the row (lanes along H);
every weight tile is read once and multiplied with all M token rows, so M = 2..4 (the MTP verify
batch) costs the same bytes as M = 1. Each lane sums its 16 bytes of a row into one register per
(token, row), the next tile's loads are issued before this tile's math (register double-buffer),
and the lanes' partials meet in one reduction at the end; the row scale multiplies once. V is
large (248320), so the grid needs no split of H.

With 2..4 rows that loop is instruction-bound (M FMAs per weight byte plus x's conversions: ~21
instructions a byte at M = 4; H200: 0.61 / 0.45 / 0.45 of copy bandwidth at M = 2 / 3 / 4). The
tensor-core variant (`_int8_rows_dot_kernel`, the default for 16-bit x; `ROOFLINE_INT8_DOT=0` keeps the loop)
converts each [BV, BH] weight tile to x's 16-bit type (exact for int8) and multiplies it with x^T
padded to 16 token columns (tl.dot's smallest N) in fp32, so a byte costs its conversion and the
products go to the tensor cores; Triton's loop pipelining keeps `num_stages` tiles in flight.
H200 (2026-12-05, benchmarks/NOTES-kernels.md "Session 13"), 248320 x 3072, swept: 32 vocabulary rows x 256 bytes
on 2 warps, 3 tiles in flight, takes 183 / 178 / 179 / 191 us at M = 1 / 2 / 3 / 4 against the loop's 213 / 257 /
355 / 358 (the loop falls to 0.50 of copy bandwidth at M = 3 and 4), so it runs at every row count.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, decode_rows, pdl_options, wait_for_inputs


def int8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Plain PyTorch of the same math, in fp32: (x @ q^T) * scale, rounded to out_dtype (x's dtype by default)."""
    y = (x.float() @ weight.float().t()) * scale.float().reshape(1, -1)
    return y.to(out_dtype or x.dtype)


@triton.jit
def _x_part(x_ptr, row, h, lim, BH: tl.constexpr):
    """x[row, h] as [1, BH/16, 16] fp32 (0 past lim: H, or 0 for an absent row)."""
    xr = tl.load(x_ptr + row + h, mask=h < lim, other=0).to(tl.float32)
    return tl.reshape(xr, [BH // 16, 16])[None, :, :]


@triton.jit
def _out_value(y, x_ptr, out_ptr, ROUND_TO_X: tl.constexpr):
    """y in out's dtype; with ROUND_TO_X rounded to x's dtype first (fp32 logits holding head(x).float()'s values)."""
    if ROUND_TO_X:
        y = y.to(x_ptr.dtype.element_ty)
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def _int8_rows_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, V, H,
    BM: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, ROUND_TO_X: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    v = pid * BV + tl.arange(0, BV)
    v_mask = v < V
    hh = tl.arange(0, BH)
    lim1 = tl.where(M > 1, H, 0)
    lim2 = tl.where(M > 2, H, 0)
    lim3 = tl.where(M > 3, H, 0)
    # per-lane partial sums over 16 consecutive h (one 16-byte load), one accumulator per token row,
    # reduced across lanes once at the end
    acc0 = tl.zeros([BV, BH // 16], dtype=tl.float32)
    acc1 = tl.zeros([BV, BH // 16], dtype=tl.float32)
    acc2 = tl.zeros([BV, BH // 16], dtype=tl.float32)
    acc3 = tl.zeros([BV, BH // 16], dtype=tl.float32)
    w_rows = w_ptr + v.to(tl.int64)[:, None] * H
    w_next = tl.load(w_rows + hh[None, :], mask=v_mask[:, None] & (hh < H)[None, :], other=0)
    wait_for_inputs(PDL)  # the first weight tile is in flight; x comes from the previous kernel
    for h0 in range(0, H, BH):
        w = w_next  # registers double-buffer the weight tile: the next one is in flight during this math
        hn = h0 + BH + hh
        w_next = tl.load(w_rows + hn[None, :], mask=v_mask[:, None] & (hn < H)[None, :], other=0)
        h = h0 + hh
        w3 = tl.reshape(w.to(tl.float32), [BV, BH // 16, 16])
        acc0 += tl.sum(_x_part(x_ptr, 0, h, H, BH) * w3, axis=2)
        if BM > 1:
            acc1 += tl.sum(_x_part(x_ptr, H, h, lim1, BH) * w3, axis=2)
        if BM > 2:
            acc2 += tl.sum(_x_part(x_ptr, 2 * H, h, lim2, BH) * w3, axis=2)
            acc3 += tl.sum(_x_part(x_ptr, 3 * H, h, lim3, BH) * w3, axis=2)
    scale = tl.load(s_ptr + v, mask=v_mask, other=0).to(tl.float32)
    tl.store(out_ptr + v, _out_value(tl.sum(acc0, axis=1) * scale, x_ptr, out_ptr, ROUND_TO_X), mask=v_mask)
    if BM > 1:
        tl.store(out_ptr + V + v, _out_value(tl.sum(acc1, axis=1) * scale, x_ptr, out_ptr, ROUND_TO_X),
                 mask=v < tl.where(M > 1, V, 0))
    if BM > 2:
        tl.store(out_ptr + 2 * V + v, _out_value(tl.sum(acc2, axis=1) * scale, x_ptr, out_ptr, ROUND_TO_X),
                 mask=v < tl.where(M > 2, V, 0))
        tl.store(out_ptr + 3 * V + v, _out_value(tl.sum(acc3, axis=1) * scale, x_ptr, out_ptr, ROUND_TO_X),
                 mask=v < tl.where(M > 3, V, 0))


@triton.jit
def _int8_rows_dot_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, V, H,
    BV: tl.constexpr, BH: tl.constexpr, ROUND_TO_X: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    v = pid * BV + tl.arange(0, BV)
    v_mask = v < V
    tok = tl.arange(0, 16)  # token columns: 1..4 real, the rest zeros (tl.dot needs N >= 16)
    hh = tl.arange(0, BH)
    w_rows = w_ptr + v.to(tl.int64)[:, None] * H
    acc = tl.zeros([BV, 16], dtype=tl.float32)
    wait_for_inputs(PDL)
    for h0 in range(0, H, BH):
        h = h0 + hh
        w = tl.load(w_rows + h[None, :], mask=v_mask[:, None] & (h < H)[None, :], other=0)
        xt = tl.load(x_ptr + tok[None, :] * H + h[:, None], mask=(tok < M)[None, :] & (h < H)[:, None], other=0)
        acc = tl.dot(w.to(xt.dtype), xt, acc)
    scale = tl.load(s_ptr + v, mask=v_mask, other=0).to(tl.float32)
    tl.store(out_ptr + tok[None, :] * V + v[:, None], _out_value(acc * scale[:, None], x_ptr, out_ptr, ROUND_TO_X),
             mask=v_mask[:, None] & (tok < M)[None, :])


# The tensor-core variant for 16-bit x at 1..4 rows (faster at each: see the module docstring).
DOT_ROWS = os.environ.get("ROOFLINE_INT8_DOT", "1") != "0"


def default_config(m: int) -> dict:
    """From the H200 sweep (benchmarks/NOTES-kernels.md): 16 rows x 256 bytes; 2 warps from 2 token rows."""
    if INTERPRET:
        return {"BV": 16, "BH": 32, "num_warps": 1}
    return {"BV": 16, "BH": 256, "num_warps": 4 if m == 1 else 2}


def default_dot_config() -> dict:
    """The H200 sweep's best of seven (benchmarks/NOTES-kernels.md, session 13): 32 vocabulary rows x 256 bytes."""
    if INTERPRET:
        return {"BV": 16, "BH": 32, "num_warps": 1}
    return {"BV": 32, "BH": 256, "num_warps": 2, "num_stages": 3}


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, out_dtype=None, out=None,
                config: dict | None = None, dot: bool | None = None, round_to_x: bool = False) -> torch.Tensor:
    """logits = (x @ q^T) * scale for x [..., H] with 1..4 rows, q int8 [V, H], scale [V] or [V, 1]. `dot`: the
    tensor-core variant (default: for 16-bit x unless ROOFLINE_INT8_DOT=0). `round_to_x`: each value rounded to x's
    dtype before it is stored in out_dtype (fp32 logits of head(x).float()'s values in one launch)."""
    v, h = weight.shape
    x2, lead = decode_rows(x, h, "int8_matmul")
    m = x2.shape[0]
    if dot is None:  # fp32 x would multiply in TF32 on the tensor cores: the lanes loop keeps it exact
        dot = DOT_ROWS and x.dtype in (torch.float16, torch.bfloat16)
    cfg = default_dot_config() if dot else default_config(m)
    cfg.update(config or {})
    if out is None:
        out = torch.empty(m, v, dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(v, cfg["BV"]),)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg.get("num_stages", 1), **pdl_options(x.device)}
    if dot:
        _int8_rows_dot_kernel[grid](x2, weight, scale.reshape(-1), out, m, v, h, BV=cfg["BV"], BH=cfg["BH"],
                                    ROUND_TO_X=round_to_x, **launch)
    else:
        _int8_rows_kernel[grid](x2, weight, scale.reshape(-1), out, m, v, h, BM=max(1, 1 << (m - 1).bit_length()),
                                BV=cfg["BV"], BH=cfg["BH"], ROUND_TO_X=round_to_x, **launch)
    return out.reshape(*lead, v)
