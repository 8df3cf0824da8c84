"""Grouped INT4 expert kernels for decode: read only the routed experts' weights, each once per token chunk.

Experts are stacked Int4Weight tensors in the published GPTQ layout with a leading expert axis:
gate_up qweight [E, H/8, 2I] (columns 0..I-1 gate, I..2I-1 up), down qweight [E, I/8, H], with
their qzeros/scales likewise. Routing comes as `ids` [T, k] (int) and `weights` [T, k].

Work split: tokens are taken in chunks of CH (up to 4 rows per lane on the FMA path, 16 on the
tensor-core path). Program (column tile, chunk, slot p, K split) looks at the expert of slot p
(token p // k, choice p % k). If an earlier slot of the chunk routes to the same expert, the
program does nothing; otherwise it owns that expert for the chunk, gathers every token of the
chunk routed to it and multiplies them together, so each expert's weights are read once per
chunk however many of its tokens route to it. Only present tokens' slots get programs (T * k of
them: a 3-token verify in a chunk of 4 runs 24 slots, not 32), so the down kernels count each
chunk's arrivals from its tokens.

- gate_up: act[t, j, :] = silu(x[t] @ Wg^T) * (x[t] @ Wu^T); the gate and up columns of one
  tile come from the same program, so SiLU*up is fused (after the split-K sum when K is split).
- down: out[t] = sum_j w[t, j] * act[t, j] @ Wd_e^T. Each owner writes its routing-weighted rows
  to a workspace; the last program of a column tile to arrive sums the k choices (and K splits)
  in a fixed order and writes the output: one launch, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (INTERPRET, arrive, counters_for, next_pow2, pdl_options, pick, reset, sum_splits,
                      wait_for_inputs)
from .int4_gemv import (
    MAGIC,
    _launch_geometry,
    int4_group_dot,
    int4_group_mma,
    int4_matmul_reference,
    is_symmetric,
    refuse_blocked,
    rows_per_step,
    use_tc,
)
from .int4_tc import (
    GROUP,
    default_tc_config,
    lane_index,
    launch_options,
    one_buffer_loop,
    out_index,
    sum_warp_rows,
    tc_geometry,
    tc_groups,
    tc_supported,
)


def experts_gate_up_reference(x, ids, qweight, qzeros, scales, group_size: int = 128) -> torch.Tensor:
    """act [T, k, I] = silu(gate) * up per routed (token, expert), in fp32, rounded to x's dtype."""
    t, topk = ids.shape
    inter = qweight.shape[-1] // 2
    act = torch.empty(t, topk, inter, dtype=x.dtype, device=x.device)
    for ti in range(t):
        for j in range(topk):
            e = int(ids[ti, j])
            y = int4_matmul_reference(x[ti : ti + 1].float(), qweight[e], qzeros[e], scales[e], group_size)[0]
            act[ti, j] = (F.silu(y[:inter]) * y[inter:]).to(x.dtype)
    return act


def experts_down_reference(act, ids, weights, qweight, qzeros, scales, group_size: int = 128) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] * act[t, j] @ Wd_e^T, in fp32, rounded to act's dtype."""
    t, topk = ids.shape
    out = torch.zeros(t, qweight.shape[-1], dtype=torch.float32, device=act.device)
    for ti in range(t):
        for j in range(topk):
            e = int(ids[ti, j])
            y = int4_matmul_reference(act[ti, j : j + 1].float(), qweight[e], qzeros[e], scales[e], group_size)[0]
            out[ti] += weights[ti, j].float() * y
    return out.to(act.dtype)


@triton.jit
def _slot_owner(ids_ptr, T, CH: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr):
    """The program's (chunk, is_owner, expert, rows, routed, choice). The grid's axis 1 runs over (token chunk,
    slot) pairs, CH * TOPK slots a chunk.

    is_owner: the slot exists and no earlier slot of the chunk routes to its expert. rows [CH]:
    token indices of the chunk; routed [CH]: the token routes to the expert; choice [CH]: which of
    its k choices does (valid where routed).
    """
    pid_s = tl.program_id(1)
    chunk = pid_s // (CH * TOPK)
    slot = pid_s % (CH * TOPK)
    rr = tl.arange(0, CH)
    jj = tl.arange(0, TOPKP)
    tok = chunk * CH + rr
    valid = (tok < T)[:, None] & (jj < TOPK)[None, :]
    ids = tl.load(ids_ptr + tok[:, None] * TOPK + jj[None, :], mask=valid, other=-1).to(tl.int32)
    my_t = chunk * CH + slot // TOPK
    exists = (my_t < T) & (slot < CH * TOPK)
    e = tl.load(ids_ptr + tl.where(exists, my_t * TOPK + slot % TOPK, 0)).to(tl.int32)
    e = tl.where(exists, e, -2)
    match = (ids == e) & valid
    flat = rr[:, None] * TOPK + jj[None, :]
    earlier = tl.sum(tl.sum(tl.where(match & (flat < slot), 1, 0), axis=1), axis=0)
    is_owner = exists & (earlier == 0)
    routed = tl.sum(tl.where(match, 1, 0), axis=1) > 0
    choice = tl.sum(tl.where(match, jj[None, :], 0), axis=1)
    return chunk, is_owner, e, tok, routed, choice


@triton.jit
def _expert_tile(
    x_ptr, row_off, routed, qw_e, qz_e, sc_e, n_offs, n_mask, N, kp_start, kp_end, magic,
    GROUP: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, SYM: tl.constexpr, USE_MMA: tl.constexpr,
):
    """[CH, BN] fp32 partial products of the chunk's routed rows (x rows at `row_off`) with one expert's columns."""
    rr = tl.arange(0, CH)
    if USE_MMA:  # CH == 16: the chunk's rows are the matrix rows
        acc = tl.zeros([CH, BN], dtype=tl.float32)
        return int4_group_mma(acc, x_ptr, row_off, routed, qw_e, qz_e, sc_e, n_offs, n_mask, N, kp_start, kp_end, magic,
                              GROUP, BN, ROWS, SYM)
    else:
        ok = routed.to(tl.int32)
        y0, y1, y2, y3 = int4_group_dot(
            x_ptr, pick(row_off, rr, 0), pick(row_off, rr, 1), pick(row_off, rr, 2), pick(row_off, rr, 3),
            pick(ok, rr, 0) > 0, pick(ok, rr, 1) > 0, pick(ok, rr, 2) > 0, pick(ok, rr, 3) > 0,
            qw_e, qz_e, sc_e, n_offs, n_mask, N, kp_start, kp_end, magic, GROUP, CH, BN, ROWS, SYM)
        out = tl.where(rr[:, None] == 0, y0[None, :], 0.0)
        if CH > 1:
            out = tl.where(rr[:, None] == 1, y1[None, :], out)
        if CH > 2:
            out = tl.where(rr[:, None] == 2, y2[None, :], out)
            out = tl.where(rr[:, None] == 3, y3[None, :], out)
        return out


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, qw_ptr, qz_ptr, sc_ptr, act_ptr, ws_ptr, cnt_ptr,
    T, K, I, KP_PER_SPLIT, MAGIC,
    TOPK: tl.constexpr, TOPKP: tl.constexpr, CH: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
    ROWS: tl.constexpr, SYM: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr, USE_MMA: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)  # which weights to read comes from the router's output
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    chunk, is_owner, e, tok, routed, choice = _slot_owner(ids_ptr, T, CH, TOPK, TOPKP)
    if is_owner:
        n2 = 2 * I
        e64 = e.to(tl.int64)
        qw_e = qw_ptr + e64 * (K // 8) * n2
        qz_e = qz_ptr + e64 * (K // GROUP) * (n2 // 8)
        sc_e = sc_ptr + e64 * (K // GROUP) * n2
        n_offs = pid_n * BN + tl.arange(0, BN)
        n_mask = n_offs < I
        kp_start = pid_k * KP_PER_SPLIT
        kp_end = tl.minimum(kp_start + KP_PER_SPLIT, K // 8)
        gate = _expert_tile(x_ptr, tok * K, routed, qw_e, qz_e, sc_e, n_offs, n_mask, n2, kp_start, kp_end, MAGIC,
                            GROUP, CH, BN, ROWS, SYM, USE_MMA)
        up = _expert_tile(x_ptr, tok * K, routed, qw_e, qz_e, sc_e, n_offs + I, n_mask, n2, kp_start, kp_end, MAGIC,
                          GROUP, CH, BN, ROWS, SYM, USE_MMA)
        row = tok * TOPK + choice  # [CH] (token, choice) rows of act
        omask = routed[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(act_ptr + row[:, None] * I + n_offs[None, :], act.to(act_ptr.dtype.element_ty), mask=omask)
        else:
            # workspace [SPLIT_K, T*TOPK, 2, I]
            base = ws_ptr + pid_k * (T * TOPK * 2 * I) + row[:, None] * (2 * I) + n_offs[None, :]
            tl.store(base, gate, mask=omask)
            tl.store(base + I, up, mask=omask)
            cnt = cnt_ptr + tl.program_id(1) * tl.num_programs(0) + pid_n
            if arrive(cnt, SPLIT_K):
                # masks rebuilt here: reusing the outer ones trips a layout pass (operand does not dominate)
                _, is_owner2, e2, tok2, routed2, choice2 = _slot_owner(ids_ptr, T, CH, TOPK, TOPKP)
                row2 = tok2 * TOPK + choice2
                omask2 = routed2[:, None] & (n_offs < I)[None, :]
                offs = row2[:, None] * (2 * I) + n_offs[None, :]
                g = sum_splits(ws_ptr, T * TOPK * 2 * I, offs, omask2, SPLIT_K, SPLITP, 4)
                u = sum_splits(ws_ptr + I, T * TOPK * 2 * I, offs, omask2, SPLIT_K, SPLITP, 4)
                act = g / (1.0 + tl.exp(-g)) * u
                tl.store(act_ptr + row2[:, None] * I + n_offs[None, :], act.to(act_ptr.dtype.element_ty), mask=omask2)
                reset(cnt)


@triton.jit
def _sum_choices(ws_ptr, out_ptr, cnt, chunk, T, H, n_offs, n_mask, SPLIT_K, SPLITP: tl.constexpr,
                 CH: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr,
                 sh_ptr, sg_ptr, SG_STRIDE, res_ptr, SHARED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The down kernels' end: the last of the programs of this (chunk, column tile), one per present token's slot
    and K split, sums each token's k weighted choices over the K splits, in order, from the workspace
    [SPLIT_K, T*TOPK, H]. With SHARED it
    adds the shared expert's output times sigmoid(its gate logit), with RESIDUAL the layer's residual,
    rounding to the output dtype where the reference (SparseMoE.forward, DecoderLayer.forward) does."""
    if arrive(cnt, tl.minimum(CH, T - chunk * CH) * TOPK * SPLIT_K):
        toks = chunk * CH + tl.arange(0, CH)
        tmask = (toks < T)[:, None] & n_mask[None, :]
        offs = toks[:, None] * H + n_offs[None, :]
        total = tl.zeros([CH, BN], dtype=tl.float32)
        for j in tl.static_range(TOPK):  # all k choices' partials are loaded together
            total += sum_splits(ws_ptr, T * TOPK * H, (toks * TOPK + j)[:, None] * H + n_offs[None, :], tmask,
                                SPLIT_K, SPLITP, 2)
        ty = out_ptr.dtype.element_ty
        if SHARED:
            g = tl.load(sg_ptr + toks * SG_STRIDE, mask=toks < T, other=0).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
            shared = (tl.load(sh_ptr + offs, mask=tmask, other=0).to(tl.float32) * gate[:, None]).to(ty).to(tl.float32)
            total = total.to(ty).to(tl.float32) + shared
        if RESIDUAL:
            total = tl.load(res_ptr + offs, mask=tmask, other=0).to(tl.float32) + total.to(ty).to(tl.float32)
        tl.store(out_ptr + offs, total.to(ty), mask=tmask)
        reset(cnt)


@triton.jit
def _down_kernel(
    act_ptr, ids_ptr, wts_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, ws_ptr, cnt_ptr, sh_ptr, sg_ptr, SG_STRIDE, res_ptr,
    T, I, H, KP_PER_SPLIT, MAGIC,
    TOPK: tl.constexpr, TOPKP: tl.constexpr, CH: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
    ROWS: tl.constexpr, SYM: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr, USE_MMA: tl.constexpr,
    SHARED: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    n_offs = pid_n * BN + tl.arange(0, BN)
    n_mask = n_offs < H
    chunk, is_owner, e, tok, routed, choice = _slot_owner(ids_ptr, T, CH, TOPK, TOPKP)
    row = tok * TOPK + choice  # [CH] rows of act / routing weights
    if is_owner:
        e64 = e.to(tl.int64)
        qw_e = qw_ptr + e64 * (I // 8) * H
        qz_e = qz_ptr + e64 * (I // GROUP) * (H // 8)
        sc_e = sc_ptr + e64 * (I // GROUP) * H
        kp_start = pid_k * KP_PER_SPLIT
        kp_end = tl.minimum(kp_start + KP_PER_SPLIT, I // 8)
        y = _expert_tile(act_ptr, row * I, routed, qw_e, qz_e, sc_e, n_offs, n_mask, H, kp_start, kp_end, MAGIC,
                         GROUP, CH, BN, ROWS, SYM, USE_MMA)
        w = tl.load(wts_ptr + row, mask=routed, other=0).to(tl.float32)
        # workspace [SPLIT_K, T*TOPK, H]
        tl.store(ws_ptr + pid_k * (T * TOPK * H) + row[:, None] * H + n_offs[None, :], y * w[:, None],
                 mask=routed[:, None] & n_mask[None, :])
    # every program of this (chunk, column tile) arrives; the last sums choices and splits in order
    _sum_choices(ws_ptr, out_ptr, cnt_ptr + chunk * tl.num_programs(0) + pid_n, chunk, T, H, n_offs, n_mask,
                 SPLIT_K, SPLITP, CH, BN, TOPK, sh_ptr, sg_ptr, SG_STRIDE, res_ptr, SHARED, RESIDUAL)


def _config(t: int, n: int, group_size: int, config: dict | None) -> dict:
    """FMA path (rows on the lanes) for one token; from two tokens the tensor-core path, 16 token rows a chunk.

    Measured on the H200 (benchmarks/NOTES-kernels.md): at T=4 the lanes path took 207 us for
    gate_up, the tensor-core path 81 us; at T=1 the lanes path is ~2x faster.
    """
    mma = bool((config or {}).get("mma", t > 1))
    if INTERPRET:
        cfg = {"BN": 32, "ROWS": rows_per_step(group_size, 4), "num_warps": 1}
    elif mma:
        cfg = {"BN": 64, "ROWS": rows_per_step(group_size, 16), "num_warps": 4}
    else:  # 8 rows a step at one token; 4 keeps 2-4 token rows in registers (no spills). One-warp
        # programs need ~8 per SM to cover the dequantisation's latency (H200 sweep: gate_up 23.7 -> 17.1 us)
        cfg = {"BN": 128, "ROWS": rows_per_step(group_size, 8 if t == 1 else 4), "num_warps": 1, "programs_per_sm": 8}
    cfg["mma"] = mma
    cfg.update({key: val for key, val in (config or {}).items() if key != "tc"})
    return cfg


def _chunk(t: int, mma: bool) -> int:
    return 16 if mma else min(4, next_pow2(t))


def experts_gate_up(x: torch.Tensor, ids: torch.Tensor, qweight, qzeros, scales, group_size: int = 128, *,
                    sym: bool | None = None, out=None, config: dict | None = None, counters=None) -> torch.Tensor:
    """act [T, k, I] = silu(x @ Wg_e^T) * (x @ Wu_e^T) for each token's k routed experts e = ids[t, j]."""
    t, k = x.shape
    topk = ids.shape[1]
    inter = qweight.shape[-1] // 2
    if sym is None:
        sym = is_symmetric(qzeros)
    # the tc path also at one token since the layout fix (H200 sweep run 4: 15.1 us on 2 warps, 4 programs per SM,
    # vs 16.8 on the lanes path)
    if _tc_path(x, inter, k, group_size, t, config, (qweight, qzeros, scales)):
        return _experts_gate_up_tc(x, ids, qweight, qzeros, scales, sym, out, config, counters)
    refuse_blocked(config, f"experts_gate_up on {t} {x.dtype} tokens")
    cfg = _config(t, inter, group_size, config)
    ch = _chunk(t, cfg["mma"])
    chunks = triton.cdiv(t, ch)
    slots = ch * topk
    tiles, split, kp_per_split = _launch_geometry(inter, k, cfg, x.device, tiles_extra=t * topk)
    act = torch.empty(t, topk, inter, dtype=x.dtype, device=x.device) if out is None else out
    ws = torch.empty(split if split > 1 else 1, t * topk, 2, inter, dtype=torch.float32, device=x.device)
    cnt = counters if counters is not None else counters_for("experts_gate_up", tiles * chunks * slots, x.device)
    _gate_up_kernel[(tiles, t * topk, split)](
        x.contiguous(), ids.contiguous(), qweight, qzeros, scales, act, ws, cnt, t, k, inter, kp_per_split, MAGIC,
        TOPK=topk, TOPKP=next_pow2(topk), CH=ch, GROUP=group_size, BN=cfg["BN"], ROWS=cfg["ROWS"], SYM=bool(sym),
        SPLIT_K=split, SPLITP=next_pow2(split), USE_MMA=bool(cfg["mma"]), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
        **pdl_options(x.device),
    )
    return act


def experts_down(act: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, qweight, qzeros, scales,
                 group_size: int = 128, *, sym: bool | None = None, out=None, config: dict | None = None,
                 counters=None, shared=None, shared_gate=None, residual=None) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] * act[t, j] @ Wd_e^T, e = ids[t, j].

    The MoE block's other terms can join in the same launch: `shared` [T, H] times sigmoid(`shared_gate`
    [T] or [T, 1], rows may be strided) and `residual` [T, H], added as SparseMoE and DecoderLayer add them."""
    t, topk, inter = act.shape
    h = qweight.shape[-1]
    if sym is None:
        sym = is_symmetric(qzeros)
    extra = _extra_terms(act, t, h, shared, shared_gate, residual)
    if _tc_path(act, h, inter, group_size, t, config, (qweight, qzeros, scales), down=True):
        return _experts_down_tc(act, ids, weights, qweight, qzeros, scales, sym, out, config, counters, extra)
    refuse_blocked(config, f"experts_down on {t} {act.dtype} tokens")
    cfg = _config(t, h, group_size, config)
    ch = _chunk(t, cfg["mma"])
    chunks = triton.cdiv(t, ch)
    slots = ch * topk
    tiles, split, kp_per_split = _launch_geometry(h, inter, cfg, act.device, tiles_extra=t * topk)
    if out is None:
        out = torch.empty(t, h, dtype=act.dtype, device=act.device)
    ws = torch.empty(split, t * topk, h, dtype=torch.float32, device=act.device)
    cnt = counters if counters is not None else counters_for("experts_down", tiles * chunks, act.device)
    _down_kernel[(tiles, t * topk, split)](
        act.contiguous(), ids.contiguous(), weights.contiguous(), qweight, qzeros, scales, out, ws, cnt, *extra.args(out),
        t, inter, h, kp_per_split, MAGIC,
        TOPK=topk, TOPKP=next_pow2(topk), CH=ch, GROUP=group_size, BN=cfg["BN"], ROWS=cfg["ROWS"], SYM=bool(sym),
        SPLIT_K=split, SPLITP=next_pow2(split), USE_MMA=bool(cfg["mma"]), **extra.flags(),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **pdl_options(act.device),
    )
    return out


@dataclass
class _ExtraTerms:
    """What the down kernels' epilogue adds besides the routed experts (see experts_down)."""

    shared: torch.Tensor | None
    gate: torch.Tensor | None
    gate_stride: int
    residual: torch.Tensor | None

    def args(self, out):
        return (self.shared if self.shared is not None else out, self.gate if self.gate is not None else out,
                self.gate_stride, self.residual if self.residual is not None else out)

    def flags(self):
        return {"SHARED": self.shared is not None, "RESIDUAL": self.residual is not None}


def _extra_terms(act, t: int, h: int, shared, shared_gate, residual) -> _ExtraTerms:
    if (shared is None) != (shared_gate is None):
        raise ValueError("experts_down: shared and shared_gate come together")
    for name, term in (("shared", shared), ("residual", residual)):
        if term is not None and (tuple(term.shape) != (t, h) or not term.is_contiguous() or term.device != act.device):
            raise ValueError(f"experts_down: {name} must be contiguous [{t}, {h}] on {act.device}, got {list(term.shape)}")
    stride = 0
    if shared_gate is not None:
        if shared_gate.shape[0] != t or shared_gate[0].numel() != 1:
            raise ValueError(f"experts_down: shared_gate must hold one logit per token, got {list(shared_gate.shape)}")
        stride = shared_gate.stride(0)
    return _ExtraTerms(shared, shared_gate, stride, residual)


# ------------------------------------------------------------------ tensor-core path (int4_tc)


@triton.jit
def _rows_of(vals, rsel, CH: tl.constexpr):
    """vals[rsel] for a [CH] vector and an [R, 1] index tensor (rsel >= CH reads 0)."""
    rr = tl.arange(0, CH)[None, None, :]
    return tl.sum(tl.where(rsel[:, :, None] == rr, vals[None, None, :], 0), axis=2)


@triton.jit
def _chunk_xrow(row_words, routed, WN: tl.constexpr, KW: tl.constexpr, CH: tl.constexpr):
    """[L, 1] x word offsets of chunk row g of each tile row (row 0 of x where absent or not routed)."""
    g, t, wn, kw = lane_index(WN, KW)
    xrow = _rows_of(tl.where(routed, row_words, 0), g, CH)
    return tl.multiple_of(xrow, [16, 16])


@triton.jit
def _tc_out_rows(tok, choice, routed, colbase, WN: tl.constexpr, CH: tl.constexpr, TOPK: tl.constexpr):
    """For the [32 WN, 4] results of chunk rows 2t (y0) and 2t + 1 (y1): (act rows, masks) of each, and columns."""
    r0, col = out_index(colbase, WN)  # r0 [32 WN, 1]
    rows = tok * TOPK + choice
    ok = routed.to(tl.int32)
    row0 = _rows_of(rows, r0, CH)
    row1 = _rows_of(rows, r0 + 1, CH)
    m0 = _rows_of(ok, r0, CH) > 0
    m1 = _rows_of(ok, r0 + 1, CH) > 0
    return row0, row1, m0, m1, col


@triton.jit
def _gate_up_tc_kernel(
    x32_ptr, ids_ptr, qw_ptr, qz_ptr, sc_ptr, act_ptr, ws_ptr, cnt_ptr,
    T, K2, I, GROUPS, GPS, QW_E, QZ_E, SC_E,
    TOPK: tl.constexpr, TOPKP: tl.constexpr, CH: tl.constexpr, WN: tl.constexpr, KW: tl.constexpr,
    SYM: tl.constexpr, BF16: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr, EMULATE: tl.constexpr,
    QBLK: tl.constexpr = False, PDL: tl.constexpr = False, DEPTH: tl.constexpr = 2,
):
    wait_for_inputs(PDL)  # which weights to read comes from the router's output
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    chunk, is_owner, e, tok, routed, choice = _slot_owner(ids_ptr, T, CH, TOPK, TOPKP)
    if is_owner:
        e64 = e.to(tl.int64)
        colbase = pid_n * (32 * WN)
        xrow = _chunk_xrow(tok * K2, routed, WN, KW, CH)
        g_start = pid_k * GPS
        g_end = tl.minimum(g_start + GPS, GROUPS)
        g0, g1, u0, u1 = tc_groups(x32_ptr, xrow, qw_ptr + e64 * QW_E, sc_ptr + e64 * SC_E, qz_ptr + e64 * QZ_E, colbase,
                                   I, 2 * I, g_start, g_end, WN, KW, SYM, BF16, True, EMULATE, GROUPS, QBLK, False,
                                   DEPTH)
        g0 = sum_warp_rows(g0, WN, KW)  # chunk row 2t
        g1 = sum_warp_rows(g1, WN, KW)  # chunk row 2t + 1
        u0 = sum_warp_rows(u0, WN, KW)
        u1 = sum_warp_rows(u1, WN, KW)
        row0, row1, m0, m1, col = _tc_out_rows(tok, choice, routed, colbase, WN, CH, TOPK)
        if SPLIT_K == 1:
            tl.store(act_ptr + row0 * I + col, (g0 / (1.0 + tl.exp(-g0)) * u0).to(act_ptr.dtype.element_ty), mask=m0)
            tl.store(act_ptr + row1 * I + col, (g1 / (1.0 + tl.exp(-g1)) * u1).to(act_ptr.dtype.element_ty), mask=m1)
        else:
            # workspace [SPLIT_K, T*TOPK, 2, I]
            base = ws_ptr + pid_k * (T * TOPK * 2 * I) + col
            tl.store(base + row0 * (2 * I), g0, mask=m0)
            tl.store(base + row0 * (2 * I) + I, u0, mask=m0)
            tl.store(base + row1 * (2 * I), g1, mask=m1)
            tl.store(base + row1 * (2 * I) + I, u1, mask=m1)
            cnt = cnt_ptr + tl.program_id(1) * tl.num_programs(0) + pid_n
            if arrive(cnt, SPLIT_K):
                _gate_up_tc_finish(ws_ptr, act_ptr, row0, m0, col, T, I, TOPK, SPLIT_K, SPLITP)
                _gate_up_tc_finish(ws_ptr, act_ptr, row1, m1, col, T, I, TOPK, SPLIT_K, SPLITP)
                reset(cnt)


@triton.jit
def _gate_up_tc_finish(ws_ptr, act_ptr, row, mask, col, T, I, TOPK: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr):
    """Sum the K splits' gate and up partials of one set of rows (`row`, `mask` and `col` alike in shape), 4 splits'
    loads at a time, and store silu(gate) * up."""
    offs = row * (2 * I) + col
    g = sum_splits(ws_ptr, T * TOPK * 2 * I, offs, mask, SPLIT_K, SPLITP, 4)
    u = sum_splits(ws_ptr + I, T * TOPK * 2 * I, offs, mask, SPLIT_K, SPLITP, 4)
    tl.store(act_ptr + row * I + col, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_tc_kernel(
    act32_ptr, ids_ptr, wts_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, ws_ptr, cnt_ptr, sh_ptr, sg_ptr, SG_STRIDE, res_ptr,
    T, I2, H, GROUPS, GPS, QW_E, QZ_E, SC_E,
    TOPK: tl.constexpr, TOPKP: tl.constexpr, CH: tl.constexpr, WN: tl.constexpr, KW: tl.constexpr,
    SYM: tl.constexpr, BF16: tl.constexpr, SPLIT_K, SPLITP: tl.constexpr, EMULATE: tl.constexpr,
    SHARED: tl.constexpr, RESIDUAL: tl.constexpr, QBLK: tl.constexpr = False, PDL: tl.constexpr = False,
    DEPTH: tl.constexpr = 2,
):
    BN: tl.constexpr = 32 * WN
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    colbase = pid_n * BN
    # Under PDL the routing is read and the first weights are loaded before the wait for gate_up: the router wrote
    # ids two kernels back, and this kernel only starts once every gate_up program has passed its own wait.
    chunk, is_owner, e, tok, routed, choice = _slot_owner(ids_ptr, T, CH, TOPK, TOPKP)
    if is_owner:
        e64 = e.to(tl.int64)
        xrow = _chunk_xrow((tok * TOPK + choice) * I2, routed, WN, KW, CH)
        g_start = pid_k * GPS
        g_end = tl.minimum(g_start + GPS, GROUPS)
        y0, y1, _, _ = tc_groups(act32_ptr, xrow, qw_ptr + e64 * QW_E, sc_ptr + e64 * SC_E, qz_ptr + e64 * QZ_E,
                                 colbase, 0, H, g_start, g_end, WN, KW, SYM, BF16, False, EMULATE, GROUPS, QBLK, PDL,
                                 DEPTH)
        y0 = sum_warp_rows(y0, WN, KW)
        y1 = sum_warp_rows(y1, WN, KW)
        row0, row1, m0, m1, col = _tc_out_rows(tok, choice, routed, colbase, WN, CH, TOPK)
        w0 = tl.load(wts_ptr + row0, mask=m0, other=0).to(tl.float32)
        w1 = tl.load(wts_ptr + row1, mask=m1, other=0).to(tl.float32)
        # workspace [SPLIT_K, T*TOPK, H]
        tl.store(ws_ptr + pid_k * (T * TOPK * H) + row0 * H + col, y0 * w0, mask=m0)
        tl.store(ws_ptr + pid_k * (T * TOPK * H) + row1 * H + col, y1 * w1, mask=m1)
    else:
        wait_for_inputs(PDL)  # (tc_groups waited in the owners)
    # every program of this (chunk, column tile) arrives; the last sums choices and splits in order
    n_offs = colbase + tl.arange(0, BN)
    n_mask = n_offs < H
    _sum_choices(ws_ptr, out_ptr, cnt_ptr + chunk * tl.num_programs(0) + pid_n, chunk, T, H, n_offs, n_mask,
                 SPLIT_K, SPLITP, CH, BN, TOPK, sh_ptr, sg_ptr, SG_STRIDE, res_ptr, SHARED, RESIDUAL)


# Programs a SM the experts kernels aim at for 2-4 token rows (the verify step). tc_geometry counts every (token,
# choice) pair as work, but a verify step's drafts share experts: the 122B's M = 3 step on distinct ids reads 9.8
# distinct experts a layer for its 24 pairs, so ~60% of the slots' programs find their expert owned by an earlier slot
# and exit. At 4 (the H200's run 7, a kernel-alone bench with fewer shared experts) gate_up kept ~2.4 working programs
# a SM on an H100; at 8 its K split goes 2 -> 3 (down unchanged): H100, session 27, in the step (ab_step, 3 rounds)
# the 122B's M = 3 verify graph 4.538 against 4.758 ms, every round; 12 (down split too) 4.561; one row unchanged; the
# 35B-A3B's M = 3 the same at 8 (2.834 against 2.836), +0.07 at 12; session 28 (the same A/B back to 4): 4.565 against
# 4.764. The down kernel's own constant: its 48 column tiles keep no K split up to ~8.7 a SM; at 16 (a split of 2) the
# M = 3 graph was the same (session 28: -0.004 ms). With the one-buffer rows (ROWS_DEPTH, lighter programs) 12 a SM
# both kernels was again slower: H100, session 40, M = 3 graph +0.017 ms on the 122B, +0.024 on the 35B-A3B.
ROWS_PROGRAMS_PER_SM = 8.0
ROWS_DOWN_PROGRAMS_PER_SM = 8.0
# Weight steps in flight a warp at 2-4 rows (both kernels) over block-repacked weights: one, as at one row (tc_groups'
# DEPTH=1 loop; fewer registers a program). H100, session 39 (ab_step, 3 rounds, every round faster): the M = 3
# verify graph 4.446 against 4.492 ms on the 122B (again: 4.394 against 4.457), 2.755 against 2.879 on the 35B-A3B;
# one row unchanged. One-warp programs at 16 a SM (the same warps a SM) were -0.017 / -0.134 with it and
# -0.013 / 0.000 without: not taken. Session 40 again: depth 2 +0.069 ms (122B), +0.126 (35B-A3B). In GPTQ order
# (ROOFLINE_INT4_QBLK=0) the two-buffer loop stays: there it read 4.472 against 4.512 ms, faster in 2 of 3 rounds.
# ab_step's `experts-rows-depth-2` puts the two-buffer loop back; ROOFLINE_INT4_DEPTH=2 does too, everywhere.
ROWS_DEPTH = 1
# The one-row configs (the H200 sweeps in _tc_expert_config's docstring, of each kernel alone). In the step on an H100
# (session 28, ab_step, 3 rounds, one-row graph 3.556 ms) their neighbours were no faster: gate_up's K split 6 +0.008,
# 12 +0.096; down at 4 a SM (no split) +0.088, 16 (split 3) -0.012, inside the rounds' 0.04 ms spread.
ONE_ROW_GATE_UP_SPLIT = 8
ONE_ROW_DOWN_PROGRAMS_PER_SM = 8.0
# The one-row gate_up's split sum stays on the [32 WN, 4] tile (a quarter of its lanes hold the row): summed on every
# lane instead, as int4_tc.ONE_ROW_FLAT_SUM does for the INT4 GEMVs, it measured -0.016 / -0.018 ms in the one-row
# step (H100, sessions 28-29, ab_step, 3 then 5 rounds; one round of 8 slower), inside the drift the untouched M = 3
# graph showed (-0.010 / -0.028): not adopted; removed in session 29 (built in d2e6a6d).


def _tc_expert_config(t: int, config: dict | None, down: bool = False) -> dict:
    """H200 sweeps: down at T=1 fastest with 1-warp programs, 8 per SM (run 3a: 9.9 us vs 11.6 on 2 warps);
    gate_up at T=1 on 1-warp programs with K split 8 (run 13, block-repacked, one-buffer loop: 12.72 us against
    14.17 on 2 warps at 4 per SM, split 5), from two tokens on 2 warps (run 7, T=4, with x loaded one step ahead:
    28.6 us vs 32.3 on 4 warps); down at T >= 2 on 2 warps; at T >= 2 ROWS_PROGRAMS_PER_SM / ROWS_DOWN_PROGRAMS_PER_SM
    programs a SM, ROWS_DEPTH weight steps in flight over block-repacked weights (config["qblk"])."""
    cfg = dict(default_tc_config(t, 0, 0))
    if not INTERPRET:
        if down:
            cfg = {"WN": 1, "KW": 1, "programs_per_sm": ONE_ROW_DOWN_PROGRAMS_PER_SM} if t == 1 else \
                {"WN": 2, "KW": 1, "programs_per_sm": ROWS_DOWN_PROGRAMS_PER_SM}
        elif one_buffer_loop(t):
            cfg = {"WN": 1, "KW": 1, "SPLIT_K": ONE_ROW_GATE_UP_SPLIT}
        else:
            cfg = {"WN": 2, "KW": 1, "programs_per_sm": ROWS_PROGRAMS_PER_SM}
        # one_buffer_loop(1) is false only under ROOFLINE_INT4_DEPTH=2, which keeps the two-buffer loop everywhere
        rows_one_buffer = ROWS_DEPTH == 1 and one_buffer_loop(1) and (config or {}).get("qblk")
        if one_buffer_loop(t) or rows_one_buffer:
            cfg["depth"] = 1
    cfg.update(config or {})
    return cfg


def _tc_path(x, n: int, k: int, group_size: int, t: int, config, weights, down: bool = False) -> bool:
    """Whether the experts take the int4_tc path: up to 16 tokens (chunks of 8), its shape and alignment rules
    (int4_tc.tc_supported), and per-expert strides that keep 16-byte alignment (Triton specialises
    integer arguments divisible by 16)."""
    if not use_tc(config) or t > 16 or not x.is_contiguous() or any(w[0].numel() % 16 for w in weights):
        return False
    return tc_supported(x, n, k, group_size, _tc_expert_config(t, config, down)["WN"], weights)


def _tc_chunk(t: int) -> int:
    return min(8, next_pow2(t))


def _experts_gate_up_tc(x, ids, qweight, qzeros, scales, sym, out, config, counters):
    t, k = x.shape
    topk = ids.shape[1]
    inter = qweight.shape[-1] // 2
    cfg = _tc_expert_config(t, config)
    ch = _tc_chunk(t)
    chunks = triton.cdiv(t, ch)
    slots = ch * topk
    tiles, split, gps = tc_geometry(inter, k, cfg, x.device, tiles_extra=t * topk)
    act = torch.empty(t, topk, inter, dtype=x.dtype, device=x.device) if out is None else out
    ws = torch.empty(split if split > 1 else 1, t * topk, 2, inter, dtype=torch.float32, device=x.device)
    cnt = counters if counters is not None else counters_for("experts_gate_up_tc", tiles * chunks * slots, x.device)
    _gate_up_tc_kernel[(tiles, t * topk, split)](
        x.contiguous().view(torch.int32), ids.contiguous(), qweight, qzeros, scales, act, ws, cnt,
        t, k // 2, inter, k // GROUP, gps, qweight[0].numel(), qzeros[0].numel(), scales[0].numel(),
        TOPK=topk, TOPKP=next_pow2(topk), CH=ch, WN=cfg["WN"], KW=cfg["KW"], SYM=bool(sym),
        BF16=x.dtype == torch.bfloat16, SPLIT_K=split, SPLITP=max(4, next_pow2(split)), EMULATE=INTERPRET,
        QBLK=bool(cfg.get("qblk")), DEPTH=cfg.get("depth", 2), num_warps=cfg["WN"] * cfg["KW"], num_stages=1,
        **launch_options(cfg), **pdl_options(x.device),
    )
    return act


def _experts_down_tc(act, ids, weights, qweight, qzeros, scales, sym, out, config, counters, extra):
    t, topk, inter = act.shape
    h = qweight.shape[-1]
    cfg = _tc_expert_config(t, config, down=True)
    ch = _tc_chunk(t)
    chunks = triton.cdiv(t, ch)
    slots = ch * topk
    tiles, split, gps = tc_geometry(h, inter, cfg, act.device, tiles_extra=t * topk)
    if out is None:
        out = torch.empty(t, h, dtype=act.dtype, device=act.device)
    ws = torch.empty(split, t * topk, h, dtype=torch.float32, device=act.device)
    cnt = counters if counters is not None else counters_for("experts_down_tc", tiles * chunks, act.device)
    _down_tc_kernel[(tiles, t * topk, split)](
        act.contiguous().view(torch.int32), ids.contiguous(), weights.contiguous(), qweight, qzeros, scales, out, ws,
        cnt, *extra.args(out), t, inter // 2, h, inter // GROUP, gps, qweight[0].numel(), qzeros[0].numel(), scales[0].numel(),
        TOPK=topk, TOPKP=next_pow2(topk), CH=ch, WN=cfg["WN"], KW=cfg["KW"], SYM=bool(sym),
        BF16=act.dtype == torch.bfloat16, SPLIT_K=split, SPLITP=next_pow2(split), EMULATE=INTERPRET, **extra.flags(),
        QBLK=bool(cfg.get("qblk")), DEPTH=cfg.get("depth", 2), num_warps=cfg["WN"] * cfg["KW"], num_stages=1,
        **launch_options(cfg),
        **pdl_options(act.device),
    )
    return out
