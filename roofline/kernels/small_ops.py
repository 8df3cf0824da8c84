"""One launch for what PyTorch runs as a chain of small kernels in the decode step.

In a captured 122B decode step most of the time outside the weight kernels goes to small
ops at ~2 us each (BENCHMARKS.md's breakdown): a zero-centred RMSNorm is ~8 kernels in
PyTorch (cast, square, mean, add, rsqrt, two multiplies, cast back), the MoE router's
softmax / top-k / renormalise ~6. Here each is one launch over the step's few rows:

- `rms_norm(x, weight, eps)`: y = x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, rounded to
  x's dtype (roofline.model.layers.rms_norm), one program per row;
- `route_top_k(logits, k)`: fp32 softmax over the experts, the k largest, renormalised to sum
  to 1 (SparseMoE.route), one program per token.

Not on by default until a GPU run has checked them (`ROOFLINE_FUSED_SMALL_OPS=1`, see
dispatch.py); the tests compare them with the references in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    mask = d < D
    x = tl.load(x_ptr + row * D + d, mask=mask, other=0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(y_ptr + row * D + d, (normed * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last axis, one program per row."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, d, eps, BD=next_pow2(d))
    return y.view(x.shape)


@triton.jit
def _route_kernel(logits_ptr, experts_ptr, weights_ptr, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    mask = e < E
    z = tl.load(logits_ptr + row * E + e, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask, p, -1.0)
    slot = tl.arange(0, KP)
    chosen = tl.zeros([KP], dtype=tl.int64)
    vals = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(K):  # the k largest, the lowest index first among equals
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BE), axis=0)
        chosen = tl.where(slot == j, idx.to(tl.int64), chosen)
        vals = tl.where(slot == j, best, vals)
        p = tl.where(e == idx, -1.0, p)
    tl.store(experts_ptr + row * K + slot, chosen, mask=slot < K)
    tl.store(weights_ptr + row * K + slot, vals / tl.sum(vals, axis=0), mask=slot < K)


def route_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64, weights [N, k] fp32 summing to 1) from router logits [N, E]."""
    n, e = logits.shape
    experts = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    _route_kernel[(n,)](logits.contiguous(), experts, weights, e, K=k, KP=next_pow2(k), BE=next_pow2(e))
    return experts, weights
