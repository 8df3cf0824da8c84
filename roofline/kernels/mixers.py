"""The mixers' pooled decode step (`slot_step`) on the fused kernels: what a CUDA graph captures.

Installed by `dispatch.install_fast_path` on each GatedAttention and GatedDeltaNet. Projections
that read the same input run as one merged weight where their formats agree (q/k/v; GDN's qkv/z
and b/a; see merge.py); the cache work is one kernel per layer:
attention writes the step's keys and values into the pool at their positions and runs
`decode_attention` over the slot; GDN runs `gdn_decode`, which writes the step's inputs to the slot's conv ring
and updates its recurrent state in place (and, for a multi-token verify step, records each token's state update
so a partial accept can roll back).

Prefill (eager, several tokens per sequence) of GDN goes through fla-core's chunked gated delta
rule where it is installed (`fla_chunked_recurrence`), instead of the reference's loop over tokens.
"""

from __future__ import annotations


import torch

from ..engine.cache import SequenceCache
from ..model.layers import GatedAttention, GatedDeltaNet, SlotBatch
from ._common import beside
from .decode_attention import decode_attention
from .gdn_decode import gdn_decode
from .int4_tc import GROUP


# The GDN kernel leaves its gated norm's rms to the out projection where the layer's out projection is the INT4 GEMV
# that adds the residual (blocks.norm_in_gemvs, 1-4 rows): each GDN program writes w * o * silu(z) and o's sum of
# squares over its v block, and the GEMV scales each row's products of a quantisation group by its head's rstd
# (int4_tc's head_norm). The GDN kernel then has no arrival round (without the deferral its key heads' last programs
# read every head's o back from a workspace after all others had finished, and ran the norms). Needs heads of a
# multiple of 128 values (one quantisation group holds one head's values), as the published models have.
GDN_NORM_IN_OUT_PROJ = True


def gdn_norm_in_out_proj(gdn: GatedDeltaNet) -> bool:
    """Whether gdn's decode step leaves its gated norm's rms to its out projection (GDN_NORM_IN_OUT_PROJ), where its
    out projection adds the residual."""
    return GDN_NORM_IN_OUT_PROJ and gdn.v_dim % GROUP == 0 and "residual_forward" in gdn.out_proj.__dict__


def out_projection(weight, x: torch.Tensor, residual: torch.Tensor | None, head_norm: tuple | None = None):
    """The mixer's out projection; with `residual` (blocks.norm_in_gemvs) its INT4 GEMV also adds the residual and
    returns (h, per-tile sums of squares); with `head_norm` it also finishes the GDN's gated norm (int4_tc)."""
    if residual is None:
        return weight(x)
    return weight.residual_forward(x, residual, head_norm=head_norm)


def attention_slot_step(attn: GatedAttention, x: torch.Tensor, batch: SlotBatch, fused_prologue: bool = False,
                        residual: torch.Tensor | None = None):
    n, m = x.shape[0], batch.tokens_per_seq
    qg, k, v = attn.merged["qkv"](x)  # one launch where q/k/v share a format (merge.py)
    qg = qg.view(n, attn.num_heads, 2 * attn.head_dim)  # [query | gate] per head
    k = k.view(n, attn.num_kv_heads, attn.head_dim)
    v = v.view(n, attn.num_kv_heads, attn.head_dim)
    keys, values = batch.pool.keys[attn.layer_idx], batch.pool.values[attn.layer_idx]
    gate = qg[..., attn.head_dim :]
    if fused_prologue:  # norms, RoPE and the KV write in one launch (small_ops, opt-in)
        from .small_ops import attention_prologue

        q = attention_prologue(qg, k, v, batch.positions, batch.kv_positions, batch.kv_slots, m, attn.q_norm.weight,
                               attn.k_norm.weight, attn.rotary.inv_freq, keys, values, attn.q_norm.eps)
    else:
        q = attn.rotary(attn.q_norm(qg[..., : attn.head_dim]), batch.positions)
        rows = batch.kv_slots.repeat_interleave(m)
        keys[rows, batch.kv_positions] = attn.rotary(attn.k_norm(k), batch.positions)
        values[rows, batch.kv_positions] = v
    out = decode_attention(
        q.reshape(n // m, m, attn.num_heads, attn.head_dim), keys, values, batch.lengths,
        attn.head_dim**-0.5, max_len=batch.max_len, slots=batch.kv_slots, gate=gate,  # output gate applied in-kernel
    )
    return out_projection(attn.o_proj, out.reshape(n, -1), residual)


def gdn_slot_step(gdn: GatedDeltaNet, x: torch.Tensor, batch: SlotBatch, residual: torch.Tensor | None = None):
    step_records = (batch.rollback or {}).get(gdn.layer_idx)
    (b, a), join = beside(x.device, gdn.merged["b_a"], x)  # the small b/a projection beside the big one
    qkv, z = gdn.merged["qkv_z"](x)  # each pair one launch where its formats agree (merge.py)
    join()
    defer = residual is not None and gdn_norm_in_out_proj(gdn)
    core = gdn_decode(
        qkv, z, b, a,
        batch.pool.conv[gdn.layer_idx], gdn.conv1d.weight, gdn.A_log, gdn.dt_bias, gdn.norm.weight,
        batch.pool.recurrent[gdn.layer_idx], gdn.num_k_heads, gdn.eps,
        positions=batch.positions, slots=batch.slots, state_rows=(batch.state_in, batch.state_out),
        tokens_per_seq=batch.tokens_per_seq, step_records=step_records, defer_norm=defer,
    )
    head_norm = None
    if defer:
        core, parts = core
        head_norm = (parts, gdn.eps)
    return out_projection(gdn.out_proj, core, residual, head_norm)


FLA_MIN_TOKENS = 16  # shorter spans (decode, verify) are not worth a chunked launch


def fla_chunked_recurrence(gdn: GatedDeltaNet, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                           cache: SequenceCache) -> torch.Tensor:
    """GatedDeltaNet.recurrence for one sequence's span through fla's `chunk_gated_delta_rule` (same math: q/k
    L2-normalised in the kernel, q scaled by k_dim^-0.5, fp32 state). Spans whose per-token states are
    recorded (speculative verify) or that are short keep the reference loop."""
    t = mixed.shape[0]
    if t < FLA_MIN_TOKENS or cache.record_steps:
        return GatedDeltaNet.recurrence(gdn, mixed, beta, decay, cache)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v = mixed.split([gdn.key_size, gdn.key_size, gdn.value_size], dim=-1)
    group = gdn.num_v_heads // gdn.num_k_heads  # fla wants one q/k head per value head
    q = q.reshape(1, t, gdn.num_k_heads, gdn.k_dim).repeat_interleave(group, dim=2)
    k = k.reshape(1, t, gdn.num_k_heads, gdn.k_dim).repeat_interleave(group, dim=2)
    v = v.reshape(1, t, gdn.num_v_heads, gdn.v_dim)
    state = cache.recurrent.get(gdn.layer_idx)
    out, final = chunk_gated_delta_rule(
        q, k, v, g=decay[None].float(), beta=beta[None].to(q.dtype), scale=gdn.k_dim**-0.5,
        initial_state=None if state is None else state[None].float(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    cache.set_recurrent(gdn.layer_idx, final[0].float())
    return out[0].float()
