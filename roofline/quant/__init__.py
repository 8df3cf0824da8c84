"""Weight formats behind one linear-layer contract (see base.LinearWeight)."""

from .base import LinearWeight
from .dense import DenseWeight
from .fp8 import Fp8BlockWeight, quantize_fp8_block
from .int4 import Int4Weight, quantize_int4
from .int8 import Int8RowWeight, quantize_int8_rows  # noqa: F401 (LM head format; the loader opts in)

# Detection order: the first format whose required suffixes are all present wins.
FORMATS: tuple[type[LinearWeight], ...] = (Int4Weight, Fp8BlockWeight, DenseWeight)

__all__ = ["FORMATS", "LinearWeight", "DenseWeight", "Int4Weight", "Fp8BlockWeight", "quantize_int4", "quantize_fp8_block"]
