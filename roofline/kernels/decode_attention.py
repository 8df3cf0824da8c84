"""Decode attention over a KV cache: GQA, head dim up to 256, 1..4 query tokens per sequence, causal.

Interface: q [B, M, Hq, D] (RoPE already applied), k_cache / v_cache [B (or S), T, Hkv, D], lengths [B]
int: sequence b holds lengths[b] valid cache entries, the last M of which are its M query tokens
(query i sits at position lengths[b] - M + i and sees keys 0..that position). T is the cache's
capacity; `max_len` (a host-side bound on lengths) sizes the grid, so a graph captured for one
bound stays valid while lengths grow up to it.

Flash-decoding: program (split, kv head, sequence) streams its share of the sequence's keys (one of
NSPLIT shares of its length, `SPLIT_BY_LENGTH`) once for all Hq/Hkv query heads of the kv head and
all M query tokens (rows = heads x tokens, padded to 16
for the matrix unit), keeping an online softmax, and writes its partial (max, sum, output)
triple; a second launch merges them, one program per (sequence and kv head, row, 64 output
dims), each reading every split's partial of its slice at once. (Until 2026-12-03 the last split
to finish merged all of a kv head's partials in two levels inside the first launch: on the H200,
ncu showed the SMs busy for 6 us of a 42 us kernel at 8K and 20 of 62 us at 32K, the rest one
program per kv head merging 16 rows x 256 dims of 32-64 partials.) With one split the first
launch writes the output itself.

Pools: with `slots` [B] (int32/int64), k_cache / v_cache are [S, T, Hkv, D] pools of S slots and
sequence b reads row slots[b]; without it, row b.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import INTERPRET, next_pow2, pdl_options, sm_count, wait_for_inputs


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
    q_ptr, k_ptr, v_ptr, len_ptr, slot_ptr, out_ptr, ws_ptr, gate_ptr, GATE_ROW, GATE_HEAD,
    T, HQ, HKV, D, KEYS_PER_SPLIT, scale_log2, NSPLIT,
    M: tl.constexpr, HG: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    HAS_SLOTS: tl.constexpr, HAS_GATE: tl.constexpr, BY_LENGTH: tl.constexpr = False, PDL: tl.constexpr = False,
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
    if BY_LENGTH:  # the sequence's own keys in NSPLIT shares (whole tiles), whatever span the grid was sized for
        keys_per_split = tl.cdiv(tl.cdiv(length, NSPLIT), BT) * BT
    else:
        keys_per_split = KEYS_PER_SPLIT
    start = sp * keys_per_split
    end = tl.minimum(start + keys_per_split, length)
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
    if NSPLIT == 1:
        out_offs = ((b * M + tok) * HQ + head)[:, None] * D + dd[None, :]
        gate_offs = ((b * M + tok) * GATE_ROW + head * GATE_HEAD)[:, None] + dd[None, :]
        _finish(out_ptr, out_offs, rmask[:, None] & dmask[None, :], acc, l_i, gate_ptr, gate_offs, HAS_GATE)
    else:  # workspace per (b, kvh, split): [BQ] max, [BQ] sum, [BQ, BD] unnormalised output
        WS: tl.constexpr = BQ * (BD + 2)
        base = ws_ptr + ((b * HKV + kvh) * NSPLIT + sp).to(tl.int64) * WS
        tl.store(base + r, m_i, mask=rmask)
        tl.store(base + BQ + r, l_i, mask=rmask)
        tl.store(base + 2 * BQ + r[:, None] * BD + dd[None, :], acc, mask=rmask[:, None])


@triton.jit
def _decode_attn_merge_kernel(
    ws_ptr, out_ptr, gate_ptr, GATE_ROW, GATE_HEAD, HQ, HKV, D, NSPLIT,
    M: tl.constexpr, HG: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, DC: tl.constexpr, SP: tl.constexpr,
    HAS_GATE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (sequence x kv head, row, dim chunk): merge the NSPLIT (<= SP) partials of one row's DC dims."""
    wait_for_inputs(PDL)
    bh = tl.program_id(0)
    r = tl.program_id(1)  # head_in_group * M + token
    b = bh // HKV
    head = (bh % HKV) * HG + r // M
    tok = r % M
    WS: tl.constexpr = BQ * (BD + 2)
    s = tl.arange(0, SP)
    smask = s < NSPLIT
    base = ws_ptr + (bh * NSPLIT + s).to(tl.int64) * WS
    dd = tl.program_id(2) * DC + tl.arange(0, DC)
    dmask = dd < D
    m_s = tl.load(base + r, mask=smask, other=-1.0e30, cache_modifier=".cg")
    l_s = tl.load(base + BQ + r, mask=smask, other=0.0, cache_modifier=".cg")
    part = tl.load(base[:, None] + 2 * BQ + r * BD + dd[None, :], mask=smask[:, None] & dmask[None, :], other=0.0,
                   cache_modifier=".cg")
    w = tl.exp2(m_s - tl.max(m_s, axis=0))  # splits without keys: max -1e30, weight 0
    acc = tl.sum(part * w[:, None], axis=0)[None, :]  # [1, DC]: one row for _finish
    l = tl.sum(w[None, :] * l_s[None, :], axis=1)  # [1]
    _finish(out_ptr, (((b * M + tok) * HQ + head) * D + dd)[None, :], dmask[None, :], acc, l, gate_ptr,
            ((b * M + tok) * GATE_ROW + head * GATE_HEAD + dd)[None, :], HAS_GATE)


# K/V pipeline stages of the query tiles wider than 16 rows (2-4 tokens of a 16-head group: the MTP verify step), where
# a block's shared memory holds them. H100, session 37 (`kernels.py --only attn`, 4 query tokens, 32q/2kv, d 256):
# 36.5 us at 3 stages against 51.3 at 2 over 32K keys, 21.3 against 26.7 over 8K. At 3 stages the 64-row tile takes
# ~128 KB of shared memory (offline compile for sm_90): more than a GB10 (sm_121) block's ~99 KB, which keeps 2 there;
# the 32-row tile takes ~82 KB, which fits both. `WIDE_TILE_STAGES = 2` is the rule before session 37.
WIDE_TILE_STAGES = 3
WIDE_TILE_SHARED = 160 * 1024  # a block's shared memory from which the 64-row tile takes WIDE_TILE_STAGES
# Each sequence's keys are shared among the splits by its own length (read on the device), not by the span the grid was
# sized for: a CUDA graph's span is a power-of-two bucket, so a sequence just past 32K tokens runs in the 64K bucket,
# where splits of span / NSPLIT keys left half of them empty (half the SMs idle; the 27B's 32K graph 8.04 ms in the
# table's 64K bucket against 7.35 in ab_step's 36K pool, H100, session 37). False: shares of the span (before).
SPLIT_BY_LENGTH = True
# Programs a SM that the splits of all sequences' kv heads add up to. One: ~0.77 of copy alone over 32K keys on an
# H100 (session 37); two were slower alone and in the 122B step at 32K (+0.026 ms, ab_step, 3 rounds).
PROGRAMS_PER_SM = 1.0


def pipeline_stages(bq: int, shared_per_block: int) -> int:
    """The K/V pipeline stages of a query tile of `bq` rows on a device whose blocks have `shared_per_block` bytes of
    shared memory (the GPU configuration; targets.py compiles what this picks for each target)."""
    if bq <= 16:
        return 3
    return WIDE_TILE_STAGES if bq <= 32 or shared_per_block >= WIDE_TILE_SHARED else 2


@functools.lru_cache(maxsize=None)
def _shared_per_block(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def default_config(bq: int = 16, device=None) -> dict:
    """One program per SM (B x Hkv x splits); the merge launch reads every split's partial of its slice at once,
    so its time barely grows with the split count. `bq`: the query tile's rows (heads of a group x tokens)."""
    if INTERPRET:
        return {"BT": 16, "num_warps": 1, "num_stages": 1}
    device = torch.device("cuda" if device is None else device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # min_keys_per_split: at short spans (the 1K bucket at context ~0) one split per SM left ~60 programs
    # mostly empty, and their partials and the in-kernel merge of then cost ~35 us per layer (H200 profile, 2026-12-03)
    return {"BT": 32, "num_warps": 4 if bq < 32 else 8,  # the [BQ, D] fp32 accumulator needs 8 warps' registers
            "num_stages": pipeline_stages(bq, _shared_per_block(index)), "programs_per_sm": PROGRAMS_PER_SM,
            "min_keys_per_split": 256}


def decode_attention(q, k_cache, v_cache, lengths, scale: float | None = None, *, max_len: int | None = None, out=None,
                     slots=None, gate=None, config: dict | None = None) -> torch.Tensor:
    """Attention of q [B, M, Hq, D] over the caches [S, T, Hkv, D] (row slots[b] for sequence b, or row b)
    (see the module docstring) -> [B, M, Hq, D]; with `gate` [B*M, Hq, D] (any row and head strides, unit
    stride along D), the output times sigmoid(gate): gated attention's output gate, applied where the output is written."""
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
    cfg = default_config(bq, q.device)
    cfg.update(config or {})
    bd = max(16, next_pow2(d))
    bt = cfg["BT"]
    max_len = t_cap if max_len is None else min(max_len, t_cap)
    blocks = triton.cdiv(max(max_len, 1), bt)
    nsplit = cfg.get("NSPLIT") or max(1, min(blocks, math.ceil(sm_count(q.device) * cfg.get("programs_per_sm", 1.0) / (bsz * hkv)),
                                             math.ceil(max_len / cfg.get("min_keys_per_split", 1))))
    keys_per_split = triton.cdiv(blocks, nsplit) * bt
    nsplit = triton.cdiv(max(max_len, 1), keys_per_split)
    scale = d**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    ws = torch.empty(bsz * hkv * nsplit * bq * (bd + 2) if nsplit > 1 else 1, dtype=torch.float32, device=q.device)
    gate_args = (gate if gate is not None else q, gate.stride(0) if gate is not None else 0,
                 gate.stride(1) if gate is not None else 0)
    _decode_attn_kernel[(nsplit, hkv, bsz)](
        q.contiguous(), k_cache, v_cache, lengths, slots if slots is not None else lengths, out, ws, *gate_args,
        t_cap, hq, hkv, d, keys_per_split, scale * 1.4426950408889634, nsplit,
        M=m, HG=hg, BQ=bq, BD=bd, BT=bt, HAS_SLOTS=slots is not None, HAS_GATE=gate is not None,
        BY_LENGTH=SPLIT_BY_LENGTH, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(q.device),
    )
    if nsplit > 1:
        dc = min(bd, cfg.get("merge_dims", 64))
        _decode_attn_merge_kernel[(bsz * hkv, hg * m, triton.cdiv(d, dc))](
            ws, out, *gate_args, hq, hkv, d, nsplit, M=m, HG=hg, BQ=bq, BD=bd, DC=dc, SP=next_pow2(nsplit),
            HAS_GATE=gate is not None, num_warps=1 if INTERPRET else 4, **pdl_options(q.device),
        )
    return out
