"""checkpoint inspect: what a checkpoint holds, whether it loads, what a token reads, and its ceiling."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.ceiling import (DEFAULT_ACCEPTANCE, DEFAULT_CONTEXTS, ClassRow, Machine, TokenBytes, bytes_summary, ceiling_table,
                             class_table, format_bytes, report_dict, tensor_format, token_bytes)
from ..config import ModelConfig, load_config
from ..hub import resolve_model
from .loader import LoadReport, checkpoint_tensors, plan_model
from .reader import CheckpointError, CheckpointReader
from .stream import INDEX_NAME


@dataclass
class Inspection:
    dir: Path
    cfg: ModelConfig
    tb: TokenBytes
    files: list[tuple[str, int, bool]]  # name, bytes, listed in the index
    vision_rows: list[ClassRow]
    mtp_files: dict[str, bool]  # file holding mtp.* -> listed in the index
    report: LoadReport
    problem: str | None
    provenance: dict | None = None
    has_index: bool = True
    notes: list[str] = field(default_factory=list)

    def header(self) -> str:
        c = self.cfg
        gdn, full = c.layer_types.count("linear_attention"), c.layer_types.count("full_attention")
        mlp = f"{c.num_experts} experts top-{c.num_experts_per_tok}" if c.is_moe else f"dense MLP {c.intermediate_size}"
        lines = [f"checkpoint: {self.dir}",
                 f"model: {c.model_type}, {c.num_hidden_layers} layers ({gdn} GDN + {full} attention), hidden {c.hidden_size}, "
                 f"{mlp}, vocab {c.vocab_size}"]
        unlisted = [n for n, _, listed in self.files if not listed]
        total = sum(size for _, size, _ in self.files)
        files = f"files: {len(self.files)} safetensors, {format_bytes(total)}"
        if not self.has_index:
            files += " (no index)"
        elif unlisted:
            files += f"; not in the index: {', '.join(unlisted)}"
        lines.append(files)
        if self.mtp_files:
            where = ", ".join(f"{f}{'' if listed else ' (not in the index: roofline reads it, tools that follow the index drop it)'}"
                              for f, listed in self.mtp_files.items())
            lines.append(f"MTP head: yes, in {where}")
        else:
            lines.append("MTP head: no" + (" (the config declares one: graft it with `roofline checkpoint graft-mtp`)"
                                           if self.cfg.mtp_num_hidden_layers else ""))
        if self.problem:
            lines.append(f"loads: NO: {self.problem}")
        else:
            fmts = ", ".join(f"{n} {fmt}" for fmt, n in self.report.formats.items())
            lines.append(f"loads: yes ({fmts} linears; experts counted each)")
        if self.provenance:
            lines.append(f"built by: {self.provenance.get('tool', '?')}"
                         + (f", plan {json.dumps(self.provenance['plan'])}" if "plan" in self.provenance else ""))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def text(self, machines: list[Machine], contexts=DEFAULT_CONTEXTS, mtp: int = 2, acceptance=DEFAULT_ACCEPTANCE) -> str:
        return "\n\n".join([self.header(), class_table(self.tb, self.vision_rows), bytes_summary(self.tb, self.cfg, contexts),
                            ceiling_table(self.tb, machines, contexts, mtp, acceptance)])

    def as_dict(self, machines: list[Machine], contexts=DEFAULT_CONTEXTS, mtp: int = 2, acceptance=DEFAULT_ACCEPTANCE) -> dict:
        return {"dir": str(self.dir), "loads": self.problem is None, "problem": self.problem,
                "files": [{"name": n, "bytes": s, "indexed": i} for n, s, i in self.files],
                "mtp_files": self.mtp_files, **report_dict(self.tb, machines, contexts, mtp, acceptance)}


def inspect_checkpoint(spec: str) -> Inspection:
    folder = resolve_model(spec, allow_download=False)
    cfg = load_config(folder)
    reader = CheckpointReader(folder)
    index = folder / INDEX_NAME
    listed = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {p.name for p in reader.files}
    report = LoadReport()
    tensors = checkpoint_tensors(reader, report)
    problem = None
    try:
        plan_model(cfg, tensors, "meta", report=report)
    except CheckpointError as exc:
        problem = str(exc)
    vision: dict[str, ClassRow] = {}
    for name, info in reader.tensors.items():
        if name.startswith(("model.visual.", "visual.")):
            row = vision.setdefault(tensor_format(info), ClassRow("vision", tensor_format(info)))
            row.tensors += 1
            row.stored += info.nbytes
    mtp_files = {}
    for canon, info in tensors.items():
        if canon.startswith("mtp."):
            mtp_files[info.file.name] = info.file.name in listed
    provenance_file = folder / "roofline-build.json"
    provenance = json.loads(provenance_file.read_text()) if provenance_file.is_file() else None
    return Inspection(
        dir=folder, cfg=cfg, tb=token_bytes(cfg, tensors),
        files=[(p.name, p.stat().st_size, p.name in listed) for p in reader.files],
        vision_rows=list(vision.values()), mtp_files=mtp_files, report=report, problem=problem,
        provenance=provenance, has_index=index.is_file(),
    )
