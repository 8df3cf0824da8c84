"""The fused small ops (RMSNorm, router top-k) against the model's own code, and the engine with them on.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the
`gpu` tests are the check that lets dispatch turn them on by default.
"""

import os

import pytest
import torch

from roofline.kernels import dispatch
from roofline.model.layers import rms_norm as reference_norm

pytest.importorskip("triton")
from roofline.kernels.small_ops import rms_norm, route_top_k  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
runs_here = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float32] if torch.cuda.is_available() else [torch.float16, torch.float32]


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 256), (3, 300), (96, 64), (4, 3072)])
def test_rms_norm_matches_the_model(rows, dim, dtype):
    x = torch.randn(rows, dim, device=DEVICE).to(dtype)
    w = (torch.randn(dim, device=DEVICE) * 0.1).to(dtype)
    got, want = rms_norm(x, w, 1e-6), reference_norm(x, w, 1e-6)
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@runs_here
@pytest.mark.parametrize("tokens,experts,k", [(1, 256, 8), (5, 8, 2), (3, 512, 10), (16, 200, 8)])
def test_route_top_k_matches_softmax_topk(tokens, experts, k):
    logits = torch.randn(tokens, experts, device=DEVICE)
    got_e, got_w = route_top_k(logits, k)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_e = torch.topk(probs, k, dim=-1)
    assert torch.equal(got_e, want_e)
    assert torch.allclose(got_w, want_w / want_w.sum(-1, keepdim=True), atol=1e-6)


@runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # int64 keys, int32 keys
def test_route_top_k_takes_the_lowest_index_among_equals(dtype):
    """Equal probabilities go lowest expert first: a fixed order (torch.topk's among equals is unspecified: on the
    CPU it picks experts 1, 5, 4 of the first row), and an expert masked off (-inf) is never chosen while finite
    ones remain."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 1.0], [2.0, -float("inf"), 2.0, 2.0, 0.0, 0.0],
                           [-1.0, -0.0, 0.0, -2.0, -0.0, -3.0]], device=DEVICE).to(dtype)  # -0.0 equals 0.0
    got_e, got_w = route_top_k(logits, 3)
    assert got_e.tolist() == [[1, 2, 4], [0, 2, 3], [1, 2, 4]]
    assert torch.allclose(got_w, torch.full_like(got_w, 1 / 3))


@runs_here
def test_engine_tokens_with_fused_small_ops(monkeypatch, tmp_path):
    """The pooled engine with the fused norm and router gives the reference path's greedy tokens."""
    from roofline.engine.engine import Engine
    from roofline.engine.sampling import SamplingParams
    from tiny_checkpoints import reference_model, text_config, write_variant

    cfg = text_config(eos_token_id=255)
    hf, mtp = reference_model(cfg, seed=5)
    write_variant(hf, mtp, tmp_path / "m", cfg=cfg)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [9, 8, 7]]

    def greedy(engine):
        seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in prompts]
        while engine.sequences:
            engine.step()
        return [s.output_ids for s in seqs]

    want = greedy(Engine.from_pretrained(str(tmp_path / "m"), device=DEVICE, dtype="float32", fast_path=False))
    monkeypatch.setattr(dispatch, "FUSED_SMALL_OPS", True)
    fused = Engine.from_pretrained(str(tmp_path / "m"), device=DEVICE, dtype="float32", cuda_graphs=True, max_num_seqs=2)
    assert type(fused.model.model.norm.forward).__name__ == "partial"
    assert greedy(fused) == want


@runs_here
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_attention_prologue_matches_the_model(m, merged):
    """q/k norms + partial RoPE + the KV write against GatedAttention's own modules (fp32); `merged`: qg, k, v as
    column views of the merged q/k/v projection's output (strided rows), read in place."""
    from roofline.kernels.small_ops import attention_prologue
    from roofline.model.layers import RMSNorm, RotaryEmbedding

    b, hq, hkv, d, cap = 2, 4, 2, 64, 40
    n = b * m
    qg = torch.randn(n, hq, 2 * d, device=DEVICE)
    k, v = torch.randn(n, hkv, d, device=DEVICE), torch.randn(n, hkv, d, device=DEVICE)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight = torch.nn.Parameter(torch.randn(d, device=DEVICE) * 0.1)
    k_norm.weight = torch.nn.Parameter(torch.randn(d, device=DEVICE) * 0.1)
    rotary = RotaryEmbedding(16, 1e4).to(DEVICE)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([p for start in (7, 30) for p in range(start, start + m)], device=DEVICE)
    k_cache = torch.full((3, cap, hkv, d), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    inputs = (qg, k, v)
    if merged:
        whole = torch.cat([t.reshape(n, -1) for t in inputs], dim=1)
        inputs = [part.view(t.shape) for part, t in zip(whole.split([t[0].numel() for t in inputs], dim=1), inputs)]
        assert n == 1 or not inputs[0].is_contiguous()
    q = attention_prologue(*inputs, positions, positions, slots, m, q_norm.weight, k_norm.weight, rotary.inv_freq,
                           k_cache, v_cache, 1e-6)
    with torch.no_grad():
        want_q = rotary(q_norm(qg[..., :d]), positions)
        want_k = rotary(k_norm(k), positions)
    assert torch.allclose(q, want_q, atol=1e-5)
    rows = slots.repeat_interleave(m)
    assert torch.allclose(k_cache[rows.long(), positions], want_k, atol=1e-5)
    assert torch.equal(v_cache[rows.long(), positions], v)
    written = torch.zeros(3, cap, dtype=torch.bool, device=DEVICE)
    written[rows.long(), positions] = True
    assert torch.isnan(k_cache[~written]).all(), "nothing else in the cache is written"


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_layer(dtype):
    """(x + r, norm(x + r)) as DecoderLayer computes them: the add rounded to the dtype, then the norm."""
    from roofline.kernels.small_ops import add_rms_norm

    x, r = (torch.randn(3, 300, device=DEVICE).to(dtype) for _ in range(2))
    w = (torch.randn(300, device=DEVICE) * 0.1).to(dtype)
    h, normed = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    want = reference_norm(x + r, w, 1e-6)
    assert (normed.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_a_strided_gate_up(dtype):
    from roofline.kernels.small_ops import silu_mul

    whole = torch.randn(2, 2 * 1100 + 8, device=DEVICE).to(dtype)
    gate_up = whole[:, : 2 * 1100]  # rows of a wider tensor (a merged projection's slice)
    got = silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :1100]) * gate_up[:, 1100:]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert got.shape == want.shape and (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@runs_here
def test_route_top_k_of_16_bit_logits_is_that_of_their_fp32_values():
    """16-bit logits (the model's) route on int32 keys made from their own bits: the same experts, in the same order,
    and the same weights as their exact fp32 values on int64 keys, over negative, positive and tied logits."""
    torch.manual_seed(27)
    logits = (torch.randn(4, 256, device=DEVICE) * 3).to(torch.float16)
    logits[1, 10] = logits[1, 200] = logits[1].max() + 1  # a tie at the top
    logits[2] = -logits[2].abs()  # every logit negative
    got_e, got_w = route_top_k(logits, 8)
    want_e, want_w = route_top_k(logits.float(), 8)
    assert torch.equal(got_e, want_e) and got_e[1, :2].tolist() == [10, 200]
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


@runs_here
def test_route_top_k_reads_strided_logits():
    """The router's logits as the first E columns of the merged router + shared-gate output."""
    merged = torch.randn(3, 65, device=DEVICE)
    got_e, got_w = route_top_k(merged[:, :64], 4)
    want_e, want_w = route_top_k(merged[:, :64].contiguous(), 4)
    assert torch.equal(got_e, want_e) and torch.equal(got_w, want_w)


def assert_same_routing(got, want):
    """The same experts in the same order, and their weights within fp32 rounding: the one-launch router's softmax
    runs in its GEMV's epilogue, whose exp and sum differ from route_top_k's in the last bits (an H200 showed
    equal experts and weights equal to 5 digits, not bit for bit)."""
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-12)


@runs_here
@pytest.mark.parametrize("merged", [True, False])
def test_router_gemv_routes_as_the_top_k_kernel(merged):
    """The MoE block's one-launch router (GEMV + top-k epilogue) routes exactly as the GEMV followed by
    route_top_k, with the shared expert's gate merged into the router's weight or kept apart."""
    import types

    from roofline.kernels.blocks import _route, fused_router
    from roofline.kernels.dispatch import install_weight_kernel
    from roofline.kernels.merge import Projections
    from roofline.quant import DenseWeight

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    torch.manual_seed(3)
    gate = DenseWeight(64, 256, dtype=dtype, device=DEVICE)
    gate.weight.copy_(torch.randn(64, 256))
    shared_gate = DenseWeight(1, 256, dtype=dtype if merged else torch.float32, device=DEVICE)
    shared_gate.weight.copy_(torch.randn(1, 256))
    for w in (gate, shared_gate):
        install_weight_kernel(w)
    moe = types.SimpleNamespace(gate=gate, shared_expert_gate=shared_gate, top_k=8,
                                merged={"router": Projections([gate, shared_gate], install_weight_kernel)})
    assert (moe.merged["router"].merged is not None) == merged and fused_router(moe) is not None
    x = torch.randn(2, 256, device=DEVICE).to(dtype)
    experts, weights, gate_logit = _route(moe, x)
    logits = gate(x)
    assert_same_routing((experts, weights), route_top_k(logits, 8))
    assert torch.equal(gate_logit, shared_gate(x))  # merged: the router's last output column

    # the layer's norm in the router's prologue (blocks.norm_in_gemvs), at 2 rows (one launch) and 3 (the GEMV, then
    # route_top_k), from h's per-tile sums of squares: the normed rows it writes are rms_norm's within a rounding, and
    # it routes exactly as the router on those rows (the GEMV multiplies the rows rounded to the model dtype). Not
    # compared with routing on rms_norm's own rows: these logits reach ~+-50, where one bf16 rounding of an input
    # moves a routing weight by more than any tolerance worth having (that comparison failed on an H200 in bf16).
    from roofline.kernels.fp8_gemv import NormOnLoad

    norm_w = (torch.randn(256, device=DEVICE) * 0.1).to(dtype)
    for rows in (2, 3):
        h = torch.randn(rows, 256, device=DEVICE).to(dtype)
        sumsq = torch.zeros(8, 4, device=DEVICE)
        sumsq[:, :rows] = h.float().pow(2).reshape(rows, 8, 32).sum(-1).t()
        want_normed = rms_norm(h, norm_w, 1e-6)
        norm = NormOnLoad(sumsq, norm_w, 1e-6, torch.empty_like(h))
        experts, weights, gate_logit = _route(moe, h, norm)
        assert (norm.normed.float() - want_normed.float()).abs().max() <= 1e-2 * want_normed.float().abs().max()
        want_e, want_w, want_gate = _route(moe, norm.normed)
        assert_same_routing((experts, weights), (want_e, want_w))
        assert torch.equal(gate_logit, want_gate)


@runs_here
@pytest.mark.parametrize("rows", [3, 4])
def test_router_routes_three_and_four_rows_in_one_launch(monkeypatch, rows):
    """The default ROOFLINE_ROUTER_ROWS=4: a verify step's 3-4 rows route in the GEMV's epilogue, on
    ROUTER_ROWS_CONFIG's tiles."""
    check_router_rows_config(monkeypatch, rows, "ROUTER_ROWS_CONFIG")


@runs_here
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_router_without_a_k_split_routes_as_the_top_k_kernel(monkeypatch, rows, split):
    """The default: one or two rows route on ROUTER_FEW_ROWS_CONFIG's tiles (one program per output row, no K split;
    H100, session 18: M = 1 0.018 ms faster), exactly as route_top_k on that GEMV's logits; `split`: ab_step's
    router-split (ROUTER_FEW_ROWS_CONFIG None, fp8_gemv's default split config) likewise on its tiles."""
    from roofline.kernels import blocks

    assert blocks.ROUTER_FEW_ROWS_CONFIG["SPLIT_K"] == 1 and blocks.ROUTER_FEW_ROWS_CONFIG["BN"] == 1
    if split:
        monkeypatch.setattr(blocks, "ROUTER_FEW_ROWS_CONFIG", None)
    check_router_rows_config(monkeypatch, rows, "ROUTER_FEW_ROWS_CONFIG")


def check_router_rows_config(monkeypatch, rows, config_name):
    """`_route` on `rows` rows routes in its GEMV's epilogue exactly as route_top_k on the logits of the same GEMV on
    blocks.<config_name>'s tiles; the shared expert's gate logit is the merged weight's last column."""
    import types

    from roofline.kernels import blocks
    from roofline.kernels.dispatch import install_weight_kernel
    from roofline.kernels.fp8_gemv import dense_matmul
    from roofline.kernels.merge import Projections
    from roofline.quant import DenseWeight

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    torch.manual_seed(rows)
    gate, shared_gate = DenseWeight(64, 256, dtype=dtype, device=DEVICE), DenseWeight(1, 256, dtype=dtype, device=DEVICE)
    for w in (gate, shared_gate):
        w.weight.copy_(torch.randn(w.weight.shape))
        install_weight_kernel(w)
    moe = types.SimpleNamespace(gate=gate, shared_expert_gate=shared_gate, top_k=8,
                                merged={"router": Projections([gate, shared_gate], install_weight_kernel)})
    x = torch.randn(rows, 256, device=DEVICE).to(dtype)
    monkeypatch.setattr(blocks, "FUSED_ROUTE_ROWS", 4)
    experts, weights, gate_logit = blocks._route(moe, x)
    logits = dense_matmul(x, moe.merged["router"].merged.weight, config=getattr(blocks, config_name))
    assert_same_routing((experts, weights), route_top_k(logits[:, :64], 8))
    assert torch.equal(gate_logit, logits[:, 64:])
