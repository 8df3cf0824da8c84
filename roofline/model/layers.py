"""Qwen3.5 layers in plain PyTorch: the reference path and the test oracle.

Tokens of all sequences in a step are flattened to `[N, hidden]`; linears and the MoE work
on the flat batch, while attention and Gated DeltaNet walk each sequence's span with its
own cache. See shared docs qwen35.md for the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ..config import ModelConfig
from ..engine.cache import CachePool, SequenceCache
from .slots import LinearSlot, plain_parameter


@dataclass
class StepBatch:
    """One forward step: `seq_lens[i]` new tokens of sequence i, flattened in order."""

    seq_lens: list[int]
    positions: torch.Tensor  # [N] absolute positions
    caches: list[SequenceCache]

    def spans(self):
        start = 0
        for length, cache in zip(self.seq_lens, self.caches):
            yield slice(start, start + length), cache
            start += length


@dataclass
class SlotBatch:
    """A decode step over pooled caches with every index on the device, so it can be captured as a
    CUDA graph and replayed: B sequences x M tokens each, flattened sequence-major.

    The mixers' `slot_step` (installed with the fast path's kernels) reads and writes the pool in
    place. With M > 1 (speculative verify), `rollback` holds per GDN layer the buffer that
    receives each of the first M-1 tokens' state-update record (gdn_decode's step_records). Keys and
    values go to (`kv_slots`, `kv_positions`), which differ from (`slots`, `positions`) only for a
    bucket's padding rows (see CachePool); GDN states are read from rows
    `state_in` and written to `state_out` of the pool (the verify writes a sequence's other buffer).
    """

    pool: CachePool
    slots: torch.Tensor  # [B] the pool slot of each sequence (GDN state)
    positions: torch.Tensor  # [B*M] absolute positions (RoPE, causality)
    lengths: torch.Tensor  # [B] cached tokens after this step
    tokens_per_seq: int
    max_len: int  # host-side bound on lengths (sizes the attention grid)
    rollback: dict[int, torch.Tensor] | None = None
    kv_slots: torch.Tensor | None = None  # [B] where keys and values are written and read; default slots
    kv_positions: torch.Tensor | None = None  # [B*M] where they are written; default positions
    state_in: torch.Tensor | None = None  # [B] GDN state rows read; default slots
    state_out: torch.Tensor | None = None  # [B] GDN state rows written; default state_in

    def __post_init__(self):
        self.kv_slots = self.slots if self.kv_slots is None else self.kv_slots
        self.kv_positions = self.positions if self.kv_positions is None else self.kv_positions
        self.state_in = self.slots if self.state_in is None else self.state_in
        self.state_out = self.state_in if self.state_out is None else self.state_out


def slot_step_missing(module: nn.Module, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
    raise RuntimeError(
        f"{type(module).__name__}: the pooled (CUDA-graph) decode step needs the fast path's kernels "
        "(roofline.kernels.dispatch.install_fast_path)"
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = plain_parameter(dim)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Partial RoPE: the first `rotary_dim` dims of each head, rotate-half pairs (i, i + rotary_dim/2)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim], positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate packed into q_proj ([query | gate] per head)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = LinearSlot(self.num_heads * self.head_dim * 2, h)
        self.k_proj = LinearSlot(self.num_kv_heads * self.head_dim, h)
        self.v_proj = LinearSlot(self.num_kv_heads * self.head_dim, h)
        self.o_proj = LinearSlot(h, self.num_heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)

    slot_step = slot_step_missing  # replaced by the fast path

    def forward(self, x: torch.Tensor, batch: StepBatch | SlotBatch) -> torch.Tensor:
        if isinstance(batch, SlotBatch):
            return self.slot_step(x, batch)
        n = x.shape[0]
        query, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.rotary(self.q_norm(query), batch.positions)
        k = self.rotary(self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)), batch.positions)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for span, cache in batch.spans():
            keys, values = cache.append_kv(self.layer_idx, k[span], v[span])
            out[span] = self.attend(q[span], keys, values)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)

    def attend(self, q, keys, values):
        """Causal GQA attention of the t newest positions q [t, H, d] over cached keys/values [T, Hkv, d] (key j at
        position j; q row i at position T - t + i). The lower-right causal bias lets SDPA take its flash kernel on
        CUDA instead of materialising [H, t, T] scores (32 GiB for an 8K chunk over 32K tokens on the 122B: an
        H200 ran out of memory there while the inputs had no batch axis, which flash requires)."""
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, keys, values))  # [1, heads, positions, d]
        gqa = q4.shape[1] != k4.shape[1]
        if gqa and q4.is_cuda and not flash_takes(q4, k4, v4):
            # flash refuses these grouped heads here: give every query head its KV head, linear in T (the
            # scores SDPA's other kernels would fall back to grow with t x T)
            k4, v4 = (t.repeat_interleave(q4.shape[1] // k4.shape[1], dim=1) for t in (k4, v4))
            gqa = False
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=causal_lower_right(q.shape[0], keys.shape[0]), scale=self.head_dim**-0.5,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)


def flash_takes(q, k, v) -> bool:
    """Whether SDPA's flash kernel accepts these [1, heads, positions, d] CUDA inputs with grouped KV heads."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))  # as CausalBias asks


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; per value head a [k_dim, v_dim] fp32 state."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_size, self.value_size = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_size, self.kernel = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        self.in_proj_qkv = LinearSlot(self.conv_size, h)
        self.in_proj_z = LinearSlot(self.value_size, h)
        self.in_proj_b = LinearSlot(self.num_v_heads, h)
        self.in_proj_a = LinearSlot(self.num_v_heads, h)
        self.out_proj = LinearSlot(h, self.value_size)
        self.conv1d = nn.Module()
        self.conv1d.weight = plain_parameter(self.conv_size, 1, self.kernel)
        self.A_log = plain_parameter(self.num_v_heads, fp32=True)
        self.dt_bias = plain_parameter(self.num_v_heads, fp32=True)
        self.norm = nn.Module()  # gated RMSNorm over each value head; plain `w`, not 1 + w
        self.norm.weight = plain_parameter(self.v_dim)

    slot_step = slot_step_missing  # replaced by the fast path

    def forward(self, x: torch.Tensor, batch: StepBatch | SlotBatch) -> torch.Tensor:
        if isinstance(batch, SlotBatch):
            return self.slot_step(x, batch)
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        decay = -self.A_log.exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # log of the per-step gate
        core = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        for span, cache in batch.spans():
            mixed = self.causal_conv(qkv[span], cache)
            core[span] = self.recurrence(mixed, beta[span], decay[span], cache)
        return self.out_proj(self.gated_norm(core.to(x.dtype), z))

    def causal_conv(self, qkv: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """Depthwise causal conv over [cached K-1 inputs | new inputs], then SiLU; updates the cache."""
        history = self.kernel - 1
        past = cache.conv_window(self.layer_idx, history)
        if past is None:
            past = qkv.new_zeros(history, self.conv_size)
        window = torch.cat([past, qkv])
        cache.set_conv(self.layer_idx, window, history)
        if cache.record_steps:
            cache.step_conv[self.layer_idx] = window
        weight = self.conv1d.weight
        out = F.conv1d(window.t().unsqueeze(0).to(weight.dtype), weight, groups=self.conv_size)
        return F.silu(out[0].t()).to(qkv.dtype)

    def recurrence(self, mixed, beta, decay, cache: SequenceCache) -> torch.Tensor:
        """S = S*exp(g); d = beta*(v - S^T k); S += k d^T; o = S^T q, token by token, in fp32."""
        t = mixed.shape[0]
        q, k, v = mixed.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        group = self.num_v_heads // self.num_k_heads  # key head j // group serves value head j
        q = l2_normalize(q.view(t, self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=1) * self.k_dim**-0.5
        k = l2_normalize(k.view(t, self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=1)
        v = v.view(t, self.num_v_heads, self.v_dim)
        state = cache.recurrent.get(self.layer_idx)
        if state is None:
            state = mixed.new_zeros(self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        if t >= DELTA_CHUNK and not cache.record_steps:  # prefill: the same recurrence in chunks of matmuls
            out, state = chunked_delta_rule(q, k, v, beta.float(), decay.float(), state)
            cache.set_recurrent(self.layer_idx, state)
            return out
        out = torch.empty(t, self.num_v_heads, self.v_dim, dtype=torch.float32, device=mixed.device)
        gate = decay.exp()
        history = []
        for i in range(t):
            state = state * gate[i][:, None, None]
            delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
            state = state + k[i][:, :, None] * delta[:, None, :]
            out[i] = torch.einsum("hkv,hk->hv", state, q[i])
            history.append(state)
        cache.set_recurrent(self.layer_idx, state)
        if cache.record_steps:
            cache.step_recurrent[self.layer_idx] = history
        return out

    def gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per head: w * rmsnorm(o) * silu(z), flattened back to [N, value_size]."""
        n = core.shape[0]
        of = core.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(core.dtype)
        gated = (self.norm.weight * normed).float() * F.silu(z.view(n, self.num_v_heads, self.v_dim).float())
        return gated.to(core.dtype).reshape(n, self.value_size)


DELTA_CHUNK = 64  # spans this long or longer take chunked_delta_rule (a 1K span on a CPU: 0.18 s vs 1.0 s for the loop)


def chunked_delta_rule(q, k, v, beta, decay, state, chunk: int = DELTA_CHUNK):
    """GatedDeltaNet.recurrence's token loop for a whole span, `chunk` tokens at a time, in fp32.

    q, k [..., T, H, dk] (normalised and scaled as the loop has them), v [..., T, H, dv], beta and
    decay (log of the gate) [..., T, H], state [..., H, dk, dv]; the leading dims (none for the
    engine, a batch for training/model.py's stand-in for transformers' torch_chunk_gated_delta_rule)
    are carried through. Returns (out [..., T, H, dv], final state). The chunked form of the gated
    delta rule (the UT transform of DeltaNet, as fla's chunked kernel and transformers'
    torch_chunk_gated_delta_rule compute it): within a chunk the updates become one triangular
    solve and a few matmuls; only the chunks are sequential. Padded positions carry beta = 0 and
    no decay, so they leave the state unchanged. Differentiable (training uses it): the chunk loop
    unbinds its inputs and stacks its outputs once, so that autograd does not answer each chunk's
    slice with a gradient the size of the whole tensor.
    """
    t = q.shape[-3]
    pad = (-t) % chunk

    def chunked(x):  # [..., T, H, d] -> [..., H, N, C, d]
        x = F.pad(x.transpose(-3, -2), (0, 0, 0, pad))
        return x.reshape(*x.shape[:-2], -1, chunk, x.shape[-1])

    q, k, v = chunked(q), chunked(k), chunked(v)
    beta, decay = (F.pad(x.transpose(-1, -2), (0, pad)).unflatten(-1, (-1, chunk)) for x in (beta, decay))
    cum = decay.cumsum(-1)  # log of the gate product from the chunk's start, [..., H, N, C]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # gate from j to i <= j
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower-triangular once its diagonal is taken as 1
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * cum.exp()[..., None]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    chunk_gate = cum[..., -1].exp()[..., None, None]  # [..., H, N, 1, 1]
    outs = []
    for nv, sk, qd, w, kt, cg in zip(*(x.unbind(-3) for x in (new_values, state_keys, q_decayed, within, k_to_end,
                                                             chunk_gate))):
        v_new = nv - sk @ state
        outs.append(qd @ state + w @ v_new)
        state = state * cg + kt @ v_new
    out = torch.stack(outs, -3).flatten(-3, -2)[..., :t, :]  # [..., H, T, dv]
    return out.transpose(-3, -2).contiguous(), state


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the dense model's MLP and the MoE's shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = LinearSlot(intermediate, hidden)
        self.up_proj = LinearSlot(intermediate, hidden)
        self.down_proj = LinearSlot(hidden, intermediate)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts stacked: gate and up fused as one [E, 2I, H] linear, down [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = LinearSlot(2 * intermediate, hidden, num_experts, split_rows=("gate_proj", "up_proj"))
        self.down = LinearSlot(hidden, intermediate, num_experts, split_rows=("down_proj",))

    def forward(self, x: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        # The (token, choice) rows sorted by expert, so each expert takes one slice: one host read of the counts per
        # call, where a torch.where per expert read the device once per expert (256 a layer in a prefill). Each
        # expert's rows are gathered and added back on their own, as before: small temporaries, the same sums.
        k = top_experts.shape[1]
        flat = top_experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.num_experts).tolist()
        weights = top_weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                tokens = order[start : start + n] // k
                gate, up = self.gate_up(x[tokens], expert=expert).chunk(2, dim=-1)
                y = self.down(F.silu(gate) * up, expert=expert) * weights[start : start + n, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = LinearSlot(cfg.num_experts, cfg.hidden_size)  # router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = LinearSlot(1, cfg.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over all experts in fp32, top-k, renormalised to sum to 1."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return experts, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)

    def forward(self, x):
        experts, weights = self.route(x)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return self.experts(x, experts, weights) + shared


class DecoderLayer(nn.Module):
    """h = x + mixer(norm1(x)); out = h + mlp(norm2(h))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: StepBatch | SlotBatch) -> torch.Tensor:
        mixer = self.self_attn if self.layer_type == "full_attention" else self.linear_attn
        h = x + mixer(self.input_layernorm(x), batch)
        return h + self.mlp(self.post_attention_layernorm(h))
