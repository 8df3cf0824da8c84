"""Decode attention over a KV cache: GQA, head dim up to 256, 1..4 query tokens per sequence, causal.

Interface: q [B, M, Hq, D] (RoPE already applied), k_cache / v_cache [B, T, Hkv, D], lengths [B]
int: sequence b holds lengths[b] valid cache entries, the last M of which are its M query tokens
(query i sits at position lengths[b] - M + i and sees keys 0..that position). T is the cache's
capacity; `max_len` (a host-side bound on lengths) sizes the grid, so a graph captured for one
bound stays valid while lengths grow up to it.

Flash-decoding: program (split, kv head, sequence) streams its share of the cache once for all
Hq/Hkv query heads of the kv head and all M query tokens (rows = heads x tokens, padded to 16
for the matrix unit), keeping an online softmax; the last split of a (sequence, kv head) to
finish combines the partial (max, sum, output) triples in split order (see _common.arrive).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import INTERPRET, arrive, counters_for, next_pow2, reset
from .int4_gemv import _sm_count


def decode_attention_reference(q, k_cache, v_cache, lengths, scale: float | None = None) -> torch.Tensor:
    """Per sequence: causal GQA softmax(q k^T * scale) v over the first lengths[b] cache entries, in fp32."""
    bsz, m, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b in range(bsz):
        length = int(lengths[b])
        keys = k_cache[b, :length].float().transpose(0, 1)  # [Hkv, L, D]
        values = v_cache[b, :length].float().transpose(0, 1)
        pos = torch.arange(length - m, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [M, L]
        o = F.scaled_dot_product_attention(
            q[b].float().transpose(0, 1), keys.repeat_interleave(hq // hkv, 0), values.repeat_interleave(hq // hkv, 0),
            attn_mask=mask, scale=scale,
        )
        out[b] = o.transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, ws_ptr, cnt_ptr,
    T, HQ, HKV, D, KEYS_PER_SPLIT, scale_log2,
    M: tl.constexpr, HG: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, NSPLIT, NSPLITP: tl.constexpr,
):
    sp = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(len_ptr + b).to(tl.int32)
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
    kv_base = (b.to(tl.int64) * T * HKV + kvh) * D
    for t0 in range(start, end, BT):
        t = t0 + tt
        tmask = t < end
        offs = kv_base + (t * HKV * D)[:, None] + dd[None, :]
        k = tl.load(k_ptr + offs, mask=tmask[:, None] & dmask[None, :], other=0)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BQ, BT], log2 units
        ok = (t[None, :] <= pos[:, None]) & tmask[None, :]
        s = tl.where(ok, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(ok, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=tmask[:, None] & dmask[None, :], other=0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # workspace per (b, kvh, split): [BQ] max, [BQ] sum, [BQ, BD] unnormalised output
    wbase = ws_ptr + ((b * HKV + kvh) * NSPLIT + sp).to(tl.int64) * (BQ * (BD + 2))
    tl.store(wbase + r, m_i)
    tl.store(wbase + BQ + r, l_i)
    tl.store(wbase + 2 * BQ + r[:, None] * BD + dd[None, :], acc)
    cnt = cnt_ptr + b * HKV + kvh
    if arrive(cnt, NSPLIT):
        # combine: all splits' (max, sum) at once, then the weighted outputs, loads unrolled (NSPLITP bound)
        base = ws_ptr + ((b * HKV + kvh) * NSPLIT).to(tl.int64) * (BQ * (BD + 2))
        sp_all = tl.arange(0, NSPLITP)
        used = (sp_all < NSPLIT) & (sp_all * KEYS_PER_SPLIT < length)
        ms = tl.load(base + sp_all[:, None] * (BQ * (BD + 2)) + r[None, :], mask=used[:, None], other=-1.0e30,
                     cache_modifier=".cg")  # [NSPLITP, BQ]
        ls = tl.load(base + sp_all[:, None] * (BQ * (BD + 2)) + BQ + r[None, :], mask=used[:, None], other=0.0,
                     cache_modifier=".cg")
        m_all = tl.max(ms, axis=0)
        wts = tl.where(used[:, None], tl.exp2(ms - m_all[None, :]), 0.0)  # [NSPLITP, BQ]
        l_all = tl.sum(wts * ls, axis=0)
        o_all = tl.zeros([BQ, BD], dtype=tl.float32)
        for s2 in tl.static_range(NSPLITP):
            w_s = tl.sum(tl.where(sp_all[:, None] == s2, wts, 0.0), axis=0)  # [BQ]
            rows = tl.where((s2 < NSPLIT) & (s2 * KEYS_PER_SPLIT < length), BQ, 0)
            o_s = tl.load(base + s2 * (BQ * (BD + 2)) + 2 * BQ + r[:, None] * BD + dd[None, :],
                          mask=(r < rows)[:, None], other=0.0, cache_modifier=".cg")
            o_all += o_s * w_s[:, None]
        o = o_all / l_all[:, None]
        tl.store(out_ptr + ((b * M + tok) * HQ + head)[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])
        reset(cnt)


def default_config() -> dict:
    """About one program per two SMs: fewer, longer splits (their K/V loads pipelined by num_stages) keep the
    final combine short; measured on the H200, 66 short splits spent most of their time combining."""
    if INTERPRET:
        return {"BT": 16, "num_warps": 1, "num_stages": 1}
    return {"BT": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 0.5}


def decode_attention(q, k_cache, v_cache, lengths, scale: float | None = None, *, max_len: int | None = None, out=None,
                     config: dict | None = None, counters=None) -> torch.Tensor:
    """Attention of q [B, M, Hq, D] over the caches [B, T, Hkv, D] (see the module docstring) -> [B, M, Hq, D]."""
    bsz, m, hq, d = q.shape
    t_cap, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not divide into {hkv} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or not k_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous [B, T, Hkv, D] with equal strides")
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
    nsplit = cfg.get("NSPLIT") or max(1, min(blocks, math.ceil(_sm_count(q.device) * cfg.get("programs_per_sm", 1.0) / (bsz * hkv))))
    keys_per_split = triton.cdiv(blocks, nsplit) * bt
    nsplit = triton.cdiv(max(max_len, 1), keys_per_split)
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    ws = torch.empty(bsz * hkv * nsplit * bq * (bd + 2), dtype=torch.float32, device=q.device)
    cnt = counters if counters is not None else counters_for("decode_attention", bsz * hkv, q.device)
    _decode_attn_kernel[(nsplit, hkv, bsz)](
        q.contiguous(), k_cache, v_cache, lengths, out, ws, cnt,
        t_cap, hq, hkv, d, keys_per_split, scale * 1.4426950408889634,
        M=m, HG=hg, BQ=bq, BD=bd, BT=bt, NSPLIT=nsplit, NSPLITP=next_pow2(nsplit),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
