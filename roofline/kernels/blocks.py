"""The decoder layer and the MoE block for decode rows (1..4), with fewer launches than the model code runs.

Same math as `DecoderLayer.forward` and `SparseMoE.forward`, rounded where they round:

- layer: h = x + mixer(norm1(x)); the add and norm2 are one launch (`add_rms_norm`); the MoE block
  adds h itself, in its last kernel;
- MLP (the dense model's, and the MoE's shared expert): gate and up as one merged GEMV, silu * up
  in one kernel, down: 3 launches where the model code runs 5 (session 15 took silu * up into the down
  GEMV's prologue, one launch fewer: H200, session 17, the M = 3 verify graph 0.44 ms slower, M = 1 no
  faster, since every program of the down GEMV recomputes its slice of the activation; removed);
- MoE (INT4 routed experts): router and shared-expert gate as one merged GEMV with the router's
  softmax / top-k in its epilogue (`fp8_gemv.router_top_k`, where the router is a dense or FP8
  weight; else a separate top-k kernel), the routed experts' gate_up, the shared expert (3), then
  the routed experts' down kernel, which also adds sigmoid(gate) * shared and the residual
  (`experts_down`'s epilogue): 6 launches where the model code runs ~16. On CUDA the shared expert's
  3 launches run on a second stream beside the router and the routed gate_up (`_common.beside`).
- the layer's add and second norm leave their launch where the mixer's out projection is an INT4
  tensor-core GEMV and the MoE block's router and shared gate_up run on fp8_gemv's kernel
  (`norm_in_gemvs`, on the pooled decode step): the out projection adds the residual in its epilogue
  and writes each column tile's sums of squares (int4_tc.int4_matmul_residual), and the router and the
  shared gate_up norm their input on the fly from those (`fp8_gemv.NormOnLoad`), the router's kernel
  also writing the normed rows for the routed experts: one launch a layer fewer, and the shared expert
  starts a kernel earlier. ROOFLINE_NORM_IN_GEMVS=0 keeps the add_rms_norm launch.
- the dense model's layers add their residuals in GEMV epilogues where the mixer's out projection and the MLP's
  down projection are INT4 tensor-core GEMVs (`residual_in_gemvs`, DENSE_RESIDUAL_IN_GEMVS): the out projection
  adds the layer's input (and finishes a GDN mixer's gated norm, mixers.gdn_norm_in_out_proj), a plain RMSNorm
  launch takes add_rms_norm's place, and the down projection adds h, where a separate add kernel ran after it (one
  launch a layer fewer, and the GDN kernel without its norm's arrival round).

Installed by `dispatch.install_fast_path` with the fused small ops; more rows (prefill) run the
model's own code.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..model.layers import MLP, DecoderLayer, RMSNorm, SlotBatch, SparseMoE
from ..quant import DenseWeight, Fp8BlockWeight
from ._common import beside
from .dispatch import MAX_DECODE_ROWS, int4_config, int4_tc_capable, row_count
from .fp8_gemv import NormOnLoad, fp8_matmul, router_top_k
from .small_ops import add_rms_norm, route_top_k, silu_mul

NORM_IN_GEMVS = os.environ.get("ROOFLINE_NORM_IN_GEMVS", "1") != "0"
# Read at call time (benchmarks/ab_step.py switches it); ROOFLINE_DENSE_RESIDUAL_IN_GEMVS=0 keeps add_rms_norm and the
# separate add after the MLP.
DENSE_RESIDUAL_IN_GEMVS = os.environ.get("ROOFLINE_DENSE_RESIDUAL_IN_GEMVS", "1") != "0"


def gemv_operands(weight) -> tuple | None:
    """(weight, scale_inv or None, scale block) of a dense / FP8 weight that runs on fp8_gemv's kernel, else None."""
    if not isinstance(weight, (DenseWeight, Fp8BlockWeight)) or "forward" not in weight.__dict__:
        return None
    if isinstance(weight, Fp8BlockWeight):
        return weight.weight, weight.scale_inv, weight.block
    return weight.weight, None, (128, 128)


def fused_router(moe: SparseMoE) -> tuple | None:
    """The operands of the dense / FP8 weight whose GEMV can also route (the router merged with the shared
    expert's gate, or the router alone), or None: the router then runs its GEMV and a top-k kernel (two launches)."""
    merged = moe.merged["router"].merged
    return gemv_operands(merged if merged is not None else moe.gate)


def norm_in_gemvs(layer: DecoderLayer, dtype) -> bool:
    """Whether the layer's add and second norm can run in its out projection's epilogue and the MoE block's GEMV
    prologues (see the module docstring); `dtype` is the model's."""
    moe = layer.mlp
    if not NORM_IN_GEMVS or not getattr(moe, "adds_residual", False):  # set where moe_forward is installed
        return False
    out = layer.self_attn.o_proj if layer.layer_type == "full_attention" else layer.linear_attn.out_proj
    return (fused_router(moe) is not None and gemv_operands(moe.shared_expert.merged["gate_up"].merged) is not None
            and "residual_forward" in out.__dict__ and int4_tc_capable(out, dtype))


def residual_in_gemvs(layer: DecoderLayer, dtype) -> bool:
    """Whether a dense (MLP) layer's out projection and down projection can add its residuals in their epilogues:
    both INT4 weights whose decode calls take the tensor-core GEMV (see the module docstring)."""
    if not isinstance(layer.mlp, MLP):
        return False
    out = layer.self_attn.o_proj if layer.layer_type == "full_attention" else layer.linear_attn.out_proj
    return all("residual_forward" in w.__dict__ and int4_tc_capable(w, dtype) for w in (out, layer.mlp.down_proj))


# Rows up to which the router routes in its GEMV's epilogue. H200, 2026-12-03 (BENCHMARKS.md): with the epilogue
# at every row count the M=3 / M=4 verify steps took 6.1-6.3 / 6.4-6.5 ms against 5.5 / 5.7 before (M=1 and M=2
# no slower); the epilogue runs in one single-warp program, where the separate top-k kernel has a program of 4
# warps per row. Run 13's router sweep at M = 4 then had the one launch at 6.72 us on 2 warps with 256-wide K steps
# (11.85 on the default single warp) against 6.18 for the two launches, which in the step also pay a kernel
# boundary. So 3-4 rows route in the epilogue on those tiles (`ROUTER_ROWS_CONFIG`): in the step (H200, session 17,
# benchmarks/ab_step.py, one build, alternating rounds) the M = 3 verify graph 0.095 ms faster than two launches in
# both of two runs, M = 1 unchanged. ROOFLINE_ROUTER_ROWS=2 keeps the separate top-k kernel past two rows.
_ROUTER_ROWS = os.environ.get("ROOFLINE_ROUTER_ROWS", "4")
if _ROUTER_ROWS not in ("2", "4"):
    raise ValueError(f"ROOFLINE_ROUTER_ROWS must be 2 or 4, got {_ROUTER_ROWS!r}")
FUSED_ROUTE_ROWS = int(_ROUTER_ROWS)
ROUTER_ROWS_CONFIG = {"BK": 256, "num_warps": 2}  # the one-launch router past two rows
# The one-launch router of one or two rows on the default split config runs two arrival rounds (each column tile's K
# splits, then the tiles for the routing); `kernel_floor.py` put a round at +1.25 us. So it reads each output row whole
# in one program (ROUTER_FEW_ROWS_CONFIG: 257 programs of 1 x 1024 steps, no K split), leaving only the routing's
# round: in the step (H100, session 18, benchmarks/ab_step.py, 122B, two rounds) M = 1 0.018 ms faster in both rounds,
# M = 3 (its 3 rows on ROUTER_ROWS_CONFIG) unchanged (+0.005). ab_step's variant router-split sets it to None
# (fp8_gemv's default config, with the K split) for the A/B.
ROUTER_FEW_ROWS_CONFIG: dict | None = {"BN": 1, "BK": 1024, "num_warps": 2, "SPLIT_K": 1}


def router_config(rows: int) -> dict | None:
    """The one-launch router's config for `rows` rows (up to FUSED_ROUTE_ROWS): read at call time, so a switched
    constant applies to the next launch."""
    return ROUTER_ROWS_CONFIG if rows > 2 else ROUTER_FEW_ROWS_CONFIG


_routes: list[torch.Tensor] | None = None  # see recording_routes


@contextmanager
def recording_routes():
    """Collect the chosen experts [rows, k] of every MoE block's decode call run inside, in layer order (the bench
    counts the distinct experts a verify step reads). For eager calls only: a captured graph would keep the
    recorded tensors' addresses, not their values."""
    global _routes
    saved, _routes = _routes, []
    try:
        yield _routes
    finally:
        _routes = saved


def _route(moe: SparseMoE, x: torch.Tensor, norm: NormOnLoad | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen experts, routing weights fp32, the shared expert's gate logit) for decode rows; with `norm` the
    router's kernel norms its input (and writes norm.normed)."""
    operands = fused_router(moe)
    if operands is None:
        logits, gate_logit = moe.merged["router"](x)
        experts, weights = route_top_k(logits, moe.top_k)
    else:
        e, rows = moe.gate.out_features, row_count(x)
        if rows > FUSED_ROUTE_ROWS:
            logits = fp8_matmul(x, *operands, norm=norm)
            experts, weights = route_top_k(logits[..., :e], moe.top_k)
        else:
            logits, experts, weights = router_top_k(x, *operands, e, moe.top_k, norm=norm, config=router_config(rows))
        if moe.merged["router"].merged is not None:
            gate_logit = logits[..., e:]
        else:
            gate_logit = moe.shared_expert_gate(x if norm is None else norm.normed)
    if _routes is not None:
        _routes.append(experts.clone())
    return experts, weights, gate_logit


def moe_forward(moe: SparseMoE, syms: tuple[bool, bool], x: torch.Tensor, residual: torch.Tensor | None = None,
                sumsq: torch.Tensor | None = None, norm: RMSNorm | None = None) -> torch.Tensor:
    """SparseMoE.forward(x) (+ residual) for INT4 routed experts; `syms`: whether gate_up / down are symmetric.
    With `sumsq` and `norm` (`norm_in_gemvs`): x is the layer's h, `sumsq` its per-tile sums of squares
    (int4_tc.int4_matmul_residual), and the block returns h + SparseMoE.forward(norm(h)), the norm done in its
    GEMVs' prologues."""
    if not 1 <= row_count(x) <= MAX_DECODE_ROWS:
        if sumsq is not None:
            raise ValueError(f"moe_forward: the norm runs in the decode kernels (1..{MAX_DECODE_ROWS} rows), "
                             f"got {row_count(x)} rows")
        out = SparseMoE.forward(moe, x)
        return out if residual is None else residual + out
    from .int4_experts import experts_down, experts_gate_up

    if sumsq is None:
        shared_out, join = beside(x.device, lambda: moe.shared_expert(x).contiguous())
        experts, weights, gate_logit = _route(moe, x)
    else:
        shared_norm = NormOnLoad(sumsq, norm.weight, norm.eps)
        shared_out, join = beside(x.device, lambda: mlp_forward(moe.shared_expert, x, shared_norm).contiguous())
        routed_norm = NormOnLoad(sumsq, norm.weight, norm.eps, torch.empty_like(x))
        experts, weights, gate_logit = _route(moe, x, routed_norm)
        x, residual = routed_norm.normed, x
    gate_up, down = moe.experts.gate_up, moe.experts.down
    act = experts_gate_up(x, experts, gate_up.qweight, gate_up.qzeros, gate_up.scales, gate_up.group_size, sym=syms[0],
                          config=int4_config(gate_up))
    join()
    return experts_down(act, experts, weights, down.qweight, down.qzeros, down.scales, down.group_size, sym=syms[1],
                        config=int4_config(down), shared=shared_out, shared_gate=gate_logit,
                        residual=None if residual is None else residual.contiguous())


def mlp_forward(mlp: MLP, x: torch.Tensor, norm: NormOnLoad | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """MLP.forward (+ residual) with gate and up as one merged projection and silu * up as one kernel; with `norm`
    (the MoE block's shared expert, `norm_in_gemvs`) the merged gate_up norms its input in its prologue; with
    `residual` (a dense layer's h, `residual_in_gemvs`) the down projection adds it in its epilogue."""
    both = mlp.merged["gate_up"]
    if norm is not None:
        gate_up = fp8_matmul(x, *gemv_operands(both.merged), norm=norm)
    elif both.merged is None or not 1 <= row_count(x) <= MAX_DECODE_ROWS:
        out = MLP.forward(mlp, x)
        return out if residual is None else residual + out
    else:
        gate_up = both.merged(x)
    act = silu_mul(gate_up.reshape(-1, 2 * mlp.gate_proj.out_features)).view(*x.shape[:-1], -1)
    if residual is None:
        return mlp.down_proj(act)
    return mlp.down_proj.residual_forward(act, residual.contiguous())[0]


def dense_residual_in_gemvs(layer: DecoderLayer) -> bool:
    """Whether the dense layer's residual adds run in its out and down projections' epilogues: its
    `residual_in_gemvs` while DENSE_RESIDUAL_IN_GEMVS (read here, at call time)."""
    return DENSE_RESIDUAL_IN_GEMVS and getattr(layer, "residual_in_gemvs", False)


def out_proj_adds_residual(layer: DecoderLayer) -> bool:
    """Whether the layer's pooled decode step hands its mixer the residual, for the out projection to add: the MoE
    layer's `norm_in_gemvs`, or dense_residual_in_gemvs."""
    return getattr(layer, "norm_in_gemvs", False) or dense_residual_in_gemvs(layer)


def layer_forward(layer: DecoderLayer, x: torch.Tensor, batch) -> torch.Tensor:
    """DecoderLayer.forward with the residual add and the second norm fused, and the MoE (or the dense layer's MLP,
    `residual_in_gemvs`) adding the residual."""
    if not 1 <= row_count(x) <= MAX_DECODE_ROWS:
        return DecoderLayer.forward(layer, x, batch)
    mixer = layer.self_attn if layer.layer_type == "full_attention" else layer.linear_attn
    norm = layer.post_attention_layernorm
    dense_residual = dense_residual_in_gemvs(layer)
    if isinstance(batch, SlotBatch) and out_proj_adds_residual(layer):
        h, sumsq = mixer.slot_step(layer.input_layernorm(x), batch, residual=x.contiguous())
        if dense_residual:
            return mlp_forward(layer.mlp, norm(h), residual=h)
        return layer.mlp(h, sumsq=sumsq, norm=norm)
    h, normed = add_rms_norm(x, mixer(layer.input_layernorm(x), batch), norm.weight, norm.eps)
    if getattr(layer.mlp, "adds_residual", False):
        return layer.mlp(normed, residual=h)
    if dense_residual:
        return mlp_forward(layer.mlp, normed, residual=h)
    return h + layer.mlp(normed)
