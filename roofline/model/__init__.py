from .qwen35 import Qwen35ForCausalLM

__all__ = ["Qwen35ForCausalLM"]
