"""Model shapes and weight layouts, as data: what tensors a checkpoint of a given shape and layout holds.

- SHAPES: the published Qwen3.5 sizes (qwen35.md's table) and a tiny one for tests, as configs.
- LAYOUTS: per module class, the weight format (bf16 / int4 / fp8 / int8) of the published
  checkpoints and of the reference system's hybrid.
- `model_units(cfg)`: every linear and plain tensor the model needs, from the model itself (the
  same LinearSlots the loader fills), so the tools can never drift from the loader.
- `layout_tensors(cfg, formats)`: the headers (name, dtype, shape) of a checkpoint in a layout,
  without allocating a byte of weights: the ceiling calculator and `checkpoint random` use it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError
from .classes import module_class
from .reader import TensorInfo

# --- shapes -----------------------------------------------------------------------------------

_COMMON = {
    "vocab_size": 248320,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "hidden_act": "silu",
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 248044,
}


def _moe(hidden, layers, heads, kv, v_heads, experts, top_k, inter, shared):
    return {**_COMMON, "model_type": "qwen3_5_moe_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "linear_num_key_heads": 16,
            "linear_num_value_heads": v_heads, "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared}


# Text configs of the published models (qwen35.md, "Sizes"); `tiny` is for tests and demos.
SHAPES: dict[str, dict] = {
    "qwen3.5-35b-a3b": _moe(2048, 40, 16, 2, 32, 256, 8, 512, 512),
    "qwen3.5-122b-a10b": _moe(3072, 48, 32, 2, 64, 256, 8, 1024, 1024),
    "qwen3.5-397b-a17b": _moe(4096, 60, 32, 2, 64, 512, 10, 1024, 1024),
    "qwen3.5-27b": {**_COMMON, "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                    "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 48, "intermediate_size": 17408},
    "tiny": {**_COMMON, "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
             "shared_expert_intermediate_size": 128, "max_position_embeddings": 4096, "eos_token_id": 1},
}


def shape_name(name: str) -> str | None:
    """'122B-A10B', 'qwen3.5-122b-a10b', 'Qwen/Qwen3.5-122B-A10B' -> 'qwen3.5-122b-a10b'; None if unknown."""
    key = name.lower().rsplit("/", 1)[-1].removeprefix("qwen3.5-").removesuffix("-fp8")
    for full in SHAPES:
        if key == full.removeprefix("qwen3.5-"):
            return full
    return None


def shape_config(name: str, layers: int | None = None) -> dict:
    """The published (multimodal, `text_config`) config.json for a named shape, optionally cut to `layers`."""
    full = shape_name(name)
    if full is None:
        raise UserError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    text = copy.deepcopy(SHAPES[full])
    if layers is not None:
        if layers < 1:
            raise UserError("--layers must be at least 1")
        text["num_hidden_layers"] = layers
    n = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    moe = text["model_type"].startswith("qwen3_5_moe")
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
    }


# --- layouts ----------------------------------------------------------------------------------

LINEAR_FORMATS = ("bf16", "int4", "fp8", "int8")
# The classes a layout may choose a format for (everything else stays as stored: norms, conv, router...).
LAYOUT_CLASSES = ("experts", "shared", "attention", "gdn", "dense_mlp", "lm_head")

LAYOUTS: dict[str, dict[str, str]] = {
    "bf16": {},  # the official BF16 checkpoints
    "int4": {"experts": "int4", "attention": "int4", "gdn": "int4", "dense_mlp": "int4"},  # public AutoRound INT4
    "fp8": {"experts": "fp8", "shared": "fp8", "attention": "fp8", "gdn": "fp8", "dense_mlp": "fp8"},  # official -FP8
    "hybrid": {"experts": "int4", "attention": "int4", "gdn": "int4", "dense_mlp": "int4", "shared": "fp8"},  # reference system
}

LAYOUT_HELP = (
    "bf16 (official BF16), int4 (public AutoRound INT4: experts, attention, GDN), "
    "fp8 (official block FP8), hybrid (int4 + shared experts FP8, the reference system's build)"
)


def resolve_layout(name: str, overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """Layout preset + per-class overrides (None = keep the preset) -> class -> format (bf16 where unset)."""
    if name not in LAYOUTS:
        raise UserError(f"unknown layout {name!r}; choose one of: {', '.join(LAYOUTS)}")
    formats = {cls: LAYOUTS[name].get(cls, "bf16") for cls in LAYOUT_CLASSES}
    for cls, fmt in (overrides or {}).items():
        if fmt is None:
            continue
        if cls not in LAYOUT_CLASSES or fmt not in LINEAR_FORMATS:
            raise UserError(f"cannot set {cls} to {fmt!r}")
        formats[cls] = fmt
    return formats


def describe_layout(formats: dict[str, str], cfg: ModelConfig | None = None) -> str:
    absent = set() if cfg is None else ({"dense_mlp"} if cfg.is_moe else {"experts", "shared"})
    quantised = [f"{cls} {fmt}" for cls, fmt in formats.items() if fmt != "bf16" and cls not in absent]
    return ", ".join(quantised) if quantised else "all bf16"


# --- what a model needs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One thing the model loads: a linear (canonical base name, [out, in]) or a plain tensor."""

    name: str  # linear: "model.layers.0.mlp.experts.3.gate_proj"; plain: "model.norm.weight"
    cls: str  # module class (classes.py)
    linear: bool
    shape: tuple[int, ...]  # linear: (out, in) of this part; plain: the tensor's shape
    fp32: bool = False  # plain tensors the model keeps in fp32 (A_log, dt_bias)
    fused: tuple[str, int, int] | None = None  # per-expert linear: (fused 3-D tensor name, expert, row offset)
    experts: int = 0  # experts of the slot this part belongs to


def linear_class(base: str) -> str:
    return module_class(base + ".weight")


def model_units(cfg: ModelConfig, mtp: bool = True) -> list[Unit]:
    """Every linear part and plain tensor the model for `cfg` loads, in module order; without MTP if `mtp` is False."""
    from ..model.qwen35 import Qwen35ForCausalLM  # the model is the one source of truth for names and shapes
    from ..model.slots import LinearSlot

    model = Qwen35ForCausalLM(cfg)
    if not mtp:
        model.mtp = None
    units: list[Unit] = []
    for path, module in model.named_modules():
        if not isinstance(module, LinearSlot):
            continue
        if path == "lm_head" and cfg.tie_word_embeddings:
            continue  # read from the embedding
        if module.num_experts:
            for part in module.parts(path):
                units.append(Unit(part.name, linear_class(part.name), True, (part.rows, module.in_features),
                                  fused=(module.fused_name(path), part.expert, part.row_offset), experts=module.num_experts))
        else:
            units.append(Unit(path, linear_class(path), True, (module.out_features, module.in_features)))
    for path, param in model.named_parameters():
        units.append(Unit(path, module_class(path), False, tuple(param.shape), fp32=bool(getattr(param, "keep_fp32", False))))
    return units


def linear_tensors(name: str, out_features: int, in_features: int, fmt: str, group_size: int = 128,
                   block: tuple[int, int] = (128, 128)) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of the stored tensors of one linear [out, in] in `fmt`."""
    n, k = out_features, in_features
    if fmt == "bf16":
        return [(f"{name}.weight", torch.bfloat16, (n, k))]
    if fmt == "int4":
        if k % group_size or k % 8 or n % 8:
            raise UserError(f"{name} [{n}, {k}] cannot be stored as int4: needs in ({k}) divisible by {group_size} and out ({n}) by 8")
        return [(f"{name}.qweight", torch.int32, (k // 8, n)),
                (f"{name}.qzeros", torch.int32, (k // group_size, n // 8)),
                (f"{name}.scales", torch.float16, (k // group_size, n))]
    if fmt == "fp8":
        return [(f"{name}.weight", torch.float8_e4m3fn, (n, k)),
                (f"{name}.weight_scale_inv", torch.float32, (math.ceil(n / block[0]), math.ceil(k / block[1])))]
    if fmt == "int8":
        return [(f"{name}.weight", torch.int8, (n, k)), (f"{name}.weight_scale", torch.float32, (n, 1))]
    raise UserError(f"unknown weight format {fmt!r}; choose one of: {', '.join(LINEAR_FORMATS)}")


PLANNED = Path("<planned>")


def layout_tensors(cfg: ModelConfig, formats: dict[str, str], fuse_bf16_experts: bool = True,
                   mtp: bool = True) -> dict[str, TensorInfo]:
    """Canonical name -> TensorInfo of a checkpoint of `cfg` in the layout `formats` (class -> format).

    BF16 routed experts are stored fused (`experts.gate_up_proj [E, 2I, H]`) as in the official
    BF16 checkpoints; quantised experts per expert. The MTP head stays BF16.
    """
    out: dict[str, TensorInfo] = {}
    fused_done: set[str] = set()
    fuse = fuse_bf16_experts and formats.get("experts", "bf16") == "bf16"
    for unit in model_units(cfg, mtp=mtp):
        if not unit.linear:
            dtype = torch.float32 if unit.fp32 else torch.bfloat16
            out[unit.name] = TensorInfo(unit.name, PLANNED, dtype, unit.shape)
            continue
        fmt = "bf16" if unit.cls == "mtp" else formats.get(unit.cls, "bf16")
        if unit.fused and fmt == "bf16" and fuse:
            fused_name, _, _ = unit.fused
            if fused_name not in fused_done:
                fused_done.add(fused_name)
                rows = unit.shape[0] * (2 if fused_name.endswith("gate_up_proj") else 1)
                out[fused_name] = TensorInfo(fused_name, PLANNED, torch.bfloat16, (unit.experts, rows, unit.shape[1]))
            continue
        for name, dtype, shape in linear_tensors(unit.name, *unit.shape, fmt):
            out[name] = TensorInfo(name, PLANNED, dtype, shape)
    return out

