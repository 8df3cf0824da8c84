"""INT4 GEMM on the tensor cores for calls with more rows than the decode kernels take: routed experts grouped by
expert (one gate_up with SiLU * up and one down launch a layer), dense weights as one group.

The decode kernels (int4_tc.py, int4_experts.py) take 1..4 rows of a dense weight and up to 16 (token,
choice) rows of the routed experts. Past that (prefill; decode batches of several sequences, or of MTP
verify rows) the default path dequantises each weight into a temporary and multiplies with torch
(`int4_dequant`), the routed experts one at a time: ~12 launches and a [K, N] temporary per expert, 256 x 48
experts a 122B prompt chunk, and one host read a layer, which also keeps such decode steps out of CUDA
graphs. Here, as vLLM's `fused_moe` does for GPTQ weights:

- the rows are sorted by expert on the device and each expert's rows padded to a multiple of the
  row block BM (`expert_blocks`: no host read, so no bincount, which reads its input's maximum
  back; the grid is sized for the worst case and blocks past the end return at once); a dense
  weight is one expert whose rows are 0..M-1 (`int4_gemm`);
- one program computes a [BM rows, BN columns] tile of one expert: it loads its rows of x, the
  packed INT4 words of its columns (either qweight order, `quant.int4`; a merged projection's
  column views too), dequantises them in registers with the reference's arithmetic ((q - zero) *
  scale in fp32, rounded to x's dtype) and multiplies on the tensor cores (`tl.dot`, fp32 accumulation);
- gate_up computes the gate and the up tile of the same columns and writes silu(gate) * up,
  rounded as the reference rounds each step; down multiplies by the routing weight and writes
  one row per (token, choice), summed over the choices afterwards.

The results equal the reference's up to the order of the fp32 sums (tests compare them). Tokens go in chunks
(`TOKEN_CHUNK`) so the [rows, hidden] temporaries stay bounded on long prompts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import INTERPRET
from .int4_dequant import qword_offset

TOKEN_CHUNK = 8192  # tokens per pair of launches: the down rows of a chunk are 8192 x k x hidden
GEMM_MAX_ROWS = 64  # dense calls up to this many rows; longer ones (prefill chunks) are compute-bound: cuBLAS


@triton.jit
def _int4_tile(qw_ptr, qz_ptr, sc_ptr, r, c, c_mask, g, K, QW_ROW, QZ_ROW, SC_ROW, BLOCKED: tl.constexpr):
    """Dequantised weights, fp32 [8 * len(r), len(c)]: packed rows r (k = 8 r .. 8 r + 7) of columns c, group g."""
    words = tl.load(qw_ptr + qword_offset(r[:, None], c[None, :], K, QW_ROW, BLOCKED), mask=c_mask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [R, 8, BN]: k = 8 r + j
    q = tl.reshape(q, [8 * r.shape[0], c.shape[0]])
    zw = tl.load(qz_ptr + g * QZ_ROW + c // 8, mask=c_mask, other=0)
    zero = ((zw >> ((c % 8) * 4)) & 0xF) + 1  # stored as zero - 1 (GPTQ v1)
    scale = tl.load(sc_ptr + g * SC_ROW + c, mask=c_mask, other=0).to(tl.float32)
    return (q - zero[None, :]).to(tl.float32) * scale[None, :]


@triton.jit
def _dot(a, w, acc):
    """acc + a @ w with w rounded to a's dtype; fp32 rows multiply in full fp32 (not TF32: the reference's sums)."""
    if a.dtype == tl.float32:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w.to(a.dtype), acc)


@triton.jit
def _grouped_kernel(a_ptr, rows_ptr, block_expert_ptr, qw_ptr, qz_ptr, sc_ptr, rw_ptr, out_ptr,
                    N, K, A_ROW_DIV, A_STRIDE, QW_E, QW_ROW, QZ_E, QZ_ROW, SC_E, SC_ROW, UP,
                    GROUP: tl.constexpr, BLOCKED: tl.constexpr, SWIGLU: tl.constexpr, WEIGHTED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[row, c] for the rows of one BM block (all of one expert) and BN columns c. A row is a (token, choice)
    index; its input is a[row // A_ROW_DIV]. SWIGLU: out = silu(x W_c) * (x W_{c + UP}); WEIGHTED: out *= rw[row]."""
    num_n = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last expert's blocks (the grid is sized for the worst case)
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
    valid = rows >= 0
    a_rows = tl.where(valid, rows // A_ROW_DIV, 0).to(tl.int64)
    c = pid_n * BN + tl.arange(0, BN)
    c_mask = c < N
    e = expert.to(tl.int64)
    qw, qz, sc = qw_ptr + e * QW_E, qz_ptr + e * QZ_E, sc_ptr + e * SC_E
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + a_rows[:, None] * A_STRIDE + k[None, :], mask=valid[:, None], other=0.0)
        r = k0 // 8 + tl.arange(0, BK // 8)
        g = k0 // GROUP  # BK divides GROUP: one group per step
        w = _int4_tile(qw, qz, sc, r, c, c_mask, g, K, QW_ROW, QZ_ROW, SC_ROW, BLOCKED)
        acc = _dot(a, w, acc)
        if SWIGLU:
            w_up = _int4_tile(qw, qz, sc, r, c + UP, c_mask, g, K, QW_ROW, QZ_ROW, SC_ROW, BLOCKED)
            acc_up = _dot(a, w_up, acc_up)
    dtype = out_ptr.dtype.element_ty
    if SWIGLU:  # rounded where the reference rounds: gate and up, silu(gate), the product
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    if WEIGHTED:
        weight = tl.load(rw_ptr + rows, mask=valid, other=0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + c[None, :], acc.to(dtype), mask=valid[:, None] & c_mask[None, :])


def _config(rows: int | None = None, experts: bool = False) -> dict:
    """Tiles for `rows` rows per group (None: many, prefill), from the H200 sweep (benchmarks/kernels.py --only
    int4_gemm, NOTES-kernels.md session 13): the grouped experts at 24 tokens (~1.4 rows an expert) 650 us with
    BN 128 / BK 128 against 703 with BN 64; a dense weight at 6 rows within 3% across the six tried."""
    if INTERPRET:
        return {"BM": 16, "BN": 32, "BK": 32, "num_warps": 1}
    if rows is not None and rows <= 16:
        return {"BM": 16, "BN": 128 if experts else 64, "BK": 128, "num_warps": 4, "num_stages": 3}
    return {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3}


def expert_blocks(top_experts: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) rows grouped by expert, each expert's run padded to a multiple of `block`, on the device:
    (rows, block_expert). rows[b * block + i] is a flat row index (token * k + choice) or -1 (padding);
    block_expert[b] the expert of block b, -1 past the last. Sized for the worst case (every used expert's run
    padded), so nothing is read back to the host."""
    flat = top_experts.reshape(-1)
    n = flat.numel()
    device = flat.device
    max_blocks = triton.cdiv(n, block) + min(num_experts, n)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block - 1) // block
    block_end = blocks.cumsum(0)
    start = counts.cumsum(0) - counts  # of each expert's run in the sorted rows
    order = flat.argsort(stable=True)
    expert_of = flat[order]
    slot = (block_end - blocks)[expert_of] * block + torch.arange(n, device=device) - start[expert_of]
    rows = torch.full((max_blocks * block,), -1, dtype=torch.int32, device=device)
    rows[slot] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def _strides(t: torch.Tensor) -> tuple[int, int]:
    """(per expert, per row) of a [E, R, C] or [R, C] tensor (a dense weight is expert 0 only)."""
    return (t.stride(0) if t.dim() == 3 else 0), t.stride(-2)


def _launch(a, rows, block_expert, weight, out, *, a_row_div: int, up: int = 0, routing=None, cfg: dict) -> None:
    qw, qz, sc = weight.qweight, weight.qzeros, weight.scales
    n, k = out.shape[1], a.shape[1]
    # a K step must lie within one quantisation group (the kernel reads one zero point and scale per step)
    cfg = {**cfg, "BK": math.gcd(cfg["BK"], weight.group_size)}
    grid = (block_expert.numel() * triton.cdiv(n, cfg["BN"]),)
    _grouped_kernel[grid](
        a, rows, block_expert, qw, qz, sc, routing if routing is not None else out, out,
        n, k, a_row_div, a.stride(0), *_strides(qw), *_strides(qz), *_strides(sc),
        up, GROUP=weight.group_size, BLOCKED=weight.blocked, SWIGLU=bool(up), WEIGHTED=routing is not None, **cfg,
    )


def gemm_blocker(weight, name: str = "weight") -> str | None:
    """Why the kernel cannot read this INT4 weight, or None."""
    if weight.group_size % 64 or weight.in_features % weight.group_size:
        return f"{name}: group size {weight.group_size} (the kernel steps K by 64 within a group)"
    if any(t.stride(-1) != 1 for t in (weight.qweight, weight.qzeros, weight.scales)):
        return f"{name}: INT4 tensors need unit stride along N"
    return None


def experts_blocker(gate_up, down) -> str | None:
    return gemm_blocker(gate_up, "gate_up") or gemm_blocker(down, "down")


def int4_gemm(x: torch.Tensor, weight, config: dict | None = None) -> torch.Tensor:
    """x @ W^T for a dense INT4 weight (or a merged projection's column view) in one launch: the rows as one group."""
    k, n = weight.in_features, weight.out_features
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    cfg = config or _config(m)
    slots = triton.cdiv(m, cfg["BM"]) * cfg["BM"]
    index = torch.arange(slots, dtype=torch.int32, device=x.device)
    rows = torch.where(index < m, index, -1)
    block_expert = torch.zeros(slots // cfg["BM"], dtype=torch.int32, device=x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(x2, rows, block_expert, weight, out, a_row_div=1, cfg=cfg)
    return out.view(*x.shape[:-1], n)


def grouped_experts(x: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor, gate_up, down,
                    config: dict | None = None) -> torch.Tensor:
    """`Experts.forward(x, top_experts, top_weights)` for INT4 gate_up [E, 2I, H] / down [E, H, I] weights in two
    grouped launches per `TOKEN_CHUNK` tokens; `config` (BM, BN, BK, num_warps, num_stages) replaces the default."""
    t, h = x.shape
    k = top_experts.shape[1]
    cfg = config or _config(-(-t * k // gate_up.num_experts), experts=True)  # rows an expert on average
    inter = down.in_features
    x = x.contiguous()
    out = torch.empty_like(x)
    for s in range(0, t, TOKEN_CHUNK):
        e = min(t, s + TOKEN_CHUNK)
        rows, block_expert = expert_blocks(top_experts[s:e], gate_up.num_experts, cfg["BM"])
        act = torch.empty((e - s) * k, inter, dtype=x.dtype, device=x.device)
        _launch(x[s:e], rows, block_expert, gate_up, act, a_row_div=k, up=inter, cfg=cfg)
        y = torch.empty((e - s) * k, h, dtype=x.dtype, device=x.device)
        _launch(act, rows, block_expert, down, y, a_row_div=1, routing=top_weights[s:e].reshape(-1).contiguous(), cfg=cfg)
        out[s:e] = y.view(e - s, k, h).sum(1, dtype=torch.float32)
    return out
