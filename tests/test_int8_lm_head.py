"""INT8 per-row LM head: the format class (quantise at load, reference dequantise) and its one-launch kernel.

Like tests/test_kernels.py: without CUDA the kernel runs in Triton's interpreter at small sizes
in fp16/fp32; the `gpu` tests run it compiled at the real head size (248320 x 3072) in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from roofline.quant import Int8RowWeight  # noqa: E402
from roofline.quant.int8 import quantize_int8_rows  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run where CUDA is absent (or with TRITON_INTERPRET=1)")


def test_from_dense_is_per_row_absmax():
    torch.manual_seed(0)
    w = torch.randn(37, 50, dtype=torch.bfloat16)
    w[3] = 0  # an all-zero row must not divide by zero
    fmt = Int8RowWeight.from_dense(w)
    assert fmt.FORMAT == "int8-row" and fmt.weight.dtype == torch.int8 and fmt.weight_scale.shape == (37, 1)
    wf = w.float()
    torch.testing.assert_close(fmt.weight_scale[:, 0], (wf.abs().amax(-1) / 127).clamp(min=1e-12))
    assert fmt.weight.abs().max() <= 127
    assert int(fmt.weight.abs().amax(-1)[torch.arange(37) != 3].min()) == 127  # each row's absmax maps to 127
    # rounding error at most half a step per element
    err = (fmt.dequantize() - wf).abs()
    assert bool((err <= fmt.weight_scale.float() / 2 + 1e-6).all())
    x = torch.randn(2, 50)
    torch.testing.assert_close(fmt(x), x @ fmt.dequantize().t())


def test_chunked_quantisation_equals_whole():
    w = torch.randn(300, 64)
    q1, s1 = quantize_int8_rows(w, chunk_rows=7)
    q2, s2 = quantize_int8_rows(w, chunk_rows=10_000)
    assert torch.equal(q1, q2) and torch.equal(s1, s2)


def test_format_contract_loads_parts():
    w = torch.randn(16, 24)
    src = Int8RowWeight.from_dense(w)
    dst = Int8RowWeight(16, 24)
    assert dst.check_part("weight", (16, 24), 16, False) is None
    assert dst.check_part("weight_scale", (16, 1), 16, False) is None
    assert dst.check_part("weight", (16, 25), 16, False) is not None
    dst.load_part("weight", src.weight[:8], None, 0)
    dst.load_part("weight", src.weight[8:], None, 8)
    dst.load_part("weight_scale", src.weight_scale, None, 0)
    assert torch.equal(dst.dequantize(), src.dequantize())
    assert dst.nbytes == 16 * 24 + 16 * 4


def check_kernel(m, v, h, dtype, device, config=None, tol=1e-2, dot=False):
    from roofline.kernels.int8_lm_head import int8_matmul, int8_matmul_reference

    torch.manual_seed(m * 13 + v)
    fmt = Int8RowWeight.from_dense(torch.randn(v, h, device=device).to(dtype))
    x = torch.randn(m, h, device=device).to(dtype)
    out = torch.full((m, v), float("nan"), dtype=dtype, device=device)
    y = int8_matmul(x, fmt.weight, fmt.weight_scale, out=out, config=config, dot=dot)
    ref = int8_matmul_reference(x, fmt.weight, fmt.weight_scale)
    assert not torch.isnan(y).any()
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < tol
    # and against the format's own reference forward (dequantise, then F.linear in x's dtype)
    assert ((y.float() - fmt(x).float()).norm() / ref.float().norm()).item() < 2 * tol


@cpu
@pytest.mark.parametrize("m,v,h,config,dot", [
    (1, 100, 96, None, False),            # V not a multiple of the row block, H not of the column block
    (2, 37, 64, {"BV": 8}, False),
    (3, 130, 200, None, False),
    (4, 64, 64, {"BH": 64}, False),
    (2, 100, 96, None, True),             # the tl.dot variant (ROOFLINE_INT8_DOT)
    (3, 37, 64, {"BV": 32}, True),
    (4, 130, 200, None, True),
    (1, 64, 64, {"BH": 64}, True),
])
def test_int8_lm_head_interpreter(m, v, h, config, dot):
    """fp32 and fp16 x; the tl.dot variant in fp16 (the interpreter's dot is right in fp16, not in bf16)."""
    pytest.importorskip("triton")
    check_kernel(m, v, h, torch.float16 if dot or m % 2 == 0 else torch.float32, "cpu", config, tol=2e-3, dot=dot)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_int8_lm_head_gpu(m):
    check_kernel(m, 248320, 3072, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_int8_lm_head_gpu_odd_sizes():
    check_kernel(3, 5003, 1000, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m,v,h", [(1, 248320, 3072), (2, 248320, 3072), (4, 248320, 3072), (3, 5003, 1000)])
def test_int8_lm_head_tensor_core_variant_gpu(m, v, h):
    check_kernel(m, v, h, torch.bfloat16, "cuda", dot=True)


def check_fp32_logits(m, v, h, dtype, device, dot, monkeypatch):
    """The fast path's fp32 logits (`round_to_x`, one launch; `Int8RowWeight.logits` once the kernel is installed) hold
    exactly the values of the 16-bit output widened (what `head(x).float()` gave, a second kernel); without the
    rounding some would differ, so the comparison can fail."""
    from roofline.kernels import dispatch, int8_lm_head
    from roofline.kernels.int8_lm_head import int8_matmul

    torch.manual_seed(m * 7 + v)
    fmt = Int8RowWeight.from_dense(torch.randn(v, h, device=device).to(dtype))
    x = torch.randn(m, h, device=device).to(dtype)
    widened = int8_matmul(x, fmt.weight, fmt.weight_scale, dot=dot).float()
    one = int8_matmul(x, fmt.weight, fmt.weight_scale, out_dtype=torch.float32, round_to_x=True, dot=dot)
    assert one.dtype == torch.float32 and torch.equal(one, widened)
    unrounded = int8_matmul(x, fmt.weight, fmt.weight_scale, out_dtype=torch.float32, dot=dot)
    assert not torch.equal(unrounded, widened)
    assert dispatch.install_weight_kernel(fmt) == "int8 lm_head"
    monkeypatch.setattr(int8_lm_head, "DOT_ROWS", dot)  # the variant the installed kernel takes
    logits = fmt.logits(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, widened)
    monkeypatch.setattr(dispatch, "FP32_LOGITS", False)  # the rule before: the 16-bit output widened by a copy
    assert torch.equal(fmt.logits(x), widened)


@cpu
@pytest.mark.parametrize("m,dot", [(1, False), (3, False), (2, True), (4, True)])
def test_fp32_logits_hold_the_16_bit_values_interpreter(m, dot, monkeypatch):
    pytest.importorskip("triton")
    check_fp32_logits(m, 100, 96, torch.float16, "cpu", dot, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_fp32_logits_hold_the_16_bit_values_gpu(m, monkeypatch):
    check_fp32_logits(m, 248320, 3072, torch.bfloat16, "cuda", True, monkeypatch)
