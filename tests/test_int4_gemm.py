"""The INT4 GEMM for calls past the decode kernels' rows (kernels/int4_gemm.py): routed experts grouped by expert on
the device, then one gate_up (+ SiLU * up) and one down launch, against the reference loop over experts
(`Experts.forward`); dense weights, merged projections' column views included, against their reference.

In CI the kernel runs in Triton's interpreter (fp16 / fp32: it gets bf16 arithmetic wrong); the `gpu` test runs the
122B experts' shape in bf16."""

import pytest
import torch

from roofline.kernels.dispatch import _block
from roofline.model.layers import Experts
from roofline.quant import Int4Weight, quantize_int4

pytest.importorskip("triton")
from roofline.kernels import int4_gemm as int4_gemm_module  # noqa: E402
from roofline.kernels.int4_gemm import experts_blocker, expert_blocks, grouped_experts, int4_gemm  # noqa: E402


def int4_experts(num_experts, hidden, inter, seed, sym=False) -> Experts:
    module = Experts(num_experts, hidden, inter)
    for name, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        weight = Int4Weight(n, k, num_experts, group_size=128)
        for e in range(num_experts):
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 97 * e + len(name))) / k**0.5
            for part, tensor in quantize_int4(w, 128, sym=sym).items():
                getattr(weight, part)[e].copy_(tensor)
        setattr(module, name, weight)
    return module


def routing(tokens, num_experts, k, seed, unused=()):
    """Top-k choices per token (distinct experts, some never chosen) and weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g)
    scores[:, list(unused)] = -1
    weights, experts = scores.topk(k, dim=-1)
    return experts, weights / weights.sum(-1, keepdim=True)


def test_expert_blocks_group_every_row_once_by_expert():
    experts, _ = routing(37, 8, 3, seed=1, unused=(2, 5))
    rows, block_expert = expert_blocks(experts, 8, 16)
    flat = experts.reshape(-1)
    real = rows[rows >= 0].long()
    assert sorted(real.tolist()) == list(range(flat.numel())), "every (token, choice) row exactly once"
    used = block_expert[block_expert >= 0]
    assert torch.equal(block_expert[: used.numel()], used), "the real blocks come first, then -1"
    assert not {2, 5} & set(used.tolist()), "no block for an expert nobody chose"
    for b, e in enumerate(used.tolist()):
        block = rows[b * 16 : (b + 1) * 16]
        assert (flat[block[block >= 0].long()] == e).all(), f"block {b} holds rows of expert {e} only"
        assert (block >= 0).any(), f"block {b} is not all padding"
    assert (rows[used.numel() * 16 :] == -1).all()


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("sym", [False, True])
def test_grouped_prefill_equals_the_loop_over_experts(monkeypatch, blocked, sym):
    """fp16 in the interpreter; 45 tokens (not a multiple of the row block), top-3 of 6 experts with one unused,
    in chunks of 20 tokens (three chunks, the last short) so the chunking is exercised."""
    monkeypatch.setattr(int4_gemm_module, "TOKEN_CHUNK", 20)
    module = int4_experts(6, 256, 128, seed=3, sym=sym)
    x = torch.randn(45, 256, generator=torch.Generator().manual_seed(4)).half()
    experts, weights = routing(45, 6, 3, seed=5, unused=(4,))
    weights = weights.half()
    want = Experts.forward(module.float(), x.float(), experts, weights.float())
    if blocked:
        _block(module.gate_up)
        _block(module.down)
    assert experts_blocker(module.gate_up, module.down) is None
    got = grouped_experts(x, experts, weights, module.gate_up, module.down)
    assert got.dtype == torch.float16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # and against the loop in the same dtype, which rounds at the same steps
    module.half()
    loop = Experts.forward(module, x, experts, weights)
    assert (got.float() - loop.float()).abs().max() <= 4 * (loop.float() - want).abs().max() + 1e-3


def test_grouped_prefill_in_fp32_is_close_to_exact():
    module = int4_experts(4, 128, 128, seed=8)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(9))
    experts, weights = routing(33, 4, 2, seed=10)
    want = Experts.forward(module, x, experts, weights)
    torch.testing.assert_close(grouped_experts(x, experts, weights, module.gate_up, module.down), want,
                               rtol=1e-4, atol=1e-4)


def test_column_tiles_past_the_weight_are_masked():
    """BN 256 over 384 columns (gate and up each) and 128 down columns: the second tile of each is partly past N."""
    module = int4_experts(3, 128, 384, seed=12)
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(13))
    experts, weights = routing(21, 3, 2, seed=14)
    want = Experts.forward(module, x, experts, weights)
    got = grouped_experts(x, experts, weights, module.gate_up, module.down,
                          config={"BM": 16, "BN": 256, "BK": 64, "num_warps": 1})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_group_size_the_kernel_cannot_step_is_refused_by_name():
    module = Experts(2, 96, 32)
    module.gate_up = Int4Weight(64, 96, 2, group_size=32)
    module.down = Int4Weight(96, 32, 2, group_size=32)
    assert "gate_up: group size 32" in experts_blocker(module.gate_up, module.down)


def dense_int4(n, k, seed):
    weight = Int4Weight(n, k, group_size=128)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    for part, tensor in quantize_int4(w, 128, sym=False).items():
        getattr(weight, part).copy_(tensor)
    return weight


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("rows", [5, 17, 40])
def test_dense_gemm_equals_the_reference_on_merged_parts(blocked, rows):
    """A merged projection's parts are column views of the whole (GPTQ order) or contiguous runs of it (blocked): the
    kernel reads each, at row counts past the decode kernels' 4 (5, 17 and 40 rows: one and several row blocks)."""
    from collections import Counter

    from roofline.kernels.dispatch import _block_int4_weights
    from roofline.kernels.merge import Projections

    parts = [dense_int4(256, 256, 1), dense_int4(128, 256, 2)]
    root = torch.nn.Module()
    for i, part in enumerate(parts):
        root.add_module(f"part{i}", part)
    root.merged = {"both": Projections(parts, lambda w: None)}
    if blocked:
        _block_int4_weights(root, torch.float16, Counter())
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3))
    for weight in (*parts, root.merged["both"].merged):
        got = int4_gemm(x.half(), weight)
        assert got.dtype == torch.float16 and got.shape == (rows, weight.out_features)
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight.dequantize()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(int4_gemm(x, parts[1]), torch.nn.functional.linear(x, parts[1].dequantize()),
                               rtol=1e-4, atol=1e-4)  # fp32 rows: close to exact


def test_a_k_step_wider_than_the_group_is_narrowed_to_it():
    """Group 64, K 192, a config asking BK 128: each K step must stay within one group (and within K)."""
    weight = Int4Weight(96, 192, group_size=64)
    w = torch.randn(96, 192, generator=torch.Generator().manual_seed(6)) / 192**0.5
    for part, tensor in quantize_int4(w, 64, sym=False).items():
        getattr(weight, part).copy_(tensor)
    x = torch.randn(7, 192, generator=torch.Generator().manual_seed(7))
    got = int4_gemm(x, weight, config={"BM": 16, "BN": 32, "BK": 128, "num_warps": 1})
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight.dequantize()), rtol=1e-4, atol=1e-4)


def test_weights_the_kernel_cannot_read_keep_the_dequantising_path_and_say_so(caplog):
    from roofline.kernels.dispatch import use_int4_gemm

    root = torch.nn.Module()
    root.odd = Int4Weight(64, 96, group_size=32)
    root.fine = dense_int4(128, 256, 5)
    with caplog.at_level("WARNING", logger="roofline.kernels"):
        use_int4_gemm(root, "triton")
    assert (root.odd.gemm, root.fine.gemm, root.max_graph_rows) == ("dequant", "triton", 80)
    assert "1 dense INT4 weights past 4 rows dequantise first, not the INT4 GEMM: weight: group size 32" in caplog.text


@pytest.mark.gpu
def test_dense_gemm_at_the_122b_projection_shape_gpu():
    """bf16, the GDN in_proj_qkv+z shape (20480 x 3072), block-repacked, 6 and 48 rows (MTP-2 verify of 2 and of 16
    sequences)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    weight = dense_int4(20480, 3072, 4).to("cuda")
    want_w = weight.dequantize()
    _block(weight)
    for rows in (6, 48):
        x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
        got = int4_gemm(x, weight)
        torch.testing.assert_close(got.float(), x.float() @ want_w.t(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_grouped_prefill_at_the_122b_expert_shape_gpu():
    """bf16, hidden 3072, 1024 per expert, top-8 of 256 experts (16 of them here), 300 tokens, blocked order."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    module = int4_experts(16, 3072, 1024, seed=11).to("cuda")
    _block(module.gate_up)
    _block(module.down)
    x = torch.randn(300, 3072, device="cuda", dtype=torch.bfloat16)
    experts, weights = routing(300, 16, 8, seed=12)
    experts, weights = experts.cuda(), weights.cuda()
    want = Experts.forward(module.float(), x.float(), experts, weights.float())
    got = grouped_experts(x, experts, weights.bfloat16(), module.gate_up, module.down)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
