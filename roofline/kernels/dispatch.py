"""The CUDA fast path: which Triton kernel serves which weight format, installed after loading.

`install_fast_path(model)` gives each packed weight (INT4, block FP8, INT8 rows) and each
layer's routed experts a `forward` that runs the Triton decode kernel for 1..4 rows (the
decode and MTP-verify batch) and the reference otherwise (prefill), and gives every attention
and GDN mixer its pooled `slot_step` (fused decode attention / GDN kernels, see mixers.py),
the step the CUDA-graph runner captures. It reports what it installed, and what keeps the
decode step from being captured, so the engine can say so in its log. The model code is
unchanged: kernels are chosen by device and format here, not inside the model.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ..model.layers import MLP, DecoderLayer, Experts, GatedAttention, GatedDeltaNet, RMSNorm, SparseMoE
from ..errors import UserError
from ..quant import DenseWeight, Fp8BlockWeight, Int4Weight, LinearWeight
from ..quant.int4 import block_qweight, blocked_columns
from ..quant.int8 import Int8RowWeight

log = logging.getLogger("roofline.kernels")

MAX_DECODE_ROWS = 4  # = kernels._common.MAX_ROWS (not imported here: that module needs Triton)
MAX_EXPERT_TOKENS = 16  # beyond this (prefill) the reference loop over experts is used
DENSE_MAX_ROWS = 1024  # 16-bit dense weights up to this many rows take dense_matmul; larger ones stay on cuBLAS


def row_count(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def int4_config(weight: Int4Weight) -> dict | None:
    """The kernel config a call on this weight needs: {"qblk": True} where its qweight is block-repacked."""
    return {"qblk": True} if weight.blocked else None


def int4_tc_capable(weight: Int4Weight, dtype: torch.dtype) -> bool:
    """Whether every decode call on this weight with `dtype` activations takes the INT4 tensor-core path."""
    from .int4_gemv import use_tc

    return use_tc(int4_config(weight)) and _blockable(weight, dtype)


def _int4_residual(weight: Int4Weight, sym: bool, x: torch.Tensor, residual: torch.Tensor, head_norm=None):
    from .int4_tc import int4_matmul_residual

    return int4_matmul_residual(x, weight.qweight, weight.qzeros, weight.scales, residual, sym=sym,
                                config=int4_config(weight), head_norm=head_norm)


def _int4(weight: Int4Weight, sym: bool, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= row_count(x) <= MAX_DECODE_ROWS:
        from .int4_gemv import int4_matmul

        return int4_matmul(x, weight.qweight, weight.qzeros, weight.scales, weight.group_size, sym=sym,
                           config=int4_config(weight))
    return many_rows_forward(weight, x, expert)


def many_rows_forward(weight: LinearWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    """A call with more rows than the decode kernels take (prefill, decode batches): for a dense INT4 weight on the
    "triton" path (`use_int4_gemm`) and up to GEMM_MAX_ROWS rows, the INT4 GEMM kernel; else x @ W^T on the
    dequantised weight, built in one launch for INT4 (`int4_dequant`; the same values as the reference's), by the
    format's reference otherwise."""
    if isinstance(weight, Int4Weight):
        from .int4_dequant import dequantize_int4
        from .int4_gemm import GEMM_MAX_ROWS, int4_gemm

        if expert is None and getattr(weight, "gemm", "dequant") == "triton" and row_count(x) <= GEMM_MAX_ROWS:
            return int4_gemm(x, weight)

        return F.linear(x, dequantize_int4(weight, expert, x.dtype))
    return LinearWeight.forward(weight, x, expert)


def _fp8(weight: Fp8BlockWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= row_count(x) <= MAX_DECODE_ROWS:
        from .fp8_gemv import fp8_matmul

        return fp8_matmul(x, weight.weight, weight.scale_inv, weight.block)
    return LinearWeight.forward(weight, x, expert)


def _dense(weight: LinearWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= row_count(x) <= MAX_DECODE_ROWS:
        from .fp8_gemv import dense_matmul

        return dense_matmul(x, weight.weight)
    return LinearWeight.forward(weight, x, expert)


def _int8(weight: Int8RowWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= row_count(x) <= MAX_DECODE_ROWS:
        from .int8_lm_head import int8_matmul

        return int8_matmul(x, weight.weight, weight.weight_scale)
    return LinearWeight.forward(weight, x, expert)


# The INT8 LM head's kernel stores fp32 logits, rounded to x's dtype first (the values of head(x).float()), where a
# separate copy kernel widened its 16-bit output before (~4 us a step; ab_step `logits-copy` keeps that). Read at
# call time.
FP32_LOGITS = True


def _int8_logits(weight: Int8RowWeight, x: torch.Tensor) -> torch.Tensor:
    if FP32_LOGITS and 1 <= row_count(x) <= MAX_DECODE_ROWS:
        from .int8_lm_head import int8_matmul

        return int8_matmul(x, weight.weight, weight.weight_scale, out_dtype=torch.float32, round_to_x=True)
    return LinearWeight.logits(weight, x)


# INT4 calls with more rows than the decode kernels take (prefill; decode batches past MAX_DECODE_ROWS dense rows
# or MAX_EXPERT_TOKENS expert rows). "dequant": each weight dequantised in one launch (int4_dequant) and multiplied by
# torch, the routed experts one at a time (~12 launches an expert and a host read a layer, so such decode steps run
# outside CUDA graphs). "triton": int4_gemm.py's kernel: routed experts grouped by expert in two launches at any row
# count, dense weights up to GEMM_MAX_ROWS rows in one, nothing read back, so decode steps of up to
# TRITON_GRAPH_ROWS rows are captured. "triton" is the default since its first H200 run (2026-12-05,
# benchmarks/NOTES-kernels.md "Session 13"): the 122B's routed experts of one MoE layer at 4K prompt tokens 3.5 ms
# against the loop's 55 ms, at a 24-row decode batch 0.86 against 51 ms; in_proj_qkv+z at 6 / 48 rows 48 / 69 us
# against 94 / 95. ROOFLINE_INT4_GEMM=dequant|triton at install; `use_int4_gemm` switches a model (the benchmark).
INT4_GEMM_ENV = "ROOFLINE_INT4_GEMM"
INT4_GEMM_KINDS = ("dequant", "triton")
TRITON_GRAPH_ROWS = 80  # 16 sequences x 5 tokens (an MTP-4 verify)


def int4_gemm_wanted() -> str:
    kind = os.environ.get(INT4_GEMM_ENV, "triton")
    if kind not in INT4_GEMM_KINDS:
        raise UserError(f"{INT4_GEMM_ENV} must be one of {', '.join(INT4_GEMM_KINDS)}, got {kind!r}")
    return kind


def _int4_weights(model: torch.nn.Module):
    """Every non-expert INT4 weight with a fast-path forward, merged projections' wholes included."""
    for module in model.modules():
        if isinstance(module, Int4Weight) and not module.num_experts:
            yield module
        for proj in getattr(module, "merged", {}).values():
            if isinstance(proj.merged, Int4Weight):
                yield proj.merged


def use_int4_gemm(model: torch.nn.Module, kind: str) -> Counter:
    """Give the INT4 weights of `model` the many-rows path `kind` (INT4_GEMM_KINDS); returns how many took it:
    routed-expert modules ("experts") and dense weights ("dense"). Weights the kernel cannot read stay on the
    dequantising path (the experts on their loop), and the log says why. With
    "triton" on every expert module, `model.max_graph_rows` lets decode steps of TRITON_GRAPH_ROWS rows be captured."""
    from .int4_gemm import experts_blocker, gemm_blocker

    taken, refused = Counter(), 0
    for module in model.modules():
        if isinstance(module, Experts) and isinstance(module.forward, partial) and module.forward.func is _experts:
            why = experts_blocker(module.gate_up, module.down) if kind == "triton" else None
            if why:
                log.warning("routed experts past %d rows loop over experts, not the grouped kernel: %s", MAX_EXPERT_TOKENS, why)
            module.gemm = "dequant" if why else kind
            taken["experts"] += not why
            refused += bool(why)
    kept = Counter()
    for weight in _int4_weights(model):
        why = gemm_blocker(weight) if kind == "triton" else None
        weight.gemm = "dequant" if why else kind
        kept[why] += bool(why)
        taken["dense"] += not why
    for why, count in kept.items():
        if count:
            log.warning("%d dense INT4 weights past %d rows dequantise first, not the INT4 GEMM: %s", count,
                        MAX_DECODE_ROWS, why)
    model.max_graph_rows = TRITON_GRAPH_ROWS if kind == "triton" and not refused else MAX_EXPERT_TOKENS
    return taken


def _experts(module: Experts, syms: tuple[bool, bool], x, top_experts, top_weights) -> torch.Tensor:
    if x.shape[0] > MAX_EXPERT_TOKENS:
        if module.gemm == "triton":
            from .int4_gemm import grouped_experts

            return grouped_experts(x, top_experts, top_weights, module.gate_up, module.down)
        return Experts.forward(module, x, top_experts, top_weights)
    from .int4_experts import experts_down, experts_gate_up

    gate_up, down = module.gate_up, module.down
    act = experts_gate_up(x, top_experts, gate_up.qweight, gate_up.qzeros, gate_up.scales, gate_up.group_size, sym=syms[0],
                          config=int4_config(gate_up))
    return experts_down(act, top_experts, top_weights, down.qweight, down.qzeros, down.scales, down.group_size, sym=syms[1],
                        config=int4_config(down))


# One-launch RMSNorm, router and attention prologue (small_ops.py; checked on an H200 by tests/test_small_ops.py).
# ROOFLINE_FUSED_SMALL_OPS=0 runs the PyTorch ops instead (to compare, or to rule the kernels out).
FUSED_SMALL_OPS = os.environ.get("ROOFLINE_FUSED_SMALL_OPS", "1") != "0"


def _fused_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    from .small_ops import rms_norm

    return rms_norm(x, norm.weight, norm.eps)


def _fused_route(moe: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .small_ops import route_top_k

    experts, weights = route_top_k(moe.gate(x), moe.top_k)
    return experts, weights.to(x.dtype)


def _dense_experts(module: Experts, x, top_experts, top_weights) -> torch.Tensor:
    """Routed dense experts (the MTP head's BF16 ones, as published) without a host sync: gate_up and down each one
    grouped GEMV that reads the routed experts' rows in place (fp8_gemv.grouped_dense_matmul; the down GEMV takes
    silu * up on load), then the routing weights' sum over each token's k choices."""
    if x.shape[0] > MAX_EXPERT_TOKENS:
        return Experts.forward(module, x, top_experts, top_weights)
    from .fp8_gemv import grouped_dense_matmul

    gate_up = grouped_dense_matmul(x, module.gate_up.weight, top_experts)
    y = grouped_dense_matmul(gate_up, module.down.weight, top_experts, gated=True).view(*top_experts.shape, -1)
    return (y * top_weights[..., None]).sum(1).to(x.dtype)


def _fla_available() -> bool:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as exc:  # ImportError, or fla failing to initialise against this torch/triton
        log.debug("fla-core unavailable: %r", exc)
        return False
    return True


@dataclass
class FastPath:
    """What `install_fast_path` did: kernels by kind, and what (if anything) keeps the decode step
    from being captured in a CUDA graph."""

    installed: Counter = field(default_factory=Counter)
    graph_blockers: list[str] = field(default_factory=list)

    @property
    def graph_ready(self) -> bool:
        return bool(self.installed) and not self.graph_blockers

    @property
    def int4_order(self) -> str:
        """The INT4 qweights' order: "blocked" (block-repacked at load) or "gptq" (as stored)."""
        return "blocked" if self.installed["int4 weights block-repacked"] else "gptq"


def install_weight_kernel(weight: LinearWeight) -> str | None:
    """Give one (non-expert) packed weight its Triton decode `forward`; returns its kind, None for dense."""
    if isinstance(weight, Int4Weight):
        from .int4_gemv import is_symmetric

        sym = is_symmetric(weight.qzeros)
        weight.forward = partial(_int4, weight, sym)
        weight.residual_forward = partial(_int4_residual, weight, sym)  # (h, sumsq): see blocks.norm_in_gemvs
        return "int4"
    if isinstance(weight, Fp8BlockWeight):
        weight.forward = partial(_fp8, weight)
        return "fp8"
    if isinstance(weight, Int8RowWeight):
        weight.forward = partial(_int8, weight)
        weight.logits = partial(_int8_logits, weight)
        return "int8 lm_head"
    if (isinstance(weight, DenseWeight) and weight.out_features <= DENSE_MAX_ROWS and weight.weight.is_contiguous()
            and weight.weight.dtype in (torch.bfloat16, torch.float16)):
        weight.forward = partial(_dense, weight)  # small dense weights (router, GDN b/a): one launch, no cuBLAS split-K
        return "small dense"
    return None


# Linears that read the same input, by module type: merged where formats allow (merge.py).
MERGE_GROUPS = {
    GatedAttention: {"qkv": ("q_proj", "k_proj", "v_proj")},
    GatedDeltaNet: {"qkv_z": ("in_proj_qkv", "in_proj_z"), "b_a": ("in_proj_b", "in_proj_a")},
    SparseMoE: {"router": ("gate", "shared_expert_gate")},
    MLP: {"gate_up": ("gate_proj", "up_proj")},
}


def _install_merged_projections(model: torch.nn.Module, installed: Counter) -> None:
    from .merge import Projections

    apart = Counter()
    for module in model.modules():
        groups = next((g for cls, g in MERGE_GROUPS.items() if isinstance(module, cls)), None)
        if groups is None:
            continue
        module.merged = {}
        for name, parts in groups.items():
            proj = Projections([getattr(module, p) for p in parts], install_weight_kernel)
            module.merged[name] = proj
            if proj.blocker is None:
                installed[f"merged {'+'.join(parts)}"] += 1
            else:
                apart[f"{'+'.join(parts)} ({proj.blocker})"] += 1
    if apart:
        log.info("projections kept apart: %s", ", ".join(f"{n} {what}" for what, n in apart.items()))


def _install_blocks(model: torch.nn.Module, installed: Counter) -> None:
    """Decoder layers, MoE blocks and MLPs with fewer launches for decode rows (blocks.py)."""
    from .blocks import (dense_residual_in_gemvs, fused_router, layer_forward, mlp_forward, moe_forward, norm_in_gemvs,
                         out_proj_adds_residual, residual_in_gemvs)
    from .int4_gemv import is_symmetric
    from .mixers import gdn_norm_in_out_proj

    apart = 0
    for module in model.modules():
        if isinstance(module, SparseMoE) and isinstance(module.experts.forward, partial) and module.experts.forward.func is _experts:
            gate_up, down = module.experts.gate_up, module.experts.down
            module.forward = partial(moe_forward, module, (is_symmetric(gate_up.qzeros), is_symmetric(down.qzeros)))
            module.adds_residual = True
            installed["fused moe block"] += 1
            if fused_router(module) is not None:
                installed["router + top-k in one launch"] += 1
            else:
                apart += 1
        elif isinstance(module, MLP):
            module.forward = partial(mlp_forward, module)
            installed["fused mlp"] += 1
        elif isinstance(module, DecoderLayer):
            module.forward = partial(layer_forward, module)
            installed["fused decoder layer"] += 1
    for module in model.modules():  # after the MoE blocks' own forwards, which norm_in_gemvs checks
        if isinstance(module, DecoderLayer):
            module.norm_in_gemvs = norm_in_gemvs(module, model.dtype)
            module.residual_in_gemvs = residual_in_gemvs(module, model.dtype)
            if module.norm_in_gemvs:
                installed["layer add + norm in out_proj's epilogue and the MoE GEMVs' prologues"] += 1
            if dense_residual_in_gemvs(module):
                installed["dense layer's residual adds in out_proj's and down_proj's epilogues"] += 1
            if (out_proj_adds_residual(module) and module.layer_type != "full_attention"
                    and gdn_norm_in_out_proj(module.linear_attn)):
                installed["GDN gated norm's rms in out_proj"] += 1
    if apart:
        log.info("%d MoE routers run their GEMV and a separate top-k kernel: the router weight is neither dense "
                 "16-bit nor block FP8 with a decode kernel", apart)


# INT4 qweights block-repacked at load for the tensor-core kernels (quant.int4.block_qweight): each warp-step 2 KB
# contiguous. H200, 122B, context 0, alternating A/B (session 9, NOTES-kernels run 11): step 3.49 against 3.90 ms
# (graph 3.35 against 3.66), +12% tok/s. Run 11 kept GPTQ order for engines with MTP (its verify steps were no faster
# blocked then); since session 40 they block-repack too: on the kernels of sessions 12-39 the blocked verify rows were
# faster (H100, 122B: M = 2 / 3 steps 4.38-4.45 / 4.63-4.74 ms against 5.00-5.17 / 5.10-5.25, the M = 3 graph with the
# rollback saves 4.39 against 4.47). ROOFLINE_INT4_QBLK=1 / =0 forces either order.
QBLK_ENV = "ROOFLINE_INT4_QBLK"


def _blockable(weight: Int4Weight, dtype: torch.dtype) -> bool:
    """Whether every decode call on this weight takes the tensor-core path, the only one that reads the blocked order:
    16-bit activations, group 128, K and N multiples of 128 (any of the kernels' column tiles divides N)."""
    return (dtype in (torch.bfloat16, torch.float16) and weight.group_size == 128 and weight.in_features % 128 == 0
            and weight.out_features % 128 == 0)


def _block(weight: Int4Weight) -> None:
    weight.qweight = block_qweight(weight.qweight)  # one tensor's copy at a time; the old one is freed
    weight.blocked = True


def _block_int4_weights(model: torch.nn.Module, dtype: torch.dtype, installed: Counter) -> None:
    """Reorder the INT4 qweights the tensor-core kernels read (`QBLK_ENV`). A merged projection is reordered as a
    whole and its parts become views of it again: a part's 32-column blocks are whole rows of the blocked order."""
    seen: set[int] = set()
    count = 0
    for module in model.modules():
        for proj in getattr(module, "merged", {}).values():
            whole = proj.merged
            if whole is not None:  # its parts are views of it: they go with it or stay as they are
                seen.update(id(p) for p in proj.parts)
            if not isinstance(whole, Int4Weight) or not _blockable(whole, dtype) or any(n % 32 for n in proj.sizes):
                continue
            _block(whole)
            start = 0
            for part, size in zip(proj.parts, proj.sizes):
                part._buffers["qweight"] = blocked_columns(whole.qweight, start, start + size)
                part.blocked = True
                start += size
            count += 1
    for module in model.modules():
        if isinstance(module, Experts) and isinstance(module.forward, partial) and module.forward.func is _experts:
            for weight in (module.gate_up, module.down):
                if _blockable(weight, dtype):
                    _block(weight)
                    count += 1
                seen.add(id(weight))
        elif isinstance(module, Int4Weight) and id(module) not in seen and not module.num_experts and _blockable(module, dtype):
            _block(module)
            count += 1
    if count:
        installed["int4 weights block-repacked"] += count


def block_int4_wanted() -> tuple[bool, str]:
    """(whether to block-repack the INT4 qweights, why): `QBLK_ENV` when set, else on."""
    forced = os.environ.get(QBLK_ENV)
    if forced in ("0", "1"):
        return forced == "1", f"{QBLK_ENV}={forced}"
    if forced:
        raise UserError(f"{QBLK_ENV} must be 0 or 1, got {forced!r}")
    return True, "the default"


def install_fast_path(model: torch.nn.Module, allow_cpu: bool = False) -> FastPath:
    """Install the Triton decode kernels on `model`; `allow_cpu` (tests) runs them in Triton's interpreter."""
    result = FastPath()
    installed = result.installed
    device = model.device
    if device.type != "cuda" and not (allow_cpu and os.environ.get("TRITON_INTERPRET") == "1"):
        log.info("fast path not used: the model is on %s; the Triton decode kernels need CUDA", device)
        return result
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("fast path not used: Triton is not installed (pip install 'roofline[gpu]'); running the PyTorch reference path")
        return result
    from .int4_gemv import is_symmetric
    from .mixers import attention_slot_step, fla_chunked_recurrence, gdn_slot_step

    fla = _fla_available() if device.type == "cuda" else False  # fla's kernels need CUDA (not the interpreter)

    for module in model.modules():
        if isinstance(module, Experts) and isinstance(module.gate_up, Int4Weight) and isinstance(module.down, Int4Weight):
            syms = (is_symmetric(module.gate_up.qzeros), is_symmetric(module.down.qzeros))
            module.forward = partial(_experts, module, syms)
            for weight in (module.gate_up, module.down):  # prefill: each expert's weight dequantised in one launch
                weight.forward = partial(many_rows_forward, weight)
            installed["int4 experts"] += 1
        elif isinstance(module, LinearWeight) and not module.num_experts:
            kind = install_weight_kernel(module)
            if kind:
                installed[kind] += 1
        elif isinstance(module, Experts) and module.gate_up.FORMAT == module.down.FORMAT == "dense":
            module.forward = partial(_dense_experts, module)
            installed["dense experts (grouped GEMV)"] += 1
        elif isinstance(module, Experts):
            result.graph_blockers.append(
                f"routed experts stored as {module.gate_up.FORMAT}/{module.down.FORMAT} have no sync-free kernel"
            )
        elif isinstance(module, RMSNorm) and FUSED_SMALL_OPS:
            module.forward = partial(_fused_norm, module)
            installed["fused rms_norm"] += 1
        elif isinstance(module, SparseMoE) and FUSED_SMALL_OPS:
            module.route = partial(_fused_route, module)
            installed["fused router"] += 1
        elif isinstance(module, GatedAttention):
            module.slot_step = partial(attention_slot_step, module, fused_prologue=FUSED_SMALL_OPS)
            installed["decode attention"] += 1
        elif isinstance(module, GatedDeltaNet):
            module.slot_step = partial(gdn_slot_step, module)
            installed["gdn decode"] += 1
            if fla:
                module.recurrence = partial(fla_chunked_recurrence, module)
                installed["gdn chunked prefill (fla)"] += 1
    if installed["gdn decode"] and not fla and device.type == "cuda":
        log.warning("GDN prefill runs the PyTorch loop over tokens: fla-core is not installed (pip install 'roofline[gpu]')")
    _install_merged_projections(model, installed)
    block, why = block_int4_wanted()
    if block:
        _block_int4_weights(model, model.dtype, installed)
    if installed["int4 weights block-repacked"]:
        log.info("INT4 qweights block-repacked for the tensor-core kernels (%s)", why)
    elif installed["int4"] or installed["int4 experts"]:
        log.info("INT4 qweights kept in GPTQ order: %s", why if not block else "no weight the tensor-core path reads "
                 "(16-bit activations, group 128, K and N multiples of 128)")
    if FUSED_SMALL_OPS:
        _install_blocks(model, installed)
    if installed["int4"] or installed["int4 experts"]:
        from .int4_tc import INT4_DEPTH, NO_SPLIT_MAX_ROWS, NO_SPLIT_MIN_N, WIDE_TILES

        if NO_SPLIT_MAX_ROWS >= 2:
            installed[f"int4 tc without a K split: GEMVs of >= {NO_SPLIT_MIN_N} columns at 2-{NO_SPLIT_MAX_ROWS} rows "
                      f"(the verify rows)"] += 1
        if INT4_DEPTH == 2:
            installed["int4 tc two-buffer loop at one row too (ROOFLINE_INT4_DEPTH=2)"] += 1
        elif WIDE_TILES is None:
            installed["int4 tc two-buffer loop for wide GEMVs of several rows (ROOFLINE_INT4_DEPTH=one-row)"] += 1
    if installed["int4"] or installed["int4 experts"]:
        gemm = int4_gemm_wanted()
        use_int4_gemm(model, gemm)
        if gemm == "triton":
            installed["int4 gemm for many rows: experts grouped, dense up to 64 rows"] += 1
        else:
            log.info("INT4 calls past the decode kernels' rows dequantise the weight first, the routed experts one at a "
                     "time, and decode steps past %d rows run outside CUDA graphs (ROOFLINE_INT4_GEMM=dequant; the "
                     "default, triton, is the grouped INT4 GEMM kernel)", MAX_EXPERT_TOKENS)
    if installed["int8 lm_head"]:
        from .int8_lm_head import DOT_ROWS

        if DOT_ROWS:
            installed["int8 lm_head on the tensor cores"] += 1
        else:
            log.info("INT8 LM head on the lanes loop, not the tensor cores (ROOFLINE_INT8_DOT=0)")
    if device.type == "cuda":
        from ._common import PDL_ENABLED, SECOND_STREAM, pdl_supported

        if SECOND_STREAM:
            installed["second stream (MoE shared expert, GDN b/a)"] += 1
        else:
            log.info("decode kernels on one stream (the MoE's shared expert and the GDN's b/a not beside the rest): "
                     "ROOFLINE_SECOND_STREAM=0")
        if pdl_supported(device):
            installed["programmatic dependent launch"] += 1
        else:
            log.info("decode kernels launch one after another (no programmatic dependent launch): %s",
                     "ROOFLINE_PDL=0" if not PDL_ENABLED else f"it needs sm_90+, {device} is sm_"
                     + "".join(map(str, torch.cuda.get_device_capability(device))))
    result.graph_blockers = sorted(set(result.graph_blockers))
    dense = sum(1 for m in model.modules()
                if isinstance(m, LinearWeight) and m.FORMAT == "dense" and not m.num_experts and "forward" not in m.__dict__)
    log.info(
        "fast path: Triton decode kernels on %s; %d dense linears stay on PyTorch%s",
        ", ".join(f"{n} {kind}" for kind, n in installed.items()),
        dense,
        "; the decode step cannot be captured: " + "; ".join(result.graph_blockers) if result.graph_blockers else "",
    )
    return result
