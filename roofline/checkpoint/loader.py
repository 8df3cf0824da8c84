"""Load a Qwen3.5 checkpoint into the model: plan from headers, validate, then stream weights.

1. Read every safetensors header and normalise names (`model.language_model.*` -> `model.*`,
   vision tower skipped).
2. For each LinearSlot of the model, find its checkpoint tensors and detect their format by
   suffix (INT4 `qweight/qzeros/scales`, FP8 `weight + weight_scale_inv`, else dense);
   routed experts come fused (`experts.gate_up_proj [E, 2I, H]`) or per expert.
3. Fail before reading any weight if a tensor is missing, unexpected or misshapen.
4. Allocate each format's storage on the target device and stream tensors file by file.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig, load_config
from ..model.qwen35 import Qwen35ForCausalLM
from ..model.slots import LinearSlot, SlotPart
from ..quant import FORMATS, DenseWeight, Fp8BlockWeight, Int4Weight, LinearWeight
from ..quant.int8 import Int8RowWeight
from .reader import CheckpointError, CheckpointReader, TensorInfo

log = logging.getLogger("roofline.checkpoint")

VISION_PREFIXES = ("model.visual.", "visual.")
# Detection order: the first format whose required suffixes are all present wins (dense last).
LOAD_FORMATS: tuple[type[LinearWeight], ...] = (*(f for f in FORMATS if f is not DenseWeight), Int8RowWeight, DenseWeight)
ALL_SUFFIXES = sorted({s for fmt in LOAD_FORMATS for s in (*fmt.SUFFIXES, *fmt.OPTIONAL_SUFFIXES)})


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> the model's module path; None for tensors a text engine skips."""
    if name.startswith(VISION_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


@dataclass
class LoadReport:
    formats: Counter = field(default_factory=Counter)  # format -> number of linears (experts counted each)
    bytes_by_format: Counter = field(default_factory=Counter)
    skipped_vision: int = 0
    has_mtp: bool = False


@dataclass
class _Assignment:
    target: LinearWeight | nn.Parameter
    suffix: str | None = None
    expert: int | None = None
    row_offset: int = 0


class _Planner:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, TensorInfo], device, dtype):
        self.cfg, self.tensors, self.device, self.dtype = cfg, tensors, torch.device(device), dtype
        self.assignments: dict[str, _Assignment] = {}  # canonical tensor name -> where it goes

    def where(self, name: str) -> str:
        return f"{name} (in {self.tensors[name].file.name})" if name in self.tensors else name

    def suffixes(self, base: str) -> set[str]:
        return {s for s in ALL_SUFFIXES if f"{base}.{s}" in self.tensors}

    def detect(self, base: str) -> type[LinearWeight]:
        found = self.suffixes(base)
        for fmt in LOAD_FORMATS:
            if set(fmt.SUFFIXES) <= found:
                return fmt
        others = sorted(n for n in self.tensors if n.startswith(base + "."))
        if others:
            raise CheckpointError(f"tensor {base}: unsupported weight format (found {', '.join(self.where(n) for n in others)})")
        raise CheckpointError(f"tensor {base}.weight is missing from the checkpoint")

    def plan_linear(self, path: str, slot: LinearSlot) -> LinearWeight:
        fused = slot.fused_name(path) if slot.num_experts else None
        if fused and fused in self.tensors:
            return self._plan_fused_experts(fused, slot)
        parts = slot.parts(path)
        fmt = self.detect(parts[0].name)
        for part in parts[1:]:
            if self.detect(part.name) is not fmt:
                raise CheckpointError(
                    f"tensor {part.name} is {self.detect(part.name).FORMAT} but {parts[0].name} is {fmt.FORMAT}: "
                    "one linear (or one expert group) must use one format"
                )
        weight = self._allocate(fmt, slot, parts[0].name)
        for part in parts:
            self._assign_part(weight, part, fused_experts=False)
        return weight

    def _plan_fused_experts(self, name: str, slot: LinearSlot) -> LinearWeight:
        weight = DenseWeight(slot.out_features, slot.in_features, slot.num_experts, dtype=self.dtype, device=self.device)
        problem = weight.check_part("weight", self.tensors[name].shape, slot.out_features, fused_experts=True)
        if problem:
            raise CheckpointError(f"tensor {self.where(name)}: {problem}")
        self.assignments[name] = _Assignment(weight, "weight", None, 0)
        return weight

    def _allocate(self, fmt: type[LinearWeight], slot: LinearSlot, first: str) -> LinearWeight:
        args = (slot.out_features, slot.in_features, slot.num_experts)
        if fmt is Int4Weight:
            scales = self.tensors[f"{first}.scales"]
            groups = scales.shape[0] if len(scales.shape) == 2 else 0
            if not groups or slot.in_features % groups:
                raise CheckpointError(f"tensor {self.where(first + '.scales')}: {list(scales.shape)} gives no group size dividing K={slot.in_features}")
            try:
                return Int4Weight(*args, group_size=slot.in_features // groups, scale_dtype=scales.dtype, device=self.device)
            except ValueError as exc:
                raise CheckpointError(f"tensor {first}: {exc}") from exc
        if fmt is Fp8BlockWeight:
            block = self.cfg.quantization.weight_block_size or (128, 128)
            scale = self.tensors[f"{first}.weight_scale_inv"]
            return Fp8BlockWeight(*args, block=block, scale_dtype=scale.dtype, device=self.device)
        if fmt is Int8RowWeight:
            scale = self.tensors[f"{first}.weight_scale"]
            return Int8RowWeight(*args, scale_dtype=scale.dtype, device=self.device)
        return DenseWeight(*args, dtype=self.dtype, device=self.device)

    def _assign_part(self, weight: LinearWeight, part: SlotPart, fused_experts: bool) -> None:
        if isinstance(weight, Fp8BlockWeight) and part.row_offset % weight.block[0]:
            raise CheckpointError(
                f"tensor {part.name}: FP8 block rows ({weight.block[0]}) do not divide the expert size {part.rows}; "
                "this FP8 expert layout cannot be fused"
            )
        for suffix in (*weight.SUFFIXES, *weight.OPTIONAL_SUFFIXES):
            name = f"{part.name}.{suffix}"
            if name not in self.tensors:
                continue  # optional suffix absent (required ones were checked by detect)
            problem = weight.check_part(suffix, self.tensors[name].shape, part.rows, fused_experts)
            if problem:
                raise CheckpointError(f"tensor {self.where(name)}: {problem}")
            self.assignments[name] = _Assignment(weight, suffix, part.expert, part.row_offset)

    def plan_parameter(self, name: str, param: nn.Parameter) -> nn.Parameter:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        info = self.tensors[name]
        if tuple(info.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {self.where(name)}: shape {list(info.shape)}, expected {list(param.shape)}")
        dtype = torch.float32 if param.keep_fp32 else self.dtype
        real = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=self.device), requires_grad=False)
        real.keep_fp32 = param.keep_fp32
        self.assignments[name] = _Assignment(real)
        return real


def _set(root: nn.Module, path: str, value) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, value)


def checkpoint_tensors(reader: CheckpointReader, report: LoadReport | None = None) -> dict[str, TensorInfo]:
    """The reader's tensors under canonical names (vision tower skipped, counted in `report`)."""
    tensors: dict[str, TensorInfo] = {}
    for name, info in reader.tensors.items():
        canon = canonical_name(name)
        if canon is None:
            if report is not None:
                report.skipped_vision += 1
        elif canon in tensors:
            raise CheckpointError(f"tensor {name} ({info.file.name}) duplicates {tensors[canon].name} ({tensors[canon].file.name})")
        else:
            tensors[canon] = TensorInfo(name, info.file, info.dtype, info.shape)
    return tensors


def plan_model(
    cfg: ModelConfig,
    tensors: dict[str, TensorInfo],
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    report: LoadReport | None = None,
) -> tuple[Qwen35ForCausalLM, _Planner, LoadReport]:
    """Build the model with each weight in its checkpoint format, allocated on `device`, without reading weights.

    Raises CheckpointError (naming the tensor) if a tensor is missing, unexpected, misshapen or in an
    unsupported format. On the `meta` device this validates a checkpoint from its headers alone.
    """
    report = report if report is not None else LoadReport()
    tensors = dict(tensors)
    model = Qwen35ForCausalLM(cfg)
    if model.mtp is not None and not any(n.startswith("mtp.") for n in tensors):
        log.warning("config declares an MTP head but the checkpoint has no mtp.* tensors: speculative decoding is unavailable")
        model.mtp = None
    report.has_mtp = model.mtp is not None
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    planner = _Planner(cfg, tensors, device, dtype)
    slots = [(p, m) for p, m in model.named_modules() if isinstance(m, LinearSlot)]
    for path, slot in slots:
        weight = planner.plan_linear(path, slot)
        _set(model, path, weight)
        report.formats[weight.FORMAT] += max(1, slot.num_experts)
        report.bytes_by_format[weight.FORMAT] += weight.nbytes
    for path, param in list(model.named_parameters()):
        _set(model, path, planner.plan_parameter(path, param))

    unexpected = sorted(set(tensors) - set(planner.assignments))
    if unexpected:
        shown = ", ".join(planner.where(n) for n in unexpected[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) for this config: {shown}{more}")
    return model, planner, report


def validate_checkpoint(model_dir: str | Path, cfg: ModelConfig | None = None) -> LoadReport:
    """Check from headers alone that `model_dir` loads: every tensor present once, supported, shaped per config."""
    cfg = cfg or load_config(model_dir)
    report = LoadReport()
    tensors = checkpoint_tensors(CheckpointReader(model_dir), report)
    plan_model(cfg, tensors, "meta", torch.bfloat16, report)
    return report


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> tuple[Qwen35ForCausalLM, LoadReport]:
    """Build the model for `model_dir` and load its weights onto `device`, computing in `dtype`."""
    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    report = LoadReport()
    tensors = checkpoint_tensors(reader, report)
    if report.skipped_vision:
        log.info("skipped %d vision-tower tensors (a text engine does not use them)", report.skipped_vision)
    model, planner, report = plan_model(cfg, tensors, device, dtype, report)
    tensors = planner.tensors

    # Several targets can share one stored tensor (a tied lm_head reads the embedding).
    targets: dict[str, list[tuple[str, _Assignment]]] = defaultdict(list)
    for canon, assignment in planner.assignments.items():
        targets[tensors[canon].name].append((canon, assignment))
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[reader.tensors[name].file].append(name)
    for name, tensor in reader.stream(by_file):
        for canon, a in targets[name]:
            try:
                if isinstance(a.target, LinearWeight):
                    a.target.load_part(a.suffix, tensor, a.expert, a.row_offset)
                else:
                    a.target.data.copy_(tensor)
            except ValueError as exc:
                raise CheckpointError(f"tensor {planner.where(canon)}: {exc}") from exc
    model.to(device)  # rotary tables and other buffers built on the host
    log.info(
        "loaded %s: %s",
        model_dir,
        ", ".join(f"{n} {fmt} linears ({report.bytes_by_format[fmt] / 2**20:.1f} MiB)" for fmt, n in report.formats.items()),
    )
    return model, report
