"""Streaming checkpoint output: safetensors files written tensor by tensor, into a folder renamed when complete.

Every tool that writes a checkpoint knows all output names, dtypes and shapes before it reads a
weight (that is what lets it validate first). So each file's header is written up front and
tensors are appended as they arrive: host memory holds one tensor, not a shard.

`OutputFolder` writes into `.NAME.incomplete` beside the output and renames it into place only
after validation; an interrupted run leaves a hidden folder that nothing mistakes for a
checkpoint, and the next run removes it and starts again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .reader import DTYPES, CheckpointError

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str  # output file name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def assign_shards(items: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int, prefix: str = "model") -> list[str]:
    """Output file per item, filling shards in order up to `max_shard_bytes` (published naming)."""
    shard_of, shard, size = [], 0, 0
    for _, dtype, shape in items:
        n = math.prod(shape) * dtype.itemsize
        if size and size + n > max_shard_bytes:
            shard, size = shard + 1, 0
        shard_of.append(shard)
        size += n
    count = shard + 1
    if count == 1:
        return [f"{prefix}.safetensors"] * len(items)
    return [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in shard_of]


class StreamWriter:
    """Writes planned tensors into safetensors files; each file's tensors must arrive in planned order."""

    def __init__(self, folder: Path, planned: list[PlannedTensor]):
        self.folder = Path(folder)
        self.planned = {t.name: t for t in planned}
        if len(self.planned) != len(planned):
            raise CheckpointError("output plan lists a tensor twice")
        self.order: dict[str, list[PlannedTensor]] = {}
        for t in planned:
            self.order.setdefault(t.file, []).append(t)
        self.next_index = {f: 0 for f in self.order}
        self.handles: dict[str, BinaryIO] = {}

    def _open(self, file: str) -> BinaryIO:
        header, offset = {}, 0
        for t in self.order[file]:
            header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f = open(self.folder / file, "wb")
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        self.handles[file] = f
        return f

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append `tensor` as `name`; returns its bytes. The dtype and shape must be the planned ones."""
        t = self.planned.get(name)
        if t is None:
            raise CheckpointError(f"internal: tensor {name} was not planned")
        expected = self.order[t.file][self.next_index[t.file]]
        if expected.name != name:
            raise CheckpointError(f"internal: {t.file} expects {expected.name} next, got {name}")
        if tensor.dtype != t.dtype or tuple(tensor.shape) != t.shape:
            raise CheckpointError(
                f"tensor {name}: produced {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
                f"planned {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
            )
        f = self.handles.get(t.file) or self._open(t.file)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        f.write(memoryview(data))
        self.next_index[t.file] += 1
        if self.next_index[t.file] == len(self.order[t.file]):
            f.close()
            del self.handles[t.file]
        return t.nbytes

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()
        missing = [ts[i].name for f, ts in self.order.items() for i in range(self.next_index[f], len(ts))]
        if missing:
            raise CheckpointError(f"internal: {len(missing)} planned tensor(s) never written, e.g. {missing[0]}")


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(Path(folder) / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.incomplete")
    tmp.write_text(text)
    os.replace(tmp, path)


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() or any(path.glob("*.safetensors")) or not any(path.iterdir())


class OutputFolder:
    """`with OutputFolder(out, force) as tmp: ...write into tmp...; folder.commit()`; removed on any failure."""

    def __init__(self, out: str | Path, force: bool = False):
        self.out = Path(out).expanduser()
        self.force = force
        if self.out.exists():
            if not force:
                raise CheckpointError(f"{self.out} already exists (pass --force to replace it)")
            if not self.out.is_dir() or not _looks_like_checkpoint(self.out):
                raise CheckpointError(f"{self.out} exists and is not a checkpoint folder: refusing to replace it, even with --force")
        self.tmp = self.out.with_name(f".{self.out.name}.incomplete")
        self.committed = False

    def __enter__(self) -> "OutputFolder":
        if self.tmp.exists():
            shutil.rmtree(self.tmp)  # left by an interrupted run: restart cleanly
        self.tmp.mkdir(parents=True)
        return self

    def commit(self) -> Path:
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.replaced")
            if old.exists():
                shutil.rmtree(old)
            os.replace(self.out, old)
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        self.committed = True
        return self.out

    def __exit__(self, *exc) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)


def copy_side_files(src: Path, dst: Path, skip: set[str] = frozenset()) -> list[str]:
    """Copy tokenizer, generation config, chat template... (every top-level non-weight file) from src to dst."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        name = path.name
        if (not path.is_file() or name.startswith(".") or name.endswith(".safetensors") or name in skip
                or name in (INDEX_NAME, "config.json", "README.md", "roofline-build.json")):
            continue
        shutil.copyfile(path, dst / name)  # follows HF-cache symlinks
        copied.append(name)
    return copied
