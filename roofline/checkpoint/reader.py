"""Safetensors checkpoint reading: headers first, tensors streamed file by file.

A checkpoint is a single `model.safetensors` or shards listed by `model.safetensors.index.json`,
plus any `.safetensors` files the index does not list (the INT4 checkpoint keeps its MTP head
in `model_extra_tensors.safetensors`). Headers are parsed here (not by the safetensors library)
so that a truncated file or a duplicate tensor is reported with its file name before any
weight is read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError


class CheckpointError(UserError):
    """The checkpoint is incomplete, corrupt, or does not match the model; the message names file and tensor."""


DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds every byte it declares."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes, file {size})")
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    infos, end = {}, 0
    for name, meta in header.items():
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        infos[name] = TensorInfo(name, path, DTYPES[meta["dtype"]], tuple(meta["shape"]))
        end = max(end, meta["data_offsets"][1])
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: truncated: tensors need {8 + header_len + end} bytes, the file has {size}")
    return infos


class CheckpointReader:
    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = self._files()
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name} appears twice: in {self.tensors[name].file.name} and {path.name}")
                self.tensors[name] = info

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        on_disk = sorted(self.dir.glob("*.safetensors"))
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from exc
            listed = sorted(set(weight_map.values()))
            missing = [name for name in listed if not (self.dir / name).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) not on disk: {', '.join(missing)}")
            # Unlisted files (e.g. model_extra_tensors.safetensors with the MTP head) are read too.
            return [self.dir / name for name in listed] + [p for p in on_disk if p.name not in listed]
        if not on_disk:
            raise CheckpointError(f"{self.dir}: no .safetensors files")
        return on_disk

    def stream(self, names_by_file: dict[Path, list[str]]):
        """Yield (name, tensor) file by file, so host memory holds about one file's tensors at a time."""
        for path in self.files:
            wanted = names_by_file.get(path)
            if not wanted:
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in wanted:
                        yield name, f.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error type for corrupt data
                raise CheckpointError(f"{path}: failed reading tensors ({exc})") from exc
