"""Fused Gated DeltaNet decode step: one new token per sequence, all of a layer's GDN math in one launch.

Per sequence b and value head h (key head h // (Hv/Hk)), from the projections of the token:
  conv:  window = [conv_state[b] (K-1 rows) | qkv[b]]; mixed = silu(sum_i w[c, i] window[i, c]);
         conv_state[b] <- window[1:]                                   (in place)
  norms: q = l2norm(q) * dk^-0.5, k = l2norm(k)                       (per key head, eps 1e-6)
  gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  delta rule on S [dk, dv] fp32 (in place):
         S *= exp(g); d = beta * (v - S^T k); S += k d^T; o = S^T q
  out:   w * rmsnorm(o) * silu(z)                                      (over each head's dv)
The roundings to the model dtype follow roofline.model.layers.GatedDeltaNet step for step.

Parallelism: the state is the bytes (122B: 64 heads x 128 x 128 fp32 = 4.2 MB read and written
per layer), and fla's fused_recurrent kernel gives one program per head at T=1 (~4% of the
bandwidth). Here program (v block, value head, sequence) owns BV columns of one head's state,
so a layer runs Hv * dv/BV programs per sequence (512 at BV=16); each recomputes its key head's
q/k conv and norms (256 channels, cheap). Two things need the whole head or key head: the
RMSNorm over dv and the q/k conv-state update (other programs still read the old window). The
last program of each (sequence, key head) to arrive (see _common.arrive) does both, reading the
group's o vectors back from a small fp32 workspace.

Layouts: qkv [B, 2*Hk*dk + Hv*dv] ([q | k | v], as in_proj_qkv writes it), z [B, Hv*dv], a, b
[B, Hv], conv_state [B, K-1, C] (the reference cache's rows, oldest first), conv_weight [C, 1, K]
or [C, K], state [B, Hv, dk, dv] fp32; output [B, Hv*dv] in qkv's dtype (out_proj's input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import INTERPRET, arrive, counters_for, next_pow2, reset


def gdn_decode_reference(qkv, z, b, a, conv_state, conv_weight, A_log, dt_bias, norm_weight, state,
                         num_k_heads: int, eps: float = 1e-6) -> torch.Tensor:
    """The same step in plain PyTorch (fp32 math, the model's roundings); updates conv_state and state in place."""
    bsz, conv_dim = qkv.shape
    hv, dk, dv = state.shape[1:]
    key = num_k_heads * dk
    dtype = qkv.dtype
    w = conv_weight.reshape(conv_dim, -1).float()
    window = torch.cat([conv_state, qkv[:, None, :]], dim=1)  # [B, K, C]
    conv_state.copy_(window[:, 1:])
    mixed = (window.float() * w.t()[None]).sum(1).to(conv_weight.dtype)  # conv1d, rounded as the model's
    mixed = F.silu(mixed.float()).to(dtype).float()
    q, k, v = mixed.split([key, key, hv * dv], dim=-1)
    group = hv // num_k_heads
    q = q.view(bsz, num_k_heads, dk)
    k = k.view(bsz, num_k_heads, dk)
    q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1) * dk**-0.5
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1)
    v = v.view(bsz, hv, dv)
    beta = torch.sigmoid(b.float()).to(dtype).float()  # the model takes sigmoid in its dtype
    decay = (-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())).exp()
    s = state * decay[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    state.copy_(s)
    of = o.to(dtype).float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gated = (norm_weight.float() * normed.float()).to(dtype).float() * F.silu(z.view(bsz, hv, dv).float())
    return gated.to(dtype).reshape(bsz, hv * dv)


@triton.jit
def _conv_silu(qkv_row, hist_ptr, w_ptr, c, cmask, C, KERNEL: tl.constexpr, CONV_TY: tl.constexpr, OUT_TY: tl.constexpr):
    """silu(depthwise causal conv) of channels c over [K-1 cached rows | new value], with the model's roundings."""
    new = tl.load(qkv_row + c, mask=cmask, other=0).to(tl.float32)
    acc = new * tl.load(w_ptr + c * KERNEL + (KERNEL - 1), mask=cmask, other=0).to(tl.float32)
    for i in tl.static_range(KERNEL - 1):
        hist = tl.load(hist_ptr + i * C + c, mask=cmask, other=0).to(tl.float32)
        acc += hist * tl.load(w_ptr + c * KERNEL + i, mask=cmask, other=0).to(tl.float32)
    acc = acc.to(CONV_TY).to(tl.float32)
    return (acc / (1.0 + tl.exp(-acc))).to(OUT_TY).to(tl.float32)


@triton.jit
def _shift_window(qkv_row, hist_ptr, c, cmask, C, KERNEL: tl.constexpr):
    """conv_state rows <- [rows 1..K-2 | new value]: drop the oldest input."""
    for i in tl.static_range(KERNEL - 2):
        tl.store(hist_ptr + i * C + c, tl.load(hist_ptr + (i + 1) * C + c, mask=cmask), mask=cmask)
    tl.store(hist_ptr + (KERNEL - 2) * C + c, tl.load(qkv_row + c, mask=cmask), mask=cmask)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, nw_ptr, state_ptr, out_ptr, o_ws, cnt_ptr,
    C, KEY, HV, HK, DK, DV, eps,
    GROUP: tl.constexpr, GROUPP: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BV: tl.constexpr,
    NVB, KERNEL: tl.constexpr, CONV_TY: tl.constexpr,
):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    bi = tl.program_id(2)
    kh = h // GROUP
    ty = out_ptr.dtype.element_ty
    qkv_row = qkv_ptr + bi * C
    hist = conv_ptr + bi * (KERNEL - 1) * C
    dk = tl.arange(0, BDK)
    dmask = dk < DK
    vv = vb * BV + tl.arange(0, BV)
    vmask = vv < DV
    cq = kh * DK + dk
    ck = KEY + kh * DK + dk
    cv = 2 * KEY + h * DV + vv

    q = _conv_silu(qkv_row, hist, convw_ptr, cq, dmask, C, KERNEL, CONV_TY, ty)
    k = _conv_silu(qkv_row, hist, convw_ptr, ck, dmask, C, KERNEL, CONV_TY, ty)
    v = _conv_silu(qkv_row, hist, convw_ptr, cv, vmask, C, KERNEL, CONV_TY, ty)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK.to(tl.float32)))
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    bv = tl.load(b_ptr + bi * HV + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bv))).to(ty).to(tl.float32)
    u = tl.load(a_ptr + bi * HV + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(u)))
    decay = tl.exp(-tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus)

    s_ptrs = state_ptr + ((bi * HV + h) * DK + dk[:, None]).to(tl.int64) * DV + vv[None, :]
    smask = dmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0) * decay
    d = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * d[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=smask)
    tl.store(o_ws + (bi * HV + h) * DV + vv, o, mask=vmask)
    _shift_window(qkv_row, hist, cv, vmask, C, KERNEL)  # this program's own v channels

    cnt = cnt_ptr + bi * HK + kh
    if arrive(cnt, GROUP * NVB):
        # every program of this key head has read the old window and written its o
        _shift_window(qkv_row, hist, cq, dmask, C, KERNEL)
        _shift_window(qkv_row, hist, ck, dmask, C, KERNEL)
        gi = tl.arange(0, GROUPP)
        dv = tl.arange(0, BDV)
        heads = kh * GROUP + gi
        omask = (gi < GROUP)[:, None] & (dv < DV)[None, :]
        offs = (bi * HV + heads)[:, None] * DV + dv[None, :]
        of = tl.load(o_ws + offs, mask=omask, other=0, cache_modifier=".cg").to(ty).to(tl.float32)
        rms = tl.rsqrt(tl.sum(of * of, axis=1) / DV + eps)
        normed = (of * rms[:, None]).to(ty).to(tl.float32)
        nw = tl.load(nw_ptr + dv, mask=dv < DV, other=0).to(tl.float32)
        gated = (nw[None, :] * normed).to(ty).to(tl.float32)
        zz = tl.load(z_ptr + bi * HV * DV + heads[:, None] * DV + dv[None, :], mask=omask, other=0).to(tl.float32)
        res = gated * (zz / (1.0 + tl.exp(-zz)))
        tl.store(out_ptr + bi * HV * DV + heads[:, None] * DV + dv[None, :], res.to(ty), mask=omask)
        reset(cnt)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def gdn_decode(qkv, z, b, a, conv_state, conv_weight, A_log, dt_bias, norm_weight, state, num_k_heads: int,
               eps: float = 1e-6, *, out=None, block_v: int | None = None, num_warps: int | None = None,
               counters=None) -> torch.Tensor:
    """One fused GDN decode step (see the module docstring); updates conv_state and state in place."""
    bsz, conv_dim = qkv.shape
    hv, dk, dv = state.shape[1:]
    if state.dtype != torch.float32 or not state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("state must be contiguous fp32 [B, Hv, dk, dv]; conv_state contiguous [B, K-1, C]")
    if hv % num_k_heads:
        raise ValueError(f"{hv} value heads do not divide into {num_k_heads} key heads")
    kernel = conv_state.shape[1] + 1
    group = hv // num_k_heads
    bv = block_v or (16 if not INTERPRET else 8)  # 512 programs per sequence at 122B shapes
    nvb = triton.cdiv(dv, bv)
    if out is None:
        out = torch.empty(bsz, hv * dv, dtype=qkv.dtype, device=qkv.device)
    o_ws = torch.empty(bsz, hv, dv, dtype=torch.float32, device=qkv.device)
    cnt = counters if counters is not None else counters_for("gdn_decode", bsz * num_k_heads, qkv.device)
    _gdn_decode_kernel[(nvb, hv, bsz)](
        qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_state, conv_weight.contiguous(),
        A_log, dt_bias, norm_weight, state, out, o_ws, cnt,
        conv_dim, num_k_heads * dk, hv, num_k_heads, dk, dv, eps,
        GROUP=group, GROUPP=next_pow2(group), BDK=next_pow2(dk), BDV=next_pow2(dv), BV=bv, NVB=nvb, KERNEL=kernel,
        CONV_TY=_TL[conv_weight.dtype], num_warps=num_warps or (2 if not INTERPRET else 1),
    )
    return out
