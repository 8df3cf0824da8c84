"""The CUDA fast path: which Triton kernel serves which weight format, installed after loading.

`install_fast_path(model)` gives each packed weight (INT4, block FP8, INT8 rows) and each
layer's routed experts a `forward` that runs the Triton decode kernel for 1..4 rows (the
decode and MTP-verify batch) and the reference otherwise (prefill). It reports what it
installed, and why nothing was installed, so the engine can say so in its log. The model
code is unchanged: kernels are chosen by device and format here, not inside the model.

Not yet on the fast path: GDN decode, decode attention and CUDA graphs (they need the
preallocated caches of the graph runner), so decode is still launch-bound on a GPU.
"""

from __future__ import annotations

import logging
from collections import Counter
from functools import partial

import torch

from ..model.layers import Experts
from ..quant import Fp8BlockWeight, Int4Weight, LinearWeight
from ..quant.int8 import Int8RowWeight

log = logging.getLogger("roofline.kernels")

MAX_DECODE_ROWS = 4  # = kernels._common.MAX_ROWS (not imported here: that module needs Triton)
MAX_EXPERT_TOKENS = 16  # beyond this (prefill) the reference loop over experts is used


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _int4(weight: Int4Weight, sym: bool, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= _rows(x) <= MAX_DECODE_ROWS:
        from .int4_gemv import int4_matmul

        return int4_matmul(x, weight.qweight, weight.qzeros, weight.scales, weight.group_size, sym=sym)
    return LinearWeight.forward(weight, x, expert)


def _fp8(weight: Fp8BlockWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= _rows(x) <= MAX_DECODE_ROWS:
        from .fp8_gemv import fp8_matmul

        return fp8_matmul(x, weight.weight, weight.scale_inv, weight.block)
    return LinearWeight.forward(weight, x, expert)


def _int8(weight: Int8RowWeight, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    if 1 <= _rows(x) <= MAX_DECODE_ROWS:
        from .int8_lm_head import int8_matmul

        return int8_matmul(x, weight.weight, weight.weight_scale)
    return LinearWeight.forward(weight, x, expert)


def _experts(module: Experts, syms: tuple[bool, bool], x, top_experts, top_weights) -> torch.Tensor:
    if x.shape[0] > MAX_EXPERT_TOKENS:
        return Experts.forward(module, x, top_experts, top_weights)
    from .int4_experts import experts_down, experts_gate_up

    gate_up, down = module.gate_up, module.down
    act = experts_gate_up(x, top_experts, gate_up.qweight, gate_up.qzeros, gate_up.scales, gate_up.group_size, sym=syms[0])
    return experts_down(act, top_experts, top_weights, down.qweight, down.qzeros, down.scales, down.group_size, sym=syms[1])


def install_fast_path(model: torch.nn.Module) -> Counter:
    """Install the Triton decode kernels on `model`'s weights; returns counts by kind (empty: not installed)."""
    installed: Counter = Counter()
    device = model.device
    if device.type != "cuda":
        log.info("fast path not used: the model is on %s; the Triton decode kernels need CUDA", device)
        return installed
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("fast path not used: Triton is not installed (pip install 'roofline[gpu]'); running the PyTorch reference path")
        return installed
    from .int4_gemv import is_symmetric

    for module in model.modules():
        if isinstance(module, Experts) and isinstance(module.gate_up, Int4Weight) and isinstance(module.down, Int4Weight):
            syms = (is_symmetric(module.gate_up.qzeros), is_symmetric(module.down.qzeros))
            module.forward = partial(_experts, module, syms)
            installed["int4 experts"] += 1
        elif isinstance(module, Int4Weight) and not module.num_experts:
            module.forward = partial(_int4, module, is_symmetric(module.qzeros))
            installed["int4"] += 1
        elif isinstance(module, Fp8BlockWeight) and not module.num_experts:
            module.forward = partial(_fp8, module)
            installed["fp8"] += 1
        elif isinstance(module, Int8RowWeight):
            module.forward = partial(_int8, module)
            installed["int8 lm_head"] += 1
    dense = sum(1 for m in model.modules() if isinstance(m, LinearWeight) and m.FORMAT == "dense")
    log.info(
        "fast path: Triton decode kernels on %s; %d dense linears stay on PyTorch; GDN, attention and CUDA graphs are "
        "not on the fast path yet",
        ", ".join(f"{n} {kind}" for kind, n in installed.items()) or "no packed weights",
        dense,
    )
    return installed
