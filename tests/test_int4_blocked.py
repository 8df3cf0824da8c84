"""INT4 qweights block-repacked at load for the tensor-core kernels (default without MTP, kernels/dispatch.py).

The reference path must read the blocked order back exactly, a merged projection's parts must stay views of the
blocked whole, and the decode kernels must read it (the interpreter emulates the tensor-core path on the CPU).
"""

from collections import Counter

import pytest
import torch

from roofline.errors import UserError
from roofline.kernels.dispatch import _block, _block_int4_weights, block_int4_wanted, install_weight_kernel
from roofline.kernels.merge import Projections
from roofline.quant import Int4Weight, quantize_int4
from roofline.quant.int4 import block_qweight, unblock_qweight


def int4(n, k, seed, experts=0):
    w = Int4Weight(n, k, experts, group_size=128)
    for e in range(max(experts, 1)):
        packed = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed + e)), 128, sym=False)
        for name in ("qweight", "qzeros", "scales"):
            (getattr(w, name)[e] if experts else getattr(w, name)).copy_(packed[name])
    return w


def no_kernel(weight):
    return None


def holder(parts, solo):
    """A module tree as the fast path sees it: a merged projection (parts as views) and a weight on its own."""
    root = torch.nn.Module()
    for i, p in enumerate(parts):
        root.add_module(f"part{i}", p)
    root.add_module("solo", solo)
    root.merged = {"qkv": Projections(parts, no_kernel)}
    return root


def test_block_order_round_trips_and_keeps_column_blocks_whole():
    q = torch.randint(-(2**31), 2**31 - 1, (2, 32, 256), dtype=torch.int32)
    blocked = block_qweight(q)
    assert blocked.shape == q.shape and not torch.equal(blocked, q)
    assert torch.equal(unblock_qweight(blocked), q)
    # columns [64, 160) are rows 2..4 of the blocked order: a part of a merged weight stays one contiguous view
    assert torch.equal(blocked[1].view(8, -1)[2:5].reshape(32, 96), block_qweight(q[1, :, 64:160].contiguous()))


def test_blocked_weights_answer_as_before_and_parts_stay_views():
    parts = [int4(256, 256, 0), int4(128, 256, 1), int4(128, 256, 2)]
    solo = int4(128, 384, 3)
    experts = int4(256, 256, 10, experts=3)
    x, xs = torch.randn(8, 256), torch.randn(8, 384)  # 8 rows: the reference path (dequantize), which must unblock
    want = [p(x) for p in parts] + [solo(xs)]
    want_experts = [experts.dequantize(e) for e in range(3)]
    root = holder(parts, solo)
    installed = Counter()
    _block_int4_weights(root, torch.float16, installed)
    merged = root.merged["qkv"].merged
    assert installed["int4 weights block-repacked"] == 2 and merged.blocked and solo.blocked
    assert all(p.blocked and p.qweight.untyped_storage().data_ptr() == merged.qweight.untyped_storage().data_ptr()
               for p in parts)
    got = [p(x) for p in parts] + [solo(xs)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    _block(experts)
    assert all(torch.equal(experts.dequantize(e), w) for e, w in enumerate(want_experts))


def test_what_the_tensor_core_path_cannot_take_stays_in_gptq_order():
    parts = [int4(256, 256, 0), int4(64, 256, 1)]  # merged N = 320: not a multiple of 128
    solo = int4(128, 256, 3)
    root = holder(parts, solo)
    installed = Counter()
    _block_int4_weights(root, torch.float32, installed)  # fp32 activations: the lanes path, which reads GPTQ order
    assert not installed and not solo.blocked
    _block_int4_weights(root, torch.float16, installed)
    assert installed["int4 weights block-repacked"] == 1 and solo.blocked and not root.merged["qkv"].merged.blocked


def test_decode_kernels_read_blocked_weights_interpreter():
    """The merged GEMV for 1 and 3 decode rows, in Triton's interpreter, on blocked weights: equal to the reference."""
    parts = [int4(256, 256, 0), int4(128, 256, 1), int4(128, 256, 2)]
    root = holder(parts, int4(128, 256, 3))
    for p in parts:
        install_weight_kernel(p)
    merged = root.merged["qkv"].merged
    install_weight_kernel(merged)
    xs = [torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half() for m in (1, 3)]
    want = [torch.cat([p.dequantize().half().float() for p in parts]) for _ in xs]
    _block_int4_weights(root, torch.float16, Counter())
    for x, w in zip(xs, want):
        ref = (x.float() @ w.t())
        got = root.merged["qkv"](x)
        assert all(g.dtype == torch.float16 for g in got)
        torch.testing.assert_close(torch.cat(got, -1).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("blocked", [False, True])
def test_one_launch_dequantisation_equals_the_reference(blocked):
    """The prefill path's INT4 dequantisation (int4_dequant, in the interpreter): bit for bit the reference's, for a
    weight alone, each expert, and a merged projection's parts (column views), in GPTQ and blocked order."""
    pytest.importorskip("triton")
    from roofline.kernels.dispatch import many_rows_forward
    from roofline.kernels.int4_dequant import dequantize_int4

    parts = [int4(256, 256, 0), int4(128, 256, 1), int4(128, 256, 2)]
    solo, experts = int4(200, 384, 3), int4(64, 256, 10, experts=3)  # 200 rows: not a multiple of the tile
    root = holder(parts, solo)
    if blocked:
        _block_int4_weights(root, torch.float16, Counter())
        _block(experts)
    assert all(p.qweight.stride(-2) != p.out_features for p in parts) or blocked, "parts are column views"
    for dtype in (torch.float32, torch.float16):
        for weight, expert in [(solo, None), *((p, None) for p in parts), *((experts, e) for e in range(3))]:
            assert torch.equal(dequantize_int4(weight, expert, dtype), weight.dequantize(expert).to(dtype))
    x = torch.randn(9, 256)  # more rows than the decode kernels take: the prefill path
    assert torch.equal(many_rows_forward(parts[1], x), torch.nn.functional.linear(x, parts[1].dequantize()))


@pytest.mark.gpu
def test_one_launch_dequantisation_equals_the_reference_gpu():
    """At the 122B experts' shape (gate_up 2048 x 3072), blocked as the fast path keeps it, into bf16."""
    from roofline.kernels.int4_dequant import dequantize_int4

    experts = int4(2048, 3072, 20, experts=2).to("cuda")
    _block(experts)
    for e in range(2):
        assert torch.equal(dequantize_int4(experts, e, torch.bfloat16), experts.dequantize(e).to(torch.bfloat16))


def test_a_blocked_weight_refuses_the_lanes_path():
    from roofline.kernels.int4_gemv import int4_matmul

    w = int4(128, 256, 0)
    _block(w)
    with pytest.raises(ValueError, match="block-repacked"):
        int4_matmul(torch.randn(1, 256), w.qweight, w.qzeros, w.scales, 128, config={"qblk": True})  # fp32 rows


def test_the_weight_order_is_blocked_unless_forced(monkeypatch):
    monkeypatch.delenv("ROOFLINE_INT4_QBLK", raising=False)
    assert block_int4_wanted() == (True, "the default")
    monkeypatch.setenv("ROOFLINE_INT4_QBLK", "0")
    assert block_int4_wanted() == (False, "ROOFLINE_INT4_QBLK=0")
    monkeypatch.setenv("ROOFLINE_INT4_QBLK", "1")
    assert block_int4_wanted() == (True, "ROOFLINE_INT4_QBLK=1")
    monkeypatch.setenv("ROOFLINE_INT4_QBLK", "yes")
    with pytest.raises(UserError, match="ROOFLINE_INT4_QBLK must be 0 or 1"):
        block_int4_wanted()


@pytest.mark.parametrize("kind", ["dequant", "triton"])
def test_int4_prefill_through_the_fast_path_equals_the_reference(tmp_path, monkeypatch, kind):
    """A 20-token prefill (past the decode kernels' rows) of an INT4 checkpoint with the fast path installed
    (interpreter): every INT4 weight dequantised by int4_dequant and the routed experts in a loop, or, with
    ROOFLINE_INT4_GEMM=triton, the dense weights and the grouped experts in int4_gemm's kernel."""
    pytest.importorskip("triton")
    from roofline.checkpoint import load_model
    from roofline.engine.cache import SequenceCache
    from roofline.kernels import int4_gemm
    from roofline.kernels.dispatch import install_fast_path
    from roofline.model.layers import Experts
    from tiny_checkpoints import INT4_PLAN, reference_model, text_config, write_variant

    cfg = text_config()  # 4 layers: 3 GDN, 1 full attention
    hf, mtp = reference_model(cfg, seed=5)
    write_variant(hf, mtp, tmp_path / "m", cfg=cfg, plan=INT4_PLAN)
    ids = torch.arange(3, 23)
    reference, _ = load_model(tmp_path / "m", "cpu", torch.float32)
    want = reference.logits(reference(ids, [len(ids)], [SequenceCache()]))
    fast, _ = load_model(tmp_path / "m", "cpu", torch.float32)
    monkeypatch.setenv("ROOFLINE_INT4_GEMM", kind)
    installed = install_fast_path(fast, allow_cpu=True).installed
    assert installed["int4 experts"]
    assert bool(installed["int4 gemm for many rows: experts grouped, dense up to 64 rows"]) == (kind == "triton")
    experts = next(m for m in fast.modules() if isinstance(m, Experts))
    assert experts.gate_up.forward.func.__name__ == "many_rows_forward" and experts.gemm == kind
    assert fast.max_graph_rows == (80 if kind == "triton" else 16)
    calls = {"expert_blocks": [], "int4_gemm": []}
    for name in calls:
        original = getattr(int4_gemm, name)
        monkeypatch.setattr(int4_gemm, name, lambda *a, _f=original, _n=name, **kw: calls[_n].append(1) or _f(*a, **kw))
    torch.testing.assert_close(fast.logits(fast(ids, [len(ids)], [SequenceCache()])), want, rtol=1e-4, atol=1e-4)
    layers = sum(1 for m in fast.model.modules() if isinstance(m, Experts))
    assert layers and len(calls["expert_blocks"]) == (layers if kind == "triton" else 0), "once per MoE layer, or never"
    assert (len(calls["int4_gemm"]) > 0) == (kind == "triton"), "the dense INT4 projections take the kernel"


def test_an_unknown_int4_gemm_kind_is_refused_by_name(monkeypatch):
    from roofline.kernels.dispatch import int4_gemm_wanted

    monkeypatch.setenv("ROOFLINE_INT4_GEMM", "fused")
    with pytest.raises(UserError, match="ROOFLINE_INT4_GEMM must be one of dequant, triton, got 'fused'"):
        int4_gemm_wanted()
