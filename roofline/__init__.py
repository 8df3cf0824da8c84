"""roofline: Qwen3.5 inference at the memory-bandwidth ceiling of one GPU."""

__version__ = "0.1.0"
