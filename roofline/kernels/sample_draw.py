"""One launch for a sampled token's filters and draw over each row's top candidates; one for a row's argmax and
logsumexp (`row_stats`).

engine/sampling.py samples a row that has a top_k (Qwen3.5's generation_config asks for 20) from its
largest top_k + TIE_CANDIDATES scores. In PyTorch what follows the top-k is ~20 small kernels a token
(flips, the temperature, the k-th score's gather and mask, two softmaxes, the cumulative sum and its
mask, min_p, the noise's gather, clamp, division and argmax, three host-to-device copies of per-row
parameters), each a launch of a few microseconds on the decode step's critical path. Here they are one
program per row, in the same order and on the same values: the candidates ascending, temperature, top_k
(ties with the k-th kept), top_p (the ascending cumulative probability <= 1 - top_p dropped, the most
likely token always kept), min_p, the softmax and the exponential race against the same noise
(`sampling.exponential_noise`: one Exp(1) per vocabulary token, gathered at the candidates' ids).
The sums run in another order than PyTorch's, so a row whose cumulative probability lands within
rounding of 1 - top_p may keep one token more or less.

On by default on CUDA (`ROOFLINE_FUSED_SAMPLING=0` opts out). benchmarks/sampling.py times both forms: on an H100
(session 23) a token with Qwen3.5's thinking defaults took 38 kernels and 102 us of kernel time against 61 and 131,
and 355 against 679 us as back-to-back calls, with the same tokens over 32 seeds. Most of what is left is PyTorch's
top-k over the 248K scores (~20 radix-select kernels, ~66 us).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, arrive, counters_for, next_pow2, reset

# Per-row parameters, packed so that one host-to-device copy carries them: temperature, top_k, top_p, log(min_p)
# (-inf without min_p). top_k as fp32 is exact below 2^24.
PARAMS = 4


@triton.jit
def _draw_candidates_kernel(vals_ptr, ids_ptr, noise_ptr, params_ptr, out_ptr, C, NOISE_STRIDE, BC: tl.constexpr,
                            NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BC)  # ascending: position j holds the (BC - 1 - j)-th largest candidate, padding first
    desc = BC - 1 - j
    valid = desc < C
    s = tl.load(vals_ptr + row * C + desc, mask=valid, other=float("-inf"))
    temperature = tl.load(params_ptr + row * NP)
    top_k = tl.load(params_ptr + row * NP + 1).to(tl.int32)
    top_p = tl.load(params_ptr + row * NP + 2)
    log_min_p = tl.load(params_ptr + row * NP + 3)
    s = s / temperature
    kth = tl.sum(tl.where(j == BC - top_k, s, 0.0), axis=0)  # the k-th largest (top_k <= C: always a candidate)
    s = tl.where(s < kth, float("-inf"), s)
    e = tl.exp(s - tl.max(s, axis=0))
    cumulative = tl.cumsum(e / tl.sum(e, axis=0), axis=0)
    s = tl.where((cumulative <= 1 - top_p) & (j != BC - 1), float("-inf"), s)  # the most likely token always stays
    # min_p: p_i < min_p * p_max  <=>  s_i < s_max + log(min_p)
    s = tl.where(s < tl.max(s, axis=0) + log_min_p, float("-inf"), s)
    e = tl.exp(s - tl.max(s, axis=0))
    probs = e / tl.sum(e, axis=0)
    ids = tl.load(ids_ptr + row * C + desc, mask=valid, other=0)
    noise = tl.load(noise_ptr + row * NOISE_STRIDE + ids, mask=valid, other=1.0)
    race = tl.where(valid, probs / tl.maximum(noise, 1.1754943508222875e-38), -1.0)  # the clamp: no 0/0
    pick = tl.argmax(race, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * C + (BC - 1 - pick)))


def draw_candidates(values: torch.Tensor, ids: torch.Tensor, noise: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """One token id per row. values / ids [B, C]: each row's C largest raw scores in descending order (topk) and
    their token ids; noise [B, V] fp32: the rows' Exp(1) noise over the vocabulary; params [B, PARAMS] fp32
    (temperature, top_k <= C, top_p, log(min_p) or -inf)."""
    rows, c = values.shape
    if values.dtype != torch.float32 or noise.dtype != torch.float32 or params.shape != (rows, PARAMS):
        raise ValueError(f"draw_candidates: fp32 values and noise and [{rows}, {PARAMS}] params expected, got "
                         f"{values.dtype} / {noise.dtype} / {tuple(params.shape)}")
    out = torch.empty(rows, dtype=torch.long, device=values.device)
    _draw_candidates_kernel[(rows,)](values.contiguous(), ids.contiguous(), noise, params.contiguous(), out, c,
                                     noise.stride(0), BC=next_pow2(c), NP=PARAMS)
    return out


# --------------------------------------------------------------------------- a row's argmax and logsumexp

# Every decoded token needs its row's argmax (greedy) and logsumexp (the reported logprob): in PyTorch ~15 kernels and
# ~34 us of kernel time over the 248K-token vocabulary (H100, session 23's benchmarks/sampling.py). Here one launch:
# each program reduces a chunk of ROW_CHUNK scores to (max, its first index, the sum of exp(x - max)), and the last
# program of a row to arrive combines the chunks in order.
ROW_CHUNK = 4096


class RowStats(NamedTuple):
    ids: torch.Tensor  # [B] int64: each row's argmax, the lowest index on ties (as torch.argmax)
    log_z: torch.Tensor  # [B, 1] fp32: each row's logsumexp
    top_logprob: torch.Tensor  # [B] fp32: the argmax's log-probability, max - log_z


@triton.jit
def _row_stats_kernel(x_ptr, ids_ptr, logz_ptr, lp_ptr, ws_ptr, cnt_ptr, V, STRIDE, CHUNKS, BV: tl.constexpr,
                      CP: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = c * BV + tl.arange(0, BV)
    x = tl.load(x_ptr + row * STRIDE + offs, mask=offs < V, other=float("-inf"))
    m = tl.max(x, axis=0)
    first = c * BV + tl.argmax(x, axis=0, tie_break_left=True)
    shift = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf alone sums to 0, not NaN
    s = tl.sum(tl.exp(x - shift), axis=0)
    ws = ws_ptr + row * 3 * CP  # [max | first index | sum] x CP chunks; indices < 2^24 are exact in fp32
    tl.store(ws + c, m)
    tl.store(ws + CP + c, first.to(tl.float32))
    tl.store(ws + 2 * CP + c, s)
    if arrive(cnt_ptr + row, CHUNKS):
        cc = tl.arange(0, CP)
        ok = cc < CHUNKS
        ms = tl.load(ws + cc, mask=ok, other=float("-inf"), cache_modifier=".cg")
        firsts = tl.load(ws + CP + cc, mask=ok, other=0.0, cache_modifier=".cg")
        sums = tl.load(ws + 2 * CP + cc, mask=ok, other=0.0, cache_modifier=".cg")
        top = tl.max(ms, axis=0)
        winner = tl.min(tl.where(ms == top, cc, CP), axis=0)  # the first chunk holding the max
        top_id = tl.sum(tl.where(cc == winner, firsts, 0.0), axis=0)
        top_shift = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.where(ok, sums * tl.exp(ms - top_shift), 0.0), axis=0)
        log_z = top_shift + tl.log(total)
        tl.store(ids_ptr + row, top_id.to(tl.int64))
        tl.store(logz_ptr + row, log_z)
        tl.store(lp_ptr + row, top - log_z)
        reset(cnt_ptr + row)


def row_stats(scores: torch.Tensor) -> RowStats:
    """Each row's argmax, logsumexp and the argmax's log-probability of fp32 scores [B, V] (unit stride along V) in one
    launch. The sums run in another order than torch.logsumexp's: the same within fp32 rounding."""
    rows, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"row_stats: fp32 scores with unit stride along the vocabulary expected, got {scores.dtype} "
                         f"with strides {scores.stride()}")
    if vocab >= 1 << 24:
        raise ValueError(f"row_stats: {vocab} scores a row; indices past 2^24 are not exact in its fp32 workspace")
    bv = 64 if INTERPRET else ROW_CHUNK
    chunks = triton.cdiv(vocab, bv)
    cp = next_pow2(chunks)
    ids = torch.empty(rows, dtype=torch.long, device=scores.device)
    log_z = torch.empty(rows, 1, dtype=torch.float32, device=scores.device)
    top_logprob = torch.empty(rows, dtype=torch.float32, device=scores.device)
    ws = torch.empty(rows, 3, cp, dtype=torch.float32, device=scores.device)
    cnt = counters_for("row_stats", rows, scores.device)
    _row_stats_kernel[(chunks, rows)](scores, ids, log_z, top_logprob, ws, cnt, vocab, scores.stride(0), chunks,
                                      BV=bv, CP=cp, num_warps=4)
    return RowStats(ids, log_z, top_logprob)
