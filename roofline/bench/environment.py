"""What every benchmark result records about where it ran."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

import torch

from .. import __version__


def git_commit() -> str | None:
    """HEAD of the checkout (`+dirty` with uncommitted changes); $ROOFLINE_COMMIT where the tree has no .git."""
    if os.environ.get("ROOFLINE_COMMIT"):
        return os.environ["ROOFLINE_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0 or not sha.stdout.strip():
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def environment(device: torch.device | str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "roofline_version": __version__,
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
