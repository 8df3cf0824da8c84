"""Weight formats decode the published bit layouts exactly (checked against the formulas written out by hand)."""

import math

import torch

from roofline.quant import Fp8BlockWeight, Int4Weight, quantize_fp8_block, quantize_int4


def nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def test_int4_dequantize_follows_the_gptq_layout():
    n, k, g = 16, 256, 64
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(k // g, n, generator=gen).half()
    w = Int4Weight(n, k, group_size=g)
    for s, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        w.load_part(s, t, None, 0)
    got = w.dequantize()
    for nn_ in range(0, n, 5):
        for kk in range(0, k, 7):
            q = nibble(int(qweight[kk // 8, nn_]) & 0xFFFFFFFF, kk % 8)  # lowest k in the lowest nibble
            zero = nibble(int(qzeros[kk // g, nn_ // 8]) & 0xFFFFFFFF, nn_ % 8) + 1  # stored as zero - 1
            want = (q - zero) * float(scales[kk // g, nn_])
            assert math.isclose(float(got[nn_, kk]), want, rel_tol=1e-6, abs_tol=1e-6)


def test_fp8_dequantize_multiplies_by_scale_inv_per_block():
    n, k = 200, 300  # not multiples of the 128 block
    weight = torch.randn(n, k).to(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.bfloat16)
    w = Fp8BlockWeight(n, k, scale_dtype=torch.bfloat16)
    w.load_part("weight", weight, None, 0)
    w.load_part("weight_scale_inv", scale, None, 0)
    got = w.dequantize()
    for i, j in [(0, 0), (127, 128), (128, 127), (199, 299), (150, 260)]:
        assert float(got[i, j]) == float(weight[i, j].float()) * float(scale[i // 128, j // 128].float())


def test_round_trips_stay_within_format_error():
    w = torch.randn(256, 384)
    for sym in (True, False):
        q = quantize_int4(w, 128, sym)
        int4 = Int4Weight(256, 384, group_size=128)
        for s, t in q.items():
            int4.load_part(s, t, None, 0)
        assert (int4.dequantize() - w).norm() / w.norm() < 0.12
    q, s = quantize_fp8_block(w)
    fp8 = Fp8BlockWeight(256, 384)
    fp8.load_part("weight", q, None, 0)
    fp8.load_part("weight_scale_inv", s, None, 0)
    assert (fp8.dequantize() - w).norm() / w.norm() < 0.05


def test_experts_fill_their_rows_of_a_fused_slot():
    """Per-expert gate and up INT4 linears land in rows [0, I) and [I, 2I) of expert e."""
    e, i, h = 3, 64, 128
    w = Int4Weight(2 * i, h, num_experts=e, group_size=128)
    dense = torch.randn(e, 2 * i, h)
    for ex in range(e):
        for row, part in ((0, dense[ex, :i]), (i, dense[ex, i:])):
            for s, t in quantize_int4(part, 128).items():
                w.load_part(s, t, ex, row)
    for ex in range(e):
        assert (w.dequantize(ex) - dense[ex]).norm() / dense[ex].norm() < 0.12
