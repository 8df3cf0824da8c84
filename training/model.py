"""The tiny Qwen3.5-MoE: config, MTP head, checkpoint writing and reading.

The trunk is transformers' Qwen3_5MoeForCausalLM. The MTP head (which transformers
ignores) is built here from the formula in docs/qwen35.md:

    x = mtp.fc(cat([mtp.pre_fc_norm_embedding(embed(tok[t+1])), mtp.pre_fc_norm_hidden(h_t)]))
    x = mtp.layers.0(x)            # one full-attention decoder layer with its own MoE,
                                   # causal over the sequence, RoPE position t
    logits = lm_head(mtp.norm(x))  # predicts tok[t+2]

h_t is the trunk's hidden state after its final norm. embed_tokens and lm_head are shared
with the trunk. For a second draft the same layer is applied again to
(embed(tok[t+2]), mtp.norm(x_t)) at RoPE position t+1.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

SPECIAL_IDS_NOTE = "eos = <|im_end|>, <|endoftext|>; pad = <|endoftext|>"


def tiny_config_dict(vocab_size: int, eos_ids: list[int]) -> dict:
    """Flat text config as Qwen3_5MoeForCausalLM.save_pretrained writes it, plus MTP."""
    n_layers = 8
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": n_layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "pad_token_id": None,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "dtype": "bfloat16",
    }


def quantisable_input_dims(cfg: dict) -> dict:
    """Input dimension of every linear that the quantised formats convert."""
    h = cfg["hidden_size"]
    return {
        "hidden (q/k/v, in_proj_qkv/z, experts gate/up, shared gate/up, router)": h,
        "o_proj (num_attention_heads*head_dim)": cfg["num_attention_heads"] * cfg["head_dim"],
        "out_proj (linear value dim)": cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"],
        "experts down_proj (moe_intermediate_size)": cfg["moe_intermediate_size"],
        "shared_expert down_proj": cfg["shared_expert_intermediate_size"],
        "mtp.fc (2*hidden)": 2 * h,
    }


# ------------------------------------------------------------------ gated delta rule for training

TRANSFORMERS_GDN = qm.torch_chunk_gated_delta_rule  # transformers' own, whatever it resolved to at import


def roofline_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                                    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                    **kwargs):
    """Drop-in for transformers' torch_chunk_gated_delta_rule (same arguments, shapes and result),
    computed by roofline's chunked_delta_rule: one batched triangular solve for all chunks instead of
    transformers 5.17's row-by-row forward substitution (63 small steps per chunk size 64), and a chunk
    loop of 4 matmuls a chunk; far fewer ops to dispatch per training step. fp32 inside, as transformers
    casts; autocast is switched off inside so that the matmuls stay fp32 (under bf16 autocast transformers'
    matmuls run in bf16). query, key [B, T, Hk, dk], value [B, T, Hv, dv], g (log decay), beta [B, T, Hv]."""
    from roofline.model.layers import chunked_delta_rule, l2_normalize

    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        q, k, v, g, beta = (x.float() for x in (query, key, value, g, beta))
        if use_qk_l2norm_in_kernel:  # the engine's l2 norm is transformers' (and fla's): x / sqrt(sum x^2 + 1e-6)
            q, k = l2_normalize(q), l2_normalize(k)
        q = q * q.shape[-1] ** -0.5
        rep = v.shape[-2] // k.shape[-2]  # each key head serves `rep` consecutive value heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
        b, _, h, dk = k.shape
        state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device) if initial_state is None
                 else initial_state.float())
        out, state = chunked_delta_rule(q, k, v, beta, g, state, chunk=chunk_size)
    return out.to(dtype), (state if output_final_state else None)


def set_gdn(modules, impl: str) -> int:
    """impl: 'roofline' (roofline_chunk_gated_delta_rule) or 'transformers' (what transformers resolved
    at import: its torch function, or fla's kernel if it found fla). Sets transformers' module-level
    function (what 5.24's GatedDeltaNet.forward calls, and what modules built later bind) and the
    chunk_gated_delta_rule attribute that 5.17's GatedDeltaNet binds in __init__ (its original is kept on
    the module for 'transformers'). Returns the number of GatedDeltaNet modules found."""
    if impl not in ("roofline", "transformers"):
        raise ValueError(f"unknown gated delta rule implementation {impl!r}")
    qm.torch_chunk_gated_delta_rule = roofline_chunk_gated_delta_rule if impl == "roofline" else TRANSFORMERS_GDN
    n = 0
    for root in modules:
        for m in root.modules():
            if type(m).__name__ != "Qwen3_5MoeGatedDeltaNet":
                continue
            n += 1
            if "chunk_gated_delta_rule" in m.__dict__:  # bound at construction (transformers <= 5.17 or so)
                if "_transformers_gdn" not in m.__dict__:
                    bound = m.chunk_gated_delta_rule
                    m._transformers_gdn = TRANSFORMERS_GDN if bound is roofline_chunk_gated_delta_rule else bound
                m.chunk_gated_delta_rule = (roofline_chunk_gated_delta_rule if impl == "roofline"
                                            else m._transformers_gdn)
    return n


def make_text_config(cfg: dict) -> Qwen3_5MoeTextConfig:
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype", "transformers_version")}
    return Qwen3_5MoeTextConfig(**kw)


def _rms_norm(dim, eps):
    return qm.Qwen3_5MoeRMSNorm(dim, eps=eps)


class MTPHead(nn.Module):
    """Module names match the checkpoint: fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
    layers.0 (a full-attention Qwen3_5MoeDecoderLayer), norm."""

    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = _rms_norm(h, eps)
        self.pre_fc_norm_hidden = _rms_norm(h, eps)
        full = config.layer_types.index("full_attention")  # any full-attention index builds that layer type
        self.layers = nn.ModuleList([qm.Qwen3_5MoeDecoderLayer(config, full)])
        self.norm = _rms_norm(h, eps)
        hd = config.head_dim
        rp = getattr(config, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(config, "rope_theta", 1e7))
        frac = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.25))
        rot = int(hd * frac)
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)),
                             persistent=False)
        self.init_weights(config.initializer_range)

    @torch.no_grad()
    def init_weights(self, std: float):
        for name, m in self.named_modules():
            cls = type(m).__name__
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif cls == "Qwen3_5MoeRMSNorm":
                m.weight.zero_()
            elif cls == "Qwen3_5MoeExperts":
                m.gate_up_proj.normal_(0.0, std)
                m.down_proj.normal_(0.0, std)
            elif cls == "Qwen3_5MoeTopKRouter":
                m.weight.normal_(0.0, std)

    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[None]  # [1, T, rot]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, embed_next: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """embed_next, hidden: [B, T, H] (embedding of tok[t+1], post-norm trunk state at t);
        positions: [T] RoPE positions. Returns the post-mtp.norm state [B, T, H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        out = self.layers[0](x, position_embeddings=(cos, sin), attention_mask=None)
        if isinstance(out, tuple):
            out = out[0]
        return self.norm(out)


def build_model(cfg: dict, seed: int):
    torch.manual_seed(seed)
    tcfg = make_text_config(cfg)
    tcfg._experts_implementation = "eager"
    tcfg._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(tcfg)
    mcfg = copy.deepcopy(model.config)
    mtp = MTPHead(mcfg)
    return model, mtp


# ------------------------------------------------------------------ checkpoint


def _per_expert(name: str, t: torch.Tensor):
    """Fused experts -> per-expert tensors, as save_pretrained writes them."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        n_inter = t.shape[1] // 2
        for j in range(t.shape[0]):
            yield f"{base}{j}.gate_proj.weight", t[j, :n_inter]
            yield f"{base}{j}.up_proj.weight", t[j, n_inter:]
    elif name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        for j in range(t.shape[0]):
            yield f"{base}{j}.down_proj.weight", t[j]
    else:
        yield name, t


def checkpoint_tensors(model, mtp) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, mod in (("", model), ("mtp.", mtp)):
        for name, t in mod.state_dict().items():
            if name.endswith("inv_freq"):
                continue
            for n, x in _per_expert(prefix + name, t):
                out[n] = x.detach().to("cpu", torch.bfloat16).contiguous()
    return out


def save_checkpoint(model, mtp, cfg: dict, out_dir: str | os.PathLike, max_shard_bytes: int = 15_000_000,
                    generation_config: dict | None = None, extra_files: dict | None = None):
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, mtp)
    names = sorted(tensors, key=lambda n: (n.startswith("mtp."), n))
    shards, cur, size = [], [], 0
    for n in names:
        b = tensors[n].numel() * 2
        if cur and size + b > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += tensors[n].numel() * 2
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    import transformers

    conf = dict(cfg)
    conf["transformers_version"] = transformers.__version__
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]


def load_mtp(model_dir: str | os.PathLike, model, device=None, dtype=None) -> MTPHead:
    """Build the MTP head for a loaded trunk and fill it from the checkpoint's mtp.* tensors."""
    from safetensors import safe_open

    d = Path(model_dir)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    mtp = MTPHead(copy.deepcopy(model.config))
    sd = {}
    for name, fname in index["weight_map"].items():
        if name.startswith("mtp."):
            with safe_open(str(d / fname), "pt") as f:
                sd[name[4:]] = f.get_tensor(name)
    fused = {}
    for name in list(sd):
        if ".mlp.experts." in name and name.split(".mlp.experts.")[1].split(".")[0].isdigit():
            base, rest = name.split(".mlp.experts.")
            j, kind = rest.split(".")[0], rest.split(".")[1]
            fused.setdefault(base, {}).setdefault(int(j), {})[kind] = sd.pop(name)
    for base, experts in fused.items():
        n = len(experts)
        sd[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[j]["gate_proj"], experts[j]["up_proj"]], 0) for j in range(n)])
        sd[f"{base}.mlp.experts.down_proj"] = torch.stack([experts[j]["down_proj"] for j in range(n)])
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise KeyError(f"MTP checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return mtp.to(device=device or next(model.parameters()).device, dtype=dtype or next(model.parameters()).dtype)
