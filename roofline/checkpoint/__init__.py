"""Checkpoint reading and loading (see loader.load_model)."""

from .loader import LoadReport, load_model
from .reader import CheckpointError, CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader", "LoadReport", "load_model"]
