"""One launch for what PyTorch runs as a chain of small kernels in the decode step.

In a captured 122B decode step most of the time outside the weight kernels goes to small
ops at ~2 us each (BENCHMARKS.md's breakdown): a zero-centred RMSNorm is ~8 kernels in
PyTorch (cast, square, mean, add, rsqrt, two multiplies, cast back), the MoE router's
softmax / top-k / renormalise ~6. Here each is one launch over the step's few rows:

- `rms_norm(x, weight, eps)`: y = x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, rounded to
  x's dtype (roofline.model.layers.rms_norm), one program per row; `add_rms_norm` adds the
  residual first and returns both (the decoder layer's add and the next norm);
- `silu_mul(gate_up)`: silu(gate) * up (the shared expert's activation, two kernels in PyTorch);
- `route_top_k(logits, k)`: fp32 softmax over the experts, the k largest, renormalised to sum
  to 1 (SparseMoE.route), one program per token;
- `attention_prologue(...)`: gated attention's q/k norms, partial RoPE and the KV-cache write
  (~40 small kernels in PyTorch), one program per (token, head).

On by default in the fast path (`ROOFLINE_FUSED_SMALL_OPS=0` opts out, see dispatch.py); the
tests compare them with the references in Triton's interpreter and on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, pdl_options, rows_in_place, wait_for_inputs


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, eps, ADD: tl.constexpr, BD: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    mask = d < D
    x = tl.load(x_ptr + row * D + d, mask=mask, other=0)
    if ADD:  # h = x + r, rounded to the model dtype as the reference's add is, then normed
        x = x + tl.load(r_ptr + row * D + d, mask=mask, other=0)
        tl.store(h_ptr + row * D + d, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(y_ptr + row * D + d, (normed * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last axis, one program per row."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, d, eps, ADD=False, BD=next_pow2(d), **pdl_options(x.device))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = x + residual: the decoder layer's residual add and the next norm in one launch."""
    d = x.shape[-1]
    x2, r2 = x.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous()
    h, y = torch.empty_like(x2), torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, h, d, eps, ADD=True, BD=next_pow2(d), **pdl_options(x.device))
    return h.view(x.shape), y.view(x.shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, STRIDE, BI: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = i < I
    g = tl.load(gu_ptr + row * STRIDE + i, mask=mask, other=0).to(tl.float32)
    u = tl.load(gu_ptr + row * STRIDE + I + i, mask=mask, other=0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the dtype before the product
    tl.store(out_ptr + row * I + i, act * u, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from one [N, 2I] tensor holding [gate | up] per row (rows may be strided)."""
    n, i2 = gate_up.shape
    if gate_up.stride(1) != 1 or i2 % 2:
        raise ValueError(f"silu_mul wants rows of [gate | up] with unit stride, got {list(gate_up.shape)}")
    out = torch.empty(n, i2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(i2 // 2))
    _silu_mul_kernel[(n, triton.cdiv(i2 // 2, block))](gate_up, out, i2 // 2, gate_up.stride(0), BI=block,
                                                    **pdl_options(gate_up.device))
    return out


@triton.jit
def _order_bits(bits, SIGN: tl.constexpr):
    """A float's bits as a signed integer (sign bit SIGN, sign-extended) <-> an integer ordered as the floats are:
    negative floats' magnitude bits flipped. Its own inverse."""
    return bits ^ ((bits >> SIGN) & ((1 << SIGN) - 1))


@triton.jit
def softmax_top_k(z, e, mask, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr):
    """(experts [R, KP] int64, weights [R, KP] fp32) from router logits z [R, BE] (16-bit or fp32, as stored; `mask`
    [R, BE] or [1, BE] keeps the experts e < E, e [1, BE]): per row the K largest logits (the lowest index first among
    equals), their softmax probabilities over all E experts renormalised to sum to 1 (computed in fp32 as the K chosen
    logits' own softmax); all rows in one pass.

    One max reduction per choice: each candidate is an integer key, the logit's bits mapped to an order-preserving
    integer (negative floats' magnitude bits flipped; -0.0 taken as 0.0) above BE - 1 - e, so the key's maximum is the
    largest logit with the lowest index among equals; taken keys become the type's minimum (below -inf's). The choice
    compares the logits' own bits, so any kernel routing from the same logits chooses alike, whatever its layout.
    16-bit logits (the model's) make int32 keys, fp32 ones int64: on an H100 (session 27, 122B, the router's epilogue)
    the int32 keys made the step 0.026 ms faster at one row and 0.355 at three (the M = 3 verify) than int64 keys of
    the logits widened to fp32; one tree reduction keeping the 8 largest keys of two lists a step was no faster at one
    row and 0.05 ms slower at three."""
    z = tl.where(mask, z, -float("inf"))
    if z.dtype.primitive_bitwidth == 16:
        tl.static_assert(BE <= 65536)
        bits = z.to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(bits == -32768, 0, bits)
        key = (_order_bits(bits, 15) << 16) | (BE - 1 - e)
        lowest = tl.full(key.shape, -2147483648, tl.int32)
    else:
        bits = z.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        key = (_order_bits(bits, 31).to(tl.int64) << 32) | (BE - 1 - e).to(tl.int64)
        lowest = tl.full(key.shape, -2147483648, tl.int64) << 32
    slot = tl.arange(0, KP)[None, :]
    top = tl.zeros([z.shape[0], KP], dtype=key.dtype)
    for j in tl.static_range(K):
        best = tl.max(key, axis=1)[:, None]
        top = tl.where(slot == j, best, top)
        key = tl.where(key == best, lowest, key)
    chosen = (BE - 1 - (top & (BE - 1))).to(tl.int64)
    if z.dtype.primitive_bitwidth == 16:  # the map undone: the chosen logits
        top_z = _order_bits(top >> 16, 15).to(tl.int16).to(z.dtype, bitcast=True).to(tl.float32)
    else:
        top_z = _order_bits((top >> 32).to(tl.int32), 31).to(tl.float32, bitcast=True)
    # renormalised over the chosen, the softmax's sum over all E cancels: the weights are the K chosen logits' own
    # softmax (H100, session 28: the step 0.013 ms faster at one row than the softmax over all E, then renormalised)
    zmax = tl.max(tl.where(slot < K, top_z, -float("inf")), axis=1)[:, None]  # the first choice's logit
    p = tl.where(slot < K, tl.exp(top_z - zmax), 0.0)
    return chosen, p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _route_kernel(logits_ptr, experts_ptr, weights_ptr, E, STRIDE, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                  PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)[None, :]
    mask = e < E
    z = tl.load(logits_ptr + row * STRIDE + e, mask=mask, other=0)
    chosen, weights = softmax_top_k(z, e, mask, K, KP, BE)
    slot = tl.arange(0, KP)[None, :]
    tl.store(experts_ptr + row * K + slot, chosen, mask=slot < K)
    tl.store(weights_ptr + row * K + slot, weights, mask=slot < K)


def route_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64, weights [N, k] fp32 summing to 1) from router logits [N, E] (rows may be strided)."""
    n, e = logits.shape
    logits, row_stride = rows_in_place(logits)
    experts = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    _route_kernel[(n,)](logits, experts, weights, e, row_stride, K=k, KP=next_pow2(k), BE=next_pow2(e),
                        **pdl_options(logits.device))
    return experts, weights


@triton.jit
def _attention_prologue_kernel(qg_ptr, k_ptr, v_ptr, pos_ptr, kvpos_ptr, slot_ptr, qw_ptr, kw_ptr, inv_freq_ptr,
                               q_out_ptr, kc_ptr, vc_ptr, H, HKV, D, T_CAP, M, eps, QGS, KS, VS,
                               ROT: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)  # token row
    h = tl.program_id(1)  # 0..H-1: query heads; H..H+HKV-1: key (and value) heads
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BD)
    mask = d < D
    half: tl.constexpr = ROT // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate-half pairs (i, i + ROT/2)
    partner = tl.where(d < ROT, partner, d)
    is_q = h < H
    kh = h - H
    if is_q:
        base = qg_ptr + t * QGS + h * 2 * D  # [query D | gate D] per head; token rows QGS apart (KS, VS for k, v)
        w_ptr = qw_ptr
    else:
        base = k_ptr + t * KS + kh * D
        w_ptr = kw_ptr
    x = tl.load(base + d, mask=mask, other=0).to(tl.float32)
    xp = tl.load(base + partner, mask=mask, other=0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dt = q_out_ptr.dtype.element_ty
    normed = (x * r * (1.0 + tl.load(w_ptr + d, mask=mask, other=0).to(tl.float32))).to(dt).to(tl.float32)
    normed_p = (xp * r * (1.0 + tl.load(w_ptr + partner, mask=mask, other=0).to(tl.float32))).to(dt).to(tl.float32)
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + (d % half), mask=d < ROT, other=0)
    cos = tl.cos(angle).to(dt).to(tl.float32)
    sin = tl.sin(angle).to(dt).to(tl.float32)
    rotated = tl.where(d < half, -normed_p, normed_p)
    out = tl.where(d < ROT, normed * cos + rotated * sin, normed).to(dt)
    if is_q:
        tl.store(q_out_ptr + (t * H + h) * D + d, out, mask=mask)
    else:
        slot = tl.load(slot_ptr + t // M).to(tl.int64)
        row = ((slot * T_CAP + tl.load(kvpos_ptr + t)) * HKV + kh) * D
        tl.store(kc_ptr + row + d, out, mask=mask)
        v = tl.load(v_ptr + t * VS + kh * D + d, mask=mask, other=0)
        tl.store(vc_ptr + row + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def attention_prologue(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       kv_positions: torch.Tensor, slots: torch.Tensor, tokens_per_seq: int, q_norm_w: torch.Tensor,
                       k_norm_w: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Gated attention's work between the projections and decode attention, in one launch: q and k
    zero-centred-RMSNormed per head, partial RoPE (rotate-half over the first 2 * len(inv_freq) dims) at
    `positions`, k and v written into the pool at (slots[token // M], kv_positions[token]). Returns q [n, H, D].

    qg [n, H, 2D] ([query | gate] per head, as q_proj writes it), k, v [n, Hkv, D], each contiguous within a
    token's row but the rows possibly strided (column views of the merged q/k/v projection: no copy); the caches
    [S, T, Hkv, D]. The roundings to the model dtype follow the reference (normed, cos/sin), except that
    RoPE's products are summed in fp32 before the one rounding."""
    n, hq, d2 = qg.shape
    hkv, d = k.shape[1], k.shape[2]
    (qg, qgs), (k, ks), (v, vs) = (rows_in_place(t) for t in (qg, k, v))
    q = torch.empty(n, hq, d, dtype=qg.dtype, device=qg.device)
    _attention_prologue_kernel[(n, hq + hkv)](
        qg, k, v, positions, kv_positions, slots, q_norm_w, k_norm_w,
        inv_freq.to(qg.device),
        q, k_cache, v_cache, hq, hkv, d, k_cache.shape[1], tokens_per_seq, eps, qgs, ks, vs,
        ROT=2 * inv_freq.numel(), BD=next_pow2(d), **pdl_options(qg.device),
    )
    return q
