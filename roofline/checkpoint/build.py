"""Building checkpoints from sources: plan every output tensor from headers, validate, then stream.

The checkpoint tools (build-hybrid, quantize, random) share this shape:

1. `Source`: a checkpoint given as a folder, an HF id or a cache path; its index and headers
   are read first, shards only when needed (and downloaded only when needed and possible).
2. `plan_units`: for every tensor the model needs (`shapes.model_units`), which source it
   comes from and in which format; this yields `Step`s (source tensors in -> output tensors
   out) whose outputs are fully known (name, dtype, shape) before a weight is read.
3. The planned output is validated as the loader would load it (`loader.plan_model` on the
   meta device) before anything is written, and again from the written headers.
4. `run_build` streams the steps source file by source file into an `OutputFolder`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import UserError
from ..hub import ModelNotFound, resolve_model
from ..quant import quantize_fp8_block, quantize_int4
from ..quant.int8 import quantize_int8_rows
from .loader import canonical_name, checkpoint_tensors, plan_model
from .progress import Progress
from .reader import CheckpointError, CheckpointReader, TensorInfo, read_header
from .shapes import Unit, linear_tensors
from .stream import INDEX_NAME, OutputFolder, PlannedTensor, StreamWriter, assign_shards, copy_side_files, write_index

log = logging.getLogger("roofline.checkpoint")

DEFAULT_MAX_SHARD_BYTES = 4 << 30
FORMAT_SUFFIXES = {
    "int4": ("qweight", "qzeros", "scales"),
    "fp8": ("weight", "weight_scale_inv"),
    "int8": ("weight", "weight_scale"),
    "bf16": ("weight",),
}
OPTIONAL_SUFFIXES = {"int4": ("g_idx",)}


# --- sources ------------------------------------------------------------------------------------

_CACHE_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/([^/]+)/?$")


def _hub():
    try:
        import huggingface_hub
    except ImportError:  # pragma: no cover - a dependency, but keep the message clear
        return None
    return huggingface_hub


def _resolve(spec: str, label: str) -> tuple[Path, str | None, str | None]:
    """-> (folder, HF repo id, revision). A cache snapshot keeps its repo id so missing shards can be fetched."""
    try:
        folder = resolve_model(spec, allow_download=False)
    except ModelNotFound as exc:
        if Path(spec).expanduser().exists() or spec.count("/") != 1:
            raise ModelNotFound(f"{label}: {exc}") from None
        folder = _download_metadata(spec, label)
    match = _CACHE_SNAPSHOT.search(str(folder))
    if match:
        return folder, f"{match.group(1)}/{match.group(2)}", match.group(3)
    return folder, None, None


def downloads_allowed() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True") and _hub() is not None


def _download_metadata(repo_id: str, label: str) -> Path:
    """Fetch config.json and the shard index only; shards come later, when a plan needs them."""
    hub = _hub()
    if hub is None:
        raise ModelNotFound(f"{label}: {repo_id} is not in the local Hugging Face cache and huggingface_hub is not installed")
    if not downloads_allowed():
        raise ModelNotFound(f"{label}: {repo_id} is not in the local Hugging Face cache and downloads are off (HF_HUB_OFFLINE)")
    try:
        config = Path(hub.hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # no network, unknown or gated repo
        raise ModelNotFound(f"{label}: {repo_id} is not in the local cache and downloading it failed ({type(exc).__name__}: {exc})") from None
    try:
        hub.hf_hub_download(repo_id, INDEX_NAME)
    except Exception:
        pass  # a single-file checkpoint has no index
    return config.parent


class Source:
    """A checkpoint to read from. Headers are read per file on demand; missing shards fail (or download) only when needed."""

    def __init__(self, spec: str | os.PathLike, label: str):
        self.spec, self.label = str(spec), label
        self.dir, self.repo_id, self.revision = _resolve(self.spec, label)
        path = self.dir / "config.json"
        try:
            self.raw_config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{label}: {path} is not valid JSON ({exc})") from None
        self.cfg = ModelConfig.from_dict(self.raw_config, source=f"{label} {path}")
        self.file_of: dict[str, str] = {}  # stored name -> file
        self.indexed: set[str] = set()  # files the index lists
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{label}: {index}: unreadable index ({exc})") from None
            self.file_of.update(weight_map)
            self.indexed = set(weight_map.values())
        self.files = sorted(self.indexed)
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        # Files the index does not list (the INT4 checkpoint's MTP head) are read for their names.
        for path in sorted(self.dir.glob("*.safetensors")):
            if path.name in self.indexed:
                continue
            self.files.append(path.name)
            for name in self._header(path.name):
                if name in self.file_of:
                    raise CheckpointError(f"{label}: tensor {name} appears twice: in {self.file_of[name]} and {path.name}")
                self.file_of[name] = path.name
        if not self.files:
            raise CheckpointError(f"{label}: {self.dir} has no .safetensors files")
        self.canonical: dict[str, str] = {}  # canonical name -> stored name
        self.vision: list[str] = []
        for name in self.file_of:
            canon = canonical_name(name)
            if canon is None:
                self.vision.append(name)
            elif canon in self.canonical:
                raise CheckpointError(f"{label}: tensor {name} duplicates {self.canonical[canon]}")
            else:
                self.canonical[canon] = name
        self.nested = any(n.startswith("model.language_model.") for n in self.file_of)

    def __repr__(self) -> str:
        return f"{self.label} ({self.spec})"

    def missing(self, file: str) -> bool:
        return not (self.dir / file).is_file()

    def can_download(self) -> bool:
        return bool(self.repo_id) and downloads_allowed()

    def ensure_file(self, file: str, for_tensor: str | None = None) -> Path:
        """The local path of `file`, downloading it when the source is an HF repo and a network is there."""
        path = self.dir / file
        if path.is_file():
            return path
        holds = f" (it holds {for_tensor})" if for_tensor else ""
        if self.can_download():
            log.info("downloading %s from %s", file, self.repo_id)
            try:
                return Path(_hub().hf_hub_download(self.repo_id, file, revision=self.revision))
            except Exception as exc:
                raise CheckpointError(f"{self.label}: shard {file}{holds} is missing from {self.dir} and downloading it "
                                      f"failed ({type(exc).__name__}: {exc})") from None
        why = " (downloads are off)" if self.repo_id else ""
        raise CheckpointError(f"{self.label}: shard {file}{holds} is listed in the index but missing from {self.dir}{why}")

    def _header(self, file: str, for_tensor: str | None = None) -> dict[str, TensorInfo]:
        """A file's header: from disk, or for a shard not downloaded yet, from the Hub without downloading it."""
        if file not in self._headers:
            if self.missing(file) and self.can_download():
                self._headers[file] = self._remote_header(file, for_tensor)
            else:
                try:
                    self._headers[file] = read_header(self.ensure_file(file, for_tensor))
                except CheckpointError as exc:
                    if str(exc).startswith(self.label):
                        raise
                    raise CheckpointError(f"{self.label}: {exc}") from None
        return self._headers[file]

    def _remote_header(self, file: str, for_tensor: str | None) -> dict[str, TensorInfo]:
        from .reader import DTYPES

        try:
            meta = _hub().HfApi().parse_safetensors_file_metadata(self.repo_id, file, revision=self.revision)
        except Exception as exc:
            holds = f" (it holds {for_tensor})" if for_tensor else ""
            raise CheckpointError(f"{self.label}: shard {file}{holds} is missing from {self.dir} and its header could not "
                                  f"be fetched from {self.repo_id} ({type(exc).__name__}: {exc})") from None
        return {name: TensorInfo(name, self.dir / file, DTYPES[t.dtype], tuple(t.shape)) for name, t in meta.tensors.items()}

    def info(self, name: str) -> TensorInfo:
        """Header of stored tensor `name` (reads its file's header; the index alone has no shapes)."""
        file = self.file_of[name]
        header = self._header(file, name)
        if name not in header:
            raise CheckpointError(f"{self.label}: the index puts {name} in {file}, but that file does not hold it")
        return header[name]

    def file_path(self, file: str) -> Path:
        return self.ensure_file(file)


def check_same_model(a: ModelConfig, b: ModelConfig, label_a: str, label_b: str) -> None:
    """Two checkpoints can be mixed only if they describe the same architecture and sizes."""
    fields = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"]
    diffs = []
    for f in fields:
        va, vb = getattr(a, f), getattr(b, f)
        if f == "model_type":
            va, vb = va.removesuffix("_text"), vb.removesuffix("_text")
        if va != vb:
            if f == "layer_types":
                va, vb = f"{va.count('full_attention')} full-attention", f"{vb.count('full_attention')} full-attention"
            diffs.append(f"{f} {va} vs {vb}")
    if diffs:
        raise CheckpointError(f"the models do not match ({label_a} vs {label_b}): {'; '.join(diffs)}")


# --- plans --------------------------------------------------------------------------------------


@dataclass
class Output:
    name: str  # stored name in the output
    dtype: torch.dtype
    shape: tuple[int, ...]
    cls: str
    fmt: str  # format of the linear it belongs to, or the dtype of a plain tensor
    source: str  # source label, "random", ...
    action: str  # copy | quantize | generate

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Step:
    source: Source | None
    reads: list[str]  # stored names in `source`
    outputs: list[Output]
    make: Callable[[dict[str, torch.Tensor]], Iterable[tuple[str, torch.Tensor]]]

    def sort_key(self, sources: list[Source]):
        if self.source is None:
            return (0, 0)
        return (sources.index(self.source), self.source.files.index(self.source.file_of[self.reads[0]]))


@dataclass(frozen=True)
class Choice:
    """Where one module class comes from and in which format ("keep": as the source stores it)."""

    source: Source
    fmt: str


@dataclass
class BuildPlan:
    config: dict  # raw config.json of the output
    cfg: ModelConfig
    steps: list[Step]
    sources: list[Source] = field(default_factory=list)
    side_files_from: Path | None = None
    expect_mtp: bool = False
    notes: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)

    @property
    def outputs(self) -> list[Output]:
        return [o for s in self.steps for o in s.outputs]

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)

    def canonical_tensors(self) -> dict[str, TensorInfo]:
        """The planned output's headers under canonical names, as the loader will see them."""
        out = {}
        for o in self.outputs:
            canon = canonical_name(o.name)
            if canon is not None:
                out[canon] = TensorInfo(o.name, Path("<planned>"), o.dtype, o.shape)
        return out


def output_name(canonical: str, nested: bool) -> str:
    return "model.language_model." + canonical[len("model."):] if nested and canonical.startswith("model.") else canonical


DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALL_SUFFIXES = ("weight", "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale")


def _stored_format(src: Source, base: str) -> tuple[str, list[str]] | None:
    """(format, stored names) of the linear `base` (canonical) in `src`; None if absent.

    Raises PlanError when the linear is there but incomplete (a quantised weight without its scales).
    """
    for fmt in ("int4", "fp8", "int8", "bf16"):
        names = [f"{base}.{s}" for s in FORMAT_SUFFIXES[fmt]]
        if all(n in src.canonical for n in names):
            if fmt == "bf16" and src.info(src.canonical[names[0]]).dtype not in DENSE_DTYPES:
                break  # e.g. an FP8 weight whose scale is missing
            names += [f"{base}.{s}" for s in OPTIONAL_SUFFIXES.get(fmt, ()) if f"{base}.{s}" in src.canonical]
            return fmt, [src.canonical[n] for n in names]
    present = [s for s in _ALL_SUFFIXES if f"{base}.{s}" in src.canonical]
    if not present:
        return None
    weight_dtype = src.info(src.canonical[f"{base}.weight"]).dtype if "weight" in present else None
    if set(present) & {"qweight", "qzeros", "scales"}:
        fmt = "int4"
    elif "weight_scale_inv" in present or weight_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmt = "fp8"
    elif "weight_scale" in present or weight_dtype == torch.int8:
        fmt = "int8"
    else:
        fmt = "bf16"
    missing = [f"{base}.{s}" for s in FORMAT_SUFFIXES[fmt] if s not in present]
    have = ", ".join(f"{s} ({str(src.info(src.canonical[f'{base}.{s}']).dtype).removeprefix('torch.')})" for s in present)
    raise PlanError(f"{src.label} lacks {' and '.join(missing) or base} (it has {have}: an incomplete {fmt} linear)")


def _dense_dtype_fmt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype).removeprefix("torch."))


def _convert(name: str, weight: torch.Tensor, fmt: str, group_size: int) -> list[tuple[str, torch.Tensor]]:
    """A dense linear weight -> the stored tensors of `fmt` (round to nearest)."""
    if fmt == "int4":
        return [(f"{name}.{s}", t) for s, t in quantize_int4(weight, group_size).items()]
    if fmt == "fp8":
        q, scale = quantize_fp8_block(weight)
        return [(f"{name}.weight", q), (f"{name}.weight_scale_inv", scale)]
    if fmt == "int8":
        q, scale = quantize_int8_rows(weight)
        return [(f"{name}.weight", q), (f"{name}.weight_scale", scale)]
    return [(f"{name}.weight", weight.to(torch.bfloat16))]


class PlanError(CheckpointError):
    pass


def plan_units(
    units: list[Unit],
    choose: Callable[[str], Choice],
    nested: bool,
    group_size: int = 128,
) -> tuple[list[Step], dict[Source, set[str]]]:
    """Steps that produce every unit from its chosen source; and per source, the stored names used.

    Raises PlanError listing (grouped by class) what the chosen sources lack or cannot convert.
    """
    steps: list[Step] = []
    used: dict[Source, set[str]] = defaultdict(set)
    problems: dict[str, list[str]] = defaultdict(list)  # class -> messages
    fused_groups: dict[tuple[Source, str], list[tuple[Unit, str]]] = {}

    for unit in units:
        choice = choose(unit.cls)
        src, want = choice.source, choice.fmt
        if not unit.linear:
            stored = src.canonical.get(unit.name)
            if stored is None:
                problems[unit.cls].append(f"{src.label} lacks {unit.name}")
                continue
            info = src.info(stored)
            used[src].add(stored)
            out = Output(output_name(unit.name, nested), info.dtype, tuple(info.shape), unit.cls,
                         _dense_dtype_fmt(info.dtype), src.label, "copy")
            steps.append(Step(src, [stored], [out], lambda t, s=stored, o=out.name: [(o, t[s])]))
            continue
        try:
            found = _stored_format(src, unit.name)
        except PlanError as exc:
            problems[unit.cls].append(str(exc))
            continue
        if found is None and unit.fused and unit.fused[0] in src.canonical:
            fused_groups.setdefault((src, unit.fused[0]), []).append((unit, want))
            continue
        if found is None:
            problems[unit.cls].append(f"{src.label} lacks {unit.name}.weight (or its quantised tensors)")
            continue
        have, stored = found
        target = have if want == "keep" else want
        infos = [src.info(n) for n in stored]
        used[src].update(stored)
        if target == have and not (have == "bf16" and want == "bf16" and infos[0].dtype != torch.bfloat16):
            outs = [Output(output_name(canonical_name(n), nested), i.dtype, tuple(i.shape), unit.cls,
                           have if have != "bf16" else _dense_dtype_fmt(i.dtype), src.label, "copy")
                    for n, i in zip(stored, infos)]
            steps.append(Step(src, stored, outs, lambda t, pairs=[(n, o.name) for n, o in zip(stored, outs)]: [(o, t[n]) for n, o in pairs]))
            continue
        if have != "bf16":
            problems[unit.cls].append(
                f"{unit.name} is {have} in {src.label} and {target} was asked for; converting {have} to {target} would "
                f"compound rounding errors (convert from BF16, or keep {have})")
            continue
        if tuple(infos[0].shape) != unit.shape:
            problems[unit.cls].append(f"{stored[0]} in {src.label} has shape {list(infos[0].shape)}, the config needs {list(unit.shape)}")
            continue
        try:
            planned = linear_tensors(output_name(unit.name, nested), *unit.shape, target, group_size)
        except UserError as exc:
            problems[unit.cls].append(str(exc))
            continue
        outs = [Output(n, d, s, unit.cls, target, src.label, "convert" if target == "bf16" else "quantize") for n, d, s in planned]
        out_base = output_name(unit.name, nested)
        steps.append(Step(src, stored[:1], outs,
                          lambda t, s=stored[0], b=out_base, f=target: _convert(b, t[s], f, group_size)))

    for (src, fused), members in fused_groups.items():
        stored = src.canonical[fused]
        info = src.info(stored)
        used[src].add(stored)
        unit0, want = members[0]
        target = "bf16" if want in ("keep", "bf16") else want
        experts = unit0.experts
        rows = unit0.shape[0] * (2 if fused.endswith("gate_up_proj") else 1)
        if tuple(info.shape) != (experts, rows, unit0.shape[1]):
            problems[unit0.cls].append(f"{stored} in {src.label} has shape {list(info.shape)}, the config needs {[experts, rows, unit0.shape[1]]}")
            continue
        if target == "bf16" and (want == "keep" or info.dtype == torch.bfloat16):
            out = Output(output_name(fused, nested), info.dtype, tuple(info.shape), unit0.cls, _dense_dtype_fmt(info.dtype), src.label, "copy")
            steps.append(Step(src, [stored], [out], lambda t, s=stored, o=out.name: [(o, t[s])]))
            continue
        outs, parts = [], []
        try:
            for unit, _ in members:
                _, expert, row = unit.fused
                base = output_name(unit.name, nested)
                planned = linear_tensors(base, *unit.shape, target, group_size)
                outs += [Output(n, d, s, unit.cls, target, src.label, "quantize") for n, d, s in planned]
                parts.append((base, expert, row, unit.shape[0]))
        except UserError as exc:
            problems[unit0.cls].append(str(exc))
            continue

        def split(t, s=stored, parts=parts, f=target):
            whole = t[s]
            for base, expert, row, n in parts:
                yield from _convert(base, whole[expert, row:row + n], f, group_size)

        steps.append(Step(src, [stored], outs, split))

    if problems:
        lines = []
        for cls, msgs in problems.items():
            more = f" (and {len(msgs) - 1} more like it)" if len(msgs) > 1 else ""
            lines.append(f"{cls}: {msgs[0]}{more}")
        raise PlanError("the sources cannot provide what the plan needs:\n  " + "\n  ".join(lines))
    return steps, used


def vision_steps(src: Source) -> list[Step]:
    """The vision tower, copied as stored (a text engine skips it; the output stays a complete published checkpoint)."""
    steps = []
    for name in src.vision:
        info = src.info(name)
        out = Output(name, info.dtype, tuple(info.shape), "vision", _dense_dtype_fmt(info.dtype), src.label, "copy")
        steps.append(Step(src, [name], [out], lambda t, n=name: [(n, t[n])]))
    return steps


def quantization_config(outputs: list[Output], previous: dict | None, group_size: int = 128, block=(128, 128)) -> dict | None:
    """The `quantization_config` describing the output's formats (the loader still detects per tensor)."""
    fmts = {o.fmt for o in outputs}
    if "int4" in fmts:
        qc = dict(previous) if previous and previous.get("quant_method") in ("auto-round", "gptq") else {}
        qc.update({"quant_method": qc.get("quant_method", "auto-round"), "bits": 4, "group_size": group_size, "sym": True,
                   "packing_format": qc.get("packing_format", "auto_round:auto_gptq")})
        if "fp8" in fmts:
            qc["weight_block_size"] = list(block)
        return qc
    if "fp8" in fmts:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return None


def with_quantization(raw: dict, qc: dict | None) -> dict:
    out = json.loads(json.dumps(raw))
    if isinstance(out.get("text_config"), dict):
        out["text_config"].pop("quantization_config", None)
    out.pop("quantization_config", None)
    if qc:
        out["quantization_config"] = qc
    return out


def validate_plan(plan: BuildPlan) -> None:
    """The planned output, as the loader will see it: every tensor once, supported, shaped per config."""
    tensors = plan.canonical_tensors()
    _, _, report = plan_model(plan.cfg, tensors, "meta")
    if plan.expect_mtp and not report.has_mtp:
        raise CheckpointError("the planned output has no MTP head, but the source has one")


def validate_output(folder: Path, plan: BuildPlan, unindexed: set[str] = frozenset()) -> None:
    """After writing: headers readable, the index lists every tensor of every file (but `unindexed` ones),
    and the model loads (checked from headers)."""
    reader = CheckpointReader(folder)
    index = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    unlisted = [n for n, info in reader.tensors.items() if info.file.name not in unindexed and index.get(n) != info.file.name]
    if unlisted:
        raise CheckpointError(f"the written index misses {len(unlisted)} tensor(s), e.g. {unlisted[0]}")
    planned = {o.name for o in plan.outputs}
    if set(reader.tensors) != planned:
        raise CheckpointError(f"written tensors differ from the plan: {sorted(set(reader.tensors) ^ planned)[:3]}")
    cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    _, _, report = plan_model(cfg, checkpoint_tensors(reader), "meta")
    if plan.expect_mtp and not report.has_mtp:
        raise CheckpointError("the written checkpoint lost its MTP head")


def run_build(plan: BuildPlan, out: str | Path, force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              progress: bool = True, label: str = "writing", extra_files: dict[str, str] | None = None,
              unindexed: Iterable[str] = ()) -> Path:
    """Write `plan` to `out` atomically. `extra_files` maps a name prefix to its own file (e.g. {"mtp.": ...});
    files in `unindexed` are left out of the index (as the public INT4 checkpoint does with its MTP file)."""
    folder = OutputFolder(out, force)
    for src in plan.sources:
        src_dir, out_dir = src.dir.resolve(), folder.out.resolve()
        if out_dir == src_dir or out_dir in src_dir.parents or src_dir in out_dir.parents:
            raise CheckpointError(f"the output {folder.out} overlaps the {src.label} ({src.dir}); choose another --out")
    validate_plan(plan)
    for step in plan.steps:  # download what is needed before writing anything
        for name in step.reads:
            step.source.ensure_file(step.source.file_of[name], name)
    outputs = plan.outputs
    main = [(o.name, o.dtype, o.shape) for o in outputs if not _extra_file(o.name, extra_files)]
    main_files = iter(assign_shards(main, max_shard_bytes))
    files = [_extra_file(o.name, extra_files) or next(main_files) for o in outputs]
    bar = Progress(plan.total_bytes, label, enabled=progress)
    with folder, _OpenFiles() as files_open:
        writer = StreamWriter(folder.tmp, [PlannedTensor(o.name, o.dtype, o.shape, f) for o, f in zip(outputs, files)])

        def read(src: Source, names: list[str]) -> dict[str, torch.Tensor]:
            tensors = {}
            for name in names:
                path = src.file_path(src.file_of[name])
                try:
                    tensors[name] = files_open.get(path, src.label).get_tensor(name)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"{src.label}: failed reading {name} from {path} ({exc})") from None
            return tensors

        for step in plan.steps:
            tensors = read(step.source, step.reads) if step.source else {}
            for name, tensor in step.make(tensors):
                bar.advance(writer.write(name, tensor))
        writer.close()
        bar.close()
        weight_map = {o.name: f for o, f in zip(outputs, files) if f not in set(unindexed)}
        write_index(folder.tmp, weight_map, sum(o.nbytes for o, f in zip(outputs, files) if f in set(weight_map.values())))
        (folder.tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
        if plan.side_files_from:
            copy_side_files(plan.side_files_from, folder.tmp)
        if plan.provenance:
            (folder.tmp / "roofline-build.json").write_text(json.dumps(plan.provenance, indent=2) + "\n")
        validate_output(folder.tmp, plan, set(unindexed))
        return folder.commit()


class _OpenFiles:
    """Source files open for reading, at most `keep` at a time: each is memory-mapped, and a mapping that
    stays open keeps every page read so far in the process's resident memory."""

    def __init__(self, keep: int = 2):
        self.keep, self.handles = keep, {}

    def get(self, path: Path, label: str):
        if path in self.handles:
            self.handles[path] = self.handles.pop(path)  # most recently used last
            return self.handles[path]
        while len(self.handles) >= self.keep:
            self.handles.pop(next(iter(self.handles))).__exit__(None, None, None)
        try:
            handle = safe_open(str(path), framework="pt")
            handle.__enter__()
        except Exception as exc:
            raise CheckpointError(f"{label}: {path} is not a readable safetensors file ({exc})") from None
        self.handles[path] = handle
        return handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()


def _extra_file(name: str, extra_files: dict[str, str] | None) -> str | None:
    return next((f for prefix, f in (extra_files or {}).items() if name.startswith(prefix)), None)


# --- summary ------------------------------------------------------------------------------------


def summary_table(plan: BuildPlan) -> str:
    """One line per (module class, source, format, action): tensors and bytes. Replaces per-tensor warnings."""
    rows: dict[tuple, list[int]] = {}
    for o in plan.outputs:
        key = (o.cls, o.source, o.fmt, o.action)
        row = rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += o.nbytes
    from ..bench.ceiling import format_bytes

    order = ["experts", "shared", "dense_mlp", "attention", "gdn", "gdn_small", "router", "embed", "lm_head", "other", "mtp", "vision"]
    keys = sorted(rows, key=lambda k: (order.index(k[0]) if k[0] in order else 99, k[1], k[2]))
    lines = [f"{'class':<11}{'source':<14}{'format':<10}{'action':<10}{'tensors':>9}{'bytes':>12}"]
    for k in keys:
        lines.append(f"{k[0]:<11}{k[1]:<14}{k[2]:<10}{k[3]:<10}{rows[k][0]:>9}{format_bytes(rows[k][1]):>12}")
    lines.append(f"{'total':<45}{sum(r[0] for r in rows.values()):>9}{format_bytes(plan.total_bytes):>12}")
    return "\n".join(lines)
