"""build-hybrid: one checkpoint from the public INT4 one and the official block-FP8 one.

The reference system's recipe, as a default plan: everything as the INT4 source stores it
(routed experts, attention and GDN in INT4; the rest BF16; the MTP head, also from its unindexed
extra file), except the shared experts, which come from the FP8 source with their scales. A plan
file can choose the source and format of any module class.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..bench.ceiling import MACHINES, bytes_summary, ceiling_table, format_bytes, token_bytes
from ..config import ModelConfig
from ..errors import UserError, read_json_file
from .build import (BuildPlan, Choice, PlanError, Source, check_same_model, plan_units, quantization_config, summary_table,
                    vision_steps, with_quantization)
from .classes import MODULE_CLASSES
from .shapes import model_units

SOURCES = ("int4", "fp8")
PLAN_FORMATS = ("keep", "bf16", "int4", "fp8", "int8")
DEFAULT_PLAN: dict[str, tuple[str, str]] = {"default": ("int4", "keep"), "shared": ("fp8", "fp8")}
PLAN_HELP = (
    "JSON object: module class (or \"default\") -> \"SOURCE:FORMAT\" or {\"source\": ..., \"format\": ...}; "
    f"sources {', '.join(SOURCES)}; formats {', '.join(PLAN_FORMATS)} (keep = as the source stores it); "
    f"classes {', '.join(MODULE_CLASSES)}"
)


def parse_plan(raw: dict, where: str = "plan") -> dict[str, tuple[str, str]]:
    """Plan-file entries over the default plan -> class -> (source, format)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: must be a JSON object of module class -> choice ({PLAN_HELP})")
    plan = dict(DEFAULT_PLAN)
    for cls, choice in raw.items():
        if cls not in (*MODULE_CLASSES, "default"):
            raise UserError(f"{where}: unknown module class {cls!r}; classes: {', '.join(MODULE_CLASSES)}, default")
        if isinstance(choice, str) and ":" in choice:
            source, fmt = choice.split(":", 1)
        elif isinstance(choice, dict) and set(choice) <= {"source", "format"} and "source" in choice:
            source, fmt = choice["source"], choice.get("format", "keep")
        else:
            raise UserError(f"{where}: {cls}: give \"SOURCE:FORMAT\" (e.g. \"fp8:fp8\") or "
                            f"{{\"source\": \"fp8\", \"format\": \"fp8\"}}, not {json.dumps(choice)}")
        if source not in SOURCES:
            raise UserError(f"{where}: {cls}: unknown source {source!r}; choose {' or '.join(SOURCES)}")
        if fmt not in PLAN_FORMATS:
            raise UserError(f"{where}: {cls}: unknown format {fmt!r}; choose one of {', '.join(PLAN_FORMATS)}")
        plan[cls] = (source, fmt)
    return plan


def load_plan_file(path: str | Path | None) -> dict[str, tuple[str, str]]:
    if path is None:
        return dict(DEFAULT_PLAN)
    p = Path(path).expanduser()
    return parse_plan(read_json_file(p, "plan file"), f"plan file {p}")


def hybrid_plan(int4: str, fp8: str, plan: dict[str, tuple[str, str]] | None = None) -> BuildPlan:
    """Plan the hybrid from headers alone; raises (naming tensors) if the sources cannot provide it."""
    plan = plan or dict(DEFAULT_PLAN)
    a = Source(int4, "INT4 source")
    b = Source(fp8, "FP8 source")
    check_same_model(a.cfg, b.cfg, "INT4 source", "FP8 source")
    sources = {"int4": a, "fp8": b}

    def choose(cls: str) -> Choice:
        source, fmt = plan.get(cls, plan["default"])
        return Choice(sources[source], fmt)

    notes = []
    mtp_src = choose("mtp").source
    has_mtp = a.cfg.mtp_num_hidden_layers > 0 and any(n.startswith("mtp.") for n in mtp_src.canonical)
    if a.cfg.mtp_num_hidden_layers > 0 and not has_mtp:
        notes.append(f"the {mtp_src.label} has no MTP head (no mtp.* tensors): the output has none either")
    units = model_units(a.cfg, mtp=has_mtp)
    steps, used = plan_units(units, choose, nested=a.nested)

    # Everything in the INT4 source must be accounted for: used, replaced by the plan, or the vision tower.
    accounted = set(used.get(a, ())) | set(a.vision)
    for unit in units:
        if choose(unit.cls).source is not a:
            for canon in _unit_names(a, unit):
                accounted.add(a.canonical[canon])
    leftover = sorted(set(a.file_of) - accounted)
    if leftover:
        shown = ", ".join(leftover[:5]) + (f" and {len(leftover) - 5} more" if len(leftover) > 5 else "")
        raise PlanError(f"{len(leftover)} tensor(s) in the INT4 source are not part of a model with its config: {shown}")

    steps += vision_steps(a)
    order = [a, b]
    steps.sort(key=lambda s: s.sort_key(order))
    outputs = [o for s in steps for o in s.outputs]
    block = tuple(b.cfg.quantization.weight_block_size or (128, 128))
    config = with_quantization(a.raw_config, quantization_config(outputs, a.raw_config.get("quantization_config")
                                                                  or (a.raw_config.get("text_config") or {}).get("quantization_config"),
                                                                  block=block))
    used_b = used.get(b, set())
    b_files = sorted({b.file_of[n] for n in used_b})
    to_fetch = [f for f in b_files if b.missing(f)]
    notes.append(f"FP8 source: {len(used_b)} of {len(b.file_of)} tensors used, from {len(b_files)} of {len(b.files)} shard(s)"
                 + (f" ({len(to_fetch)} to download)" if to_fetch else "") + "; the rest is covered by the INT4 source")
    return BuildPlan(
        config=config,
        cfg=ModelConfig.from_dict(config, source="output config"),
        steps=steps,
        sources=order,
        side_files_from=a.dir,
        expect_mtp=has_mtp,
        notes=notes,
        provenance={
            "tool": "roofline checkpoint build-hybrid",
            "sources": {"int4": {"spec": a.spec, "dir": str(a.dir)}, "fp8": {"spec": b.spec, "dir": str(b.dir)}},
            "plan": {cls: f"{src}:{fmt}" for cls, (src, fmt) in plan.items()},
        },
    )


def _unit_names(src: Source, unit) -> list[str]:
    """Canonical names `src` holds for `unit` (any format, fused or not)."""
    if not unit.linear:
        return [unit.name] if unit.name in src.canonical else []
    names = [n for n in (f"{unit.name}.{s}" for s in ("weight", "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale"))
             if n in src.canonical]
    if unit.fused and unit.fused[0] in src.canonical:
        names.append(unit.fused[0])
    return names


def plan_description(plan_choices: dict[str, tuple[str, str]]) -> str:
    lines = [f"  {cls:<16} {fmt:<6} from the {src.upper()} source" for cls, (src, fmt) in plan_choices.items() if cls != "default"]
    src, fmt = plan_choices["default"]
    lines.append(f"  {'everything else':<16} {fmt:<6} from the {src.upper()} source")
    return "\n".join(lines)


def dry_run_report(plan: BuildPlan, out: str, machine: str = "dgx-spark", choices: dict | None = None) -> str:
    """The plan, the summary table, output size, bytes per token and the ceiling on `machine`."""
    if machine not in MACHINES:
        raise UserError(f"unknown machine {machine!r}; known: {', '.join(MACHINES)}")
    tb = token_bytes(plan.cfg, plan.canonical_tensors())
    parts = []
    if choices:
        parts += ["plan:", plan_description(choices), ""]
    parts += [summary_table(plan), ""]
    parts += [f"output: {out}: {len(plan.outputs)} tensors, {format_bytes(plan.total_bytes)}" + (", MTP head kept" if plan.expect_mtp else "")]
    parts += [f"note: {n}" for n in plan.notes]
    parts += ["", bytes_summary(tb, plan.cfg), "", ceiling_table(tb, [MACHINES[machine]])]
    return "\n".join(parts)

