"""Tiny Qwen3.5 checkpoints in the published formats, with transformers models as the reference.

Weights are random but bf16-representable, so a BF16 checkpoint and the fp32 reference model
hold identical values. Quantised variants replace the reference's weights by their
dequantised values, so "logits of the dequantised model" is what transformers computes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from roofline.checkpoint.classes import FP8_CLASSES, INT4_CLASSES
from roofline.checkpoint.convert import publish_names, quantize_tensors
from roofline.checkpoint.writer import write_checkpoint
from roofline.quant import Fp8BlockWeight, Int4Weight

INT4_PLAN = {c: "int4" for c in INT4_CLASSES}
FP8_PLAN = {c: "fp8" for c in FP8_CLASSES}


def text_config(moe: bool = True, heads: tuple[int, int] = (4, 2), layers: int = 4, hidden: int = 128, **overrides) -> dict:
    """A flat config as `Qwen3_5[Moe]ForCausalLM.save_pretrained` writes it; linears' K divisible by 128."""
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": 256,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads[0],
        "num_key_value_heads": heads[1],
        "head_dim": 32 if heads[0] % 4 == 0 else 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 1,
    }
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    else:
        cfg.update(intermediate_size=256)
    cfg.update(overrides)
    return cfg


def nested_config(flat: dict) -> dict:
    """The multimodal layout of published checkpoints: text under `text_config`."""
    moe = flat["model_type"].startswith("qwen3_5_moe")
    text = {k: v for k, v in flat.items() if k not in ("architectures", "tie_word_embeddings")}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32},
        "tie_word_embeddings": flat["tie_word_embeddings"],
    }


def reference_model(cfg: dict, seed: int = 0):
    """A transformers model for `cfg` with random bf16-representable fp32 weights, and random MTP tensors."""
    import transformers

    arch = hf_class(cfg["architectures"][0])
    config_cls = transformers.Qwen3_5MoeTextConfig if "Moe" in arch.__name__ else transformers.Qwen3_5TextConfig
    hf_cfg = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = arch(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=gen))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
            p.copy_(p.bfloat16().float())
    return model, mtp_tensors(model, cfg, gen)


def hf_class(name: str):
    """transformers' model class `name`, its modeling module imported with fla-core hidden where it is installed (the
    GPU environment): transformers 5.17 binds fla's Triton kernels when it imports the module, and they fail on this
    CPU reference model (5.24+ fall back to PyTorch for CPU inputs). The module is imported again if it was already."""
    import importlib
    import sys

    import transformers

    package = "qwen3_5_moe" if "Moe" in name else "qwen3_5"
    path = f"transformers.models.{package}.modeling_{package}"
    fla = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    if not fla and importlib.util.find_spec("fla") is None:
        return getattr(transformers, name)
    checks = [f for f in vars(transformers.utils.import_utils).values() if hasattr(f, "cache_clear")]
    try:
        sys.modules.update({k: None for k in fla} | {"fla": None})
        for check in checks:
            check.cache_clear()
        module = importlib.reload(sys.modules[path]) if path in sys.modules else importlib.import_module(path)
    finally:
        for k in [k for k in sys.modules if k == "fla" or k.startswith("fla.")]:
            del sys.modules[k]
        sys.modules.update(fla)
        for check in checks:
            check.cache_clear()
    return getattr(module, name)


def mtp_tensors(model, cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors: fc, two pre-fc norms, one full-attention decoder layer, final norm."""
    h = cfg["hidden_size"]
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    out = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=gen) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=gen) * 0.1,
        "mtp.norm.weight": torch.randn(h, generator=gen) * 0.1,
    }
    prefix = f"model.layers.{full}."
    for name, p in model.state_dict().items():
        if name.startswith(prefix):
            scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
            out["mtp.layers.0." + name[len(prefix):]] = torch.randn(p.shape, generator=gen) * scale
    return {k: v.bfloat16().float() for k, v in out.items()}


def dequantized(tensors: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    """The dense weight a quantised linear stands for, through the engine's verified format classes."""
    if f"{base}.qweight" in tensors:
        qweight = tensors[f"{base}.qweight"]
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        w = Int4Weight(n, k, group_size=k // tensors[f"{base}.scales"].shape[0])
        for s in ("qweight", "qzeros", "scales"):
            w.load_part(s, tensors[f"{base}.{s}"], None, 0)
    else:
        n, k = tensors[f"{base}.weight"].shape
        w = Fp8BlockWeight(n, k)
        for s in ("weight", "weight_scale_inv"):
            w.load_part(s, tensors[f"{base}.{s}"], None, 0)
    return w.dequantize()


def write_variant(
    model,
    mtp: dict[str, torch.Tensor] | None,
    out: Path,
    *,
    nested: bool = False,
    per_expert: bool = True,
    plan: dict[str, str] | None = None,
    max_shard_bytes: int = 1 << 30,
    mtp_in_extra_file: bool = False,
    cfg: dict,
):
    """Write `model` (+ MTP) as a checkpoint; returns the reference model whose weights match it exactly.

    With a quantisation `plan` the returned reference is a copy holding the dequantised weights.
    """
    state = {**model.state_dict(), **(mtp or {})}
    tensors = dict(publish_names(((n, t.bfloat16()) for n, t in state.items()), nested=False, per_expert=per_expert or bool(plan)))
    reference, ref_mtp = model, dict(mtp or {})
    if plan:
        tensors = dict(quantize_tensors(tensors.items(), plan))
        reference = copy.deepcopy(model)
        for name, param in reference.named_parameters():
            with torch.no_grad():
                param.copy_(_dequantized_param(name, param, tensors))
        for name in ref_mtp:
            ref_mtp[name] = _dequantized_param(name, ref_mtp[name], tensors)
    if nested:
        tensors = dict(publish_names(tensors.items(), nested=True, per_expert=False))
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    config = nested_config(cfg) if nested else dict(cfg)
    if plan and "int4" in plan.values():
        config["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True, "packing_format": "auto_round:auto_gptq"}
    elif plan:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    write_checkpoint(
        out, tensors.items(), config, max_shard_bytes=max_shard_bytes,
        extra_files={"mtp.": "model_extra_tensors.safetensors"} if mtp_in_extra_file else None,
        index_extra_files=False, force=True,
    )
    return reference, ref_mtp


def write_random_checkpoint(path, seed: int, plan: dict | None = None, **overrides):
    """A random tiny Qwen3.5-MoE checkpoint (with its MTP head) for engine tests; end of sequence is id 255, so
    random weights rarely stop early. `overrides`: config fields (text_config's)."""
    cfg = text_config(eos_token_id=255, **overrides)
    hf, mtp = reference_model(cfg, seed=seed)
    write_variant(hf, mtp, path, cfg=cfg, plan=plan)
    return path


def _dequantized_param(name: str, param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The value a reference parameter must hold to match the quantised checkpoint."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        parent, kind = name.rsplit(".", 1)
        experts = []
        for e in range(param.shape[0]):
            if kind == "down_proj":
                experts.append(_dequantized_param(f"{parent}.{e}.down_proj.weight", param[e], tensors))
            else:
                gate, up = param[e].chunk(2)
                experts.append(torch.cat([
                    _dequantized_param(f"{parent}.{e}.gate_proj.weight", gate, tensors),
                    _dequantized_param(f"{parent}.{e}.up_proj.weight", up, tensors),
                ]))
        return torch.stack(experts)
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if f"{base}.qweight" in tensors or f"{base}.weight_scale_inv" in tensors:
        return dequantized(tensors, base).float()
    return param


