"""checkpoint random: random-weight checkpoints of the real shapes, in any layout, streamed tensor by tensor.

For tests, demos and benchmarks without a download. Values are random but sane (weights scaled
by in_features^-1/2, norms near identity) so a forward pass stays finite; they say nothing about
quality or MTP acceptance. Names follow the published multimodal layout (`model.language_model.*`,
config under `text_config`); BF16 experts are fused as in the official BF16 checkpoints, quantised
experts per expert. With `mtp_file="extra"` the MTP head goes to an unindexed
`model_extra_tensors.safetensors`, as in the public INT4 checkpoint.
"""

from __future__ import annotations

import zlib

import torch

from ..config import ModelConfig
from .build import BuildPlan, Output, Step, output_name, quantization_config, with_quantization
from .classes import module_class
from .reader import TensorInfo
from .shapes import describe_layout, layout_tensors, shape_config, shape_name

MTP_EXTRA_FILE = "model_extra_tensors.safetensors"
_FORMAT_OF_SUFFIX = {"qweight": "int4", "qzeros": "int4", "scales": "int4", "weight_scale_inv": "fp8", "weight_scale": "int8"}


def _fmt(name: str, dtype: torch.dtype, siblings: dict[str, TensorInfo]) -> str:
    suffix = name.rsplit(".", 1)[-1]
    if suffix in _FORMAT_OF_SUFFIX:
        return _FORMAT_OF_SUFFIX[suffix]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if f"{base}.weight_scale_inv" in siblings:
        return "fp8"
    if f"{base}.weight_scale" in siblings:
        return "int8"
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def random_tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int, in_features: int | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """A deterministic random tensor for `name` (same seed and device, same values, whatever the order)."""
    gen = torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    kw = {"generator": gen, "device": device}
    suffix = name.rsplit(".", 1)[-1]
    scale = (in_features or shape[-1]) ** -0.5
    if suffix == "qweight":
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, **kw).to(torch.int32)
    if suffix == "qzeros":
        return torch.full(shape, 0x77777777, dtype=torch.int32, device=device)  # symmetric: every zero nibble 7 (real zero 8)
    if suffix == "scales":
        return torch.full(shape, scale / 4.6, dtype=dtype, device=device)  # uniform nibbles -8..7 have std ~4.6
    if suffix == "weight_scale_inv":
        return torch.full(shape, scale, dtype=dtype, device=device)
    if suffix == "weight_scale":
        return torch.full(shape, scale / 73.0, dtype=dtype, device=device)  # uniform -127..127 has std ~73
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, dtype=torch.int8, **kw)
    if dtype == torch.float8_e4m3fn:
        return torch.randn(shape, **kw).clamp(-448, 448).to(dtype)
    if name.endswith("A_log"):
        return torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1, generator=gen)
    if name.endswith("linear_attn.norm.weight"):  # plain w (not 1 + w)
        return torch.randn(shape, dtype=dtype, **kw).mul_(0.1).add_(1)
    if "norm" in name or name.endswith(("dt_bias", "conv1d.weight")):
        return torch.randn(shape, dtype=dtype, **kw).mul_(0.1)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, dtype=dtype, **kw)
    return torch.randn(shape, dtype=dtype, **kw).mul_(scale)  # generated in place: one tensor of memory


def random_plan(shape: str, formats: dict[str, str], layers: int | None = None, seed: int = 0,
                mtp_file: str = "auto") -> tuple[BuildPlan, dict[str, str], set[str]]:
    """Plan a random checkpoint -> (plan, extra files by name prefix, unindexed files) for `run_build`."""
    raw = shape_config(shape, layers)
    cfg = ModelConfig.from_dict(raw, source=f"shape {shape}")
    tensors = layout_tensors(cfg, formats)
    steps = []
    for canon, info in tensors.items():
        base = canon.rsplit(".", 1)[0]
        in_features = None
        if canon.endswith((".qweight", ".scales", ".qzeros")):
            in_features = tensors[f"{base}.qweight"].shape[0] * 8
        elif len(info.shape) >= 2 and not canon.endswith((".weight_scale", ".weight_scale_inv")):
            in_features = info.shape[-1]
        elif canon.endswith((".weight_scale", ".weight_scale_inv")):
            in_features = tensors[f"{base}.weight"].shape[-1]
        out = Output(output_name(canon, True), info.dtype, tuple(info.shape), module_class(canon),
                     _fmt(canon, info.dtype, tensors), "random", "generate")
        steps.append(Step(None, [], [out], lambda _, o=out, k=in_features: [(o.name, random_tensor(o.name, o.dtype, o.shape, seed, k))]))
    steps.sort(key=lambda s: s.outputs[0].name.startswith("mtp."))  # the MTP head last, as published
    outputs = [o for s in steps for o in s.outputs]
    config = with_quantization(raw, quantization_config(outputs, None))
    has_mtp = cfg.mtp_num_hidden_layers > 0
    if mtp_file == "auto":
        mtp_file = "extra" if formats.get("experts") == "int4" else "index"
    extra = {"mtp.": MTP_EXTRA_FILE} if has_mtp and mtp_file == "extra" else {}
    unindexed = {MTP_EXTRA_FILE} if extra else set()
    plan = BuildPlan(config=config, cfg=ModelConfig.from_dict(config), steps=steps, expect_mtp=has_mtp,
                     provenance={"tool": "roofline checkpoint random", "shape": shape_name(shape), "layers": cfg.num_hidden_layers,
                                 "layout": describe_layout(formats), "seed": seed})
    return plan, extra, unindexed
