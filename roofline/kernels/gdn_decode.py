"""Fused Gated DeltaNet decode step: M = 1..5 new tokens per sequence, all of a layer's GDN math in one launch.

Per sequence b and value head h (key head h // (Hv/Hk)), token by token, from the projections:
  conv:  window = [conv_state[b] (K-1 rows) | qkv[b]]; mixed = silu(sum_i w[c, i] window[i, c]);
         conv_state[b] <- window[1:]                                   (in place)
  norms: q = l2norm(q) * dk^-0.5, k = l2norm(k)                       (per key head, eps 1e-6)
  gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  delta rule on S [dk, dv] fp32 (in place):
         S *= exp(g); d = beta * (v - S^T k); S += k d^T; o = S^T q
  out:   w * rmsnorm(o) * silu(z)                                      (over each head's dv)
The roundings to the model dtype follow roofline.model.layers.GatedDeltaNet step for step.

Pools and several tokens (the CUDA-graph decode step and the MTP verify step):
- `slots` [B] (int32/int64, optional): conv_state [S, K-1, C] and state [S, Hv, dk, dv] are pools
  of S >= B slots and sequence b reads and updates slot slots[b]; without it, row b.
- `tokens_per_seq` M: qkv [B*M, C], z [B*M, Hv*dv], a, b [B*M, Hv] and the output [B*M, Hv*dv]
  are sequence-major (row b*M + j is token j of sequence b). The M tokens are processed in order,
  exactly as M successive one-token steps (same roundings); the state stays in registers across
  them (read and written once), and the slot holds the values after all M tokens.
- `step_states` [B, M-1, Hv, dk, dv] fp32 and `step_conv` [B, M-1, K-1, C] (optional outputs):
  the recurrent state and the conv window (oldest row first, as conv_state holds it) after token
  j, j = 0..M-2, so a verify step that accepts only j+1 tokens can roll the slot back.

Parallelism: the state is the bytes (122B: 64 heads x 128 x 128 fp32 = 4.2 MB read and written
per layer), and fla's fused_recurrent kernel gives one program per head at T=1 (~4% of the
bandwidth). Here program (v block, value head, sequence) owns BV columns of one head's state,
so a layer runs Hv * dv/BV programs per sequence (512 at BV=16); each recomputes its key head's
q/k conv and norms (256 channels, cheap). Two things need the whole head or key head: the
RMSNorm over dv and the q/k conv-state update (other programs still read the old window). The
last program of each (sequence, key head) to arrive (see _common.arrive) does both, reading the
group's o vectors back from a small fp32 workspace.

Layouts: qkv [B*M, 2*Hk*dk + Hv*dv] ([q | k | v], as in_proj_qkv writes it; qkv, z, b and a may be column views of
a merged projection's output, their rows strided), conv_weight
[C, 1, K] or [C, K], state fp32; output in qkv's dtype (out_proj's input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (INTERPRET, arrive, counters_for, next_pow2, pdl_options, reset, rows_in_place,
                      wait_for_inputs)

MAX_TOKENS = 5  # tokens per sequence in one step (1 decode token + up to 4 MTP drafts)


def _check_step_outputs(bsz, m, conv_state, state, step_states, step_conv):
    if step_states is not None:
        want = (bsz, m - 1, *state.shape[1:])
        if tuple(step_states.shape) != want or step_states.dtype != torch.float32 or not step_states.is_contiguous():
            raise ValueError(f"step_states must be contiguous fp32 {list(want)}, got {list(step_states.shape)}")
    if step_conv is not None:
        want = (bsz, m - 1, *conv_state.shape[1:])
        if tuple(step_conv.shape) != want or step_conv.dtype != conv_state.dtype or not step_conv.is_contiguous():
            raise ValueError(f"step_conv must be contiguous {list(want)} in conv_state's dtype, got {list(step_conv.shape)}")


def _one_step(qkv, z, b, a, window_hist, conv_weight, A_log, dt_bias, norm_weight, s, num_k_heads, eps):
    """One token per sequence: qkv [N, C], window_hist [N, K-1, C], s [N, Hv, dk, dv] fp32
    -> (out [N, Hv*dv], new window [N, K-1, C], new state)."""
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
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1)
    v = v.view(bsz, hv, dv)
    beta = torch.sigmoid(b.float()).to(dtype).float()  # the model takes sigmoid in its dtype
    decay = (-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())).exp()
    s = s * decay[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    of = o.to(dtype).float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gated = (norm_weight.float() * normed.float()).to(dtype).float() * F.silu(z.view(bsz, hv, dv).float())
    return gated.to(dtype).reshape(bsz, hv * dv), window[:, 1:], s


def gdn_decode_reference(qkv, z, b, a, conv_state, conv_weight, A_log, dt_bias, norm_weight, state,
                         num_k_heads: int, eps: float = 1e-6, *, slots=None, tokens_per_seq: int = 1,
                         step_states=None, step_conv=None) -> torch.Tensor:
    """The same step in plain PyTorch (fp32 math, the model's roundings), M tokens as M one-token steps;
    updates conv_state and state (rows `slots`, or 0..B-1) in place and fills the optional step outputs."""
    m = tokens_per_seq
    n, conv_dim = qkv.shape
    if m < 1 or n % m:
        raise ValueError(f"{n} rows are not B sequences x {m} tokens")
    bsz = n // m
    _check_step_outputs(bsz, m, conv_state, state, step_states, step_conv)
    rows = torch.arange(bsz, device=qkv.device) if slots is None else slots.long()
    hist, s = conv_state[rows], state[rows]
    qkv3, z3, b3, a3 = (t.reshape(bsz, m, -1) for t in (qkv, z, b, a))
    outs = []
    for j in range(m):
        o, hist, s = _one_step(qkv3[:, j], z3[:, j], b3[:, j], a3[:, j], hist, conv_weight, A_log, dt_bias,
                               norm_weight, s, num_k_heads, eps)
        outs.append(o)
        if j < m - 1 and step_states is not None:
            step_states[:, j] = s
        if j < m - 1 and step_conv is not None:
            step_conv[:, j] = hist
    conv_state[rows] = hist
    state[rows] = s
    return torch.stack(outs, 1).reshape(n, -1)


@triton.jit
def _conv_silu(qkv_row, hist_ptr, w_ptr, c, cmask, C, QS, J: tl.constexpr, KERNEL: tl.constexpr,
               CONV_TY: tl.constexpr, OUT_TY: tl.constexpr):
    """silu(depthwise causal conv) of channels c for token J of the step, with the model's roundings.

    The inputs are ext = [K-1 cached rows | the step's tokens]; token J's window is ext[J : J+K].
    `qkv_row` points at the sequence's token 0 (rows QS apart; cached rows C apart)."""
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for i in tl.static_range(KERNEL):
        if J + i < KERNEL - 1:
            x = tl.load(hist_ptr + (J + i) * C + c, mask=cmask, other=0).to(tl.float32)
        else:
            x = tl.load(qkv_row + (J + i - (KERNEL - 1)) * QS + c, mask=cmask, other=0).to(tl.float32)
        acc += x * tl.load(w_ptr + c * KERNEL + i, mask=cmask, other=0).to(tl.float32)
    acc = acc.to(CONV_TY).to(tl.float32)
    return (acc / (1.0 + tl.exp(-acc))).to(OUT_TY).to(tl.float32)


@triton.jit
def _window_row(qkv_row, hist_ptr, c, cmask, C, QS, E: tl.constexpr, KERNEL: tl.constexpr):
    """ext[E] of channels c (ext = [K-1 cached rows | the step's tokens]), in the storage dtype."""
    if E < KERNEL - 1:
        x = tl.load(hist_ptr + E * C + c, mask=cmask)
    else:
        x = tl.load(qkv_row + (E - (KERNEL - 1)) * QS + c, mask=cmask)
    return x


@triton.jit
def _save_windows(qkv_row, hist_ptr, sconv_ptr, c, cmask, C, QS, M: tl.constexpr, KERNEL: tl.constexpr):
    """step_conv[j] <- ext[j+1 : j+K] for j < M-1 (before the cached rows change)."""
    for j in tl.static_range(M - 1):
        for i in tl.static_range(KERNEL - 1):
            x = _window_row(qkv_row, hist_ptr, c, cmask, C, QS, j + 1 + i, KERNEL)
            tl.store(sconv_ptr + (j * (KERNEL - 1) + i) * C + c, x, mask=cmask)


@triton.jit
def _shift_window(qkv_row, hist_ptr, c, cmask, C, QS, M: tl.constexpr, KERNEL: tl.constexpr):
    """conv_state rows <- ext[M : M+K-1]: the last K-1 inputs after the step's M tokens.

    Row i reads row i+M (> i) before that row is written; each thread stores only what it loaded."""
    for i in tl.static_range(KERNEL - 1):
        x = _window_row(qkv_row, hist_ptr, c, cmask, C, QS, M + i, KERNEL)
        tl.store(hist_ptr + i * C + c, x, mask=cmask)


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
def _gdn_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, nw_ptr, state_ptr, out_ptr, o_ws, cnt_ptr,
    slot_ptr, sstate_ptr, sconv_ptr,
    C, KEY, HV, HK, DK, DV, eps, QS, ZS, BS, AS,
    GROUP: tl.constexpr, GROUPP: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BV: tl.constexpr,
    NVB, KERNEL: tl.constexpr, CONV_TY: tl.constexpr, M: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SAVE_STATES: tl.constexpr, SAVE_CONV: tl.constexpr, PDL: tl.constexpr = False,
):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    bi = tl.program_id(2)
    kh = h // GROUP
    ty = out_ptr.dtype.element_ty
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + bi).to(tl.int64)
    else:
        slot = bi.to(tl.int64)
    qkv_row = qkv_ptr + (bi * M).to(tl.int64) * QS  # token 0 of this sequence (rows QS apart: z, b, a by theirs)
    hist = conv_ptr + slot * (KERNEL - 1) * C
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
    s_ptrs = state_ptr + ((slot * HV + h) * DK + dk[:, None]) * DV + vv[None, :]
    smask = dmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0)
    decay_scale = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    wait_for_inputs(PDL)  # qkv, z, b and a come from the projections
    for j in tl.static_range(M):
        tok = bi * M + j
        q = _conv_silu(qkv_row, hist, convw_ptr, cq, dmask, C, QS, j, KERNEL, CONV_TY, ty)
        k = _conv_silu(qkv_row, hist, convw_ptr, ck, dmask, C, QS, j, KERNEL, CONV_TY, ty)
        v = _conv_silu(qkv_row, hist, convw_ptr, cv, vmask, C, QS, j, KERNEL, CONV_TY, ty)
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
        s = s + k[:, None] * d[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ws + (tok * HV + h) * DV + vv, o, mask=vmask)
        if SAVE_STATES:
            if j < M - 1:
                sp = sstate_ptr + (((bi * (M - 1) + j) * HV + h) * DK + dk[:, None]).to(tl.int64) * DV + vv[None, :]
                tl.store(sp, s, mask=smask)
    tl.store(s_ptrs, s, mask=smask)
    sconv = sconv_ptr + (bi * (M - 1)).to(tl.int64) * (KERNEL - 1) * C
    if SAVE_CONV:
        _save_windows(qkv_row, hist, sconv, cv, vmask, C, QS, M, KERNEL)
    _shift_window(qkv_row, hist, cv, vmask, C, QS, M, KERNEL)  # this program's own v channels

    cnt = cnt_ptr + bi * HK + kh
    if arrive(cnt, GROUP * NVB):
        # every program of this key head has read the old window and written its o
        if SAVE_CONV:
            _save_windows(qkv_row, hist, sconv, cq, dmask, C, QS, M, KERNEL)
            _save_windows(qkv_row, hist, sconv, ck, dmask, C, QS, M, KERNEL)
        _shift_window(qkv_row, hist, cq, dmask, C, QS, M, KERNEL)
        _shift_window(qkv_row, hist, ck, dmask, C, QS, M, KERNEL)
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
               eps: float = 1e-6, *, slots=None, tokens_per_seq: int = 1, step_states=None, step_conv=None,
               out=None, block_v: int | None = None, num_warps: int | None = None, counters=None) -> torch.Tensor:
    """One fused GDN decode step of M = tokens_per_seq tokens per sequence (see the module docstring);
    updates conv_state and state (rows `slots`, or 0..B-1) in place -> [B*M, Hv*dv]."""
    m = tokens_per_seq
    n, conv_dim = qkv.shape
    hv, dk, dv = state.shape[1:]
    if not 1 <= m <= MAX_TOKENS or n % m:
        raise ValueError(f"gdn_decode takes 1..{MAX_TOKENS} tokens per sequence; {n} rows, tokens_per_seq={m}")
    bsz = n // m
    if state.dtype != torch.float32 or not state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("state must be contiguous fp32 [S, Hv, dk, dv]; conv_state contiguous [S, K-1, C]")
    if hv % num_k_heads:
        raise ValueError(f"{hv} value heads do not divide into {num_k_heads} key heads")
    if slots is None and (state.shape[0] < bsz or conv_state.shape[0] < bsz):
        raise ValueError(f"{bsz} sequences but only {state.shape[0]} state rows")
    if slots is not None and (slots.shape != (bsz,) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slots must be int32/int64 [{bsz}], got {slots.dtype} {list(slots.shape)}")
    _check_step_outputs(bsz, m, conv_state, state, step_states, step_conv)
    save_states = step_states is not None and m > 1
    save_conv = step_conv is not None and m > 1
    kernel = conv_state.shape[1] + 1
    group = hv // num_k_heads
    # 512 programs per sequence at 122B shapes; the interpreter runs programs one after another, so there one
    # V block per head (the split-V path is tested with an explicit block_v); either way every program writes its o to
    # the workspace and the key head's last program runs the gated norms, so the interpreter runs the GPU's code path
    bv = block_v or (16 if not INTERPRET else next_pow2(dv))
    nvb = triton.cdiv(dv, bv)
    if out is None:
        out = torch.empty(n, hv * dv, dtype=qkv.dtype, device=qkv.device)
    o_ws = torch.empty(n, hv, dv, dtype=torch.float32, device=qkv.device)
    cnt = counters if counters is not None else counters_for("gdn_decode", bsz * num_k_heads, qkv.device)
    (qkv, qs), (z, zs), (b, bs), (a, as_) = (rows_in_place(t) for t in (qkv, z, b, a))
    _gdn_decode_kernel[(nvb, hv, bsz)](
        qkv, z, b, a, conv_state, conv_weight.contiguous(),
        A_log, dt_bias, norm_weight, state, out, o_ws, cnt,
        slots if slots is not None else state, step_states if save_states else state,
        step_conv if save_conv else conv_state,
        conv_dim, num_k_heads * dk, hv, num_k_heads, dk, dv, eps, qs, zs, bs, as_,
        GROUP=group, GROUPP=next_pow2(group), BDK=next_pow2(dk), BDV=next_pow2(dv), BV=bv, NVB=nvb, KERNEL=kernel,
        CONV_TY=_TL[conv_weight.dtype], M=m, HAS_SLOTS=slots is not None, SAVE_STATES=save_states,
        SAVE_CONV=save_conv, num_warps=num_warps or (2 if not INTERPRET else 1), **pdl_options(qkv.device),
    )
    return out
