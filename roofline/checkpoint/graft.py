"""graft-mtp: put the MTP head of one checkpoint into another and list it in the index; idempotent.

The reference system's index rebuild dropped the MTP head, and a second script grafted its 785
tensors back. Here: the head is copied from SRC (indexed or in an unindexed extra file) into
DIR as its own file, written under a temporary name and renamed, then the index is rewritten
atomically. Running it again finds the head in place and does nothing; a head present in DIR
but missing from its index (an interrupted run, or the public INT4 layout) is just indexed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ..config import load_config
from ..hub import resolve_model
from .build import Source, check_same_model
from .loader import checkpoint_tensors, plan_model, validate_checkpoint
from .reader import CheckpointError, CheckpointReader
from .stream import INDEX_NAME, PlannedTensor, StreamWriter, write_index

MTP_FILE = "model_extra_tensors.safetensors"


@dataclass
class GraftResult:
    action: str  # "grafted" | "indexed" | "nothing to do"
    tensors: int
    file: str
    bytes: int

    def message(self, into: Path, dry_run: bool = False) -> str:
        if dry_run and self.action != "nothing to do":
            return f"dry run: would add {self.tensors} MTP tensors to {into} ({self.file}) and list them in the index"
        if self.action == "grafted":
            return f"grafted the MTP head into {into}: {self.tensors} tensors ({self.bytes / 1e9:.2f} GB) in {self.file}, listed in the index"
        if self.action == "indexed":
            return f"{into} already held the MTP head in {self.file}; listed its {self.tensors} tensors in the index"
        return f"{into} already has the MTP head ({self.tensors} tensors in {self.file}), listed in the index: nothing to do"


def _index(folder: Path, reader: CheckpointReader) -> tuple[dict[str, str], int]:
    path = folder / INDEX_NAME
    if path.is_file():
        raw = json.loads(path.read_text())
        return dict(raw["weight_map"]), int(raw.get("metadata", {}).get("total_size", 0))
    # single-file checkpoint: the new index lists what is there
    return {n: i.file.name for n, i in reader.tensors.items()}, sum(i.nbytes for i in reader.tensors.values())


def graft_mtp(src_spec: str, into: str | Path, dry_run: bool = False) -> GraftResult:
    target = Path(into).expanduser()
    if not (target / "config.json").is_file():
        target = resolve_model(into, allow_download=False)
    cfg = load_config(target)
    if not cfg.mtp_num_hidden_layers:
        raise CheckpointError(f"{target}/config.json declares no MTP layer (mtp_num_hidden_layers is 0 or absent)")
    src = Source(src_spec, "MTP source")
    check_same_model(src.cfg, cfg, "MTP source", str(target))
    src_mtp = sorted(n for n in src.canonical if n.startswith("mtp."))
    if not src_mtp:
        raise CheckpointError(f"MTP source {src.dir} has no mtp.* tensors (checked the index and every .safetensors file)")

    reader = CheckpointReader(target)
    tensors = checkpoint_tensors(reader)
    have = sorted(n for n in tensors if n.startswith("mtp."))
    if have:
        return _already_there(target, cfg, reader, tensors, have, dry_run)

    # Validate DIR + the head from headers before writing: every MTP tensor the config needs, shaped right.
    infos = {n: src.info(src.canonical[n]) for n in src_mtp}
    planned = dict(tensors)
    for n, info in infos.items():
        planned[n] = info
    _, _, report = plan_model(cfg, planned, "meta")
    if not report.has_mtp:
        raise CheckpointError("internal: the grafted checkpoint would have no MTP head")
    file = MTP_FILE if not (target / MTP_FILE).exists() else "model-mtp.safetensors"
    if (target / file).exists():
        raise CheckpointError(f"{target / file} exists but holds no mtp.* tensors; remove it first")
    total = sum(i.nbytes for i in infos.values())
    result = GraftResult("grafted", len(src_mtp), file, total)
    if dry_run:
        return result
    tmp = target / f".{file}.incomplete"
    try:
        writer = StreamWriter(target, [PlannedTensor(n, infos[n].dtype, tuple(infos[n].shape), tmp.name) for n in src_mtp])
        by_file: dict[str, list[str]] = {}
        for n in src_mtp:
            by_file.setdefault(src.file_of[src.canonical[n]], []).append(n)
        for f, names in by_file.items():
            with safe_open(str(src.file_path(f)), framework="pt") as handle:
                for n in names:
                    writer.write(n, handle.get_tensor(src.canonical[n]))
        writer.close()
        os.replace(tmp, target / file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    weight_map, size = _index(target, reader)
    weight_map.update({n: file for n in src_mtp})
    write_index(target, weight_map, size + total)
    if not validate_checkpoint(target, cfg).has_mtp:
        raise CheckpointError(f"internal: {target} has no loadable MTP head after grafting")
    return result


def _already_there(target, cfg, reader, tensors, have, dry_run) -> GraftResult:
    """DIR holds mtp.* tensors: fine if they make a complete head for its config (then make sure the index
    lists them), else refuse rather than mix two heads."""
    try:
        _, _, report = plan_model(cfg, tensors, "meta")
    except CheckpointError as exc:
        raise CheckpointError(f"{target} already holds {len(have)} mtp.* tensor(s) but they do not make a loadable head "
                              f"({exc}); remove them before grafting") from None
    files = sorted({tensors[n].file.name for n in have})
    weight_map, size = _index(target, reader)
    missing = [n for n in have if weight_map.get(tensors[n].name) != tensors[n].file.name]
    nbytes = sum(tensors[n].nbytes for n in have)
    if not missing:
        return GraftResult("nothing to do", len(have), ", ".join(files), nbytes)
    if not dry_run:
        weight_map.update({tensors[n].name: tensors[n].file.name for n in missing})
        write_index(target, weight_map, size + sum(tensors[n].nbytes for n in missing))
    return GraftResult("indexed", len(missing), ", ".join(files), nbytes)
