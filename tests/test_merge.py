"""Merged projections (kernels/merge.py): one weight for linears that read the same input, parts as views."""

import torch

from roofline.kernels.merge import Projections, merge_blocker
from roofline.quant import DenseWeight, Fp8BlockWeight, Int4Weight, quantize_fp8_block, quantize_int4


def int4(n, k, seed):
    w = Int4Weight(n, k, group_size=128)
    packed = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), 128, sym=False)
    for name in ("qweight", "qzeros", "scales"):
        getattr(w, name).copy_(packed[name])
    return w


def fp8(n, k, seed):
    w = Fp8BlockWeight(n, k)
    weight, scale_inv = quantize_fp8_block(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    w.weight.copy_(weight)
    w.scale_inv.copy_(scale_inv)
    return w


def dense(n, k, seed):
    w = DenseWeight(n, k)
    w.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return w


def no_kernel(weight):
    return None


def check_merge(parts):
    x1, x8 = torch.randn(1, parts[0].in_features), torch.randn(8, parts[0].in_features)
    before = [[p(x) for p in parts] for x in (x1, x8)]
    storage = sum(p.nbytes for p in parts)
    proj = Projections(parts, no_kernel)
    assert proj.blocker is None and proj.merged is not None
    assert proj.merged.nbytes == storage and sum(p.nbytes for p in parts) == storage
    for p in parts:  # the parts' storage now lives inside the merged tensors
        for buf in p.buffers():
            assert any(buf.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() for m in proj.merged.buffers())
    for x, want in zip((x1, x8), before):
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(proj(x), want))  # merged: one product
        assert all(torch.allclose(p(x), w, atol=1e-5) for p, w in zip(parts, want))  # each part alone still
    return proj


def test_int4_parts_merge_and_still_work_alone():
    proj = check_merge([int4(256, 256, 0), int4(128, 256, 1), int4(64, 256, 2)])
    assert proj.merged.qweight.shape == (32, 448) and not proj.parts[1].qweight.is_contiguous()


def test_fp8_and_dense_parts_merge():
    check_merge([fp8(256, 256, 0), fp8(128, 256, 1)])
    check_merge([dense(64, 96, 0), dense(1, 96, 1)])  # the router and the shared expert's one-row gate


def test_what_cannot_merge_runs_apart():
    x = torch.randn(2, 256)
    mixed = [int4(128, 256, 0), dense(64, 256, 1)]
    proj = Projections(mixed, no_kernel)
    assert proj.merged is None and "formats differ" in proj.blocker
    assert all(torch.equal(g, p(x)) for g, p in zip(proj(x), mixed))
    assert "rows do not fill whole blocks" in merge_blocker([fp8(64, 256, 0), fp8(128, 256, 1)])
    assert "different input sizes" in merge_blocker([dense(64, 256, 0), dense(64, 128, 1)])
