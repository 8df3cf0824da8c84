"""Fused Gated DeltaNet decode step: M = 1..5 new tokens per sequence, all of a layer's GDN math in one launch.

Per sequence b and value head h (key head h // (Hv/Hk)), token by token at position p, from the projections:
  conv:  window = the inputs of positions p-K+1 .. p (the last from qkv[b]); mixed = silu(sum_i w[c, i] window[i, c]);
         ring[b][p mod R] <- qkv[b]                                    (in place)
  norms: q = l2norm(q) * dk^-0.5, k = l2norm(k)                       (per key head, eps 1e-6)
  gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  delta rule on S [dk, dv] fp32 (in place):
         S *= exp(g); d = beta * (v - S^T k); S += k d^T; o = S^T q
  out:   w * rmsnorm(o) * silu(z)                                      (over each head's dv)
The roundings to the model dtype follow roofline.model.layers.GatedDeltaNet step for step.

The conv state is a ring: conv_state [S, R, C] holds the input of position p in row p mod R (R a power of two, at
least K-1 + M: `conv_ring_rows`). A step reads the K-1 rows before its first position and writes its M inputs to
their own rows, so no program overwrites a row another still reads and nothing moves; a verify step that keeps fewer
tokens needs no conv restore (the rows the next step reads are the kept tokens' and older). `positions` [B*M] are the
rows' absolute positions (the step batch's; the kernel reads each sequence's first).

Pools and several tokens (the CUDA-graph decode step and the MTP verify step):
- `slots` [B] (int32/int64, optional): conv_state [S, R, C] and state [S', Hv, dk, dv] are pools
  and sequence b reads and updates conv slot slots[b] and state row slots[b]; without it, row b.
  `state_rows` = (read [B], write [B]) separates the state's rows: the MTP verify reads a sequence's state
  from one of its two buffers and writes the new one to the other, so the state before the step stays
  (engine.cache.CachePool's `state_buffers`).
- `tokens_per_seq` M: qkv [B*M, C], z [B*M, Hv*dv], a, b [B*M, Hv] and the output [B*M, Hv*dv]
  are sequence-major (row b*M + j is token j of sequence b). The M tokens are processed in order,
  exactly as M successive one-token steps (same roundings); the state stays in registers across
  them (read and written once), and the slot holds the values after all M tokens.
- `step_records` [B, M-1, step_record_size(...)] fp32 (optional output): for token j = 0..M-2, what its state
  update used (each key head's normalised k, each value head's delta d and decay; 40 KB a layer on the 122B). A
  verify step that accepts only j+1 tokens rebuilds the state after token j from the untouched state before the
  step (`gdn_replay`, the same float operations in the same order, so the same bits). Saving whole states instead
  (4.2 MB a layer and position) cost the 122B's M = 3 verify 0.19 ms every step on an H100 (session 20).

Parallelism: the state is the bytes (122B: 64 heads x 128 x 128 fp32 = 4.2 MB read and written
per layer), and fla's fused_recurrent kernel gives one program per head at T=1 (~4% of the
bandwidth). Here program (v block, value head, sequence) owns BV columns of one head's state,
so a layer runs Hv * dv/BV programs per sequence (512 at BV=16); each recomputes its key head's
q/k conv and norms (256 channels, cheap); each program writes its own v channels' inputs to the ring, one program a
key head the q/k channels'. The RMSNorm over dv needs the whole head: the last program of each (sequence, key head)
to arrive (see _common.arrive) runs its heads' gated norms, reading the group's o vectors back from a small fp32
workspace. With `defer_norm` the norm's rms is left to the kernel that reads the output (the out projection,
int4_tc's `head_norm`): each program writes its columns' w * o * silu(z) and their sum of o^2, and the kernel has
no arrival round.

Layouts: qkv [B*M, 2*Hk*dk + Hv*dv] ([q | k | v], as in_proj_qkv writes it; qkv, z, b and a may be column views of
a merged projection's output, their rows strided), conv_weight
[C, 1, K] or [C, K], state fp32; output in qkv's dtype (out_proj's input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..engine.cache import step_record_size
from ._common import (INTERPRET, arrive, counters_for, next_pow2, pdl_options, reset, rows_in_place,
                      wait_for_inputs)

MAX_TOKENS = 5  # tokens per sequence in one step (1 decode token + up to 4 MTP drafts)
# (V block, warps) of a program on the GPU: one token per sequence, and a verify step's several. H100, session 25
# (benchmarks/ab_step.py, 122B, 3 rounds, graph ms): the M = 3 verify step 5.134 -> 5.062 at (32, 4); at M = 1 (32, 4)
# was 0.025 slower, (16, 4) 0.011 and (8, 2) 0.056. The reductions over dk depend on the tile, so a verify step's
# bits differ from one-token steps' (gdn_replay redoes the verify's own updates from its records: unaffected).
ONE_TOKEN_TILE = (16, 2)
VERIFY_TILE = (32, 4)


def _check_inputs(bsz, m, conv_state, conv_weight, positions, state, num_k_heads, step_records):
    """The ring's size and `positions` (both paths take them), and step_records' shape."""
    kernel, ring = conv_weight.shape[-1], conv_state.shape[1]
    if ring & (ring - 1) or ring < kernel - 1 + m:
        raise ValueError(f"conv_state must be a ring of a power of two >= K-1 + M = {kernel - 1 + m} rows a slot "
                         f"(conv_ring_rows), got {ring}")
    if positions is None or positions.shape != (bsz * m,) or positions.dtype not in (torch.int32, torch.int64):
        got = None if positions is None else f"{positions.dtype} {list(positions.shape)}"
        raise ValueError(f"positions must be int32/int64 [{bsz * m}] (each row's absolute position), got {got}")
    if step_records is not None:
        hv, dk, dv = state.shape[1:]
        want = (bsz, m - 1, step_record_size(num_k_heads, dk, hv, dv))
        if tuple(step_records.shape) != want or step_records.dtype != torch.float32 or not step_records.is_contiguous():
            raise ValueError(f"step_records must be contiguous fp32 {list(want)}, got {list(step_records.shape)}")


def _one_step(qkv, z, b, a, window_hist, conv_weight, A_log, dt_bias, norm_weight, s, num_k_heads, eps, defer=False):
    """One token per sequence: qkv [N, C], window_hist [N, K-1, C], s [N, Hv, dk, dv] fp32
    -> (out [N, Hv*dv], new window [N, K-1, C], new state, its step record [N, record_size], o's sum of squares per
    head [N, Hv] or None); `defer`: out without the gated norm's rms (see gdn_decode)."""
    bsz, conv_dim = qkv.shape
    hv, dk, dv = s.shape[1:]
    key = num_k_heads * dk
    dtype = qkv.dtype
    w = conv_weight.reshape(conv_dim, -1).float()
    window = torch.cat([window_hist, qkv[:, None, :]], dim=1)  # [N, K, C]
    mixed = (window.float() * w.t()[None]).sum(1).to(conv_weight.dtype)  # conv1d, rounded as the model's
    mixed = F.silu(mixed.float()).to(dtype).float()
    q, k, v = mixed.split([key, key, hv * dv], dim=-1)
    group = hv // num_k_heads
    q = q.view(bsz, num_k_heads, dk)
    k = k.view(bsz, num_k_heads, dk)
    q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1) * dk**-0.5
    k_heads = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    k = k_heads.repeat_interleave(group, dim=1)
    v = v.view(bsz, hv, dv)
    beta = torch.sigmoid(b.float()).to(dtype).float()  # the model takes sigmoid in its dtype
    decay = (-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())).exp()
    s = s * decay[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    of = o.to(dtype).float()
    sumsq = of.pow(2).sum(-1) if defer else None
    normed = of if defer else (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gated = (norm_weight.float() * normed.float()).to(dtype).float() * F.silu(z.view(bsz, hv, dv).float())
    record = torch.cat([k_heads.reshape(bsz, -1), delta.reshape(bsz, -1), decay.float()], dim=1)
    return gated.to(dtype).reshape(bsz, hv * dv), window[:, 1:], s, record, sumsq


def gdn_decode_reference(qkv, z, b, a, conv_state, conv_weight, A_log, dt_bias, norm_weight, state,
                         num_k_heads: int, eps: float = 1e-6, *, positions, slots=None, state_rows=None,
                         tokens_per_seq: int = 1, step_records=None, defer_norm: bool = False):
    """The same step in plain PyTorch (fp32 math, the model's roundings), M tokens as M one-token steps;
    updates the conv rings and state (rows `slots`, or 0..B-1; the state's rows `state_rows`) in place and fills
    step_records if given. `defer_norm`: (out, parts [B*M, Hv, 1]) as gdn_decode's (one block a head)."""
    m = tokens_per_seq
    n, conv_dim = qkv.shape
    if m < 1 or n % m:
        raise ValueError(f"{n} rows are not B sequences x {m} tokens")
    bsz = n // m
    _check_inputs(bsz, m, conv_state, conv_weight, positions, state, num_k_heads, step_records)
    rows = torch.arange(bsz, device=qkv.device) if slots is None else slots.long()
    read, write = (rows, rows) if state_rows is None else (r.long() for r in state_rows)
    ring, history = conv_state.shape[1], conv_weight.shape[-1] - 1
    first = positions.view(bsz, m)[:, :1].long()
    hist = conv_state[rows[:, None], (first + torch.arange(-history, 0, device=qkv.device)) % ring]
    s = state[read]
    qkv3, z3, b3, a3 = (t.reshape(bsz, m, -1) for t in (qkv, z, b, a))
    outs, sums = [], []
    for j in range(m):
        o, hist, s, record, sumsq = _one_step(qkv3[:, j], z3[:, j], b3[:, j], a3[:, j], hist, conv_weight, A_log,
                                              dt_bias, norm_weight, s, num_k_heads, eps, defer_norm)
        outs.append(o)
        sums.append(sumsq)
        if j < m - 1 and step_records is not None:
            step_records[:, j] = record
    conv_state[rows[:, None], (first + torch.arange(m, device=qkv.device)) % ring] = qkv3
    state[write] = s
    out = torch.stack(outs, 1).reshape(n, -1)
    return (out, torch.stack(sums, 1).reshape(n, -1, 1)) if defer_norm else out


@triton.jit
def _conv_silu(qkv_row, ring_ptr, w_ptr, c, cmask, C, QS, first, J: tl.constexpr, KERNEL: tl.constexpr,
               RING: tl.constexpr, CONV_TY: tl.constexpr, OUT_TY: tl.constexpr):
    """silu(depthwise causal conv) of channels c for token J of the step (position first + J), with the model's
    roundings. Inputs before the step come from the ring (position p in row p mod RING), the step's own from qkv;
    `qkv_row` points at the sequence's token 0 (rows QS apart; ring rows C apart)."""
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for i in tl.static_range(KERNEL):
        if J + i < KERNEL - 1:
            row = (first + (J + i - (KERNEL - 1))) & (RING - 1)
            x = tl.load(ring_ptr + row * C + c, mask=cmask, other=0).to(tl.float32)
        else:
            x = tl.load(qkv_row + (J + i - (KERNEL - 1)) * QS + c, mask=cmask, other=0).to(tl.float32)
        acc += x * tl.load(w_ptr + c * KERNEL + i, mask=cmask, other=0).to(tl.float32)
    acc = acc.to(CONV_TY).to(tl.float32)
    return (acc / (1.0 + tl.exp(-acc))).to(OUT_TY).to(tl.float32)


@triton.jit
def _ring_store(qkv_row, ring_ptr, c, cmask, C, QS, first, M: tl.constexpr, RING: tl.constexpr):
    """The step's M inputs of channels c to their ring rows (positions first .. first + M - 1). No program of the
    step reads those rows: the ring has at least K-1 + M of them."""
    for j in tl.static_range(M):
        x = tl.load(qkv_row + j * QS + c, mask=cmask)
        tl.store(ring_ptr + ((first + j) & (RING - 1)) * C + c, x, mask=cmask)


@triton.jit
def _gated_norm_store(o, tok, heads, dv, omask, z_ptr, ZS, nw_ptr, out_ptr, HV, DV, eps, ty: tl.constexpr):
    """out[tok, heads] = w * rmsnorm(o) * silu(z) over each head's dv, with the model's roundings; o [R, BDV] fp32
    holds R heads' outputs (`heads` [R, 1]), dv [1, BDV], omask [R, BDV]."""
    of = o.to(ty).to(tl.float32)
    rms = tl.rsqrt(tl.sum(of * of, axis=1) / DV + eps)
    normed = (of * rms[:, None]).to(ty).to(tl.float32)
    nw = tl.load(nw_ptr + dv, mask=dv < DV, other=0).to(tl.float32)
    gated = (nw * normed).to(ty).to(tl.float32)
    zz = tl.load(z_ptr + tok * ZS + heads * DV + dv, mask=omask, other=0).to(tl.float32)
    res = gated * (zz / (1.0 + tl.exp(-zz)))
    tl.store(out_ptr + (tok * HV + heads) * DV + dv, res.to(ty), mask=omask)


@triton.jit
def _rank_one_update(s, k, d):
    """s + k d^T as one explicit fma per element: left to the compiler, `s = s * decay; s = s + k d^T` contracts one
    way in the decode kernel and another in gdn_replay (where s * decay has no other use), and the replayed state
    differed from the step's in the last bits (H100, session 20). Both kernels call this."""
    return tl.fma(tl.broadcast_to(k[:, None], s.shape), tl.broadcast_to(d[None, :], s.shape), s)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, nw_ptr, state_ptr, out_ptr, o_ws, cnt_ptr,
    pos_ptr, slot_ptr, rin_ptr, rout_ptr, srec_ptr,
    C, KEY, HV, HK, DK, DV, eps, QS, ZS, BS, AS, REC,
    GROUP: tl.constexpr, GROUPP: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BV: tl.constexpr,
    NVB, KERNEL: tl.constexpr, RING: tl.constexpr, CONV_TY: tl.constexpr, M: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SAVE_STEPS: tl.constexpr, parts_ptr=None, DEFER: tl.constexpr = False, PDL: tl.constexpr = False,
):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    bi = tl.program_id(2)
    kh = h // GROUP
    ty = out_ptr.dtype.element_ty
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + bi).to(tl.int64)
        row_in = tl.load(rin_ptr + bi).to(tl.int64)  # the state's rows (the slots', or its two buffers')
        row_out = tl.load(rout_ptr + bi).to(tl.int64)
    else:
        slot = bi.to(tl.int64)
        row_in = slot
        row_out = slot
    qkv_row = qkv_ptr + (bi * M).to(tl.int64) * QS  # token 0 of this sequence (rows QS apart: z, b, a by theirs)
    ring = conv_ptr + slot * RING * C
    first = tl.load(pos_ptr + bi * M).to(tl.int64)  # token 0's position
    dk = tl.arange(0, BDK)
    dmask = dk < DK
    vv = vb * BV + tl.arange(0, BV)
    vmask = vv < DV
    cq = kh * DK + dk
    ck = KEY + kh * DK + dk
    cv = 2 * KEY + h * DV + vv

    # issue the state load first: it is the bytes, the conv and norms below overlap with it. Under PDL it goes out
    # before the wait for the previous kernel: only this kernel writes the state (the step's inputs, slots among
    # them, are copied in before the first kernel), so it overlaps with the previous kernel's tail too.
    tile = (h * DK + dk[:, None]) * DV + vv[None, :]
    s_ptrs = state_ptr + row_in * HV * DK * DV + tile
    smask = dmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0)
    decay_scale = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    if DEFER:
        nw = tl.load(nw_ptr + vv, mask=vmask, other=0).to(tl.float32)
    wait_for_inputs(PDL)  # qkv, z, b and a come from the projections
    for j in tl.static_range(M):
        tok = bi * M + j
        q = _conv_silu(qkv_row, ring, convw_ptr, cq, dmask, C, QS, first, j, KERNEL, RING, CONV_TY, ty)
        k = _conv_silu(qkv_row, ring, convw_ptr, ck, dmask, C, QS, first, j, KERNEL, RING, CONV_TY, ty)
        v = _conv_silu(qkv_row, ring, convw_ptr, cv, vmask, C, QS, first, j, KERNEL, RING, CONV_TY, ty)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK.to(tl.float32)))
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        bv = tl.load(b_ptr + tok * BS + h).to(tl.float32)
        av = tl.load(a_ptr + tok * AS + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-bv))).to(ty).to(tl.float32)
        u = av + dtb
        softplus = tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(u)))
        decay = tl.exp(decay_scale * softplus)
        s = s * decay
        d = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = _rank_one_update(s, k, d)
        o = tl.sum(s * q[:, None], axis=0)
        if DEFER:  # the gated norm without its rms: w * o * silu(z), and o's sum of squares over this block
            of = o.to(ty).to(tl.float32)
            tl.store(parts_ptr + (tok * HV + h) * NVB + vb, tl.sum(of * of, axis=0))
            zz = tl.load(z_ptr + tok * ZS + h * DV + vv, mask=vmask, other=0).to(tl.float32)
            gated = (nw * of).to(ty).to(tl.float32) * (zz / (1.0 + tl.exp(-zz)))
            tl.store(out_ptr + (tok * HV + h) * DV + vv, gated.to(ty), mask=vmask)
        else:
            tl.store(o_ws + (tok * HV + h) * DV + vv, o, mask=vmask)
        if SAVE_STEPS:  # what gdn_replay needs to redo this update: k, d, decay
            if j < M - 1:
                rec = srec_ptr + (bi * (M - 1) + j).to(tl.int64) * REC
                if vb == 0:
                    if h % GROUP == 0:
                        tl.store(rec + kh * DK + dk, k, mask=dmask)
                    tl.store(rec + HK * DK + HV * DV + h, decay)
                tl.store(rec + HK * DK + h * DV + vv, d, mask=vmask)
    tl.store(state_ptr + row_out * HV * DK * DV + tile, s, mask=smask)
    _ring_store(qkv_row, ring, cv, vmask, C, QS, first, M, RING)  # this program's own v channels
    if vb == 0:
        if h % GROUP == 0:  # one program a key head: its q/k channels
            _ring_store(qkv_row, ring, cq, dmask, C, QS, first, M, RING)
            _ring_store(qkv_row, ring, ck, dmask, C, QS, first, M, RING)

    if not DEFER:
        cnt = cnt_ptr + bi * HK + kh
        if arrive(cnt, GROUP * NVB):
            # the group's heads' gated norms, from the o vectors its programs wrote
            gi = tl.arange(0, GROUPP)
            dv = tl.arange(0, BDV)[None, :]
            heads = (kh * GROUP + gi)[:, None]
            omask = (gi < GROUP)[:, None] & (dv < DV)
            for j in tl.static_range(M):
                tok = bi * M + j
                o_group = tl.load(o_ws + (tok * HV + heads) * DV + dv, mask=omask, other=0, cache_modifier=".cg")
                _gated_norm_store(o_group, tok, heads, dv, omask, z_ptr, ZS, nw_ptr, out_ptr, HV, DV, eps, ty)
            reset(cnt)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def gdn_decode(qkv, z, b, a, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, num_k_heads: int,
               eps: float = 1e-6, *, positions, slots=None, state_rows=None, tokens_per_seq: int = 1,
               step_records=None, out=None, block_v: int | None = None, num_warps: int | None = None,
               counters=None, defer_norm: bool = False):
    """One fused GDN decode step of M = tokens_per_seq tokens per sequence at `positions` (see the module
    docstring); updates the conv rings and state (rows `slots`, or 0..B-1; the state's `state_rows` = (read,
    write)) in place -> [B*M, Hv*dv].

    `defer_norm` -> (out, parts): out is the gated norm without its rms, w * o * silu(z) (o and w * o rounded to the
    model's dtype as the norm rounds its terms), and parts [B*M, Hv, blocks] fp32 each v block's sum of o^2 (o
    rounded): its reader finishes the norm (int4_tc's `head_norm`). No arrival round: each program's work ends with
    its own stores."""
    m = tokens_per_seq
    n, conv_dim = qkv.shape
    hv, dk, dv = state.shape[1:]
    if not 1 <= m <= MAX_TOKENS or n % m:
        raise ValueError(f"gdn_decode takes 1..{MAX_TOKENS} tokens per sequence; {n} rows, tokens_per_seq={m}")
    bsz = n // m
    if state.dtype != torch.float32 or not state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("state must be contiguous fp32 [S, Hv, dk, dv]; conv_state a contiguous ring [S, R, C]")
    if hv % num_k_heads:
        raise ValueError(f"{hv} value heads do not divide into {num_k_heads} key heads")
    if slots is None and (state.shape[0] < bsz or conv_state.shape[0] < bsz):
        raise ValueError(f"{bsz} sequences but only {state.shape[0]} state rows")
    for name, rows in (("slots", slots), *zip(("state_rows[0]", "state_rows[1]"), state_rows or ())):
        if rows is not None and (rows.shape != (bsz,) or rows.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be int32/int64 [{bsz}], got {rows.dtype} {list(rows.shape)}")
    if state_rows is not None and slots is None:
        raise ValueError("state_rows need slots (the conv rings' rows)")
    _check_inputs(bsz, m, conv_state, conv_weight, positions, state, num_k_heads, step_records)
    # the conv rings' rows, then the state's read and write rows (all unread without slots: any pointer)
    rows = (slots, *(state_rows or (slots, slots))) if slots is not None else (positions,) * 3
    save_steps = step_records is not None and m > 1
    group = hv // num_k_heads
    # 512 programs per sequence at 122B shapes (256 for a verify step); the interpreter runs programs one after
    # another, so there one V block per head (the split-V path is tested with an explicit block_v); either way every
    # program writes its o to the workspace and the key head's last program runs the gated norms (or, deferred, each
    # program its own columns' part), so the interpreter runs the GPU's code path
    tile_v, warps = ONE_TOKEN_TILE if m == 1 else VERIFY_TILE
    bv = block_v or (tile_v if not INTERPRET else next_pow2(dv))
    nvb = triton.cdiv(dv, bv)
    if out is None:
        out = torch.empty(n, hv * dv, dtype=qkv.dtype, device=qkv.device)
    parts = torch.empty(n, hv, nvb, dtype=torch.float32, device=qkv.device) if defer_norm else None
    o_ws = parts if defer_norm else torch.empty(n, hv, dv, dtype=torch.float32, device=qkv.device)  # unread deferred
    cnt = counters if counters is not None else counters_for("gdn_decode", bsz * num_k_heads, qkv.device)
    (qkv, qs), (z, zs), (b, bs), (a, as_) = (rows_in_place(t) for t in (qkv, z, b, a))
    _gdn_decode_kernel[(nvb, hv, bsz)](
        qkv, z, b, a, conv_state, conv_weight.contiguous(),
        A_log, dt_bias, norm_weight, state, out, o_ws, cnt,
        positions, *rows, step_records if save_steps else state,
        conv_dim, num_k_heads * dk, hv, num_k_heads, dk, dv, eps, qs, zs, bs, as_, step_record_size(num_k_heads, dk, hv, dv),
        GROUP=group, GROUPP=next_pow2(group), BDK=next_pow2(dk), BDV=next_pow2(dv), BV=bv, NVB=nvb,
        KERNEL=conv_weight.shape[-1], RING=conv_state.shape[1], CONV_TY=_TL[conv_weight.dtype], M=m,
        HAS_SLOTS=slots is not None, SAVE_STEPS=save_steps,
        parts_ptr=parts, DEFER=defer_norm,
        num_warps=num_warps or (warps if not INTERPRET else 1), **pdl_options(qkv.device),
    )
    return (out, parts) if defer_norm else out


@triton.jit(do_not_specialize=["row_in", "row_out", "first_record", "kept"])
def _gdn_replay_kernel(state_ptr, rec_ptr, LAYER_STATE, LAYER_REC, row_in, row_out, first_record, kept,
                       HV, HK, DK, DV, REC, GROUP: tl.constexpr, BDK: tl.constexpr, BV: tl.constexpr):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    kh = h // GROUP
    dk = tl.arange(0, BDK)
    dmask = dk < DK
    vv = vb * BV + tl.arange(0, BV)
    vmask = vv < DV
    smask = dmask[:, None] & vmask[None, :]
    states = state_ptr + layer * LAYER_STATE + (h * DK + dk[:, None]) * DV + vv[None, :]
    s = tl.load(states + row_in.to(tl.int64) * HV * DK * DV, mask=smask, other=0)
    records = rec_ptr + layer * LAYER_REC + first_record.to(tl.int64) * REC
    for j in range(kept):  # as _gdn_decode_kernel's update, operation for operation
        rec = records + j * REC
        k = tl.load(rec + kh * DK + dk, mask=dmask, other=0)
        d = tl.load(rec + HK * DK + h * DV + vv, mask=vmask, other=0)
        decay = tl.load(rec + HK * DK + HV * DV + h)
        s = s * decay
        s = _rank_one_update(s, k, d)
    tl.store(states + row_out.to(tl.int64) * HV * DK * DV, s, mask=smask)


def gdn_replay(states: torch.Tensor, records: torch.Tensor, num_k_heads: int, row_in: int, row_out: int,
               first_record: int, kept: int) -> None:
    """After a verify step that kept `kept` of its tokens: every GDN layer's state row `row_out` <- the state in row
    `row_in` (before the step) updated by the step's first `kept` tokens from their records (rows first_record ..
    first_record + kept - 1 of each layer's records); one launch for all layers. `states` [L, R, Hv, dk, dv] fp32
    (every layer's pool, CachePool.recurrent_all), `records` [L, rows, record_size] fp32 (every layer's step_records
    storage). Bit for bit the state the step had after token kept - 1."""
    layers, rows, hv, dk, dv = states.shape
    rec = step_record_size(num_k_heads, dk, hv, dv)
    if records.dim() != 3 or records.shape[0] != layers or records.shape[2] != rec or records.dtype != torch.float32:
        raise ValueError(f"gdn_replay: records must be fp32 [{layers}, rows, {rec}], got {records.dtype} "
                         f"{list(records.shape)}")
    if not (0 <= row_in < rows and 0 <= row_out < rows and kept >= 1 and 0 <= first_record
            and first_record + kept <= records.shape[1]):
        raise ValueError(f"gdn_replay: state rows {row_in} -> {row_out} of {rows}, records {first_record} + {kept} of "
                         f"{records.shape[1]}")
    if not states.is_contiguous() or not records.is_contiguous():
        raise ValueError("gdn_replay wants contiguous states and records")
    bv = 16 if not INTERPRET else next_pow2(dv)
    _gdn_replay_kernel[(triton.cdiv(dv, bv), hv, layers)](
        states, records, rows * hv * dk * dv, records.shape[1] * rec, row_in, row_out, first_record, kept,
        hv, num_k_heads, dk, dv, rec, GROUP=hv // num_k_heads, BDK=next_pow2(dk), BV=bv,
        num_warps=2 if not INTERPRET else 1,
    )
