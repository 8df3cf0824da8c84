"""Write checkpoints in the published layout: shards, an index, atomically.

Everything goes into a temporary folder beside the output and is renamed into place only
once complete, so an interrupted write never leaves a folder that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from .reader import CheckpointError


class ShardWriter:
    """Accumulates tensors and flushes a shard whenever `max_shard_bytes` would be exceeded."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = 4 << 30, prefix: str = "model"):
        self.out_dir, self.max_bytes, self.prefix = Path(out_dir), max_shard_bytes, prefix
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[str] = []  # temporary names of the shards written so far
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise CheckpointError(f"tensor {name} written twice")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.prefix}-part{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, str(self.out_dir / name), metadata={"format": "pt"})
        for key in self.pending:
            self.weight_map[key] = name
        self.shards.append(name)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Write the last shard, rename shards to `-0000i-of-0000n`, write the index; returns the weight map."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self.out_dir / self.shards[0], self.out_dir / f"{self.prefix}.safetensors")
            renames = {self.shards[0]: f"{self.prefix}.safetensors"}
        else:
            renames = {old: f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(self.shards)}
            for old, new in renames.items():
                os.replace(self.out_dir / old, self.out_dir / new)
        self.weight_map = {k: renames[v] for k, v in self.weight_map.items()}
        return self.weight_map


def write_index(out_dir: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_checkpoint(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict,
    extra_files: dict[str, str] | None = None,
    max_shard_bytes: int = 4 << 30,
    copy_files: Iterable[Path] = (),
    index_extra_files: bool = True,
    force: bool = False,
) -> Path:
    """Write `tensors` as a sharded checkpoint with `config.json` into `out_dir`, atomically.

    `extra_files` maps a tensor-name prefix to a separate file name (e.g. {"mtp.":
    "model_extra_tensors.safetensors"}); with `index_extra_files=False` that file is left out of
    the index, as the public INT4 checkpoint does. `copy_files` (tokenizer, generation config, ...)
    are copied beside the weights.
    """
    out = Path(out_dir)
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists (pass --force to replace it)")
    tmp = out.with_name(f".{out.name}.incomplete")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted run: restart cleanly
    tmp.mkdir(parents=True)
    try:
        main = ShardWriter(tmp, max_shard_bytes)
        extras: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            file = next((f for prefix, f in (extra_files or {}).items() if name.startswith(prefix)), None)
            if file:
                extras.setdefault(file, {})[name] = tensor.contiguous()
            else:
                main.add(name, tensor)
        weight_map = main.finish()
        total = main.total_bytes
        for file, group in extras.items():
            save_file(group, str(tmp / file), metadata={"format": "pt"})
            if index_extra_files:
                weight_map.update({name: file for name in group})
                total += sum(t.numel() * t.element_size() for t in group.values())
        write_index(tmp, weight_map, total)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in copy_files:
            shutil.copy2(path, tmp / Path(path).name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
