"""INT4 GEMV on the tensor cores with 16-bit dequantisation: the decode fast path (CUDA, x in bf16/fp16).

Reads the published GPTQ layout as it is (no repack; see roofline.quant.int4):
  qweight int32 [K/8, N], qzeros int32 [K/g, N/8], scales fp16 [K/g, N], group g = 128.

Why: the per-lane FMA path (int4_gemv.int4_group_dot) spends ~36 instructions per packed int32
(8 weights), which caps it well under the memory bandwidth. Here a packed word costs ~14:

- Unpack, two weights per instruction: `((w >> 4i) & 0x000F000F) | MAGIC` read as two 16-bit
  floats is (MB + q_i, MB + q_{i+4}) exactly (MB = 128 for bf16, 1024 for fp16): 3 shifts and 4
  LOP3 per word.
- Multiply on the tensor cores, `mma.sync.m16n8k16` with fp32 accumulation: 16 weight columns x
  16 k as the A operand, x as B (16 k x 8 token columns; up to 8 tokens, absent ones discarded).
  Two packed words (two columns, 8 k each) are exactly one thread's A fragment for two mma
  k-halves, so the unpacked pairs go straight into the mma registers: no shared-memory round
  trip, no register copies (checked in the SASS: 14 instructions per packed word in the loop).
- The bias MB + zero is not subtracted per weight: sum_k (MB + q) x = sum_k (q - zero) x +
  (MB + zero) sum_k x, and sum_k x over the group comes from one extra mma with A = ones per
  k-half (shared by all column tiles). Per group and column: y += scale * (acc - (MB + zero) *
  sum_x), two FMAs. Products are exact (16-bit x 16-bit in fp32); the cancellation costs a few
  of fp32's 24 bits.

How the data meets the mma fragments without a repack. The weights of one step (a quantisation
group per warp row) are loaded as four [L, 4] int32 tensors (k-steps s = 0..3), L = 32 warps:
row l = lane 4 g + t of warp w holds packed row 16 * group(w) + 4 s + t, columns
colbase + 32 wn + 4 g + v. Triton's coalescing gives a 2-D tile with one 4-wide contiguous axis
the blocked layout sizePerThread [1, 4] (one 16-byte vector), 32 lanes along l: lane l % 32 holds
row l, i.e. t = lane & 3 and g = lane >> 2, mma's (threadID_in_group, groupID). All threads
with the same t hold the same packed row, so mma k-slots {2t, 2t+1, 2t+8, 2t+9} map to one set of
k for the whole warp (nibbles (0, 4), (1, 5) for the first k-half, (2, 6), (3, 7) for the second);
tile p takes words 2p (A row g) and 2p + 1 (A row g + 8). The C fragment of lane (g, t) then holds
its own columns for tokens 2t and 2t + 1. x is loaded as raw 32-bit words in the same shape
(row l: words 4 kp + w of token g) and paired into (x_j, x_{j+4}) by PRMT. (A first version
loaded one 5-D [4, KW, G, 4, 4] tile; triton 3.6 breaks ties between equally non-contiguous axes
the other way from 3.9 and put the lanes along s: wrong results on the H200, run 3.) The GPU
tests compare with the reference, and tests/test_kernels.py runs the
generated PTX through a lane-level simulator (`simulate_group_asm`) against the plain formula.

Under TRITON_INTERPRET=1 (no inline assembly) `emulate_group` computes the same per-element
result in plain Triton, so the CPU tests cover the loads, the column map, split-K and the
experts' routing; the asm itself is covered by the simulator test and the GPU tests.

Portability: plain PTX (mma.sync m16n8k16 bf16/f16, lop3, prmt), sm_80 and newer (H200 sm_90,
DGX Spark sm_121); registers only, no shared memory beyond Triton's cross-warp reduction.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, MAX_ROWS, arrive, counters_for, decode_rows, next_pow2, pdl_options, reset, sm_count,
                      sum_splits, wait_for_inputs)

GROUP = 128  # the path handles group size 128 (the published checkpoints); others use int4_gemv's lanes path
SUMSQ_ROWS = tl.constexpr(MAX_ROWS)  # the row stride of int4_matmul_residual's per-tile sums of squares


def _gen_asm(bf16: bool) -> str:
    """PTX for one thread and one quantisation group: 4 k-steps x 2 weight tiles x 2 k-halves, then the epilogue.

    mma.m16n8k16 with the weights as A (16 columns x 16 k) and x as B (16 k x 8 tokens). Thread
    (g, t) = (lane >> 2, lane & 3) holds, per k-step s, words v = 0..3 of packed row 4 s + t at
    columns 4 gi + v. Tile p takes words 2p (A row g) and 2p + 1 (A row g + 8); k-half h takes
    nibble pairs (2h, 2h + 4) and (2h + 1, 2h + 5), so the A quad is four fresh LOP3 results and
    the B pair two PRMTs of x: no register copies. C row g / g + 8 is the thread's own column
    4 gi + 2p / + 1; C columns are tokens 2t and 2t + 1.

    Operands (pack=4: each tensor argument gives the thread's 4 elements v of one 16-byte vector):
      $0..$7   y0, y1 out (tied to $48..$55): $(4h + v) is token 2t + h at the thread's column v
      $8..$23  q0..q3: $(8 + 4s + v) the packed word of k-step s (packed row 4 s + t), column v
      $24..$39 x0..x3: $(24 + 4s + w) raw 32-bit word w of x at packed row 4 s + t, token g
      $40..$43 scale of column v; $44..$47 -(MB + zero) of column v
    """
    magic = "0x43004300" if bf16 else "0x64006400"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    ty = "bf16" if bf16 else "f16"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    zero4 = "{0f00000000, 0f00000000, 0f00000000, 0f00000000}"
    lines = [
        "{",
        ".reg .b32 rw<3>, rp<32>, rb<16>, ro<4>;",
        ".reg .f32 rc<8>, rs<4>, rt;",
    ] + [f"mov.b32 ro{i}, {one};" for i in range(4)]
    for s in range(4):
        x = [f"${24 + 4 * s + w}" for w in range(4)]
        b = [f"rb{4 * s + i}" for i in range(4)]
        lines += [
            f"prmt.b32 {b[0]}, {x[0]}, {x[2]}, 0x5410;",  # (x0, x4)
            f"prmt.b32 {b[1]}, {x[0]}, {x[2]}, 0x7632;",  # (x1, x5)
            f"prmt.b32 {b[2]}, {x[1]}, {x[3]}, 0x5410;",  # (x2, x6)
            f"prmt.b32 {b[3]}, {x[1]}, {x[3]}, 0x7632;",  # (x3, x7)
        ]
        b_lo = f"{{{b[0]}, {b[1]}}}"
        b_hi = f"{{{b[2]}, {b[3]}}}"
        sx = "{rs0, rs1, rs2, rs3}"
        ones = "{ro0, ro1, ro2, ro3}"
        lines += [
            f"{mma} {sx}, {ones}, {b_lo}, {zero4 if s == 0 else sx};",
            f"{mma} {sx}, {ones}, {b_hi}, {sx};",
        ]
        p = {}
        for v in range(4):
            q = f"${8 + 4 * s + v}"
            r = [f"rp{8 * (s % 2) + 4 * v + i}" for i in range(4)]  # (q0,q4), (q1,q5), (q2,q6), (q3,q7)
            p[v] = r
            lines += [
                f"shr.u32 rw0, {q}, 4;",
                f"shr.u32 rw1, {q}, 8;",
                f"shr.u32 rw2, {q}, 12;",
                f"lop3.b32 {r[0]}, {q}, 0x000F000F, {magic}, 0xEA;",
                f"lop3.b32 {r[1]}, rw0, 0x000F000F, {magic}, 0xEA;",
                f"lop3.b32 {r[2]}, rw1, 0x000F000F, {magic}, 0xEA;",
                f"lop3.b32 {r[3]}, rw2, 0x000F000F, {magic}, 0xEA;",
            ]
        for tile in range(2):
            w0, w1 = p[2 * tile], p[2 * tile + 1]
            c = f"{{rc{4 * tile}, rc{4 * tile + 1}, rc{4 * tile + 2}, rc{4 * tile + 3}}}"
            a_lo = f"{{{w0[0]}, {w1[0]}, {w0[1]}, {w1[1]}}}"  # k slots (2t, 2t+1) = nibbles (0, 4); (2t+8, 2t+9) = (1, 5)
            a_hi = f"{{{w0[2]}, {w1[2]}, {w0[3]}, {w1[3]}}}"
            lines += [
                f"{mma} {c}, {a_lo}, {b_lo}, {zero4 if s == 0 else c};",
                f"{mma} {c}, {a_hi}, {b_hi}, {c};",
            ]
    for v in range(4):
        tile, row = divmod(v, 2)
        for h in range(2):
            e = 4 * h + v
            lines += [
                f"fma.rn.f32 rt, ${44 + v}, rs{h}, rc{4 * tile + 2 * row + h};",  # acc - (MB + zero) * sum_x
                f"fma.rn.f32 ${e}, ${40 + v}, rt, ${e};",  # y += scale * (...)
            ]
    lines.append("}")
    return "\n".join(lines)


ASM_BF16 = tl.constexpr(_gen_asm(True))
ASM_F16 = tl.constexpr(_gen_asm(False))
ASM_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 32 + ["f"] * 8 + [str(i) for i in range(8)]))


@triton.jit
def _asm_group(q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1, BF16: tl.constexpr):
    args = [q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1]
    if BF16:
        return tl.inline_asm_elementwise(ASM_BF16, ASM_CONSTRAINTS, args, dtype=(tl.float32, tl.float32), is_pure=True,
                                         pack=4)
    else:
        return tl.inline_asm_elementwise(ASM_F16, ASM_CONSTRAINTS, args, dtype=(tl.float32, tl.float32), is_pure=True,
                                         pack=4)


@triton.jit
def _x_half(words, j: tl.constexpr, BF16: tl.constexpr):
    """Element j (0..7) of the 8 16-bit x values held as 4 raw words along the last axis (of 4), as fp32."""
    w4 = tl.arange(0, 4)[None, None, None, :]
    wd = tl.sum(tl.where(w4 == j // 2, words, 0), axis=3)
    bits = (wd >> (16 * (j % 2))) & 0xFFFF
    if BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _emulate_step(q, xw, c0, c1, sx0, sx1, MB: tl.constexpr, BF16: tl.constexpr, W: tl.constexpr):
    """One k-step of `emulate_group`: lane (g, t) of warp w holds q and x words at [w * 32 + 4 g + t, v]."""
    hh = tl.arange(0, 2)[None, None, :, None]
    qq = tl.reshape(q, [W, 8, 4, 4])  # (w, g, t', v)
    xx = tl.reshape(xw, [W, 8, 4, 4])  # (w, g' = token, t', word)
    for j in tl.static_range(8):
        xj = tl.reshape(_x_half(xx, j, BF16), [W, 4, 2, 4])  # (w, t, h, t'): token 2t + h
        x0 = tl.sum(tl.where(hh == 0, xj, 0.0), axis=2)  # (w, t, t')
        x1 = tl.sum(tl.where(hh == 1, xj, 0.0), axis=2)
        nib = ((qq >> (4 * j)) & 0xF).to(tl.float32) + MB  # (w, g, t', v)
        wb = nib[:, :, None, :, :]  # (w, g, 1, t', v)
        c0 += tl.sum(wb * x0[:, None, :, :, None], axis=3)  # (w, g, t, v)
        c1 += tl.sum(wb * x1[:, None, :, :, None], axis=3)
        sx0 += tl.sum(x0, axis=2)  # (w, t)
        sx1 += tl.sum(x1, axis=2)
    return c0, c1, sx0, sx1


@triton.jit
def emulate_group(q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1, MB: tl.constexpr, BF16: tl.constexpr, L: tl.constexpr):
    """What `_asm_group` computes, element by element, in plain Triton (for the interpreter).

    y_h[w * 32 + 4 g + t, v] += scale * sum over the group of (q - zero) * x[token 2t + h] at the
    column of word v of lane (g, t): the x of token 2t + h is the one loaded by lane group 2t + h.
    """
    W: tl.constexpr = L // 32
    c0 = tl.zeros([W, 8, 4, 4], dtype=tl.float32)
    c1 = tl.zeros([W, 8, 4, 4], dtype=tl.float32)
    sx0 = tl.zeros([W, 4], dtype=tl.float32)
    sx1 = tl.zeros([W, 4], dtype=tl.float32)
    c0, c1, sx0, sx1 = _emulate_step(q0, x0, c0, c1, sx0, sx1, MB, BF16, W)
    c0, c1, sx0, sx1 = _emulate_step(q1, x1, c0, c1, sx0, sx1, MB, BF16, W)
    c0, c1, sx0, sx1 = _emulate_step(q2, x2, c0, c1, sx0, sx1, MB, BF16, W)
    c0, c1, sx0, sx1 = _emulate_step(q3, x3, c0, c1, sx0, sx1, MB, BF16, W)
    s4 = tl.reshape(sc, [W, 8, 4, 4])
    n4 = tl.reshape(nb, [W, 8, 4, 4])
    y0 += tl.reshape(s4 * (c0 + n4 * sx0[:, None, :, None]), [L, 4])
    y1 += tl.reshape(s4 * (c1 + n4 * sx1[:, None, :, None]), [L, 4])
    return y0, y1


@triton.jit
def _neg_bias(grp, qz_ptr, col, N, MB: tl.constexpr, SYM: tl.constexpr):
    """-(MB + zero) of each column, [L, 4] fp32."""
    if SYM:
        return tl.full(col.shape, -(MB + 8.0), tl.float32)
    else:
        zw = tl.load(qz_ptr + grp * (N // 8) + col // 8)
        return -(MB + 1.0) - ((zw >> (col % 8 * 4)) & 0xF).to(tl.float32)


@triton.jit
def _group_math(q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1, MB: tl.constexpr, BF16: tl.constexpr,
                L: tl.constexpr, EMULATE: tl.constexpr):
    if EMULATE:
        return emulate_group(q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1, MB, BF16, L)
    elif EMULATE is None:  # benchmark probe: the same loads, almost no math (what the access pattern alone costs)
        mix = (q0 ^ q1 ^ q2 ^ q3 ^ x0 ^ x1 ^ x2 ^ x3).to(tl.float32)
        return y0 + mix * sc, y1 + nb
    else:
        return _asm_group(q0, q1, q2, q3, x0, x1, x2, x3, sc, nb, y0, y1, BF16)


@triton.jit
def lane_index(WN: tl.constexpr, KW: tl.constexpr):
    """(g, t, wn, kw) of each row l of an [L, 4] tile, L = 32 WN KW: lane l % 32 = 4 g + t of warp l // 32 = kw WN + wn."""
    L: tl.constexpr = 32 * WN * KW
    l = tl.arange(0, L)[:, None]
    lane = l % 32
    w = l // 32
    return lane // 4, lane % 4, w % WN, w // WN


@triton.jit
def _load_weights(qp, sp, q2, col2, R4, mask, DUAL: tl.constexpr):
    """One k-step's weight words (4 [L, 4] tensors) and scales, and with DUAL the up half's (else aliases)."""
    q0 = tl.load(qp, mask=mask)
    q1 = tl.load(qp + R4, mask=mask)
    q2_ = tl.load(qp + 2 * R4, mask=mask)
    q3 = tl.load(qp + 3 * R4, mask=mask)
    s = tl.load(sp, mask=mask)
    if DUAL:
        return (q0, q1, q2_, q3, s, tl.load(qp + q2, mask=mask), tl.load(qp + q2 + R4, mask=mask),
                tl.load(qp + q2 + 2 * R4, mask=mask), tl.load(qp + q2 + 3 * R4, mask=mask), tl.load(sp + col2, mask=mask))
    else:
        return q0, q1, q2_, q3, s, q0, q1, q2_, q3, s


@triton.jit
def _load_x(xp, mask):
    """One k-step's x words, [L, 4] x 4."""
    return tl.load(xp, mask=mask), tl.load(xp + 16, mask=mask), tl.load(xp + 32, mask=mask), tl.load(xp + 48, mask=mask)


@triton.jit
def _head_parts(row_ptr, grp, mask, gs_hg, ON: tl.constexpr, GS_NVB: tl.constexpr):
    """The partial sums of squares of the head holding group grp ([L, 1]; gs_hg groups a head) in the token rows at
    row_ptr ([L, 1]: each lane's row of gdn_decode(defer_norm=True)'s [rows, heads, GS_NVB] fp32), added into [L, 4]
    (the weights' tile shape, so Triton keeps the asm operands' layout: an [L, 8] load moved them off it); 0.0 when
    not ON."""
    if ON:
        v = tl.arange(0, 4)[None, :]
        base = row_ptr + (grp // gs_hg) * GS_NVB
        parts = tl.load(base + v, mask=mask & (v < GS_NVB), other=0.0)
        for c in tl.static_range(4, GS_NVB, 4):
            parts += tl.load(base + c + v, mask=mask, other=0.0)
        return parts
    else:
        return 0.0


@triton.jit
def _rstd(parts, gs_dv, gs_eps):
    return tl.rsqrt(tl.sum(parts, axis=1)[:, None] / gs_dv + gs_eps)


@triton.jit
def _step_math(q0, q1, q2, q3, s, u0, u1, u2, u3, su, x0, x1, x2, x3, grp, qz_ptr, col, col2, N, y0, y1, w0, w1,
               MB: tl.constexpr, SYM: tl.constexpr, BF16: tl.constexpr, DUAL: tl.constexpr, L: tl.constexpr,
               EMULATE: tl.constexpr, p0=0.0, p1=0.0, gs_dv=1, gs_eps=0.0, GS: tl.constexpr = 0):
    """One k-step (group grp of each warp row) into (y0, y1) and with DUAL the up half into (w0, w1). With GS each
    token row's products are scaled by its head's rstd from the parts p0 (rows 2t) and p1 (rows 2t + 1, GS == 2;
    `_head_parts`): one row folds it into the scale, several rows take the group's products apart first."""
    s = s.to(tl.float32)
    nb = _neg_bias(grp, qz_ptr, col, N, MB, SYM)
    if GS == 1:
        y0, y1 = _group_math(q0, q1, q2, q3, x0, x1, x2, x3, s * _rstd(p0, gs_dv, gs_eps), nb, y0, y1, MB, BF16, L,
                             EMULATE)
    elif GS == 2:
        g0, g1 = _group_math(q0, q1, q2, q3, x0, x1, x2, x3, s, nb, tl.zeros_like(y0), tl.zeros_like(y1), MB, BF16, L,
                             EMULATE)
        y0 += g0 * _rstd(p0, gs_dv, gs_eps)
        y1 += g1 * _rstd(p1, gs_dv, gs_eps)
    else:
        y0, y1 = _group_math(q0, q1, q2, q3, x0, x1, x2, x3, s, nb, y0, y1, MB, BF16, L, EMULATE)
    if DUAL:
        w0, w1 = _group_math(u0, u1, u2, u3, x0, x1, x2, x3, su.to(tl.float32),
                             _neg_bias(grp, qz_ptr, col + col2, N, MB, SYM), w0, w1, MB, BF16, L, EMULATE)
    return y0, y1, w0, w1


@triton.jit
def _steps_one_ahead(qp, sp, xp, q2, col2, R4, QSTEP, SSTEP, XSTEP: tl.constexpr, g_start, g_end, kw, qz_ptr, col, N,
                     y0, y1, u0, u1, MB: tl.constexpr, SYM: tl.constexpr, BF16: tl.constexpr, DUAL: tl.constexpr,
                     L: tl.constexpr, EMULATE: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr,
                     gs0=None, gs1=None, gs_hg=1, gs_dv=1, gs_eps=0.0, GS: tl.constexpr = 0,
                     GS_NVB: tl.constexpr = 1):
    """tc_groups' loop with DEPTH=1: one register buffer; the next step's weights and x load during this step's math."""
    ga = g_start + kw
    q0, q1, q2_, q3, s, v0, v1, v2, v3, sv = _load_weights(qp, sp, q2, col2, R4, ga < g_end, DUAL)
    wait_for_inputs(PDL)  # the first step's weights are in flight; x comes from the previous kernel
    x0, x1, x2, x3 = _load_x(xp, ga < g_end)
    p0 = _head_parts(gs0, ga, ga < g_end, gs_hg, GS > 0, GS_NVB)
    p1 = _head_parts(gs1, ga, ga < g_end, gs_hg, GS > 1, GS_NVB)
    for g0 in range(g_start, g_end, KW):
        ga = g0 + kw
        y0, y1, u0, u1 = _step_math(q0, q1, q2_, q3, s, v0, v1, v2, v3, sv, x0, x1, x2, x3, ga, qz_ptr, col, col2, N,
                                    y0, y1, u0, u1, MB, SYM, BF16, DUAL, L, EMULATE, p0, p1, gs_dv, gs_eps, GS)
        qp += QSTEP
        sp += SSTEP
        xp += XSTEP
        q0, q1, q2_, q3, s, v0, v1, v2, v3, sv = _load_weights(qp, sp, q2, col2, R4, ga + KW < g_end, DUAL)
        x0, x1, x2, x3 = _load_x(xp, ga + KW < g_end)
        p0 = _head_parts(gs0, ga + KW, ga + KW < g_end, gs_hg, GS > 0, GS_NVB)
        p1 = _head_parts(gs1, ga + KW, ga + KW < g_end, gs_hg, GS > 1, GS_NVB)
    return y0, y1, u0, u1


@triton.jit
def _steps_two_ahead(qp, sp, xp, q2, col2, R4, QSTEP, SSTEP, XSTEP: tl.constexpr, g_start, g_end, kw, qz_ptr, col, N,
                     y0, y1, u0, u1, MB: tl.constexpr, SYM: tl.constexpr, BF16: tl.constexpr, DUAL: tl.constexpr,
                     L: tl.constexpr, EMULATE: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr,
                     gs0=None, gs1=None, gs_hg=1, gs_dv=1, gs_eps=0.0, GS: tl.constexpr = 0,
                     GS_NVB: tl.constexpr = 1):
    """tc_groups' loop with DEPTH=2: two register buffers A and B, each refilled two steps ahead (see tc_groups)."""
    grp = g_start + kw  # [L, 1] group of each warp row in the first step
    qa0, qa1, qa2, qa3, sa, ua0, ua1, ua2, ua3, sua = _load_weights(qp, sp, q2, col2, R4, grp < g_end, DUAL)
    qb0, qb1, qb2, qb3, sb, ub0, ub1, ub2, ub3, sub = _load_weights(qp + QSTEP, sp + SSTEP, q2, col2, R4,
                                                                    grp + KW < g_end, DUAL)
    wait_for_inputs(PDL)  # the first steps' weights are in flight; x comes from the previous kernel
    xa0, xa1, xa2, xa3 = _load_x(xp, grp < g_end)
    pa0 = _head_parts(gs0, grp, grp < g_end, gs_hg, GS > 0, GS_NVB)
    pa1 = _head_parts(gs1, grp, grp < g_end, gs_hg, GS > 1, GS_NVB)
    for g0 in range(g_start, g_end, 2 * KW):
        ga = g0 + kw  # [L, 1] group of each warp row in buffer A's step; B's is + KW
        # buffer A (step g0, always present): x of the next step, the math, the buffer refilled two steps ahead
        xb0, xb1, xb2, xb3 = _load_x(xp + XSTEP, ga + KW < g_end)
        pb0 = _head_parts(gs0, ga + KW, ga + KW < g_end, gs_hg, GS > 0, GS_NVB)
        pb1 = _head_parts(gs1, ga + KW, ga + KW < g_end, gs_hg, GS > 1, GS_NVB)
        y0, y1, u0, u1 = _step_math(qa0, qa1, qa2, qa3, sa, ua0, ua1, ua2, ua3, sua, xa0, xa1, xa2, xa3, ga, qz_ptr,
                                    col, col2, N, y0, y1, u0, u1, MB, SYM, BF16, DUAL, L, EMULATE, pa0, pa1, gs_dv,
                                    gs_eps, GS)
        qa0, qa1, qa2, qa3, sa, ua0, ua1, ua2, ua3, sua = _load_weights(qp + 2 * QSTEP, sp + 2 * SSTEP, q2, col2, R4,
                                                                        ga + 2 * KW < g_end, DUAL)
        # buffer B (step g0 + KW)
        xa0, xa1, xa2, xa3 = _load_x(xp + 2 * XSTEP, ga + 2 * KW < g_end)
        pa0 = _head_parts(gs0, ga + 2 * KW, ga + 2 * KW < g_end, gs_hg, GS > 0, GS_NVB)
        pa1 = _head_parts(gs1, ga + 2 * KW, ga + 2 * KW < g_end, gs_hg, GS > 1, GS_NVB)
        if g0 + KW < g_end:
            y0, y1, u0, u1 = _step_math(qb0, qb1, qb2, qb3, sb, ub0, ub1, ub2, ub3, sub, xb0, xb1, xb2, xb3, ga + KW,
                                        qz_ptr, col, col2, N, y0, y1, u0, u1, MB, SYM, BF16, DUAL, L, EMULATE, pb0,
                                        pb1, gs_dv, gs_eps, GS)
        qb0, qb1, qb2, qb3, sb, ub0, ub1, ub2, ub3, sub = _load_weights(qp + 3 * QSTEP, sp + 3 * SSTEP, q2, col2, R4,
                                                                        ga + 3 * KW < g_end, DUAL)
        qp += 2 * QSTEP
        sp += 2 * SSTEP
        xp += 2 * XSTEP
    return y0, y1, u0, u1


@triton.jit
def tc_groups(
    x32_ptr, xrow, qw_ptr, sc_ptr, qz_ptr, colbase, col2, N, g_start, g_end,
    WN: tl.constexpr, KW: tl.constexpr, SYM: tl.constexpr, BF16: tl.constexpr, DUAL: tl.constexpr,
    EMULATE: tl.constexpr, GROUPS=1, QBLK: tl.constexpr = False, PDL: tl.constexpr = False, DEPTH: tl.constexpr = 2,
    gs_ptr=None, gs_rows=1, gs_hg=1, gs_dv=1, gs_eps=0.0, GS: tl.constexpr = 0, GS_NVB: tl.constexpr = 1,
):
    """Partial products over quantisation groups [g_start, g_end) for up to 8 token rows.

    Tiles are [L, 4] (L = 32 WN KW), row l = lane 4 g + t of warp kw WN + wn: 2-D with a 4-wide
    contiguous axis, so Triton's coalescing gives sizePerThread [1, 4], 32 lanes along l, warps
    along l, whatever its tie-breaking between axes (a 5-D version got a different lane order on
    triton 3.6 than on 3.9). Each k-step s of a group is its own tensor.

    x32_ptr: x as int32 words (two 16-bit values each); xrow [L, 1]: word offset of the x row of
    token g (any valid row where the token is absent). g_end - g_start must be a positive multiple
    of KW (warp row kw takes group g0 + kw of each step). Returns (y0, y1) [L, 4] fp32, tokens 2t
    and 2t + 1 at column colbase + 32 wn + 4 g + v (sum the KW warp rows), and with DUAL the same
    pair for columns + col2 (the up half of gate_up), sharing the x loads.

    PDL: wait for the previous kernel (`wait_for_inputs`) after the first steps' weight loads and
    before x's; callers whose weight addresses depend on its output wait before calling instead.

    Load pipeline: two steps of weights in flight per warp, in two register buffers A and B (the
    loop takes two steps an iteration; each buffer is reloaded two steps ahead right after its math,
    no register copies). x, an L2/L1 hit shared by every program, is loaded one step ahead only: in
    flight with its weights it took as many registers as they do (16 words a lane a step; 124
    registers a thread for the GEMV against 96 now). H200 run 7: in_proj_qkv M=1 9.1 us (was 11.9),
    out_proj 9.0 (9.6), experts down 8.5 (9.1). Four weight steps in flight (a ring of four buffers,
    145 registers) were slower in every configuration swept (11.5-11.9 us): fewer programs fit per
    SM. Loads past the end are masked off (no fill value: their registers are never used).

    DEPTH=1 (config "depth"; the default at one row, `INT4_DEPTH`): one buffer, each step's weights and x loaded one step
    ahead: fewer registers a program, so more programs fit per SM, like the loads-only probe that read
    in_proj_qkv at 0.72 of copy with ~6 small programs per SM and one step in flight (NOTES-kernels run 10c).
    Run 11b: faster at one row with 6 programs per SM, slower at four; run 12: -2% on the 122B step (see `INT4_DEPTH`).

    GS (1: one token row, 2: several): each token row's products of a group are scaled by the rstd of the GDN head
    that holds the group, summed from the partial sums of squares at gs_ptr ([gs_rows, heads, GS_NVB], gs_hg groups a
    head, gs_dv values a head, loaded with each step's x): the gated norm's rms that gdn_decode(defer_norm=True)
    leaves to its out projection.
    """
    MB: tl.constexpr = 128.0 if BF16 else 1024.0
    L: tl.constexpr = 32 * WN * KW
    g, t, wn, kw = lane_index(WN, KW)
    v = tl.arange(0, 4)[None, :]
    col = colbase + 32 * wn + 4 * g + v  # [L, 4] word columns, also the result columns
    grp = g_start + kw  # [L, 1]
    kp = grp * 16 + t  # packed row of k-step 0
    if QBLK:  # qweight in quant.int4.block_qweight's order: [N/32, K/128, 16, 32], one warp-step = 2 KB contiguous
        qp = qw_ptr + ((((colbase + 32 * wn) // 32) * GROUPS + grp) * 16 + t) * 32 + 4 * g + v
        R4 = 128
        QSTEP = 512 * KW
        q2 = (col2 // 32) * GROUPS * 512
    else:
        qp = qw_ptr + kp * N + col
        R4 = 4 * N  # one k-step: 4 packed rows
        QSTEP = 16 * KW * N
        q2 = col2
    xp = x32_ptr + xrow + kp * 4 + v
    sp = sc_ptr + grp * N + col
    SSTEP = KW * N
    XSTEP: tl.constexpr = 64 * KW
    y0 = tl.zeros([L, 4], dtype=tl.float32)
    y1 = tl.zeros([L, 4], dtype=tl.float32)
    u0 = tl.zeros([L, 4], dtype=tl.float32)
    u1 = tl.zeros([L, 4], dtype=tl.float32)
    gs0 = gs_ptr  # each lane's parts rows: tokens 2t (y0) and 2t + 1 (y1), absent ones on the last row
    gs1 = gs_ptr
    if GS == 2:
        row = (GROUPS // gs_hg) * GS_NVB
        gs0 = gs_ptr + tl.minimum(2 * t, gs_rows - 1) * row
        gs1 = gs_ptr + tl.minimum(2 * t + 1, gs_rows - 1) * row
    if DEPTH == 1:
        return _steps_one_ahead(qp, sp, xp, q2, col2, R4, QSTEP, SSTEP, XSTEP, g_start, g_end, kw, qz_ptr, col, N,
                                y0, y1, u0, u1, MB, SYM, BF16, DUAL, L, EMULATE, KW, PDL,
                                gs0, gs1, gs_hg, gs_dv, gs_eps, GS, GS_NVB)
    else:
        return _steps_two_ahead(qp, sp, xp, q2, col2, R4, QSTEP, SSTEP, XSTEP, g_start, g_end, kw, qz_ptr, col, N,
                                y0, y1, u0, u1, MB, SYM, BF16, DUAL, L, EMULATE, KW, PDL,
                                gs0, gs1, gs_hg, gs_dv, gs_eps, GS, GS_NVB)


@triton.jit
def sum_warp_rows(y, WN: tl.constexpr, KW: tl.constexpr):
    """[L, 4] -> [32 WN, 4]: the sum over the KW warp rows (row 32 wn + lane)."""
    if KW == 1:
        return y
    else:
        return tl.sum(tl.reshape(y, [KW, 32 * WN, 4]), axis=0)


@triton.jit
def out_index(colbase, WN: tl.constexpr):
    """(token slot of y0 (2t; y1: 2t + 1), column) of each element of a [32 WN, 4] result."""
    g, t, wn, kw = lane_index(WN, 1)
    v = tl.arange(0, 4)[None, :]
    return 2 * t, colbase + 32 * wn + 4 * g + v


@triton.jit
def _gemv_tc_kernel(
    x32_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K2, GROUPS, GPS,
    WN: tl.constexpr, KW: tl.constexpr, SYM: tl.constexpr, BF16: tl.constexpr,
    SPLIT_K, SPLITP: tl.constexpr, EMULATE: tl.constexpr, QBLK: tl.constexpr = False, PDL: tl.constexpr = False,
    DEPTH: tl.constexpr = 2, res_ptr=None, ss_ptr=None, RESIDUAL: tl.constexpr = False, ONE_ROW: tl.constexpr = False,
    gs_ptr=None, gs_hg=1, gs_dv=1, gs_eps=0.0, GS: tl.constexpr = 0, GS_NVB: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    colbase = pid_n * (32 * WN)
    g, t, wn, kw = lane_index(WN, KW)
    xrow = tl.minimum(g, M - 1) * K2  # [L, 1]: token g's row (the last row for absent tokens)
    g_start = pid_k * GPS
    g_end = tl.minimum(g_start + GPS, GROUPS)
    y0, y1, _, _ = tc_groups(x32_ptr, xrow, qw_ptr, sc_ptr, qz_ptr, colbase, 0, N, g_start, g_end,
                             WN, KW, SYM, BF16, False, EMULATE, GROUPS, QBLK, PDL, DEPTH,
                             gs_ptr, M, gs_hg, gs_dv, gs_eps, GS, GS_NVB)
    y0 = sum_warp_rows(y0, WN, KW)
    y1 = sum_warp_rows(y1, WN, KW)
    tok, col = out_index(colbase, WN)
    o0 = tok * N + col
    o1 = o0 + N
    m0 = tok < M
    m1 = tok + 1 < M
    if SPLIT_K == 1:
        _store_tile(out_ptr, res_ptr, ss_ptr, y0, y1, o0, o1, m0, m1, tok, pid_n, M, RESIDUAL)
    else:
        tl.store(ws_ptr + pid_k * M * N + o0, y0, mask=m0)
        tl.store(ws_ptr + pid_k * M * N + o1, y1, mask=m1)
        if arrive(cnt_ptr + pid_n, SPLIT_K):
            if ONE_ROW:  # one token row: every thread sums its column's partials, up to 32 splits' loads at once
                col1 = colbase + tl.arange(0, 32 * WN)[None, :]
                tok1 = tl.zeros_like(col1)
                t0 = sum_splits(ws_ptr, N, col1, col1 < N, SPLIT_K, SPLITP, ONE_ROW_SUM_CHUNK)
                _store_tile(out_ptr, res_ptr, ss_ptr, t0, tl.zeros_like(t0), col1, col1 + N, col1 < N, tok1 > 0, tok1,
                            pid_n, M, RESIDUAL)
            else:  # the partials of 4 splits at a time, loads together
                t0 = sum_splits(ws_ptr, M * N, o0, m0, SPLIT_K, SPLITP, 4)
                t1 = sum_splits(ws_ptr, M * N, o1, m1, SPLIT_K, SPLITP, 4)
                _store_tile(out_ptr, res_ptr, ss_ptr, t0, t1, o0, o1, m0, m1, tok, pid_n, M, RESIDUAL)
            reset(cnt_ptr + pid_n)


@triton.jit
def _store_tile(out_ptr, res_ptr, ss_ptr, y0, y1, o0, o1, m0, m1, tok, tile, M, RESIDUAL: tl.constexpr):
    """A column tile's final output (y0: token rows `tok`, y1: `tok` + 1). With RESIDUAL: out = residual + y, each
    rounded to the output dtype as the decoder layer's add is, and ss[tile, row] = the fp32 sum of squares of the
    row's out over the tile's columns (the next norm's partial sums, `int4_matmul_residual`)."""
    dt = out_ptr.dtype.element_ty
    if RESIDUAL:
        h0 = y0.to(dt) + tl.load(res_ptr + o0, mask=m0, other=0)
        h1 = y1.to(dt) + tl.load(res_ptr + o1, mask=m1, other=0)
        tl.store(out_ptr + o0, h0, mask=m0)
        tl.store(out_ptr + o1, h1, mask=m1)
        f0 = h0.to(tl.float32)
        f1 = h1.to(tl.float32)
        for j in tl.static_range(SUMSQ_ROWS):
            sq = tl.where(tok == j, f0 * f0, 0.0) + tl.where(tok + 1 == j, f1 * f1, 0.0)
            tl.store(ss_ptr + tile * SUMSQ_ROWS + j, tl.sum(tl.sum(sq, axis=1), axis=0), mask=j < M)
    else:
        tl.store(out_ptr + o0, y0.to(dt), mask=m0)
        tl.store(out_ptr + o1, y1.to(dt), mask=m1)


def tc_supported(x: torch.Tensor, n: int, k: int, group_size: int, wn: int = 1, tensors=()) -> bool:
    """The tensor-core path: CUDA sm_80+ (or the interpreter), x bf16/fp16, group 128, N a multiple of 32*WN and 16.

    Every pointer 16-byte aligned (x and `tensors`): the 16-byte vector loads that give the loaded
    tiles their mma-shaped layout need it (Triton specialises on pointer alignment). Metadata
    only, no sync.
    """
    if x.dtype not in (torch.bfloat16, torch.float16) or group_size != GROUP or k % GROUP or n % (32 * wn) or n % 16:
        return False
    if any(t.data_ptr() % 16 for t in (x, *tensors)):
        return False
    if INTERPRET:
        return True
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 8


# One-row calls (decode without MTP, and the MTP draft steps) take tc_groups' one-buffer loop (DEPTH=1), the GEMV at 6
# programs per SM. H200, 122B, context 0, alternating A/B (session 10, NOTES-kernels run 12): graph 3.278 / 3.282 ms
# against 3.344 / 3.349 with DEPTH=2 everywhere (-2%); the kernel sweep of run 11b had it faster at one row
# (in_proj_qkv 8.60 against 8.97 us, out_proj 7.99 / 8.13, experts gate_up 14.43 / 15.58, down 8.33 / 9.42).
# At four rows the same sweep split by width: the wide in_proj_qkv (96 column tiles) 10.36 us one-buffer at 6 per SM
# against 13.92 two-buffer (and 13.76 at the two per SM the M > 1 default takes), but out_proj (24 tiles) 11.95
# against 10.85 and the experts' gate_up 31.5 against 29.2. So GEMVs of 2..4 rows over weights of at least
# WIDE_TILES column tiles (the merged in_proj_qkv+z, 160; attention's q/k/v, 136: the verify step's widest GEMVs) take
# the one-buffer loop too (session 16; measured at four rows, block-repacked only). ROOFLINE_INT4_DEPTH=2 keeps the
# two-buffer loop at every row count; =one-row takes the one-buffer loop at one row only for the GEMVs (session 15's
# rule; the experts' rows follow int4_experts.ROWS_DEPTH: one-buffer over block-repacked weights since session 39). Since
# session 18 those GEMVs (>= NO_SPLIT_MIN_N columns) run without a K split at 2..4 rows (`no_split_config`, one
# buffer whatever ROOFLINE_INT4_DEPTH says), so the several-rows part here applies only with NO_SPLIT_MAX_ROWS lowered.
_DEPTH_ENV = os.environ.get("ROOFLINE_INT4_DEPTH", "1")
if _DEPTH_ENV not in ("1", "2", "one-row"):
    raise ValueError(f"ROOFLINE_INT4_DEPTH must be 1, 2 or one-row, got {_DEPTH_ENV!r}")
INT4_DEPTH = 2 if _DEPTH_ENV == "2" else 1
WIDE_TILES = 96 if _DEPTH_ENV == "1" else None  # 128-column tiles from which several rows take the one-buffer loop


# `kernel_floor.py` on the H200 (session 17) put a split-K arrival round at +1.25 us a kernel in a PDL chain (2.49
# against 1.24 us for an empty kernel; one atomic add a program instead: 1.22), and a stream with no split at 3.75 us
# for 8 MB against 4.37 split 8 ways. So the GEMVs of a verify step's 2..NO_SPLIT_MAX_ROWS rows over weights of
# >= NO_SPLIT_MIN_N columns (the merged GDN in_proj_qkv+z, attention's q/k/v; the mma takes up to 8 token columns at
# no extra cost) run one program per 32 columns over the whole K, its 4 warps splitting K and summing in the program
# (shared memory): no workspace, no arrival round. In the step (H100, session 18, benchmarks/ab_step.py, 122B, two
# rounds) the M = 3 verify graph 0.029 ms faster in both rounds. The same at one row (those GEMVs and the experts'
# gate_up at one token) was 0.086-0.094 ms slower at M = 1, and 8 warps along K 0.75 ms slower: both removed, one
# row keeps its split configs. ab_step's variant int4-split-verify sets NO_SPLIT_MAX_ROWS to 1 (no GEMV without the
# split: session 17's defaults) for the A/B.
NO_SPLIT_MAX_ROWS = 4
NO_SPLIT_MIN_N = 8192


def no_split_config(rows: int, n: int) -> dict | None:
    """The config without a K split across programs for a GEMV of `rows` rows and `n` columns, or None: 2 up to
    NO_SPLIT_MAX_ROWS rows and >= NO_SPLIT_MIN_N columns (see above)."""
    if not 2 <= rows <= NO_SPLIT_MAX_ROWS or n < NO_SPLIT_MIN_N:
        return None
    return {"WN": 1, "KW": 4, "SPLIT_K": 1, "depth": 1}


def one_buffer_loop(rows: int, n: int = 0) -> bool:
    """Whether a call on `rows` token rows of a weight with `n` output columns takes the one-buffer loop
    (`INT4_DEPTH`): every one-row call, and GEMVs of more rows over wide weights (`WIDE_TILES`). The experts
    kernels pass no width (their rows' loop: int4_experts.ROWS_DEPTH)."""
    if INT4_DEPTH != 1:
        return False
    return rows == 1 or (WIDE_TILES is not None and n >= WIDE_TILES * 128)


# The K split's last program at one token row sums each column's partials on all its threads, the loads of up to
# ONE_ROW_SUM_CHUNK splits at once, where the [32 WN, 4] tile of the multi-row layout leaves three quarters of its
# lanes masked and loads 4 splits at a time: H100, session 28 (ab_step, 122B, 3 rounds), the one-row graph 3.502
# against 3.548 ms (-0.045 to -0.077 a round); M = 3 unchanged. ab_step's `int4-one-row-tile-sum` turns it off.
ONE_ROW_FLAT_SUM = True
# 32 slots' loads whatever the split (most masked off at the input projections' ~6 splits): the chunk cut to the
# split's power of two was +0.007 ms at one row, slower in 4 of 5 rounds (H100, session 29, ab_step).
ONE_ROW_SUM_CHUNK = tl.constexpr(32)

# Programs per SM of int4_matmul_residual (the MoE models' out projections) at 2..4 rows, in place of
# default_tc_config's 2: H100, session 25 (ab_step, 122B, 3 rounds), 3 took the M = 3 verify graph 5.134 -> 5.068 ms
# (out_proj's K split 11 -> 16); at one row (6 a SM, split 32) 3 was 0.105 ms slower.
RESIDUAL_ROWS_PROGRAMS_PER_SM = 3.0


def default_tc_config(m: int, n: int, k: int) -> dict:
    """4 warps of 32 columns (128 columns a program), one group per warp-step; K split to ~4 programs per SM
    at one row, ~2 from two (H200 sweep, run 3a: in_proj_qkv M=4 13.5 us at 2 vs 14.1 at 4; out_proj
    M=4 12.2 vs 17.0; M=1 within 3%); ~6 in the one-buffer loop (`one_buffer_loop`). The verify rows' wide GEMVs
    without a K split (`no_split_config`)."""
    if INTERPRET:
        return {"WN": 1, "KW": 2, "num_warps": 2}
    no_split = no_split_config(m, n)
    if no_split:
        return no_split
    if one_buffer_loop(m, n):
        return {"WN": 4, "KW": 1, "programs_per_sm": 6.0, "depth": 1}
    return {"WN": 4, "KW": 1, "programs_per_sm": 4.0 if m == 1 else 2.0}


def tc_geometry(n: int, k: int, cfg: dict, device, tiles_extra: int = 1) -> tuple[int, int, int]:
    """(column tiles, K splits, groups per split); groups per split a multiple of KW (lowered to divide K's groups)."""
    tiles = n // (32 * cfg["WN"])
    groups = k // GROUP
    while groups % cfg["KW"]:  # every warp row must have a group in every step (the first loads are unmasked)
        cfg["KW"] //= 2
    kw = cfg["KW"]
    steps = triton.cdiv(groups, kw)
    split = cfg.get("SPLIT_K")
    if not split:
        target = int(sm_count(device) * cfg.get("programs_per_sm", 4.0))
        split = max(1, min(steps, -(-target // max(tiles * tiles_extra, 1))))
    gps = triton.cdiv(steps, split) * kw
    split = triton.cdiv(groups, gps)
    return tiles, split, gps


def int4_matmul_residual(x: torch.Tensor, qweight, qzeros, scales, residual: torch.Tensor, *, sym: bool,
                         config: dict | None = None, head_norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, sumsq): h = residual + x @ W^T (the decoder layer's add after its mixer's out projection, each rounded to
    x's dtype) and sumsq [column tiles, MAX_ROWS] fp32, each tile's sum of h^2 per row, from which the next GEMVs
    norm h on the fly (fp8_gemv.NormOnLoad). The tensor-core path only (`tc_supported`), else ValueError.
    `head_norm` = (parts, eps): see int4_matmul_tc."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    x2, lead = decode_rows(x, k, "int4_matmul_residual")
    cfg = default_tc_config(x2.shape[0], n, k)
    if x2.shape[0] > 1 and "programs_per_sm" in cfg:
        cfg["programs_per_sm"] = RESIDUAL_ROWS_PROGRAMS_PER_SM
    cfg.update(config or {})
    if not tc_supported(x2, n, k, GROUP, cfg["WN"], (qweight, qzeros, scales)):
        raise ValueError(f"int4_matmul_residual: [{n}, {k}] on {x2.shape[0]} {x.dtype} rows is not a tensor-core call")
    res = residual.reshape(x2.shape[0], n)
    if res.dtype != x.dtype or not res.is_contiguous():
        raise ValueError(f"int4_matmul_residual: the residual must be contiguous {x.dtype} [{x2.shape[0]}, {n}]")
    sumsq = torch.empty(n // (32 * cfg["WN"]), MAX_ROWS, dtype=torch.float32, device=x.device)
    h = int4_matmul_tc(x, qweight, qzeros, scales, sym=sym, config=cfg, epilogue=(res, sumsq), head_norm=head_norm)
    return h, sumsq


def head_norm_args(head_norm: tuple | None, m: int, k: int) -> dict:
    """The kernel arguments of `head_norm` = (parts, eps) for a GEMV of m rows over K = k (see int4_matmul_tc)."""
    if head_norm is None:
        return {}
    parts, eps = head_norm
    heads, nvb = (parts.shape[1], parts.shape[2]) if parts.dim() == 3 else (0, 0)
    dv = k // heads if heads else 0
    if (parts.dim() != 3 or parts.shape[0] != m or parts.dtype != torch.float32 or not parts.is_contiguous()
            or heads * dv != k or dv % GROUP or nvb & (nvb - 1)):
        raise ValueError(f"head_norm: parts must be contiguous fp32 [{m} rows, heads, blocks] (a power of two blocks, "
                         f"heads of a multiple of {GROUP} values, {k} in all); got {parts.dtype} {list(parts.shape)}")
    return dict(gs_ptr=parts, gs_hg=dv // GROUP, gs_dv=dv, gs_eps=eps, GS=1 if m == 1 else 2, GS_NVB=nvb)


def int4_matmul_tc(x: torch.Tensor, qweight, qzeros, scales, *, sym: bool, out=None, config: dict | None = None,
                   counters: torch.Tensor | None = None, epilogue: tuple | None = None,
                   head_norm: tuple | None = None) -> torch.Tensor:
    """y = x @ W^T on the tensor-core path (see tc_supported); x [..., K] with 1..4 rows. `epilogue` = (residual,
    sumsq): see int4_matmul_residual. `head_norm` = (parts, eps): x is a GDN layer's gated output with each head's
    rms left out (gdn_decode(defer_norm=True)), parts [rows, heads, blocks] fp32 its partial sums of squares; each
    row's products of a quantisation group are scaled by rsqrt(mean over its head + eps), so y = (x * rstd of each
    value's row and head) @ W^T, the norm finished where its output is read."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    x2, lead = decode_rows(x, k, "int4_matmul")
    m = x2.shape[0]
    norm_args = head_norm_args(head_norm, m, k)
    cfg = default_tc_config(m, n, k)
    cfg.update(config or {})
    tiles, split, gps = tc_geometry(n, k, cfg, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(split if split > 1 else 1, m, n, dtype=torch.float32, device=x.device)
    cnt = counters if counters is not None else counters_for("int4_gemv_tc", tiles, x.device)
    _gemv_tc_kernel[(tiles, split)](
        x2.view(torch.int32), qweight, qzeros, scales, out, ws, cnt, m, n, k // 2, k // GROUP, gps,
        WN=cfg["WN"], KW=cfg["KW"], SYM=bool(sym), BF16=x.dtype == torch.bfloat16, SPLIT_K=split,
        SPLITP=max(4, next_pow2(split)), EMULATE=None if cfg.get("probe_loads_only") else INTERPRET,
        QBLK=bool(cfg.get("qblk")), DEPTH=cfg.get("depth", 2), num_warps=cfg["WN"] * cfg["KW"], num_stages=1,
        **launch_options(cfg), **pdl_options(x.device),
        **({} if epilogue is None else dict(res_ptr=epilogue[0], ss_ptr=epilogue[1], RESIDUAL=True)),
        ONE_ROW=m == 1 and ONE_ROW_FLAT_SUM, **norm_args,
    )
    return out.reshape(*lead, n)


def launch_options(cfg: dict) -> dict:
    """Extra Triton launch options a config may carry (maxnreg: cap registers per thread for occupancy)."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not INTERPRET else {}


# ------------------------------------------------------------------ lane-level check of the PTX


def simulate_group_asm(q, xr, sz, y, bf16: bool = True):
    """Run `_gen_asm`'s PTX on one warp in numpy, as the layout documented above places the elements.

    q, xr: int32 [4, 8, 4, 4] (s, g, t, v): the words lane 4 g + t holds for k-step s; sz: fp32
    [2, 8, 4, 4] (scale, -(MB + zero)) and y: fp32 [2, 8, 4, 4] (tokens 2t, 2t + 1) of each lane
    (extra leading entries are ignored). Returns the new y. Used by the tests to check the
    fragment bookkeeping without a GPU.
    """
    import numpy as np

    text = _gen_asm(bf16)
    lanes = [(g, t) for g in range(8) for t in range(4)]  # lane l = 4 g + t

    def operands(g, t):
        ops = {}
        for e in range(16):
            s, v = divmod(e, 4)
            ops[f"${8 + e}"] = np.uint32(np.int64(q[s, g, t, v]) & 0xFFFFFFFF)
            ops[f"${24 + e}"] = np.uint32(np.int64(xr[s, g, t, v]) & 0xFFFFFFFF)
        for e in range(8):
            h, v = divmod(e, 4)
            ops[f"${e}"] = np.float32(y[h, g, t, v])
            ops[f"${40 + e}"] = np.float32(sz[h, g, t, v])
        return ops

    regs = [operands(g, t) for g, t in lanes]

    def h2f(bits):
        bits = int(bits) & 0xFFFF
        if bf16:
            return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])

    def val(r, tok):
        tok = tok.strip()
        if tok.startswith("0f"):
            return np.array([int(tok[2:], 16)], dtype=np.uint32).view(np.float32)[0]
        if tok.startswith("0x"):
            return np.uint32(int(tok, 16))
        if tok.isdigit():
            return np.uint32(int(tok))
        return r[tok]

    def vec(tok):
        return [p.strip() for p in tok.strip().strip("{}").split(",")]

    import re

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("mma"):
            parts = re.findall(r"\{[^}]*\}", rest)
            d, a, b, c = (vec(p) for p in parts)
            amat = np.zeros((16, 16))
            bmat = np.zeros((16, 8))
            cmat = np.zeros((16, 8))
            for lane, (g, t) in enumerate(lanes):
                r = regs[lane]
                av = [val(r, a[i]) for i in range(4)]
                for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                    amat[row, col] = h2f(av[i])
                    amat[row, col + 1] = h2f(int(av[i]) >> 16)
                bv = [val(r, b[i]) for i in range(2)]
                for i, krow in enumerate([2 * t, 2 * t + 8]):
                    bmat[krow, g] = h2f(bv[i])
                    bmat[krow + 1, g] = h2f(int(bv[i]) >> 16)
                cv = [float(val(r, c[i])) for i in range(4)]
                cmat[g, 2 * t], cmat[g, 2 * t + 1], cmat[g + 8, 2 * t], cmat[g + 8, 2 * t + 1] = cv
            dmat = amat @ bmat + cmat
            for lane, (g, t) in enumerate(lanes):
                outs = [dmat[g, 2 * t], dmat[g, 2 * t + 1], dmat[g + 8, 2 * t], dmat[g + 8, 2 * t + 1]]
                for name, value in zip(d, outs):
                    regs[lane][name] = np.float32(value)
            continue
        args = [p.strip() for p in rest.split(",")]
        for r in regs:
            if op == "mov.b32" or op == "mov.f32":
                r[args[0]] = val(r, args[1])
            elif op == "prmt.b32":
                a_, b_ = int(val(r, args[1])), int(val(r, args[2]))
                sel = int(args[3], 16)
                src = a_ | (b_ << 32)
                out = 0
                for i in range(4):
                    byte = (src >> (8 * ((sel >> (4 * i)) & 0x7))) & 0xFF
                    out |= byte << (8 * i)
                r[args[0]] = np.uint32(out)
            elif op == "shr.u32":
                r[args[0]] = np.uint32(int(val(r, args[1])) >> int(args[2]))
            elif op == "lop3.b32":
                assert args[4] == "0xEA"
                r[args[0]] = np.uint32((int(val(r, args[1])) & int(val(r, args[2]))) | int(val(r, args[3])))
            elif op == "fma.rn.f32":
                r[args[0]] = np.float32(np.float32(val(r, args[1])) * np.float32(val(r, args[2])) + np.float32(val(r, args[3])))
            else:
                raise ValueError(f"simulator: unknown op {op}")
    out = np.array(y, dtype=np.float32).copy()
    for lane, (g, t) in enumerate(lanes):
        for e in range(8):
            h, v = divmod(e, 4)
            out[h, g, t, v] = regs[lane][f"${e}"]
    return out


# ------------------------------------------------------------------ layout check (compile only, no GPU)


def pdl_problems(name: str, ptx: str, prefetch: bool) -> list[str]:
    """What is wrong with a PDL kernel's PTX: the wait and the launch of dependents must be there, and with
    `prefetch` global loads (the first weights) must be issued before the wait."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0 or "griddepcontrol.launch_dependents" not in ptx:
        return [f"{name}: no griddepcontrol wait/launch_dependents in the PTX"]
    if prefetch and "ld.global" not in ptx[:wait]:
        return [f"{name}: no weight load is issued before griddepcontrol.wait"]
    return []


def check_asm_layouts(target_arch: int = 90) -> list[str]:
    """Compile the tc kernels for `target_arch` (no GPU needed) and return a problem per inline-asm operand
    layout that does not put the 32 lanes of each warp along the tile rows with the 4 columns in registers,
    and per kernel whose programmatic-dependent-launch code is missing or (the GEMV, the experts' down) waits before
    its first weight loads.

    The asm reads mma fragments straight from registers, so it is only right when Triton lays the
    [L, 4] tiles out that way; Triton picks the layout (run 3a: a 5-D tile got another lane order
    under triton 3.6). Must run with TRITON_INTERPRET unset.
    """
    import re

    from .int4_experts import _down_tc_kernel, _gate_up_tc_kernel
    from .targets import compile_offline

    def layouts(ir):
        defs = dict(re.findall(r"^(#blocked\d*) = (#ttg.blocked<\{.*?\}>)", ir, re.M))
        found = set()
        for line in ir.splitlines():
            if "elementwise_inline_asm" in line:
                found.update(defs[name] for name in re.findall(r"tensor<\d+x4xf32, (#blocked\d*)>", line))
        return found

    def good(lay):
        return ("threadsPerWarp = [32, 1]" in lay and re.search(r"warpsPerCTA = \[\d+, 1\]", lay) is not None
                and ("sizePerThread = [1, 4]" in lay or "sizePerThread = [1, 1]" in lay))

    problems = []
    gemv_sig = {"x32_ptr": "*i32", "qw_ptr": "*i32", "qz_ptr": "*i32", "sc_ptr": "*fp16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
                "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K2": "i32", "GROUPS": "i32", "GPS": "i32", "WN": "constexpr",
                "KW": "constexpr", "SYM": "constexpr", "BF16": "constexpr", "SPLIT_K": "i32", "SPLITP": "constexpr",
                "EMULATE": "constexpr", "QBLK": "constexpr", "PDL": "constexpr", "DEPTH": "constexpr", "res_ptr": "*bf16",
                "ss_ptr": "*fp32", "RESIDUAL": "constexpr", "ONE_ROW": "constexpr", "gs_ptr": "*fp32", "gs_hg": "i32",
                "gs_dv": "i32", "gs_eps": "fp32", "GS": "constexpr", "GS_NVB": "constexpr"}
    expert_common = {"T": "i32", "GROUPS": "i32", "GPS": "i32", "QW_E": "i32", "QZ_E": "i32", "SC_E": "i32", "TOPK": "constexpr",
                     "TOPKP": "constexpr", "CH": "constexpr", "WN": "constexpr", "KW": "constexpr", "SYM": "constexpr",
                     "BF16": "constexpr", "SPLIT_K": "i32", "SPLITP": "constexpr", "EMULATE": "constexpr", "QBLK": "constexpr",
                     "PDL": "constexpr", "DEPTH": "constexpr"}
    gate_up_sig = {"x32_ptr": "*i32", "ids_ptr": "*i64", "qw_ptr": "*i32", "qz_ptr": "*i32", "sc_ptr": "*fp16", "act_ptr": "*bf16",
                   "ws_ptr": "*fp32", "cnt_ptr": "*i32", "K2": "i32", "I": "i32", **expert_common}
    down_sig = {"act32_ptr": "*i32", "ids_ptr": "*i64", "wts_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "sc_ptr": "*fp16",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "sh_ptr": "*bf16", "sg_ptr": "*bf16", "SG_STRIDE": "i32",
                "res_ptr": "*bf16", "SHARED": "constexpr", "RESIDUAL": "constexpr", "I2": "i32", "H": "i32", **expert_common}
    cases = [("gemv", _gemv_tc_kernel, gemv_sig, {"WN": wn, "KW": kw, "SYM": sym, "BF16": True, "SPLITP": 4, "EMULATE": False,
                                                  "QBLK": False, "PDL": True, "DEPTH": 2, "RESIDUAL": False,
                                                  "ONE_ROW": False})
             for wn, kw, sym in [(4, 1, True), (4, 1, False), (2, 2, True)]]
    cases += [("gemv qblk", _gemv_tc_kernel, gemv_sig,  # the one-row step's (one-buffer loop, its split's sum)
               {"WN": 4, "KW": 1, "SYM": True, "BF16": True, "SPLITP": splitp, "EMULATE": False, "QBLK": True, "PDL": True,
                "DEPTH": depth, "RESIDUAL": residual, "ONE_ROW": one_row})
              for depth, residual, one_row, splitp in [(2, False, False, 4), (1, False, True, 8), (1, True, True, 32),
                                                       (1, True, False, 4)]]
    cases.append(("gemv qblk head norm", _gemv_tc_kernel, gemv_sig,  # the GDN out projection at one row (mixers)
                  {"WN": 4, "KW": 1, "SYM": True, "BF16": True, "SPLITP": 32, "EMULATE": False, "QBLK": True,
                   "PDL": True, "DEPTH": 1, "RESIDUAL": True, "ONE_ROW": True, "GS": 1, "GS_NVB": 8}))
    cases.append(("gemv head norm, 3 rows", _gemv_tc_kernel, gemv_sig,  # the verify step's (RESIDUAL_ROWS_...)
                  {"WN": 4, "KW": 1, "SYM": True, "BF16": True, "SPLITP": 16, "EMULATE": False, "QBLK": False,
                   "PDL": True, "DEPTH": 2, "RESIDUAL": True, "ONE_ROW": False, "GS": 2, "GS_NVB": 4}))
    cases += [("gemv no split", _gemv_tc_kernel, gemv_sig,  # no_split_config: the verify rows' wide GEMVs
               {"WN": 1, "KW": 4, "SYM": True, "BF16": True, "SPLITP": 4, "EMULATE": False, "QBLK": qblk, "PDL": True,
                "DEPTH": 1, "RESIDUAL": False, "ONE_ROW": False}) for qblk in (False, True)]
    cases += [(name, fn, sig, {"TOPK": 8, "TOPKP": 8, "CH": ch, "WN": wn, "KW": 1, "SYM": sym, "BF16": True, "SPLITP": 8,
                               "EMULATE": False, "QBLK": qblk, "PDL": True, "DEPTH": depth})
              for name, fn, sig in [("gate_up", _gate_up_tc_kernel, gate_up_sig), ("down", _down_tc_kernel, down_sig)]
              for wn, ch, sym, qblk, depth in [(1, 1, True, False, 2), (2, 4, False, False, 2), (2, 1, True, True, 2),
                                               (2, 1, True, True, 1)]]
    for case in cases:  # the down kernel's epilogue as the fused MoE block runs it (shared expert and residual added)
        if case[0] == "down":
            case[3].update(SHARED=True, RESIDUAL=True)
        elif case[0].startswith("gemv"):
            case[3].setdefault("GS", 0)
            case[3].setdefault("GS_NVB", 1)
    for name, fn, sig, consts in cases:
        aligned = {a for a in sig if sig[a].startswith("*") or a in ("N", "K2", "I", "I2", "H", "QW_E", "QZ_E", "SC_E")}
        compiled = compile_offline(fn, sig, consts, aligned, target_arch, consts["WN"] * consts["KW"])
        found = layouts(compiled.asm["ttgir"])
        problems += pdl_problems(name, compiled.asm["ptx"], prefetch=name.startswith("gemv") or name == "down")
        if not found:
            problems.append(f"{name} {consts}: no inline asm found")
        problems += [f"{name} {consts}: {lay}" for lay in found if not good(lay)]
    return problems
