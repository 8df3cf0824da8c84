"""MODEL argument resolution: a local folder, a Hugging Face id, or a path inside the HF cache.

A model id resolves to the newest complete snapshot in the local cache (users had two
snapshots and a shell `find` that returned both); without one it is downloaded with
huggingface_hub when a network is there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .errors import UserError

log = logging.getLogger("roofline.hub")

BUNDLED_MODEL = Path(__file__).parent / "models" / "tiny"


class ModelNotFound(UserError):
    pass


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _newest_snapshot(repo_cache: Path) -> Path | None:
    """The snapshot `refs/main` points to, else the most recently modified complete one."""
    snapshots = repo_cache / "snapshots"
    ref = repo_cache / "refs" / "main"
    if ref.is_file() and _is_model_dir(snapshots / ref.read_text().strip()):
        return snapshots / ref.read_text().strip()
    complete = [p for p in snapshots.glob("*") if _is_model_dir(p)] if snapshots.is_dir() else []
    return max(complete, key=lambda p: p.stat().st_mtime) if complete else None


def resolve_model(model: str | os.PathLike | None, allow_download: bool = True) -> Path:
    """Return a folder holding config.json for MODEL (None: the bundled model)."""
    if model is None:
        if not _is_model_dir(BUNDLED_MODEL):
            raise ModelNotFound(f"the bundled model is missing from {BUNDLED_MODEL}; pass a MODEL")
        return BUNDLED_MODEL
    path = Path(model).expanduser()
    if path.exists():
        if _is_model_dir(path):
            return path
        # a cache folder `models--org--name` (or its snapshots/) given directly
        repo = path.parent if path.name == "snapshots" else path
        snapshot = _newest_snapshot(repo)
        if snapshot:
            return snapshot
        raise ModelNotFound(f"{path} has no config.json (not a checkpoint folder or a Hugging Face cache entry)")
    model_id = str(model)
    if model_id.count("/") != 1:
        raise ModelNotFound(f"{model_id}: no such folder, and not a Hugging Face model id (org/name)")
    snapshot = _newest_snapshot(hf_cache_dir() / f"models--{model_id.replace('/', '--')}")
    if snapshot:
        return snapshot
    if not allow_download or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotFound(f"{model_id} is not in the local Hugging Face cache ({hf_cache_dir()}) and downloads are off")
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the Hugging Face Hub", model_id)
    try:
        return Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as exc:  # network errors, unknown repo, gated repo
        raise ModelNotFound(f"{model_id}: not in the local cache and the download failed ({exc})") from exc
