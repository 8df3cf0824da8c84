"""INT4 (GPTQ / AutoRound, any group size dividing K) GEMV and small-M GEMM: y[M, N] = x[M, K] @ W^T.

The kernel reads the published layout as it is, no repack (see roofline.quant.int4):
  qweight int32 [K/8, N]   8 nibbles along K, lowest k in the lowest nibble
  qzeros  int32 [K/g, N/8] zero-1 nibbles along N
  scales  fp16  [K/g, N]
N is the contiguous axis, so a warp's 32 lanes read 4 neighbouring int32 columns each (16-byte
loads, 512 contiguous bytes per row) and each lane keeps a whole group's rows of its columns:
the sum over k stays inside the lane until the end, and the scale is applied once per group.

Dequantisation without int->float conversions: for nibble j of a word (j < 4; the upper four
come from `word >> 16`), `(word & (15 << 4j)) | 0x4B000000` read as fp32 is 2^23 + q*16^j, and
one multiply-add by 16^-j, minus (2^(23-4j) + zero), gives q - zero exactly.

Small N (the output projections, 3072 columns) gives too few column tiles to fill the GPU, so K
is split over programs; the last program of a column tile to finish adds the partial sums (see
_common.arrive), all in one launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..quant.int4 import unpack_cols, unpack_rows
from ._common import (INTERPRET, arrive, counters_for, decode_rows, next_pow2, pdl_options, reset, sm_count, sum_splits,
                      wait_for_inputs)


def int4_matmul_reference(x: torch.Tensor, qweight, qzeros, scales, group_size: int = 128) -> torch.Tensor:
    """Plain PyTorch of the same math: dequantise to fp32, multiply in fp32, round to x's dtype."""
    q = unpack_rows(qweight).float()  # [K, N]
    zero = (unpack_cols(qzeros) + 1).float()  # [K/g, N]
    w = (q.unflatten(0, (-1, group_size)) - zero[:, None, :]) * scales.float()[:, None, :]
    return (x.float() @ w.flatten(0, 1)).to(x.dtype)


@triton.jit
def _dequant_nibble(q, qhi, zero, magic, J: tl.constexpr):
    """Nibble J of each word as fp32 q - zero, exactly, with one logic op and one multiply-add.

    (word & (15 << 4i)) | 0x4B000000 read as fp32 is 2^23 + q*16^i; times 16^-i, less
    2^(23-4i) + zero, is q - zero. Nibbles 4..7 come from word >> 16 (`qhi`). `magic` is
    0x4B000000 passed at run time: held in a register, the mask-and-or is one LOP3 (two
    immediates would take two).
    """
    if J < 4:
        src = q
    else:
        src = qhi
    if J % 4 == 0:
        w = (src & 0xF | magic).to(tl.float32, bitcast=True) - (zero + 8388608.0)
    elif J % 4 == 1:
        w = (src & 0xF0 | magic).to(tl.float32, bitcast=True) * 0.0625 - (zero + 524288.0)
    elif J % 4 == 2:
        w = (src & 0xF00 | magic).to(tl.float32, bitcast=True) * 0.00390625 - (zero + 32768.0)
    else:
        w = (src & 0xF000 | magic).to(tl.float32, bitcast=True) * 0.000244140625 - (zero + 2048.0)
    return w


@triton.jit
def _x_row(x_ptr, row, lim, kp, J: tl.constexpr):
    """x[row + 8*kp + J] as fp32 where kp < lim, else 0 (lim 0: the row is absent)."""
    return tl.load(x_ptr + row + kp * 8 + J, mask=kp < lim, other=0).to(tl.float32)


@triton.jit
def int4_group_dot(
    x_ptr, x_row0, x_row1, x_row2, x_row3, x_ok0, x_ok1, x_ok2, x_ok3, qw_ptr, qz_ptr, sc_ptr, n_offs, n_mask, N, kp_start, kp_end, magic,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, SYM: tl.constexpr,
):
    """Partial sums over packed rows [kp_start, kp_end) for up to four x rows: returns (y0, y1, y2, y3), each [BN] fp32.

    x_rowI: element offset of x row I; x_okI: whether row I takes part (absent rows read x as 0). Each loop step covers ROWS packed rows
    that lie in one quantisation group (8*ROWS divides GROUP; kp_start a multiple of ROWS), so the
    scale multiplies once per step. With every lane holding all ROWS rows of its columns, the
    sums over k stay inside the lane (no cross-lane reductions in the loop).
    """
    r = tl.arange(0, ROWS)
    lim0 = tl.where(x_ok0, kp_end, 0)
    lim1 = tl.where(x_ok1, kp_end, 0)
    lim2 = tl.where(x_ok2, kp_end, 0)
    lim3 = tl.where(x_ok3, kp_end, 0)
    y0 = tl.zeros([BN], dtype=tl.float32)
    y1 = tl.zeros([BN], dtype=tl.float32)
    y2 = tl.zeros([BN], dtype=tl.float32)
    y3 = tl.zeros([BN], dtype=tl.float32)
    # registers double-buffer the weight tile: the next step's loads are in flight during this step's math
    kp = kp_start + r
    q_next = tl.load(qw_ptr + kp[:, None] * N + n_offs[None, :], mask=(kp < kp_end)[:, None] & n_mask[None, :], other=0)
    s_next = tl.load(sc_ptr + (kp_start * 8 // GROUP) * N + n_offs, mask=n_offs < tl.where(kp_start < kp_end, N, 0), other=0)
    for kp0 in range(kp_start, kp_end, ROWS):
        q = q_next
        scale = s_next.to(tl.float32)
        kp = kp0 + r
        nxt = kp0 + ROWS
        kpn = nxt + r
        q_next = tl.load(qw_ptr + kpn[:, None] * N + n_offs[None, :], mask=(kpn < kp_end)[:, None] & n_mask[None, :], other=0)
        s_next = tl.load(sc_ptr + (nxt * 8 // GROUP) * N + n_offs, mask=n_offs < tl.where(nxt < kp_end, N, 0), other=0)
        grp = kp0 * 8 // GROUP
        if SYM:
            zero = 8.0
        else:
            zword = tl.load(qz_ptr + grp * (N // 8) + n_offs // 8, mask=n_mask, other=0)
            zero = (((zword >> ((n_offs % 8) * 4)) & 0xF) + 1).to(tl.float32)[None, :]
        qhi = q >> 16
        p0 = tl.zeros([BN], dtype=tl.float32)
        p1 = tl.zeros([BN], dtype=tl.float32)
        p2 = tl.zeros([BN], dtype=tl.float32)
        p3 = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(8):
            w = _dequant_nibble(q, qhi, zero, magic, j)
            p0 += tl.sum(_x_row(x_ptr, x_row0, lim0, kp, j)[:, None] * w, axis=0)
            if BM > 1:
                p1 += tl.sum(_x_row(x_ptr, x_row1, lim1, kp, j)[:, None] * w, axis=0)
            if BM > 2:
                p2 += tl.sum(_x_row(x_ptr, x_row2, lim2, kp, j)[:, None] * w, axis=0)
                p3 += tl.sum(_x_row(x_ptr, x_row3, lim3, kp, j)[:, None] * w, axis=0)
        y0 += p0 * scale
        if BM > 1:
            y1 += p1 * scale
        if BM > 2:
            y2 += p2 * scale
            y3 += p3 * scale
    return y0, y1, y2, y3


@triton.jit
def int4_group_mma(
    acc, x_ptr, x_rows, x_row_mask, qw_ptr, qz_ptr, sc_ptr, n_offs, n_mask, N, kp_start, kp_end, magic,
    GROUP: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, SYM: tl.constexpr,
):
    """acc[16, BN] += x[rows] @ W^T over packed rows [kp_start, kp_end), on the tensor cores.

    x_rows: [16] element offsets of up to 16 x rows (x_row_mask off for padding). Each step
    dequantises ROWS packed rows (8*ROWS values of k, one group) to q - zero, exact in 16 bits,
    multiplies them with tl.dot and scales the [16, BN] result once: the x values are shared by
    all columns through the matrix unit instead of being re-read per lane.
    """
    r = tl.arange(0, ROWS)
    shifts = tl.arange(0, 8) * 4
    kk = tl.arange(0, ROWS * 8)
    kp = kp_start + r
    q_next = tl.load(qw_ptr + kp[:, None] * N + n_offs[None, :], mask=(kp < kp_end)[:, None] & n_mask[None, :], other=0)
    for kp0 in range(kp_start, kp_end, ROWS):
        q = q_next
        kpn = kp0 + ROWS + r
        q_next = tl.load(qw_ptr + kpn[:, None] * N + n_offs[None, :], mask=(kpn < kp_end)[:, None] & n_mask[None, :], other=0)
        grp = kp0 * 8 // GROUP
        scale = tl.load(sc_ptr + grp * N + n_offs, mask=n_mask, other=0).to(tl.float32)
        if SYM:
            zero = 8.0
        else:
            zword = tl.load(qz_ptr + grp * (N // 8) + n_offs // 8, mask=n_mask, other=0)
            zero = (((zword >> ((n_offs % 8) * 4)) & 0xF) + 1).to(tl.float32)[None, None, :]
        nib = ((q[:, None, :] >> shifts[None, :, None]) & 0xF) | magic  # [ROWS, 8, BN]: 2^23 + q as fp32 bits
        w = nib.to(tl.float32, bitcast=True) - (zero + 8388608.0)
        w = tl.reshape(w, [ROWS * 8, BN]).to(x_ptr.dtype.element_ty)
        k = kp0 * 8 + kk
        xt = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=x_row_mask[:, None] & (k < kp_end * 8)[None, :], other=0)
        if x_ptr.dtype.element_ty == tl.float32:
            acc += tl.dot(xt, w, input_precision="ieee") * scale[None, :]
        else:
            acc += tl.dot(xt, w) * scale[None, :]
    return acc


@triton.jit
def split_rows(acc, BN: tl.constexpr):
    """Rows 0..3 of a [16, BN] accumulator as four [BN] tensors."""
    m16 = tl.arange(0, 16)[:, None]
    y0 = tl.sum(tl.where(m16 == 0, acc, 0.0), axis=0)
    y1 = tl.sum(tl.where(m16 == 1, acc, 0.0), axis=0)
    y2 = tl.sum(tl.where(m16 == 2, acc, 0.0), axis=0)
    y3 = tl.sum(tl.where(m16 == 3, acc, 0.0), axis=0)
    return y0, y1, y2, y3


@triton.jit
def store_rows(ptr, stride, n_offs, N, M, y0, y1, y2, y3, BM: tl.constexpr):
    """ptr[i * stride + n] = yI for rows i < M (yI fp32, cast to ptr's type)."""
    ty = ptr.dtype.element_ty
    tl.store(ptr + n_offs, y0.to(ty), mask=n_offs < N)
    if BM > 1:
        tl.store(ptr + stride + n_offs, y1.to(ty), mask=n_offs < tl.where(M > 1, N, 0))
    if BM > 2:
        tl.store(ptr + 2 * stride + n_offs, y2.to(ty), mask=n_offs < tl.where(M > 2, N, 0))
        tl.store(ptr + 3 * stride + n_offs, y3.to(ty), mask=n_offs < tl.where(M > 3, N, 0))


@triton.jit
def load_rows(ptr, stride, n_offs, N, M, BM: tl.constexpr):
    """The fp32 rows ptr[i * stride + n], i < 4 (rows >= M read as 0), through L2 (partials of other programs)."""
    y0 = tl.load(ptr + n_offs, mask=n_offs < N, other=0, cache_modifier=".cg")
    y1 = y0
    y2 = y0
    y3 = y0
    if BM > 1:
        y1 = tl.load(ptr + stride + n_offs, mask=n_offs < tl.where(M > 1, N, 0), other=0, cache_modifier=".cg")
    if BM > 2:
        y2 = tl.load(ptr + 2 * stride + n_offs, mask=n_offs < tl.where(M > 2, N, 0), other=0, cache_modifier=".cg")
        y3 = tl.load(ptr + 3 * stride + n_offs, mask=n_offs < tl.where(M > 3, N, 0), other=0, cache_modifier=".cg")
    return y0, y1, y2, y3


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, KP_PER_SPLIT, MAGIC,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, SYM: tl.constexpr,
    SPLIT_K, SPLITP: tl.constexpr, USE_MMA: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_offs = pid_n * BN + tl.arange(0, BN)
    n_mask = n_offs < N
    kp_start = pid_k * KP_PER_SPLIT
    kp_end = tl.minimum(kp_start + KP_PER_SPLIT, K // 8)
    if USE_MMA:
        m16 = tl.arange(0, 16)
        acc = tl.zeros([16, BN], dtype=tl.float32)
        acc = int4_group_mma(acc, x_ptr, m16 * K, m16 < M, qw_ptr, qz_ptr, sc_ptr, n_offs, n_mask, N, kp_start, kp_end,
                             MAGIC, GROUP, BN, ROWS, SYM)
        y0, y1, y2, y3 = split_rows(acc, BN)
    else:
        y0, y1, y2, y3 = int4_group_dot(
            x_ptr, 0, K, 2 * K, 3 * K, M > 0, M > 1, M > 2, M > 3,
            qw_ptr, qz_ptr, sc_ptr, n_offs, n_mask, N, kp_start, kp_end, MAGIC, GROUP, BM, BN, ROWS, SYM)
    rb = tl.arange(0, BM)[:, None]  # the BM (1, 2 or 4) output rows as one tile
    y = tl.where(rb == 0, y0[None, :], tl.where(rb == 1, y1[None, :], tl.where(rb == 2, y2[None, :], y3[None, :])))
    offs = rb * N + n_offs[None, :]
    mask = (rb < M) & (n_offs < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * 4 * N + offs, y, mask=mask)
        if arrive(cnt_ptr + pid_n, SPLIT_K):
            total = sum_splits(ws_ptr, 4 * N, offs, mask, SPLIT_K, SPLITP, 4)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            reset(cnt_ptr + pid_n)


MAGIC = 0x4B000000  # fp32 bits of 2^23, the dequantisation's magic number


def rows_per_step(group_size: int, want: int = 16) -> int:
    """Packed rows per loop step: a power of two <= want whose 8 * rows divides the group size."""
    rows = 1
    while rows * 2 <= want and group_size % (rows * 2 * 8) == 0:
        rows *= 2
    return rows


def pick_split(tiles: int, k_steps: int, device: torch.device, programs_per_sm: float = 4.0) -> int:
    """Split K until the grid has about `programs_per_sm` programs per SM (never more splits than K steps)."""
    target = int(sm_count(device) * programs_per_sm)
    split = max(1, min(k_steps, -(-target // max(tiles, 1))))
    per = -(-k_steps // split)  # equal whole numbers of steps per split
    return -(-k_steps // per)


def is_symmetric(qzeros: torch.Tensor) -> bool:
    """True when every stored zero nibble is 7 (real zero 8): the kernels then skip reading qzeros.

    A host sync: call it once at load time and pass `sym=` to the kernels.
    """
    return bool((qzeros == 0x77777777).all().item())


def default_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Per-lane FMAs for 1-2 rows; from 3 rows the x values cost more per lane than the tensor-core path."""
    mma = m >= 3
    if INTERPRET:
        return {"BN": 32, "ROWS": rows_per_step(group_size, 4), "num_warps": 1, "mma": mma}
    if mma:
        return {"BN": 64, "ROWS": rows_per_step(group_size, 16), "num_warps": 4, "mma": True}
    return {"BN": 256, "ROWS": rows_per_step(group_size, 8), "num_warps": 2, "mma": False}


def _launch_geometry(n, k, cfg, device, tiles_extra: int = 1):
    tiles = triton.cdiv(n, cfg["BN"])
    k_steps = triton.cdiv(k // 8, cfg["ROWS"])
    split = cfg.get("SPLIT_K") or pick_split(tiles * tiles_extra, k_steps, device, cfg.get("programs_per_sm", 4.0))
    kp_per_split = triton.cdiv(k_steps, split) * cfg["ROWS"]
    split = triton.cdiv(k // 8, kp_per_split)
    return tiles, split, kp_per_split


# The int4_tc tensor-core path is the default where it applies (bf16/fp16 x, group 128): checked on an H200
# (tests/test_kernels.py -k "int4 or experts", 58 passed, session of 2026-12-02, after the layout fix of run 3a in
# benchmarks/NOTES-kernels.md). ROOFLINE_INT4_TC=0 keeps every call on the lanes path.
TC_DEFAULT = os.environ.get("ROOFLINE_INT4_TC", "1") != "0"


def refuse_blocked(config: dict | None, call: str) -> None:
    """A block-repacked qweight (config "qblk") is read by the tensor-core path only: fail loudly, not wrongly."""
    if (config or {}).get("qblk"):
        raise ValueError(f"{call}: the qweight is block-repacked (ROOFLINE_INT4_QBLK), which only the tensor-core "
                         "path reads, and that path does not apply to this call")


def use_tc(config: dict | None) -> bool:
    """Whether a call may take the tensor-core path: config "tc" if given, else TC_DEFAULT unless the config
    names a lanes-path setting."""
    config = config or {}
    if "tc" in config:
        return bool(config["tc"])
    return TC_DEFAULT and not ({"mma", "BN", "ROWS"} & config.keys())


def int4_matmul(x: torch.Tensor, qweight, qzeros, scales, group_size: int = 128, *, sym: bool | None = None, out=None,
                config: dict | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for x [..., K] with at most 4 rows, W in the GPTQ layout; y in x's dtype."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    x2, lead = decode_rows(x, k, "int4_matmul")
    m = x2.shape[0]
    if k % group_size or n % 8:
        raise ValueError(f"INT4 [{n}, {k}]: K must be divisible by the group size {group_size}, N by 8")
    if sym is None:
        sym = is_symmetric(qzeros)
    if use_tc(config):  # the tensor-core path (int4_tc) where it applies; the lanes path below otherwise
        from .int4_tc import default_tc_config, int4_matmul_tc, tc_supported

        wn = (config or {}).get("WN", default_tc_config(m, n, k)["WN"])
        if tc_supported(x2, n, k, group_size, wn, (qweight, qzeros, scales)):
            return int4_matmul_tc(x, qweight, qzeros, scales, sym=sym, out=out, config=config, counters=counters)
    refuse_blocked(config, f"int4_matmul [{n}, {k}] on {m} {x.dtype} rows")
    cfg = default_config(m, n, k, group_size)
    cfg.update({key: val for key, val in (config or {}).items() if key != "tc"})
    if group_size % (8 * cfg["ROWS"]):
        raise ValueError(f"ROWS={cfg['ROWS']}: 8*ROWS must divide the group size {group_size}")
    tiles, split, kp_per_split = _launch_geometry(n, k, cfg, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(split if split > 1 else 1, 4, n, dtype=torch.float32, device=x.device)
    cnt = counters if counters is not None else counters_for("int4_gemv", tiles, x.device)
    _int4_gemv_kernel[(tiles, split)](
        x2, qweight, qzeros, scales, out, ws, cnt, m, n, k, kp_per_split, MAGIC,
        GROUP=group_size, BM=next_pow2(m), BN=cfg["BN"], ROWS=cfg["ROWS"], SYM=bool(sym), SPLIT_K=split, SPLITP=next_pow2(split),
        USE_MMA=bool(cfg.get("mma", False)),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **pdl_options(x.device),
    )
    return out.reshape(*lead, n)
