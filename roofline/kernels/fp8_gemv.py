"""Block-FP8 GEMV / small-M GEMM: y[M, N] = x[M, K] @ W^T, W as the official `-FP8` checkpoints store it.

Layout (roofline.quant.fp8, no repack): weight float8_e4m3fn [N, K] row-major, scale_inv
[ceil(N/bn), ceil(K/bk)] multiplying each (bn, bk) block. K is the contiguous axis, so lanes run
along K with 16-byte loads (16 values) and each lane keeps one partial sum per (row, token) over
its 16 k; one cross-lane reduction at the end. A tile's rows stay in one scale block (BN divides
bn); along K a tile may span several blocks, each k's block scale folds into x. K is split over programs when N
alone gives too few tiles (the shared experts' down projection, N = 3072); the last program of
a column tile adds the partial sums (see _common.arrive).

The same kernel without the block scale (`dense_matmul`) serves small dense BF16 weights of the
decode step (the router with the shared expert's gate, GDN's b/a projections), where cuBLAS
takes a GEMV plus a split-K reduction kernel (~4-6 us on an H200 for under 2 MB).

`router_top_k` is that GEMV for the MoE router with the routing in its epilogue: the program that
writes a column tile's final output arrives at one more counter, and the last of them runs the
softmax / top-k of every row (small_ops.softmax_top_k) over the outputs it reads back from L2. That
takes the separate top-k launch (~3.4 us, and a launch gap) off the MoE block's critical path.

`NormOnLoad` puts the MoE block's input norm in the GEMV's prologue (`norm=`): x is the layer's h,
written by the mixer's out projection together with each column tile's sum of h^2 per row
(int4_tc.int4_matmul_residual), so every program gets the rows' rstd from those few partial sums and
multiplies rmsnorm(h) * (1 + w), rounded as small_ops.add_rms_norm rounds, on the fly; the programs of
the first column tile also store the normed rows (each its K range) when asked, for the routed experts.
The router and the shared expert's gate_up both take it, so the add_rms_norm launch leaves the layer.

`grouped_dense_matmul(..., gated=True)` puts an MLP's activation in the prologue of its down projection (the
MTP head's routed 16-bit experts): x is the gate_up output [gate | up] and every program takes silu(gate) * up of
its K range on load, rounded as small_ops.silu_mul rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, MAX_ROWS, arrive, counters_for, decode_rows, next_pow2, pdl_options, reset, sm_count,
                      sum_splits, wait_for_inputs)
from .int4_tc import SUMSQ_ROWS
from .small_ops import softmax_top_k


@dataclass
class NormOnLoad:
    """The prologue of `fp8_matmul(norm=...)`: the GEMV's input is rms_norm(x) (zero-centred, weight `weight`, `eps`),
    with x's sums of squares given per column tile (`sumsq` [tiles, MAX_ROWS] fp32, int4_tc.int4_matmul_residual);
    `normed` [M, K] (optional) receives the normed rows."""

    sumsq: torch.Tensor
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor | None = None


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Plain PyTorch of the same math: dequantise to fp32, multiply in fp32, round to x's dtype."""
    bn, bk = block
    n, k = weight.shape
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (x.float() @ (weight.float() * full).t()).to(x.dtype)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, S_COLS,
    SBN: tl.constexpr, SBK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr,
    HAS_SCALE: tl.constexpr = True, PDL: tl.constexpr = False,
    experts_ptr=None, weights_ptr=None, E=0, TOPK: tl.constexpr = 0, KP: tl.constexpr = 1, BE: tl.constexpr = 1,
    ss_ptr=None, nw_ptr=None, normed_ptr=None, eps=0.0, NT=1, NORM: tl.constexpr = False,
    NORM_OUT: tl.constexpr = False, NTP: tl.constexpr = 1, XS=0, GATED: tl.constexpr = False,
    ids_ptr=None, X_PER_ROW=1, WS_STRIDE=0, GROUPED: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GROUPED:  # program axis 2: one (token, choice) pair p, its row of x and its expert's [N, K] weight
        wait_for_inputs(PDL)  # the routing may come from the previous kernel: no weight load before it is read
        p = tl.program_id(2)
        w_ptr += tl.load(ids_ptr + p).to(tl.int64) * N * K
        x_ptr += (p // X_PER_ROW).to(tl.int64) * XS
        out_ptr += p.to(tl.int64) * N
        ws_ptr += p.to(tl.int64) * N
        cnt_ptr += p * tl.num_programs(0)
    n_offs = pid_n * BN + tl.arange(0, BN)
    n_mask = n_offs < N
    m = tl.arange(0, BM)
    m_mask = m < M
    kk = tl.arange(0, BK)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    srow = s_ptr + (pid_n * BN // SBN) * S_COLS
    # per-lane partial sums over 16 consecutive k (one 16-byte load of a row), one cross-lane reduction at the end
    acc = tl.zeros([BM, BN, BK // 16], dtype=tl.float32)
    # registers double-buffer the weight tile: the next step's load is in flight during this step's math
    k = k_start + kk
    w_next = tl.load(w_ptr + n_offs[:, None] * K + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)
    if not GROUPED:
        wait_for_inputs(PDL)  # the first weight tile is in flight; x comes from the previous kernel
    if NORM:
        rstd = _rows_rstd(ss_ptr, m, m_mask, NT, K, eps, NTP)
    for k0 in range(k_start, k_end, BK):
        k = k0 + kk
        kmask = k < k_end
        w = w_next
        kn = k0 + BK + kk
        w_next = tl.load(w_ptr + n_offs[:, None] * K + kn[None, :], mask=n_mask[:, None] & (kn < k_end)[None, :], other=0.0)
        xk = m[:, None] * XS + k[None, :]
        xmask = m_mask[:, None] & kmask[None, :]
        if GATED:  # as small_ops.silu_mul: silu(gate) rounded to the dtype, times up
            g = tl.load(x_ptr + xk, mask=xmask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + xk + K, mask=xmask, other=0.0)
            x = (g / (1.0 + tl.exp(-g))).to(u.dtype) * u
        else:
            x = tl.load(x_ptr + xk, mask=xmask, other=0.0)
        if NORM:  # as small_ops.add_rms_norm: (x * rstd) * (1 + w), rounded to the model dtype
            nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * rstd[:, None] * (1.0 + nw)[None, :]).to(x.dtype)
            if NORM_OUT:
                if pid_n == 0:
                    tl.store(normed_ptr + m[:, None] * K + k[None, :], x, mask=xmask)
        x = x.to(tl.float32)
        if HAS_SCALE:  # the block scale of each k (a tile may span several scale blocks along K)
            x = x * tl.load(srow + k // SBK, mask=kmask, other=0.0).to(tl.float32)[None, :]
        x3 = tl.reshape(x, [BM, 1, BK // 16, 16])
        w3 = tl.reshape(w.to(tl.float32), [1, BN, BK // 16, 16])
        acc += tl.sum(x3 * w3, axis=3)
    y = tl.sum(acc, axis=2)  # [BM, BN]
    offs = m[:, None] * N + n_offs[None, :]
    omask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=omask)
        if TOPK:
            _route_last(out_ptr, experts_ptr, weights_ptr, cnt_ptr, M, N, E, BM, TOPK, KP, BE)
    else:
        tl.store(ws_ptr + pid_k * WS_STRIDE + offs, y, mask=omask)
        if arrive(cnt_ptr + pid_n, SPLIT_K):
            total = sum_splits(ws_ptr, WS_STRIDE, offs, omask, SPLIT_K, SPLITP, 4)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=omask)
            reset(cnt_ptr + pid_n)
            if TOPK:
                _route_last(out_ptr, experts_ptr, weights_ptr, cnt_ptr, M, N, E, BM, TOPK, KP, BE)


@triton.jit
def _rows_rstd(ss_ptr, m, m_mask, NT, K, eps, NTP: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of each row, [BM] fp32, from the NT column tiles' sums of squares ([NT, SUMSQ_ROWS] fp32)."""
    t = tl.arange(0, NTP)[:, None]
    parts = tl.load(ss_ptr + t * SUMSQ_ROWS + m[None, :], mask=(t < NT) & m_mask[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=0) / K + eps)


@triton.jit
def _route_last(out_ptr, experts_ptr, weights_ptr, cnt_ptr, M, N, E, BM: tl.constexpr, TOPK: tl.constexpr,
                KP: tl.constexpr, BE: tl.constexpr):
    """Called by each column tile's final writer: the last of them routes every row from the first E outputs
    (counter slot num_programs(0), after the tiles' own), as stored (16-bit logits route on int32 keys)."""
    tiles = tl.num_programs(0)
    if arrive(cnt_ptr + tiles, tiles):
        e = tl.arange(0, BE)[None, :]
        emask = e < E
        m = tl.arange(0, BM)[:, None]
        slot = tl.arange(0, KP)[None, :]
        z = tl.load(out_ptr + m * N + e, mask=(m < M) & emask, other=0, cache_modifier=".cg")
        chosen, weights = softmax_top_k(z, e, emask, TOPK, KP, BE)  # all rows at once
        tl.store(experts_ptr + m * TOPK + slot, chosen, mask=(m < M) & (slot < TOPK))
        tl.store(weights_ptr + m * TOPK + slot, weights, mask=(m < M) & (slot < TOPK))
        reset(cnt_ptr + tiles)


def default_config(m: int) -> dict:
    """Measured on the H200 (benchmarks/NOTES-kernels.md, run 5): 8-row x 128 tiles on one warp, ~16 programs per
    SM, at 1 and 4 rows (shared gate_up 6.7 / 8.6 us against 9.4 / 11.0 on 2 warps at 4 per SM). Session 16 put the
    shared experts' weights on 4 x 512 tiles at 8 per SM (session 14's kernel sweep had them 5.67 against 7.08 us for
    gate_up at M = 1); in the step (H200, session 17, one build, alternating rounds) those tiles were slower, the M = 1
    graph by 0.04 ms and the M = 3 verify by 0.23, so the 8 x 128 tiles stay."""
    if INTERPRET:
        return {"BN": 16, "BK": 32, "num_warps": 1}
    return {"BN": 8, "BK": 128, "num_warps": 1, "programs_per_sm": 16.0}


def _k_split(k: int, bk: int, programs: int, cfg: dict, device) -> tuple[int, int]:
    """(K splits, K per split, a multiple of bk): the config's SPLIT_K, else enough splits of the `programs` (column
    tiles, times the pairs of a grouped call) for its programs_per_sm."""
    k_steps = triton.cdiv(k, bk)
    split = cfg.get("SPLIT_K")
    if not split:
        target = int(sm_count(device) * cfg.get("programs_per_sm", 4.0))
        split = max(1, min(k_steps, -(-target // programs)))
    k_per_split = triton.cdiv(k_steps, split) * bk
    return triton.cdiv(k, k_per_split), k_per_split


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None, block=(128, 128), *, out=None,
               config: dict | None = None, counters: torch.Tensor | None = None, route: tuple | None = None,
               norm: NormOnLoad | None = None) -> torch.Tensor:
    """y = x @ W^T for x [..., K] with 1..4 rows, W block FP8 [N, K] with scale_inv per (bn, bk) block
    (scale_inv None: W is used as it is stored, see dense_matmul). `route` = (experts [M, k] int64, weights
    [M, k] fp32, E): also write each row's routing over its first E outputs (see router_top_k). `norm`:
    y = rms_norm(x) @ W^T (see NormOnLoad)."""
    n, k = weight.shape
    x2, lead = decode_rows(x, k, "fp8_matmul")
    m = x2.shape[0]
    cfg = default_config(m)
    cfg.update(config or {})
    bn_s, bk_s = block
    bn, bk = min(cfg["BN"], bn_s), cfg["BK"]
    if bn_s % bn or bk % 16 or (bk_s % bk and bk % bk_s):
        raise ValueError(f"tile ({bn}, {bk}): BN must divide the scale block's {bn_s} rows, BK be a multiple of 16 "
                         f"that divides or is a multiple of its {bk_s} columns")
    tiles = triton.cdiv(n, bn)
    split, k_per_split = _k_split(k, bk, tiles, cfg, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(split if split > 1 else 1, m, n, dtype=torch.float32, device=x.device)
    cnt = counters if counters is not None else counters_for("fp8_gemv", tiles + 1, x.device)
    routing = {}
    if route is not None:
        experts, weights, e = route
        top_k = experts.shape[-1]
        routing = dict(experts_ptr=experts, weights_ptr=weights, E=e, TOPK=top_k, KP=next_pow2(top_k), BE=next_pow2(e))
    _fp8_gemv_kernel[(tiles, split)](
        x2, weight, scale_inv if scale_inv is not None else weight, out, ws, cnt, m, n, k, k_per_split,
        scale_inv.shape[-1] if scale_inv is not None else 0,
        SBN=bn_s, SBK=bk_s, BM=max(1, 1 << (m - 1).bit_length()), BN=bn, BK=bk, SPLIT_K=split, SPLITP=next_pow2(split),
        HAS_SCALE=scale_inv is not None, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
        XS=x2.shape[1], WS_STRIDE=m * n, **routing, **_norm_args(norm, x2), **pdl_options(x.device),
    )
    return out.reshape(*lead, n)


def _norm_args(norm: NormOnLoad | None, x2: torch.Tensor) -> dict:
    if norm is None:
        return {}
    m, k = x2.shape
    ss = norm.sumsq
    if ss.dim() != 2 or ss.shape[1] != MAX_ROWS or ss.dtype != torch.float32 or not ss.is_contiguous():
        raise ValueError(f"norm: sumsq must be contiguous fp32 [tiles, {MAX_ROWS}], got {ss.dtype} {list(ss.shape)}")
    if norm.normed is not None and (norm.normed.numel() != m * k or norm.normed.dtype != x2.dtype
                                    or not norm.normed.is_contiguous()):
        raise ValueError(f"norm: normed must be contiguous {x2.dtype} with {m}x{k} elements")
    return dict(ss_ptr=ss, nw_ptr=norm.weight, normed_ptr=norm.normed if norm.normed is not None else x2, eps=norm.eps,
                NT=ss.shape[0], NORM=True, NORM_OUT=norm.normed is not None, NTP=next_pow2(ss.shape[0]))


def router_top_k(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None, block, experts: int,
                 top_k: int, config: dict | None = None,
                 norm: NormOnLoad | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router GEMV and its routing in one launch: (logits [..., N], chosen experts [M, top_k] int64, routing
    weights [M, top_k] fp32 summing to 1) for x [..., K] with 1..4 rows; softmax / top-k over the first
    `experts` outputs (the rest, e.g. the shared expert's gate merged in, are only computed)."""
    m = x.numel() // x.shape[-1]
    if not 1 <= experts <= weight.shape[0] or top_k > experts:
        raise ValueError(f"router_top_k: {experts} experts (top {top_k}) for a weight of {weight.shape[0]} rows")
    chosen = torch.empty(m, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=x.device)
    logits = fp8_matmul(x, weight, scale_inv, block, route=(chosen, weights, experts), config=config, norm=norm)
    return logits, chosen, weights


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, *, out=None, config: dict | None = None) -> torch.Tensor:
    """y = x @ W^T for x [..., K] with 1..4 rows and a dense [N, K] weight (the FP8 kernel without scales)."""
    if weight.stride(-1) != 1 or weight.stride(0) != weight.shape[1]:
        raise ValueError(f"dense_matmul wants a contiguous [N, K] weight, got strides {weight.stride()}")
    return fp8_matmul(x, weight, None, out=out, config=config)


def grouped_dense_matmul(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, gated: bool = False,
                         config: dict | None = None) -> torch.Tensor:
    """Routed dense experts without gathering their weights: y [T*k, N], row p = t*k + j is x[t] @ W[ids[t, j]]^T for
    x [T, K], a stacked weight [E, N, K] and ids [T, k]; `gated`: x is [T*k, 2K], one [gate | up] row per pair, and
    row p is silu_mul(x[p]) @ W[ids.flat[p]]^T. One program per (column tile, K split, pair) reads only the routed
    experts' rows, where indexing the stacked weight by the routing copied each pair's [N, K] weight first (the MTP
    head's BF16 experts: 151 MB a draft on the 122B)."""
    e, n, k = weight.shape
    t, top_k = ids.shape
    pairs = t * top_k
    rows = pairs if gated else t
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not weight.is_contiguous():
        raise ValueError(f"grouped_dense_matmul wants a contiguous bf16/fp16/fp32 [E, N, K] weight, got {weight.dtype} "
                         f"strides {weight.stride()}")
    if x.shape != (rows, 2 * k if gated else k):
        raise ValueError(f"grouped_dense_matmul: x must be [{rows}, {2 * k if gated else k}], got {list(x.shape)}")
    x = x.contiguous()
    ids = ids.reshape(-1).contiguous()
    cfg = default_config(1)
    if INTERPRET:  # the interpreter runs programs one after another: one wide tile a pair, not the GPU's many small ones
        cfg.update(BN=min(256, next_pow2(n)), BK=min(256, max(16, next_pow2(k))), SPLIT_K=1)
    cfg.update(config or {})
    bn, bk = cfg["BN"], cfg["BK"]
    tiles = triton.cdiv(n, bn)
    split, k_per_split = _k_split(k, bk, tiles * pairs, cfg, x.device)
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(split if split > 1 else 1, pairs, n, dtype=torch.float32, device=x.device)
    cnt = counters_for("fp8_gemv grouped", tiles * pairs, x.device)
    _fp8_gemv_kernel[(tiles, split, pairs)](
        x, weight, weight, out, ws, cnt, 1, n, k, k_per_split, 0,
        SBN=128, SBK=128, BM=1, BN=bn, BK=bk, SPLIT_K=split, SPLITP=next_pow2(split), HAS_SCALE=False,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), XS=x.shape[1], GATED=gated,
        ids_ptr=ids, X_PER_ROW=1 if gated else top_k, WS_STRIDE=pairs * n, GROUPED=True, **pdl_options(x.device),
    )
    return out
