"""Decode attention over a KV cache: GQA, head dim up to 256, 1..4 query tokens per sequence, causal.

Interface: q [B, M, Hq, D] (RoPE already applied), k_cache / v_cache [B (or S), T, Hkv, D], lengths [B]
int: sequence b holds lengths[b] valid cache entries, the last M of which are its M query tokens
(query i sits at position lengths[b] - M + i and sees keys 0..that position). T is the cache's
capacity; `max_len` (a host-side bound on lengths) sizes the grid, so a graph captured for one
bound stays valid while lengths grow up to it.

Flash-decoding: program (split, kv head, sequence) streams its share of the cache once for all
Hq/Hkv query heads of the kv head and all M query tokens (rows = heads x tokens, padded to 16
for the matrix unit), keeping an online softmax; the last split of a (sequence, kv head) to
finish merges the partial (max, sum, output) triples in two levels (see _common.arrive): the last
split of each group of ~sqrt(splits) merges its group, the last group merges the groups, so no
program reads more than ~sqrt(splits) partials.

Pools: with `slots` [B] (int32/int64), k_cache / v_cache are [S, T, Hkv, D] pools of S slots and
sequence b reads row slots[b]; without it, row b.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import INTERPRET, arrive, counters_for, next_pow2, pdl_options, reset, sm_count, wait_for_inputs


def decode_attention_reference(q, k_cache, v_cache, lengths, scale: float | None = None, *, slots=None) -> torch.Tensor:
    """Per sequence: causal GQA softmax(q k^T * scale) v over the first lengths[b] entries of cache row
    slots[b] (row b without slots), in fp32."""
    bsz, m, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b in range(bsz):
        length = int(lengths[b])
        row = b if slots is None else int(slots[b])
        keys = k_cache[row, :length].float().transpose(0, 1)  # [Hkv, L, D]
        values = v_cache[row, :length].float().transpose(0, 1)
        pos = torch.arange(length - m, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [M, L]
        o = F.scaled_dot_product_attention(
            q[b].float().transpose(0, 1), keys.repeat_interleave(hq // hkv, 0), values.repeat_interleave(hq // hkv, 0),
            attn_mask=mask, scale=scale,
        )
        out[b] = o.transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _combine(base, count, r, rmask, dd, BQ: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, CH: tl.constexpr):
    """Merge `count` (<= NP) partial (max, sum, output) triples stored WS = BQ*(BD+2) floats apart from base.

    Loads go through L2 (.cg: other programs wrote them); all maxima at once, then the weighted
    sums in chunks of CH partials whose loads go out together. Returns the merged triple."""
    WS: tl.constexpr = BQ * (BD + 2)
    i = tl.arange(0, NP)
    ms = tl.load(base + i[:, None] * WS + r[None, :], mask=(i < count)[:, None] & rmask[None, :], other=-1.0e30,
                 cache_modifier=".cg")
    m_all = tl.max(ms, axis=0)
    l_all = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BD], dtype=tl.float32)
    for c in tl.static_range(0, NP, CH):
        sp = c + tl.arange(0, CH)
        smask = (sp < count)[:, None] & rmask[None, :]
        mc = tl.load(base + sp[:, None] * WS + r[None, :], mask=smask, other=-1.0e30, cache_modifier=".cg")
        lc = tl.load(base + sp[:, None] * WS + BQ + r[None, :], mask=smask, other=0.0, cache_modifier=".cg")
        part = tl.load(base + sp[:, None, None] * WS + 2 * BQ + r[None, :, None] * BD + dd[None, None, :],
                       mask=smask[:, :, None], other=0.0, cache_modifier=".cg")
        w = tl.exp2(mc - m_all[None, :])  # [CH, BQ]
        l_all += tl.sum(w * lc, axis=0)
        acc += tl.sum(part * w[:, :, None], axis=0)
    return m_all, l_all, acc


@triton.jit
def _store_partial(base, m_i, l_i, acc, r, rmask, dd, BQ: tl.constexpr, BD: tl.constexpr):
    tl.store(base + r, m_i, mask=rmask)
    tl.store(base + BQ + r, l_i, mask=rmask)
    tl.store(base + 2 * BQ + r[:, None] * BD + dd[None, :], acc, mask=rmask[:, None])


@triton.jit
def _finish(out_ptr, out_offs, mask, acc, l, gate_ptr, gate_offs, HAS_GATE: tl.constexpr):
    """out = acc / l in the output dtype; with HAS_GATE times sigmoid(gate), rounded as GatedAttention rounds."""
    ty = out_ptr.dtype.element_ty
    o = (acc / tl.where(l > 0, l, 1.0)[:, None]).to(ty)
    if HAS_GATE:
        g = tl.load(gate_ptr + gate_offs, mask=mask, other=0).to(tl.float32)
        o = o * (1.0 / (1.0 + tl.exp(-g))).to(ty)
    tl.store(out_ptr + out_offs, o.to(ty), mask=mask)


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, slot_ptr, out_ptr, ws_ptr, gws_ptr, cnt_ptr, gate_ptr, GATE_ROW, GATE_HEAD,
    T, HQ, HKV, D, KEYS_PER_SPLIT, scale_log2, NSPLIT, NGROUP,
    M: tl.constexpr, HG: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    GSIZE: tl.constexpr, NGROUPP: tl.constexpr, CH: tl.constexpr, CHG: tl.constexpr, HAS_SLOTS: tl.constexpr,
    HAS_GATE: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    sp = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(len_ptr + b).to(tl.int32)
    if HAS_SLOTS:
        row = tl.load(slot_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    r = tl.arange(0, BQ)  # row = head_in_group * M + token
    rmask = r < HG * M
    head = kvh * HG + r // M
    tok = r % M
    pos = length - M + tok  # each row's position: it sees keys 0..pos
    dd = tl.arange(0, BD)
    dmask = dd < D
    q = tl.load(q_ptr + ((b * M + tok) * HQ + head)[:, None] * D + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0)
    start = sp * KEYS_PER_SPLIT
    end = tl.minimum(start + KEYS_PER_SPLIT, length)
    m_i = tl.full([BQ], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BD], dtype=tl.float32)
    tt = tl.arange(0, BT)
    kv_base = (row * T * HKV + kvh) * D
    for t0 in range(start, end, BT):
        t = t0 + tt
        tmask = t < end
        offs = kv_base + (t * HKV * D)[:, None] + dd[None, :]
        k = tl.load(k_ptr + offs, mask=tmask[:, None] & dmask[None, :], other=0)
        if q_ptr.dtype.element_ty == tl.float32:  # fp32 (tests against the reference): no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BQ, BT], log2 units
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        ok = (t[None, :] <= pos[:, None]) & tmask[None, :]
        s = tl.where(ok, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(ok, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=tmask[:, None] & dmask[None, :], other=0)
        if q_ptr.dtype.element_ty == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # workspace per (b, kvh, split): [BQ] max, [BQ] sum, [BQ, BD] unnormalised output
    WS: tl.constexpr = BQ * (BD + 2)
    bh = b * HKV + kvh
    _store_partial(ws_ptr + (bh * NSPLIT + sp).to(tl.int64) * WS, m_i, l_i, acc, r, rmask, dd, BQ, BD)
    # two-level combine: the last split of each group of GSIZE merges the group; the last group the groups
    g = sp // GSIZE
    cnt = cnt_ptr + bh * (NGROUP + 1)
    out_offs = ((b * M + tok) * HQ + head)[:, None] * D + dd[None, :]
    gate_offs = ((b * M + tok) * GATE_ROW + head * GATE_HEAD)[:, None] + dd[None, :]
    omask = rmask[:, None] & dmask[None, :]
    if arrive(cnt + g, tl.minimum(GSIZE, NSPLIT - g * GSIZE)):
        m_g, l_g, acc_g = _combine(ws_ptr + (bh * NSPLIT + g * GSIZE).to(tl.int64) * WS,
                                   tl.minimum(GSIZE, NSPLIT - g * GSIZE), r, rmask, dd, BQ, BD, GSIZE, CH)
        reset(cnt + g)
        if NGROUP == 1:
            _finish(out_ptr, out_offs, omask, acc_g, l_g, gate_ptr, gate_offs, HAS_GATE)
        else:
            _store_partial(gws_ptr + (bh * NGROUP + g).to(tl.int64) * WS, m_g, l_g, acc_g, r, rmask, dd, BQ, BD)
            if arrive(cnt + NGROUP, NGROUP):
                m_f, l_f, acc_f = _combine(gws_ptr + (bh * NGROUP).to(tl.int64) * WS, NGROUP, r, rmask, dd, BQ, BD,
                                           NGROUPP, CHG)
                _finish(out_ptr, out_offs, omask, acc_f, l_f, gate_ptr, gate_offs, HAS_GATE)
                reset(cnt + NGROUP)


def default_config() -> dict:
    """One program per SM (B x Hkv x splits): with the two-level combine a split's partial costs the
    last programs about one L2 round trip per chunk, so more, shorter splits no longer pay for their
    combine as the one-level combine of run 2 did (66 splits: most of the time spent combining)."""
    if INTERPRET:
        return {"BT": 16, "num_warps": 1, "num_stages": 1}
    # min_keys_per_split: at short spans (the 1K bucket at context ~0) one split per SM left ~60 programs
    # mostly empty, and their partials and combine cost ~35 us per layer (H200 profile, 2026-12-03)
    return {"BT": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 1.0, "min_keys_per_split": 256}


def decode_attention(q, k_cache, v_cache, lengths, scale: float | None = None, *, max_len: int | None = None, out=None,
                     slots=None, gate=None, config: dict | None = None, counters=None) -> torch.Tensor:
    """Attention of q [B, M, Hq, D] over the caches [S, T, Hkv, D] (row slots[b] for sequence b, or row b)
    (see the module docstring) -> [B, M, Hq, D]; with `gate` [B*M, Hq, D] (any row and head strides, unit
    stride along D), the output times sigmoid(gate): gated attention's output gate in the same launch."""
    bsz, m, hq, d = q.shape
    if gate is not None and (gate.shape != (bsz * m, hq, d) or gate.stride(-1) != 1):
        raise ValueError(f"gate must be [{bsz * m}, {hq}, {d}] with unit stride along D, got {list(gate.shape)}")
    t_cap, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not divide into {hkv} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or not k_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous [S, T, Hkv, D] with equal strides")
    if slots is not None and (slots.shape != (bsz,) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slots must be int32/int64 [{bsz}], got {slots.dtype} {list(slots.shape)}")
    if slots is None and k_cache.shape[0] < bsz:
        raise ValueError(f"{bsz} sequences but only {k_cache.shape[0]} cache rows")
    hg = hq // hkv
    bq = max(16, next_pow2(hg * m))
    cfg = default_config()
    if bq > 16 and not INTERPRET:
        # shared memory: 3 stages of K/V tiles plus a wider q exceed the ~99 KB of an SM 12.x block
        cfg["num_stages"] = 2
    if bq >= 32 and not INTERPRET:  # the [BQ, D] fp32 accumulator needs the registers of 8 warps
        cfg["num_warps"] = 8
    cfg.update(config or {})
    bd = max(16, next_pow2(d))
    bt = cfg["BT"]
    max_len = t_cap if max_len is None else min(max_len, t_cap)
    blocks = triton.cdiv(max(max_len, 1), bt)
    nsplit = cfg.get("NSPLIT") or max(1, min(blocks, math.ceil(sm_count(q.device) * cfg.get("programs_per_sm", 1.0) / (bsz * hkv)),
                                             math.ceil(max_len / cfg.get("min_keys_per_split", 1))))
    keys_per_split = triton.cdiv(blocks, nsplit) * bt
    nsplit = triton.cdiv(max(max_len, 1), keys_per_split)
    gsize = cfg.get("GROUP") or next_pow2(math.ceil(math.sqrt(nsplit)))
    ngroup = triton.cdiv(nsplit, gsize)
    # chunk of partials merged per step: about 8K fp32 values in flight per program
    ch = cfg.get("CH") or max(1, min(gsize, 8192 // (bq * bd)))
    chg = max(1, min(next_pow2(ngroup), 8192 // (bq * bd)))
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    ws = torch.empty(bsz * hkv * (nsplit + ngroup) * bq * (bd + 2), dtype=torch.float32, device=q.device)
    cnt = counters if counters is not None else counters_for("decode_attention", bsz * hkv * (ngroup + 1), q.device)
    _decode_attn_kernel[(nsplit, hkv, bsz)](
        q.contiguous(), k_cache, v_cache, lengths, slots if slots is not None else lengths, out, ws,
        ws[bsz * hkv * nsplit * bq * (bd + 2):], cnt, gate if gate is not None else q,
        gate.stride(0) if gate is not None else 0, gate.stride(1) if gate is not None else 0,
        t_cap, hq, hkv, d, keys_per_split, scale * 1.4426950408889634, nsplit, ngroup,
        M=m, HG=hg, BQ=bq, BD=bd, BT=bt, GSIZE=gsize, NGROUPP=next_pow2(ngroup), CH=ch, CHG=chg,
        HAS_SLOTS=slots is not None, HAS_GATE=gate is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_options(q.device),
    )
    return out
