"""Module classes of Qwen3.5 tensors: what a plan, a size table or a bytes-per-token count groups by."""

from __future__ import annotations

import re

# Order matters: the first pattern that matches a (canonical) tensor name decides its class.
_CLASSES = [
    ("mtp", r"^mtp\."),
    ("experts", r"\.mlp\.experts\."),
    ("shared", r"\.mlp\.shared_expert\."),
    ("router", r"\.mlp\.(gate|shared_expert_gate)\.weight$"),
    ("dense_mlp", r"\.mlp\.(gate_proj|up_proj|down_proj)\."),
    ("attention", r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\."),
    ("gdn", r"\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\."),
    ("gdn_small", r"\.linear_attn\.(in_proj_a|in_proj_b)\."),
    ("embed", r"embed_tokens\.weight$"),
    ("lm_head", r"^lm_head\."),
]

MODULE_CLASSES = [name for name, _ in _CLASSES] + ["other"]

# Linears that published INT4 checkpoints quantise, and that block-FP8 checkpoints convert.
INT4_CLASSES = {"experts", "attention", "gdn"}
FP8_CLASSES = {"experts", "shared", "attention", "gdn", "dense_mlp"}


def module_class(name: str) -> str:
    for cls, pattern in _CLASSES:
        if re.search(pattern, name):
            return cls
    return "other"  # norms, conv kernels, A_log, dt_bias
