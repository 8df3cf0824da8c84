"""Every decode kernel against its plain-PyTorch reference on fresh random inputs.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before
Triton is imported) at small sizes in fp16/fp32 (the interpreter computes bf16 wrongly); with
CUDA the `gpu` tests run them compiled, at Qwen3.5-122B-A10B sizes, in bf16. Outputs start as
NaN so an element a kernel forgets to write fails the comparison; sizes include ones that are
not multiples of the block sizes. The references are tied to the model's own layer code by the
`*_matches_model` tests.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from roofline.kernels import _common, gdn_decode as gdn_decode_module  # noqa: E402
from roofline.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from roofline.kernels.fp8_gemv import dense_matmul, fp8_matmul, fp8_matmul_reference, router_top_k  # noqa: E402
from roofline.engine.cache import conv_ring_rows, step_record_size  # noqa: E402
from roofline.kernels.gdn_decode import gdn_decode, gdn_decode_reference, gdn_replay  # noqa: E402
from roofline.kernels.int4_experts import (  # noqa: E402
    experts_down,
    experts_down_reference,
    experts_gate_up,
    experts_gate_up_reference,
)
from roofline.kernels.int4_gemv import int4_matmul, int4_matmul_reference  # noqa: E402
from roofline.quant.fp8 import quantize_fp8_block  # noqa: E402
from roofline.quant.int4 import Int4Weight, pack_cols, quantize_int4  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run where CUDA is absent (or with TRITON_INTERPRET=1)")
gpu = pytest.mark.gpu
GPU = "cuda"


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), "NaN in the output: an element was not written"
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def nan_like(t):
    return torch.full_like(t, float("nan"))


def random_int4(n, k, group, sym, device="cpu", experts=0):
    """Random GPTQ tensors (random bits, scales ~ 1/64, zeros 8 or random) without quantising a real weight."""
    lead = (experts,) if experts else ()
    qweight = torch.randint(-(2**31), 2**31 - 1, (*lead, k // 8, n), dtype=torch.int32, device=device)
    if sym:
        zeros = torch.full((*lead, k // group, n), 7, dtype=torch.int32, device=device)
    else:
        zeros = torch.randint(0, 15, (*lead, k // group, n), dtype=torch.int32, device=device)
    qzeros = pack_cols(zeros.cpu()).to(device)
    scales = (torch.rand(*lead, k // group, n, device=device) * 0.03 + 0.001).half()
    return qweight, qzeros, scales


def assert_counters_zero():
    for (user, *_), buf in _common._COUNTERS.items():
        assert int(buf.abs().sum()) == 0, f"{user}: arrival counters not reset"


def test_counter_space_gives_second_stream_kernels_their_own_counters():
    main = _common.counters_for("test_user", 8, "cpu")
    with _common.counter_space("side"):
        side = _common.counters_for("test_user", 8, "cpu")
        assert side.data_ptr() != main.data_ptr()
        assert _common.counters_for("test_user", 8, "cpu").data_ptr() == side.data_ptr()
    assert _common.counters_for("test_user", 8, "cpu").data_ptr() == main.data_ptr()


def test_a_grown_counter_buffer_stays_alive():
    """A kernel whose counters grow with the batch (grouped experts: tiles x pairs) gets a larger buffer; the old one
    must outlive the swap, since a CUDA graph captured on it (a smaller batch's bucket) keeps its address."""
    import gc
    import weakref

    small = _common.counters_for("test_grow", 8, "cpu")
    old = weakref.ref(small)
    del small
    big = _common.counters_for("test_grow", 5000, "cpu")
    gc.collect()
    assert big.numel() >= 5000 and old() is not None and old().data_ptr() != big.data_ptr()


# ---------------------------------------------------------------- INT4 GEMV


def check_int4(m, n, k, group, sym, dtype, device, config=None, tol=1e-2):
    torch.manual_seed(1000 * m + n + k)
    qweight, qzeros, scales = random_int4(n, k, group, sym, device)
    x = torch.randn(m, k, device=device).to(dtype)
    out = nan_like(torch.empty(m, n, dtype=dtype, device=device))
    y = int4_matmul(x, qweight, qzeros, scales, group, sym=sym, out=out, config=config)
    ref = int4_matmul_reference(x, qweight, qzeros, scales, group)
    assert rel_err(y, ref) < tol
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("m,n,k,group,sym,config", [
    (1, 40, 256, 128, True, None),                    # N not a multiple of the tile
    (2, 72, 384, 64, False, {"SPLIT_K": 2}),          # split K, asymmetric zeros
    (3, 24, 512, 32, False, {"SPLIT_K": 3}),          # 3 rows on the lanes path, uneven split
    (4, 136, 256, 256, True, {"mma": True}),          # tensor-core path, group larger than a step
    (3, 48, 384, 128, False, {"mma": True, "SPLIT_K": 2}),
])
def test_int4_matmul_interpreter(m, n, k, group, sym, config):
    check_int4(m, n, k, group, sym, torch.float32 if m % 2 else torch.float16, "cpu", config, tol=2e-3)


@cpu
@pytest.mark.parametrize("m,n,k,sym,config", [
    (1, 64, 256, True, {"tc": True}),                           # one column tile per warp, 2 groups on 2 warp rows
    (2, 96, 384, False, {"tc": True, "SPLIT_K": 2}),            # asymmetric zeros, split K, KW lowered to divide 3 groups
    (4, 64, 512, True, {"tc": True, "KW": 1, "SPLIT_K": 3}),    # uneven split (odd number of steps in a split)
    (3, 64, 256, False, {"tc": True, "WN": 2, "KW": 1}),        # two 32-column blocks per program
    (2, 64, 768, False, {"tc": True, "KW": 1, "SPLIT_K": 1}),   # 6 steps in one program: the loop runs 3 times
    (3, 64, 640, False, {"tc": True, "KW": 1, "SPLIT_K": 2, "depth": 1}),  # one-buffer loop, 3 and 2 steps a split
    (1, 64, 512, True, {"tc": True, "KW": 2, "depth": 1}),      # one-buffer loop, two warp rows
    (1, 96, 640, False, {"tc": True, "KW": 1, "SPLIT_K": 5, "depth": 1}),  # one row: its splits summed on every lane
    (3, 96, 1024, False, {"tc": True, "WN": 1, "KW": 4, "SPLIT_K": 1, "depth": 1}),  # no_split_config (verify rows)
    (4, 64, 512, True, {"tc": True, "WN": 1, "KW": 4, "SPLIT_K": 1, "depth": 1}),    # ... at four rows
])
def test_int4_tc_interpreter(m, n, k, sym, config):
    """The tensor-core path (int4_tc) with its per-thread asm emulated in plain Triton: loads, column map, split K."""
    check_int4(m, n, k, 128, sym, torch.float16, "cpu", config, tol=2e-3)


@pytest.mark.parametrize("bf16", [True, False])
def test_int4_tc_asm_fragments(bf16):
    """int4_tc's PTX, run lane by lane in numpy (mma.m16n8k16 fragment layout from the PTX ISA), is the plain formula."""
    np = pytest.importorskip("numpy")
    from roofline.kernels.int4_tc import simulate_group_asm

    rng = np.random.default_rng(7)
    mb = 128.0 if bf16 else 1024.0
    w = rng.integers(0, 16, size=(128, 32))  # one group: [k, column]
    x = torch.randn(8, 128).to(torch.bfloat16 if bf16 else torch.float16)
    bits = x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    q = np.zeros((4, 8, 4, 4), np.int64)
    xr = np.zeros((4, 8, 4, 4), np.int64)
    for s in range(4):
        for g in range(8):
            for t in range(4):
                kp = 4 * s + t
                for v in range(4):
                    q[s, g, t, v] = sum(int(w[8 * kp + j, 4 * g + v]) << (4 * j) for j in range(8))
                    xr[s, g, t, v] = int(bits[g, 8 * kp + 2 * v]) | (int(bits[g, 8 * kp + 2 * v + 1]) << 16)
    q = np.where(q >= 2**31, q - 2**32, q).astype(np.int32)
    xr = np.where(xr >= 2**31, xr - 2**32, xr).astype(np.int32)
    scale = rng.random(32).astype(np.float32) * 0.1
    zero = rng.integers(1, 17, size=32).astype(np.float32)
    cols = 4 * np.arange(8)[:, None, None] + np.arange(4)[None, None, :] + 0 * np.arange(4)[None, :, None]  # [g, t, v]
    sz = np.stack([scale[cols], -(mb + zero[cols])]).astype(np.float32)
    y = rng.standard_normal((2, 8, 4, 4)).astype(np.float32)
    out = simulate_group_asm(q, xr, sz, y, bf16)
    ref = x.float().numpy() @ ((w - zero) * scale)  # [token, column]
    expect = y.copy()
    tok = 2 * np.arange(4)[None, :, None] + 0 * cols  # token 2t (+1 for h = 1)
    expect[0] += ref[tok, cols]
    expect[1] += ref[tok + 1, cols]
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-4 * np.abs(ref).max())


def check_repacked(n, k, e, h, i, dtype, device, tol, depth=2):
    """The tc kernels on block-repacked weights (quant.int4.block_qweight, config "qblk"): GEMV, gate_up, down;
    `depth` 1: tc_groups' one-buffer loop."""
    from roofline.quant.int4 import block_qweight

    torch.manual_seed(11)
    qw, qz, sc = random_int4(n, k, 128, False, device)
    x = torch.randn(3, k, device=device).to(dtype)
    y = int4_matmul(x, block_qweight(qw), qz, sc, 128, sym=False, config={"tc": True, "qblk": True, "WN": 2, "SPLIT_K": 2,
                                                                     "depth": depth})
    assert rel_err(y, int4_matmul_reference(x, qw, qz, sc, 128)) < tol
    topk, t = 3, 2
    gate_up = random_int4(2 * i, h, 128, True, device, e)
    down = random_int4(h, i, 128, True, device, e)
    x = torch.randn(t, h, device=device).to(dtype)
    ids = torch.stack([torch.randperm(e, device=device)[:topk] for _ in range(t)])
    w = torch.softmax(torch.randn(t, topk, device=device), -1).to(dtype)
    cfg = {"tc": True, "qblk": True, "depth": depth}
    act = experts_gate_up(x, ids, block_qweight(gate_up[0]), gate_up[1], gate_up[2], 128, config=cfg)
    act_ref = experts_gate_up_reference(x, ids, *gate_up, 128)
    assert rel_err(act, act_ref) < tol
    out = experts_down(act_ref, ids, w, block_qweight(down[0]), down[1], down[2], 128, config=cfg)
    assert rel_err(out, experts_down_reference(act_ref, ids, w, *down, 128)) < tol


@cpu
@pytest.mark.parametrize("depth", [2, 1])
def test_int4_tc_repacked_interpreter(depth):
    check_repacked(128, 384, 6, 256, 128, torch.float16, "cpu", 2e-3, depth)


@gpu
@pytest.mark.parametrize("depth", [2, 1])
def test_int4_tc_repacked_gpu(depth):
    check_repacked(12288, 3072, 32, 3072, 1024, torch.bfloat16, GPU, 1e-2, depth)


def test_int4_tc_asm_layout():
    """Compiled for sm_90 and the DGX Spark's sm_121 (no GPU needed), every inline-asm operand of the tc kernels has its
    lanes along the tile rows.

    Runs in a subprocess without TRITON_INTERPRET (the interpreter replaces @triton.jit functions).
    """
    compile_only("from roofline.kernels.int4_tc import check_asm_layouts; p = check_asm_layouts(90) + check_asm_layouts(121); "
                 "print(p); assert not p")


def test_fast_path_kernels_compile_for_the_h200_and_the_dgx_spark():
    """Compiled without a GPU as the JIT would (aligned pointers), every fast-path kernel at its GPU configuration
    builds for sm_90 and for the DGX Spark's sm_121 within a block's shared memory there (~99 KB against 227); a
    configuration that needs more (attention's 64-key tiles in 3 stages) is reported for sm_121 alone. The verify
    rows' attention tile takes 3 pipeline stages on sm_90 and 2 on sm_121, and both fit."""
    out = compile_only("""
from roofline.kernels import targets
print(targets.check_targets((90, 121)))
print([(arch, c[0]) for arch in (90, 121) for c in targets._cases(arch) if c[0].startswith("decode attention M=4")])
name, fn, consts, *rest = [c for c in targets._cases(90) if c[0].startswith("decode attention M=1")][0]
targets._cases = lambda arch: [(name, fn, {**consts, "BT": 64}, rest[0], rest[1], 8, 3)]
print(targets.check_targets((90, 121)))
""")
    clean, wide, oversized = out.strip().splitlines()[-3:]
    assert clean == "[]", clean
    assert wide == str([(90, "decode attention M=4 (3 stages)"), (121, "decode attention M=4 (2 stages)")]), wide
    assert "sm_121 decode attention M=1" in oversized and "sm_90" not in oversized, oversized


def test_decode_attention_pipeline_stages_by_shared_memory(monkeypatch):
    """3 K/V stages where a block holds them: the one-token tile and the 2-token (32-row) tile everywhere, the 3-4
    token (64-row) tile only with more than a GB10 block's ~99 KB; WIDE_TILE_STAGES = 2 is the rule before."""
    from roofline.kernels import decode_attention as da

    hopper, gb10 = 227 * 1024, 99 * 1024
    assert [da.pipeline_stages(bq, hopper) for bq in (16, 32, 64)] == [3, 3, 3]
    assert [da.pipeline_stages(bq, gb10) for bq in (16, 32, 64)] == [3, 3, 2]
    monkeypatch.setattr(da, "WIDE_TILE_STAGES", 2)
    assert [da.pipeline_stages(bq, hopper) for bq in (16, 32, 64)] == [3, 2, 2]


def compile_only(code: str) -> str:
    """Run `code` in a subprocess without TRITON_INTERPRET (the interpreter replaces @triton.jit functions, so
    compiling for a GPU target needs it off) and return its output; skip where Triton has no CUDA toolchain."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode and ("ptxas" in res.stderr or "No such file" in res.stderr):
        pytest.skip(f"no CUDA compiler toolchain for Triton here: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


@gpu
@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(12288, 3072), (3072, 8192), (512, 3072), (3080, 1024)])
def test_int4_matmul_gpu(m, n, k, tc):
    check_int4(m, n, k, 128, True, torch.bfloat16, GPU, config={"tc": tc})


@gpu
@pytest.mark.parametrize("config", [None, {"mma": True}, {"tc": True}, {"tc": True, "WN": 2, "KW": 2, "SPLIT_K": 5},
                                    {"tc": True, "SPLIT_K": 1}])
@pytest.mark.parametrize("m", [1, 4])
def test_int4_matmul_gpu_paths(m, config):
    """Default config (the int4_tc path), the lanes path's tensor-core variant, and the int4_tc path (split K, and
    all 24 steps in one program), asymmetric zeros."""
    check_int4(m, 8192, 3072, 128, False, torch.bfloat16, GPU, config=config)


@gpu
@pytest.mark.parametrize("m", [1, 3])
def test_int4_matmul_gpu_fp16(m):
    check_int4(m, 4096, 3072, 128, False, torch.float16, GPU, config={"tc": True})


# ---------------------------------------------------------------- grouped INT4 experts


def check_experts(t, experts, hidden, inter, topk, group, dtype, device, config=None, tol=1e-2, extra=False):
    torch.manual_seed(t * 7 + experts)
    gate_up = random_int4(2 * inter, hidden, group, False, device, experts)
    down = random_int4(hidden, inter, group, True, device, experts)
    x = torch.randn(t, hidden, device=device).to(dtype)
    ids = torch.stack([torch.randperm(experts, device=device)[:topk] for _ in range(t)])
    if t >= 3:
        ids[1] = ids[0].flip(0)  # two tokens with the same experts (an MTP verify batch often shares)
        others = torch.randperm(experts, device=device)
        others = others[others != ids[0, 0]][: topk - 1]
        ids[2] = torch.cat([ids[0, :1], others])  # and a third sharing one of them
    weights = torch.softmax(torch.randn(t, topk, device=device), -1).to(dtype)
    act = experts_gate_up(x, ids, *gate_up, group, out=nan_like(torch.empty(t, topk, inter, dtype=dtype, device=device)),
                          config=config)
    act_ref = experts_gate_up_reference(x, ids, *gate_up, group)
    assert rel_err(act, act_ref) < tol
    terms = {}
    if extra:  # the MoE block's epilogue: + sigmoid(gate) * shared + residual; the gate a strided column of router logits
        logits = torch.randn(t, experts + 1, device=device).to(dtype)
        terms = {"shared": torch.randn(t, hidden, device=device).to(dtype), "shared_gate": logits[:, experts:],
                 "residual": torch.randn(t, hidden, device=device).to(dtype)}
    out = experts_down(act_ref, ids, weights, *down, group, out=nan_like(torch.empty(t, hidden, dtype=dtype, device=device)),
                       config=config, **terms)
    want = experts_down_reference(act_ref, ids, weights, *down, group)
    if extra:  # as SparseMoE.forward and DecoderLayer.forward compute it
        want = terms["residual"] + (want + terms["shared"] * torch.sigmoid(terms["shared_gate"]))
    assert rel_err(out, want) < tol
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("t,config", [
    (1, None),
    (3, {"SPLIT_K": 2}),                 # shared experts among tokens, split K (tensor-core path)
    (3, {"mma": False, "SPLIT_K": 2}),   # the same on the lanes path (up to 4 token rows)
    (5, None),                           # 16-token chunks
    (2, {"mma": False}),
    (6, {"mma": False}),                 # two chunks of 4, the second with 2 tokens (no programs for the absent 2)
])
def test_experts_interpreter(t, config):
    check_experts(t, 6, 64, 48, 3, 16, torch.float32 if t % 2 else torch.float16, "cpu", config, tol=2e-3)


@cpu
@pytest.mark.parametrize("t,config", [(2, {"mma": False, "SPLIT_K": 2}), (2, {"tc": True, "SPLIT_K": 2})])
def test_experts_down_adds_shared_and_residual_interpreter(t, config):
    """experts_down's epilogue (the fused MoE block): sigmoid(gate) * shared + residual, lanes and tc paths."""
    check_experts(t, 6, 256, 128, 3, 128, torch.float16, "cpu", config, tol=2e-3, extra=True)


@cpu
@pytest.mark.parametrize("t,config", [
    (1, {"tc": True}),
    (3, {"tc": True, "SPLIT_K": 2}),   # shared experts among tokens, split K
    (3, {"tc": True, "SPLIT_K": 2, "depth": 1}),  # the one-buffer loop
])
def test_experts_tc_interpreter(t, config):
    """The grouped experts on the int4_tc path (group 128, fp16), asm emulated."""
    check_experts(t, 6, 256, 128, 3, 128, torch.float16, "cpu", config, tol=2e-3)


@gpu
@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 12])
def test_experts_gpu(t, tc):
    check_experts(t, 256, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"tc": tc})


def test_wide_gemvs_of_several_rows_take_the_one_buffer_loop(monkeypatch):
    """On the GPU every one-row call takes the one-buffer loop at 6 programs per SM, and so do the GEMVs of 2..4 rows
    over wide weights (the 122B verify step's merged in_proj_qkv+z and attention q/k/v) where they keep a K split
    (NO_SPLIT_MAX_ROWS lowered: ab_step's int4-split-verify); out_proj-sized GEMVs at several tokens keep the
    two-buffer loop, which the run-11b sweep had faster there. The experts kernels take the one-buffer loop at every
    token count over block-repacked weights (int4_experts.ROWS_DEPTH, session 39), the two-buffer one at several
    tokens in GPTQ order, with ROWS_DEPTH = 2, or with ROOFLINE_INT4_DEPTH=2."""
    from roofline.kernels import int4_experts, int4_tc

    monkeypatch.setattr(int4_tc, "INTERPRET", False)
    monkeypatch.setattr(int4_experts, "INTERPRET", False)
    blocked = {"qblk": True}  # dispatch.int4_config of a block-repacked weight
    for t in (1, 2, 3, 4):
        for down in (False, True):
            assert int4_experts._tc_expert_config(t, blocked, down=down)["depth"] == 1, (t, down)
            assert ("depth" in int4_experts._tc_expert_config(t, None, down=down)) == (t == 1), (t, down)  # GPTQ order
    monkeypatch.setattr(int4_experts, "ROWS_DEPTH", 2)  # ab_step's experts-rows-depth-2
    assert "depth" not in int4_experts._tc_expert_config(3, blocked) and int4_experts._tc_expert_config(1, blocked)["depth"] == 1
    monkeypatch.setattr(int4_experts, "ROWS_DEPTH", 1)
    monkeypatch.setattr(int4_tc, "INT4_DEPTH", 2)  # ROOFLINE_INT4_DEPTH=2: the two-buffer loop everywhere
    assert "depth" not in int4_experts._tc_expert_config(3, blocked) and "depth" not in int4_experts._tc_expert_config(1, blocked)
    monkeypatch.setattr(int4_tc, "INT4_DEPTH", 1)
    one_buffer = {"WN": 4, "KW": 1, "programs_per_sm": 6.0, "depth": 1}
    for n in (3072, 20480, 17408):
        assert int4_tc.default_tc_config(1, n, 3072) == one_buffer, n
    assert "depth" not in int4_tc.default_tc_config(3, 3072, 8192)  # out_proj
    assert int4_tc.one_buffer_loop(1) and not int4_tc.one_buffer_loop(3)  # the experts pass no width
    monkeypatch.setattr(int4_tc, "NO_SPLIT_MAX_ROWS", 1)
    for m, n in [(3, 20480), (4, 17408), (2, 12288)]:
        assert int4_tc.default_tc_config(m, n, 3072) == one_buffer, (m, n)
    monkeypatch.setattr(int4_tc, "WIDE_TILES", None)  # ROOFLINE_INT4_DEPTH=one-row
    assert "depth" not in int4_tc.default_tc_config(3, 20480, 3072) and int4_tc.one_buffer_loop(1)


def test_the_verify_rows_wide_gemvs_run_without_a_k_split(monkeypatch):
    """GEMVs of 2..4 rows over >= 8192 columns (the verify step's merged in_proj_qkv+z and attention q/k/v) run one
    program per 32 columns over the whole K, 4 warps splitting K (H100, session 18: M = 3 0.029 ms faster); one-row
    calls, narrower GEMVs and the experts kernels keep their K splits; NO_SPLIT_MAX_ROWS = 1 (ab_step's
    int4-split-verify) turns it off."""
    from roofline.kernels import int4_experts, int4_tc

    monkeypatch.setattr(int4_tc, "INTERPRET", False)
    monkeypatch.setattr(int4_experts, "INTERPRET", False)
    no_split = {"WN": 1, "KW": 4, "SPLIT_K": 1, "depth": 1}
    for m, n in [(2, 20480), (3, 20480), (4, 17408), (3, 8192)]:
        assert int4_tc.default_tc_config(m, n, 3072) == no_split, (m, n)
    a, b = int4_tc.default_tc_config(3, 20480, 3072), int4_tc.default_tc_config(3, 20480, 3072)
    assert a is not b  # a fresh dict each call: tc_geometry lowers KW in it
    for m, n in [(1, 20480), (1, 17408), (3, 3072), (3, 4096), (5, 20480)]:
        assert int4_tc.no_split_config(m, n) is None and int4_tc.default_tc_config(m, n, 3072) != no_split, (m, n)
    assert int4_experts._tc_expert_config(1, None) == {"WN": 1, "KW": 1, "SPLIT_K": 8, "depth": 1}
    assert int4_experts._tc_expert_config(3, None)["WN"] == 2 and int4_experts._tc_expert_config(1, None, down=True)["KW"] == 1
    monkeypatch.setattr(int4_tc, "NO_SPLIT_MAX_ROWS", 1)
    assert int4_tc.no_split_config(3, 20480) is None and int4_tc.default_tc_config(3, 20480, 3072)["WN"] == 4


@gpu
def test_no_split_config_gpu():
    """The verify rows' no-split config at real sizes: the merged in_proj_qkv+z at two to four rows, as
    default_tc_config picks it."""
    from roofline.kernels.int4_tc import default_tc_config

    for m in (2, 3, 4):
        assert default_tc_config(m, 20480, 3072)["SPLIT_K"] == 1
        check_int4(m, 20480, 3072, 128, True, torch.bfloat16, GPU, config={"tc": True})


@gpu
@pytest.mark.parametrize("t", [1, 3])
def test_one_buffer_loop_gpu(t):
    """tc_groups' DEPTH=1 loop (the default at one row) at real sizes: GEMV (odd steps per split) and experts."""
    check_int4(t, 12288, 3072, 128, True, torch.bfloat16, GPU, config={"tc": True, "depth": 1, "SPLIT_K": 5})
    check_experts(t, 256, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"tc": True, "depth": 1})


@gpu
def test_experts_gpu_split_and_mma():
    check_experts(4, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"mma": True, "SPLIT_K": 3})
    check_experts(3, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"mma": False, "SPLIT_K": 1})
    check_experts(4, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"mma": False})
    check_experts(1, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"tc": False})
    check_experts(3, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, config={"tc": True, "WN": 4, "KW": 2, "SPLIT_K": 1})
    check_experts(16, 64, 3072, 1024, 8, 128, torch.float16, GPU, config={"tc": True, "WN": 1, "KW": 4, "SPLIT_K": 5})
    for t in (1, 4):  # the fused MoE block's epilogue at real sizes, default configs
        check_experts(t, 64, 3072, 1024, 8, 128, torch.bfloat16, GPU, extra=True)


def test_experts_reference_matches_model():
    """experts_down(experts_gate_up(x)) is the model's Experts.forward on the same INT4 weights."""
    from roofline.model.layers import Experts

    torch.manual_seed(3)
    e, h, i, topk, group = 5, 64, 32, 2, 32
    mod = Experts(e, h, i)
    mod.gate_up = Int4Weight(2 * i, h, e, group_size=group)
    mod.down = Int4Weight(h, i, e, group_size=group)
    for j in range(e):
        for fmt, rows, cols in ((mod.gate_up, 2 * i, h), (mod.down, h, i)):
            packed = quantize_int4(torch.randn(rows, cols), group)
            fmt.qweight[j], fmt.qzeros[j], fmt.scales[j] = packed["qweight"], packed["qzeros"], packed["scales"]
    x = torch.randn(3, h)
    ids = torch.stack([torch.randperm(e)[:topk] for _ in range(3)])
    w = torch.softmax(torch.randn(3, topk), -1)
    ref = mod(x, ids, w)
    act = experts_gate_up_reference(x, ids, mod.gate_up.qweight, mod.gate_up.qzeros, mod.gate_up.scales, group)
    ours = experts_down_reference(act, ids, w, mod.down.qweight, mod.down.qzeros, mod.down.scales, group)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- block FP8


def check_fp8(m, n, k, block, dtype, device, config=None, tol=1e-2):
    torch.manual_seed(m + n + k)
    q, s = quantize_fp8_block(torch.randn(n, k), block)
    q, s = q.to(device), s.to(device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = fp8_matmul(x, q, s, block, out=nan_like(torch.empty(m, n, dtype=dtype, device=device)), config=config)
    assert rel_err(y, fp8_matmul_reference(x, q, s, block)) < tol
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("m,n,k,block,config", [
    (1, 40, 200, (32, 32), None),
    (3, 72, 384, (16, 64), {"SPLIT_K": 2}),
    (4, 50, 130, (32, 32), {"SPLIT_K": 3}),
    (2, 24, 256, (128, 128), None),
    (3, 40, 200, (16, 32), {"BK": 64, "SPLIT_K": 2}),  # a tile spanning two scale blocks along K
    (2, 16, 1100, (128, 128), {"BN": 4, "BK": 512, "SPLIT_K": 2}),  # the small-FP8 default's tile, K not a multiple
])
def test_fp8_matmul_interpreter(m, n, k, block, config):
    check_fp8(m, n, k, block, torch.float32 if m % 2 else torch.float16, "cpu", config, tol=2e-3)


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(2048, 3072), (3072, 1024), (1000, 3000)])
def test_fp8_matmul_gpu(m, n, k):
    check_fp8(m, n, k, (128, 128), torch.bfloat16, GPU)


@gpu
@pytest.mark.parametrize("config", [{"BK": 256, "num_warps": 1}, {"BN": 4, "BK": 512, "num_warps": 2, "SPLIT_K": 3}])
@pytest.mark.parametrize("m", [1, 4])
def test_fp8_matmul_gpu_wide_tiles(m, config):
    """Tiles wider than a scale block along K (the sweep's candidates), K not a multiple of the tile."""
    check_fp8(m, 2048, 3072 + 128, (128, 128), torch.bfloat16, GPU, config)


def check_grouped_dense(t, top_k, n, k, dtype, device, config=None):
    """Routed 16-bit experts read in place: each pair's row equals the plain GEMV (dense_matmul) on its token's row and
    its expert's weight, bit for bit at the same K split; the down GEMV taking silu * up on load likewise; the MoE
    experts' forward through them matches the model's loop over experts."""
    from roofline.kernels.dispatch import _dense_experts
    from roofline.kernels.fp8_gemv import grouped_dense_matmul
    from roofline.kernels.small_ops import silu_mul
    from roofline.model.layers import Experts
    from roofline.quant import DenseWeight

    torch.manual_seed(t + n + k)
    e = 2 * top_k + 2  # more experts than choices: each row routes to top_k distinct ones
    gate_up_w = torch.randn(e, 2 * n, k, device=device).to(dtype)
    down_w = torch.randn(e, k, n, device=device).to(dtype)
    x = torch.randn(t, k, device=device).to(dtype)
    ids = torch.stack([torch.randperm(e, device=device)[:top_k] for _ in range(t)])
    assert ids.shape == (t, top_k)
    cfg = {"SPLIT_K": 2, **(config or {})}
    gu = grouped_dense_matmul(x, gate_up_w, ids, config=cfg)
    down = grouped_dense_matmul(gu, down_w, ids, gated=True, config=cfg)
    for p, expert in enumerate(ids.reshape(-1).tolist()):
        assert torch.equal(gu[p], dense_matmul(x[p // top_k : p // top_k + 1], gate_up_w[expert], config=cfg)[0])
        assert torch.equal(down[p], dense_matmul(silu_mul(gu[p : p + 1]), down_w[expert], config=cfg)[0])
    assert_counters_zero()

    experts = Experts(e, k, n)
    experts.gate_up, experts.down = DenseWeight(2 * n, k, e, dtype=dtype), DenseWeight(k, n, e, dtype=dtype)
    experts.gate_up.weight, experts.down.weight = gate_up_w, down_w
    weights = torch.softmax(torch.randn(t, top_k, device=device), -1).to(dtype)
    want = Experts.forward(experts, x.float(), ids, weights.float())  # fp32: the roundings apart, the same sum
    assert rel_err(_dense_experts(experts, x, ids, weights), want) < 2e-2


@cpu
@pytest.mark.parametrize("t,top_k,n,k", [(1, 4, 24, 64), (3, 2, 40, 96)])
def test_grouped_dense_experts_interpreter(t, top_k, n, k):
    check_grouped_dense(t, top_k, n, k, torch.float16, "cpu")


@gpu
@pytest.mark.parametrize("t", [1, 3])
def test_grouped_dense_experts_gpu(t):
    """The MTP head's BF16 experts at the 122B's shapes (I = 1024, H = 3072, top 8)."""
    check_grouped_dense(t, 8, 1024, 3072, torch.bfloat16, GPU, {"SPLIT_K": 1})


FP8_GEMV_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from roofline.kernels.fp8_gemv import _fp8_gemv_kernel as fn

pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
            "ids_ptr": "*i64"}
for grouped in (False, True):
    consts = {"SBN": 128, "SBK": 128, "BM": 1, "BN": 8, "BK": 128, "SPLITP": 4, "HAS_SCALE": False, "PDL": True, "TOPK": 0,
              "KP": 1, "BE": 1, "NORM": False, "NORM_OUT": False, "NTP": 1, "GATED": False, "GROUPED": grouped, "eps": 0.0,
              "experts_ptr": None, "weights_ptr": None, "ss_ptr": None, "nw_ptr": None, "normed_ptr": None}
    if not grouped:
        consts["ids_ptr"] = None
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 1, "num_stages": 1}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    print(grouped, wait > 0, "ld.global" in ptx[:wait])
"""


def test_grouped_gemv_reads_the_routing_after_the_pdl_wait():
    """Compiled for sm_90 (no GPU needed): under programmatic dependent launch the plain GEMV issues its first weight
    load before waiting for the previous kernel, but the grouped one (routed experts) loads nothing before the wait:
    its expert ids may come from the kernel just before, and the weight address depends on them."""
    out = compile_only(FP8_GEMV_PTX)
    assert out.split("\n")[:2] == ["False True True", "True True False"], out


def check_dense(m, n, k, dtype, device, tol):
    torch.manual_seed(m + n)
    w = torch.randn(n, k, device=device).to(dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    y = dense_matmul(x, w, out=nan_like(torch.empty(m, n, dtype=dtype, device=device)))
    assert rel_err(y, (x.float() @ w.float().t()).to(dtype)) < tol
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("m,n,k", [(1, 65, 256), (3, 129, 200)])  # the router + shared gate's 2^k + 1 rows
def test_dense_matmul_interpreter(m, n, k):
    check_dense(m, n, k, torch.float16, "cpu", 2e-3)


@gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n", [128, 257, 1024])  # GDN b/a merged, router + shared gate, the largest taken
def test_dense_matmul_gpu(m, n):
    check_dense(m, n, 3072, torch.bfloat16, GPU, 1e-2)


def check_residual_and_norm(m, n, k, fp8, dtype, device, config=None, tol=1e-2):
    """The layer's add and norm spread over two kernels (blocks.norm_in_gemvs): the INT4 out projection adds the
    residual and writes per-tile sums of squares (h bit for bit as add_rms_norm's, the sums as h's); the GEMV
    that norms on load gives the normed rows within one rounding of add_rms_norm's and the output of the GEMV on
    them; the router routes its own logits."""
    from roofline.kernels.fp8_gemv import NormOnLoad
    from roofline.kernels.int4_tc import int4_matmul_residual
    from roofline.kernels.small_ops import add_rms_norm

    torch.manual_seed(m + n + k)
    hidden = 256
    qweight, qzeros, scales = random_int4(hidden, k, 128, False, device)
    core, res = torch.randn(m, k, device=device).to(dtype), torch.randn(m, hidden, device=device).to(dtype)
    cfg = {"tc": True, **(config or {})}
    h, sumsq = int4_matmul_residual(core, qweight, qzeros, scales, res, sym=False, config=cfg)
    mixer_out = int4_matmul(core, qweight, qzeros, scales, 128, sym=False, config=cfg)
    norm_w = (torch.randn(hidden, device=device) * 0.1).to(dtype)
    want_h, want_normed = add_rms_norm(mixer_out, res, norm_w, 1e-6)
    assert torch.equal(h, want_h)
    tiles = h.float().pow(2).reshape(m, sumsq.shape[0], -1).sum(-1).t()  # [tiles, m]
    torch.testing.assert_close(sumsq[:, :m], tiles, rtol=1e-5, atol=1e-5)

    w = torch.randn(n, hidden)
    weight, scale = quantize_fp8_block(w, (128, 128)) if fp8 else (w.to(dtype), None)
    weight, scale = weight.to(device), None if scale is None else scale.to(device)
    normed = nan_like(torch.empty(m, hidden, dtype=dtype, device=device))
    y = fp8_matmul(h, weight, scale, (128, 128), norm=NormOnLoad(sumsq, norm_w, 1e-6, normed))
    assert rel_err(normed, want_normed) < 1e-2
    assert rel_err(y, fp8_matmul(normed, weight, scale, (128, 128))) < tol
    assert torch.equal(fp8_matmul(h, weight, scale, (128, 128), norm=NormOnLoad(sumsq, norm_w, 1e-6)), y)
    logits, chosen, _ = router_top_k(h, weight, scale, (128, 128), n - 1, 2, norm=NormOnLoad(sumsq, norm_w, 1e-6))
    assert torch.equal(logits, y)
    probs = torch.softmax(y[:, : n - 1].float(), -1)  # 16-bit logits tie: compare the chosen probabilities
    assert torch.equal(probs.gather(1, chosen), torch.topk(probs, 2, -1).values)
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("m,n,k,fp8,config", [
    (1, 33, 256, False, None),  # split K
    (1, 9, 640, False, {"KW": 1, "SPLIT_K": 5}),  # one row, 5 splits: the one-row sum (int4_tc.ONE_ROW_FLAT_SUM)
    (3, 17, 384, True, {"SPLIT_K": 1}),  # every program writes its tile's output
    (4, 24, 256, False, {"KW": 1, "SPLIT_K": 2}),
])
def test_residual_and_norm_on_load_interpreter(m, n, k, fp8, config):
    check_residual_and_norm(m, n, k, fp8, torch.float16, "cpu", config)


@gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,fp8", [(257, False), (2048, True)])  # the 122B's router + shared gate, shared gate_up
def test_residual_and_norm_on_load_gpu(m, n, fp8):
    check_residual_and_norm(m, n, 8192, fp8, torch.bfloat16, GPU)


def check_router(m, experts, k, fp8, dtype, device, config=None):
    """router_top_k's logits equal the GEMV's, and its routing the softmax / top-k of them (the extra rows, the
    shared expert's gate, outside the routing)."""
    torch.manual_seed(m + experts + k)
    hidden = 256
    w = torch.randn(experts + 1, hidden)
    if fp8:
        q, s = quantize_fp8_block(w, (128, 128))
        weight, scale = q.to(device), s.to(device)
    else:
        weight, scale = w.to(device).to(dtype), None
    x = torch.randn(m, hidden, device=device).to(dtype)
    logits, chosen, weights = router_top_k(x, weight, scale, (128, 128), experts, k) if config is None else \
        _router_with_config(x, weight, scale, experts, k, config)
    want = fp8_matmul(x, weight, scale, (128, 128), config=config) if fp8 else dense_matmul(x, weight, config=config)
    assert torch.equal(logits, want)
    probs = torch.softmax(want[:, :experts].float(), dim=-1)
    top_w, top_e = torch.topk(probs, k, dim=-1)
    # the k largest in order (16-bit logits can tie: compare probabilities, and the indices must be distinct)
    assert torch.equal(probs.gather(1, chosen), top_w)
    assert all(len(set(row)) == k for row in chosen.tolist())
    assert torch.allclose(weights, top_w / top_w.sum(-1, keepdim=True), atol=1e-6)
    assert_counters_zero()


def _router_with_config(x, weight, scale, experts, k, config):
    chosen = torch.empty(x.shape[0], k, dtype=torch.int64, device=x.device)
    weights = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    logits = fp8_matmul(x, weight, scale, (128, 128), config=config, route=(chosen, weights, experts))
    return logits, chosen, weights


@cpu
@pytest.mark.parametrize("m,experts,k,fp8,config", [
    (1, 64, 8, False, None),  # split K (the default config splits over programs)
    (3, 40, 4, False, {"SPLIT_K": 1}),  # every program writes its tile's final output
    (4, 16, 2, True, {"SPLIT_K": 2}),
])
def test_router_top_k_interpreter(m, experts, k, fp8, config):
    check_router(m, experts, k, fp8, torch.float16, "cpu", config)


@gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("experts,k,fp8", [(256, 8, False), (128, 8, False), (256, 8, True)])
def test_router_top_k_gpu(m, experts, k, fp8):
    check_router(m, experts, k, fp8, torch.bfloat16, GPU)


# ---------------------------------------------------------------- fused GDN decode step


RING = conv_ring_rows(4)  # the pool's conv ring at K = 4


def step_positions(starts, m, device):
    """Each sequence's m rows' absolute positions from its first (int64, as the step batch holds them)."""
    return (torch.as_tensor(starts)[:, None] + torch.arange(m)).reshape(-1).to(device)


def ring_window(ring, position, history=3):
    """From one slot's conv ring [R, C]: the inputs of the `history` positions before `position`."""
    return ring[torch.arange(position - history, position) % ring.shape[0]]


def gdn_inputs(bsz, hk, hv, dk, dv, dtype, device, kernel=4, ring=RING):
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(bsz * 100 + hv)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(
        z=rnd(bsz, hv * dv).to(dtype), b=rnd(bsz, hv).to(dtype), a=rnd(bsz, hv).to(dtype),
        conv_state=rnd(bsz, ring, c).to(dtype), conv_weight=rnd(c, 1, kernel, scale=0.5).to(dtype),
        A_log=rnd(hv, scale=0.5), dt_bias=rnd(hv, scale=0.5), norm_weight=(1 + rnd(dv, scale=0.1)).to(dtype),
        state=rnd(bsz, hv, dk, dv, scale=0.3),
    ), c


def check_gdn(bsz, hk, hv, dk, dv, dtype, device, block_v=None, steps=3, tol=1e-2, ring=RING):
    """One-token steps, each sequence from its own position: one before the ring's end, so the steps wrap around
    it, one at 0, whose window reaches before position 0 (the ring's last rows)."""
    args, c = gdn_inputs(bsz, hk, hv, dk, dv, dtype, device, ring=ring)
    ref_args = {k: v.clone() for k, v in args.items()}
    starts = [(ring - 1, 0, 5 * ring + 2)[i % 3] for i in range(bsz)]
    for step in range(steps):
        qkv = torch.randn(bsz, c, device=device).to(dtype)
        positions = step_positions([p + step for p in starts], 1, device)
        out = nan_like(torch.empty(bsz, hv * dv, dtype=dtype, device=device))
        y = gdn_decode(qkv, num_k_heads=hk, positions=positions, out=out, block_v=block_v, **args)
        ref = gdn_decode_reference(qkv, num_k_heads=hk, positions=positions, **ref_args)
        assert rel_err(y, ref) < tol, f"step {step}"
        assert rel_err(args["state"], ref_args["state"]) < 1e-4
        torch.testing.assert_close(args["conv_state"], ref_args["conv_state"], rtol=0, atol=0)
        for i, p in enumerate(positions.tolist()):
            assert torch.equal(args["conv_state"][i, p % ring], qkv[i]), "the token's input in its ring row"
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("bsz,hk,hv,dk,dv,dtype,block_v,ring", [
    (2, 2, 4, 16, 16, torch.float32, 8, RING),
    (3, 1, 3, 12, 20, torch.float16, 8, 4),   # 3 value heads per key head, dv not a multiple of the block; K-1 + 1 rows
    (1, 2, 2, 32, 24, torch.float32, 16, RING),
    (2, 1, 3, 12, 20, torch.float16, None, 8),  # one V block per head (the interpreter's default), norms as on the GPU
])
def test_gdn_decode_interpreter(bsz, hk, hv, dk, dv, dtype, block_v, ring):
    check_gdn(bsz, hk, hv, dk, dv, dtype, "cpu", block_v, tol=2e-3, ring=ring)


@gpu
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("block_v", [16, 32])
def test_gdn_decode_gpu(bsz, block_v):
    check_gdn(bsz, 16, 64, 128, 128, torch.bfloat16, GPU, block_v)


def check_gdn_defer_norm(bsz, hk, hv, dk, dv, dtype, device, block_v=None, tol=1e-2, m=1):
    """defer_norm: the kernel's w * o * silu(z) and per-block sums of o^2 are the reference's; finished (times each
    row's head rstd) they are the gated norm's output within its roundings; state and ring as without. m tokens a
    sequence (a verify step)."""
    args, c = gdn_inputs(bsz, hk, hv, dk, dv, dtype, device)
    n = bsz * m
    args.update(z=torch.randn(n, hv * dv, device=device).to(dtype), b=torch.randn(n, hv, device=device).to(dtype),
                a=torch.randn(n, hv, device=device).to(dtype))
    ref_args = {k: v.clone() for k, v in args.items()}
    normed_args = {k: v.clone() for k, v in args.items()}
    qkv = torch.randn(n, c, device=device).to(dtype)
    positions = step_positions([3 * i for i in range(bsz)], m, device)
    y, parts = gdn_decode(qkv, num_k_heads=hk, positions=positions, block_v=block_v, defer_norm=True,
                          tokens_per_seq=m, **args)
    ref, ref_parts = gdn_decode_reference(qkv, num_k_heads=hk, positions=positions, defer_norm=True, tokens_per_seq=m,
                                          **ref_args)
    normed = gdn_decode_reference(qkv, num_k_heads=hk, positions=positions, tokens_per_seq=m, **normed_args)
    assert parts.shape[:2] == (n, hv)
    assert rel_err(y, ref) < tol
    torch.testing.assert_close(parts.sum(-1, keepdim=True), ref_parts, rtol=1e-4, atol=1e-5)
    rstd = torch.rsqrt(parts.sum(-1, keepdim=True) / dv + 1e-6)
    assert rel_err((y.float().view(n, hv, dv) * rstd).reshape(n, -1), normed) < 2 * tol
    assert rel_err(args["state"], ref_args["state"]) < 1e-4
    torch.testing.assert_close(args["conv_state"], ref_args["conv_state"], rtol=0, atol=0)
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("bsz,hk,hv,dk,dv,dtype,block_v,m", [
    (1, 2, 4, 16, 16, torch.float32, 8, 1),
    (2, 1, 3, 12, 20, torch.float16, 8, 1),  # dv not a multiple of the block: the last block's sums masked
    (1, 1, 2, 8, 32, torch.float16, None, 1),
    (2, 2, 4, 16, 16, torch.float32, 8, 3),  # a verify step: three tokens a sequence
])
def test_gdn_decode_defer_norm_interpreter(bsz, hk, hv, dk, dv, dtype, block_v, m):
    check_gdn_defer_norm(bsz, hk, hv, dk, dv, dtype, "cpu", block_v, tol=2e-3, m=m)


@gpu
@pytest.mark.parametrize("block_v,m", [(16, 1), (32, 1), (32, 3)])
def test_gdn_decode_defer_norm_gpu(block_v, m):
    check_gdn_defer_norm(1, 16, 64, 128, 128, torch.bfloat16, GPU, block_v, m=m)


def check_head_norm(m, k, dv, nvb, dtype, device, config=None, tol=1e-2):
    """int4_matmul_residual with head_norm = the GEMV of x times each value's row and head rstd (from the parts), plus
    the residual."""
    from roofline.kernels.int4_tc import int4_matmul_residual

    torch.manual_seed(m + k + dv + nvb)
    hidden = 256
    qweight, qzeros, scales = random_int4(hidden, k, 128, False, device)
    x, res = torch.randn(m, k, device=device).to(dtype), torch.randn(m, hidden, device=device).to(dtype)
    parts = (torch.rand(m, k // dv, nvb, device=device) + 0.1) * dv / nvb
    cfg = {"tc": True, **(config or {})}
    h, sumsq = int4_matmul_residual(x, qweight, qzeros, scales, res, sym=False, config=cfg, head_norm=(parts, 1e-6))
    rstd = torch.rsqrt(parts.sum(-1) / dv + 1e-6).repeat_interleave(dv, dim=1)  # [m, k]
    y = int4_matmul_reference((x.float() * rstd), qweight, qzeros, scales, 128)
    assert rel_err(h.float() - res.float(), y) < tol
    tiles = h.float().pow(2).reshape(m, sumsq.shape[0], -1).sum(-1).t()
    torch.testing.assert_close(sumsq[:, :m], tiles, rtol=1e-5, atol=1e-5)
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("m,k,dv,nvb,config", [
    (1, 256, 128, 8, None),  # the interpreter's default: two warp rows, two steps a program
    (1, 512, 256, 2, {"KW": 1, "SPLIT_K": 3}),  # two groups a head, splits across a head
    (1, 384, 128, 1, {"KW": 1, "SPLIT_K": 1, "depth": 1}),  # the one-buffer loop of the GPU's one-row calls
    (3, 256, 128, 4, {"KW": 1, "SPLIT_K": 2}),  # a verify step's rows, each its own rstd
    (4, 512, 256, 8, {"depth": 1}),
])
def test_int4_head_norm_interpreter(m, k, dv, nvb, config):
    check_head_norm(m, k, dv, nvb, torch.float16, "cpu", config, tol=2e-3)


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("nvb", [4, 8])
def test_int4_head_norm_gpu(m, nvb):
    check_head_norm(m, 8192, 128, nvb, torch.bfloat16, GPU)


def test_int4_head_norm_rejects_parts_off_the_rows_or_heads_off_the_groups():
    from roofline.kernels.int4_tc import head_norm_args

    with pytest.raises(ValueError, match="\\[2 rows, heads, blocks\\]"):
        head_norm_args((torch.ones(1, 2, 4), 1e-6), 2, 256)
    with pytest.raises(ValueError, match="heads of a multiple of 128"):
        head_norm_args((torch.ones(1, 4, 4), 1e-6), 1, 256)


def test_gdn_decode_rejects_a_ring_too_small_or_no_positions():
    args, c = gdn_inputs(1, 1, 2, 8, 8, torch.float32, "cpu", ring=8)
    qkv = torch.randn(3, c)
    step = dict(args, z=args["z"].repeat(3, 1), b=args["b"].repeat(3, 1), a=args["a"].repeat(3, 1))
    with pytest.raises(ValueError, match="power of two >= K-1 \\+ M = 6"):
        gdn_decode_reference(qkv, num_k_heads=1, positions=step_positions([0], 3, "cpu"), tokens_per_seq=3,
                             **dict(step, conv_state=torch.zeros(1, 4, c)))
    with pytest.raises(ValueError, match="power of two"):
        gdn_decode(qkv, num_k_heads=1, positions=step_positions([0], 3, "cpu"), tokens_per_seq=3,
                   **dict(step, conv_state=torch.zeros(1, 12, c)))
    with pytest.raises(ValueError, match="positions must be int32/int64 \\[3\\]"):
        gdn_decode(qkv, num_k_heads=1, positions=step_positions([0], 1, "cpu"), tokens_per_seq=3, **step)


def test_gdn_reference_matches_model():
    """gdn_decode_reference is GatedDeltaNet's causal_conv + recurrence + gated_norm for one token."""
    from roofline.engine.cache import SequenceCache
    from roofline.model.layers import GatedDeltaNet

    bsz, hk, hv, dk, dv = 2, 2, 4, 8, 8
    args, c = gdn_inputs(bsz, hk, hv, dk, dv, torch.float32, "cpu")
    qkv = torch.randn(bsz, c)
    positions = step_positions([1, RING + 7], 1, "cpu")
    layer = types.SimpleNamespace(
        layer_idx=0, kernel=4, conv_size=c, conv1d=types.SimpleNamespace(weight=args["conv_weight"]),
        key_size=hk * dk, value_size=hv * dv, num_v_heads=hv, num_k_heads=hk, k_dim=dk, v_dim=dv, eps=1e-6,
        norm=types.SimpleNamespace(weight=args["norm_weight"]),
    )
    outs, windows = [], []
    for i in range(bsz):
        cache = SequenceCache()
        cache.conv[0] = ring_window(args["conv_state"][i], int(positions[i]))
        cache.recurrent[0] = args["state"][i].clone()
        beta = torch.sigmoid(args["b"][i : i + 1]).float()
        decay = -args["A_log"].exp() * torch.nn.functional.softplus(args["a"][i : i + 1].float() + args["dt_bias"])
        mixed = GatedDeltaNet.causal_conv(layer, qkv[i : i + 1], cache)
        core = GatedDeltaNet.recurrence(layer, mixed, beta, decay, cache)
        outs.append(GatedDeltaNet.gated_norm(layer, core, args["z"][i : i + 1]))
        outs.append(cache.recurrent[0])
        windows.append(cache.conv[0])
    ref_out = gdn_decode_reference(qkv, num_k_heads=hk, positions=positions, **args)
    torch.testing.assert_close(ref_out, torch.cat(outs[0::2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["state"], torch.stack(outs[1::2]), rtol=1e-5, atol=1e-5)
    for i in range(bsz):  # the model's window after the token: the ring's last three positions
        after = ring_window(args["conv_state"][i], int(positions[i]) + 1)
        torch.testing.assert_close(after, windows[i], rtol=0, atol=0)


def gdn_pool_inputs(bsz, pool, m, hk, hv, dk, dv, dtype, device, kernel=4, seed=0):
    """A pool of `pool` slots (conv rings, state) and one step's inputs for bsz sequences x m tokens."""
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(seed * 1000 + bsz * 100 + pool * 10 + m)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    fixed = dict(conv_weight=rnd(c, 1, kernel, scale=0.5).to(dtype), A_log=rnd(hv, scale=0.5),
                 dt_bias=rnd(hv, scale=0.5), norm_weight=(1 + rnd(dv, scale=0.1)).to(dtype))
    pools = dict(conv_state=rnd(pool, RING, c).to(dtype), state=rnd(pool, hv, dk, dv, scale=0.3))
    step = dict(qkv=rnd(bsz * m, c).to(dtype), z=rnd(bsz * m, hv * dv).to(dtype), b=rnd(bsz * m, hv).to(dtype),
                a=rnd(bsz * m, hv).to(dtype))
    return fixed, pools, step


def _merged_views(*parts):
    """The parts as column views of one [N, sum of widths] tensor, as a merged projection returns them (rows strided)."""
    return torch.cat(parts, dim=1).split([p.shape[1] for p in parts], dim=1)


def check_gdn_pool(bsz, pool, m, hk, hv, dk, dv, dtype, device, block_v=None, use_slots=True, records=True,
                   steps=2, tol=1e-2, merged=False, two_buffers=False):
    """gdn_decode with slots / M tokens / step records vs the reference, over `steps` successive steps from
    positions that wrap around the ring; in the conv rings only the step's rows change, to its inputs, and pool rows
    not in `slots` stay untouched. `merged`: the kernel takes qkv, z and b, a as column views of merged projections'
    outputs (in_proj_qkv+z, b+a), the reference contiguous copies. `two_buffers`: the state pool has two rows per
    slot, and each step reads one buffer and writes the other (`state_rows`), leaving the read rows as they were."""
    kernel = 4
    fixed, pools, _ = gdn_pool_inputs(bsz, pool, m, hk, hv, dk, dv, dtype, device, kernel)
    if two_buffers:
        pools["state"] = torch.cat([pools["state"], pools["state"].flip(0) * 0.5])  # buffer p of slot s: row s + p * pool
    ref_pools = {k: v.clone() for k, v in pools.items()}
    starts = torch.randint(0, 3 * RING, (bsz,), generator=torch.Generator().manual_seed(pool))
    starts[0] = RING - 2  # the step's rows wrap around the ring's end
    for step in range(steps):
        _, _, inp = gdn_pool_inputs(bsz, pool, m, hk, hv, dk, dv, dtype, device, kernel, seed=step + 1)
        positions = step_positions(starts + step * m, m, device).to(torch.int32 if step % 2 else torch.int64)
        slots = state_rows = None
        if use_slots:
            perm = torch.randperm(pool, generator=torch.Generator().manual_seed(step)) if step else torch.arange(pool - 1, -1, -1)
            slots = perm[:bsz].to(device)
            slots = slots.to(torch.int32 if step % 2 else torch.int64)
            if two_buffers:
                state_rows = (slots + pool * (step % 2), slots + pool * (1 - step % 2))
        before, rings_before = pools["state"].clone(), pools["conv_state"].clone()
        outs = {}
        for name, pl in (("kernel", pools), ("ref", ref_pools)):
            ss = torch.full((bsz, m - 1, step_record_size(hk, dk, hv, dv)), float("nan"), device=device) \
                if records else None
            fn = gdn_decode if name == "kernel" else gdn_decode_reference
            extra = dict(out=nan_like(torch.empty(bsz * m, hv * dv, dtype=dtype, device=device)), block_v=block_v) \
                if name == "kernel" else {}
            qkv, z, b, a = inp["qkv"], inp["z"], inp["b"], inp["a"]
            if merged and name == "kernel":
                (qkv, z), (b, a) = _merged_views(qkv, z), _merged_views(b, a)
                assert bsz * m == 1 or not qkv.is_contiguous()
            y = fn(qkv, z, b, a, pl["conv_state"], fixed["conv_weight"], fixed["A_log"],
                   fixed["dt_bias"], fixed["norm_weight"], pl["state"], hk, positions=positions, slots=slots,
                   state_rows=state_rows, tokens_per_seq=m, step_records=ss, **extra)
            outs[name] = (y, ss)
        (y, ss), (ry, rss) = outs["kernel"], outs["ref"]
        assert rel_err(y, ry) < tol, f"step {step}"
        assert rel_err(pools["state"], ref_pools["state"]) < 1e-4
        torch.testing.assert_close(pools["conv_state"], ref_pools["conv_state"], rtol=0, atol=0)
        want = rings_before.clone()
        rows = torch.arange(bsz, device=device) if slots is None else slots.long()
        want[rows[:, None], positions.long().view(bsz, m) % RING] = inp["qkv"].view(bsz, m, -1)
        assert torch.equal(pools["conv_state"], want), "the step's inputs in their rows, every other row as it was"
        if state_rows is not None:
            assert torch.equal(pools["state"][state_rows[0].long()], before[state_rows[0].long()]), "read rows kept"
            assert not torch.equal(pools["state"][state_rows[1].long()], before[state_rows[1].long()])
        if ss is not None and m > 1:
            assert rel_err(ss, rss) < 1e-4
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("bsz,pool,m,hk,hv,dk,dv,dtype,block_v,use_slots,records,two_buffers", [
    (2, 3, 1, 2, 4, 16, 16, torch.float32, 8, True, False, False),
    (2, 2, 2, 1, 3, 12, 20, torch.float16, 8, False, True, False),    # dv not a multiple of the block, no slots
    (1, 3, 3, 2, 2, 32, 24, torch.float32, 16, True, True, True),
    (3, 5, 5, 1, 2, 8, 12, torch.float16, 8, True, True, True),       # M > K-1: every window row of the last token new
    (2, 4, 4, 2, 4, 8, 8, torch.float32, 8, True, False, False),
    (2, 3, 3, 1, 2, 8, 8, torch.float32, 8, False, True, False),      # pool larger than B without slots: rows 0..B-1
])
def test_gdn_decode_pool_interpreter(bsz, pool, m, hk, hv, dk, dv, dtype, block_v, use_slots, records, two_buffers):
    check_gdn_pool(bsz, pool, m, hk, hv, dk, dv, dtype, "cpu", block_v, use_slots, records, tol=2e-3,
                   two_buffers=two_buffers)


@cpu
@pytest.mark.parametrize("bsz,m,records", [(1, 3, True), (2, 2, False), (3, 1, False)])
def test_gdn_decode_reads_merged_projections_rows_in_place_interpreter(bsz, m, records):
    """qkv, z, b, a as the merged projections write them (strided rows): the same results as contiguous inputs."""
    check_gdn_pool(bsz, 4, m, 2, 4, 16, 16, torch.float16, "cpu", 8, True, records, tol=2e-3, merged=True)


@gpu
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gdn_decode_pool_gpu(m, merged):
    check_gdn_pool(3, 5, m, 16, 64, 128, 128, torch.bfloat16, GPU, use_slots=True, records=True, merged=merged,
                   two_buffers=m > 1)


def check_gdn_replay(bsz, m, hk, hv, dk, dv, dtype, device, block_v=None, num_warps=None):
    """gdn_replay after an M-token verify step (two layers, two state buffers per slot): for every kept < M it rebuilds
    in the spare row the state that the same kernel (the same tile) leaves after only the first `kept` tokens, bit for
    bit, from the untouched state before the step and the step's records."""
    layers, pool, kernel = 2, bsz + 1, 4
    states = torch.zeros(layers, 2 * pool, hv, dk, dv, device=device)
    records = torch.full((layers, bsz * (m - 1) + 1, step_record_size(hk, dk, hv, dv)), float("nan"), device=device)
    slots = torch.arange(bsz, device=device).flip(0)
    read, write = slots * 2, slots * 2 + 1
    starts = torch.arange(bsz) * 7 + 3
    positions = step_positions(starts, m, device)
    per_layer = []
    for layer in range(layers):
        fixed, pools, inp = gdn_pool_inputs(bsz, pool, m, hk, hv, dk, dv, dtype, device, kernel, seed=layer)
        states[layer, read] = pools["state"][slots]
        conv = pools["conv_state"].clone()
        gdn_decode(inp["qkv"], inp["z"], inp["b"], inp["a"], conv, fixed["conv_weight"], fixed["A_log"],
                   fixed["dt_bias"], fixed["norm_weight"], states[layer], hk, positions=positions, slots=slots,
                   state_rows=(read, write), tokens_per_seq=m, step_records=records[layer, 1:].view(bsz, m - 1, -1),
                   block_v=block_v, num_warps=num_warps)
        per_layer.append((fixed, pools, inp))
    for i in range(bsz):
        for kept in range(1, m):
            scratch = pool * 2 - 1  # the padding slot's spare row
            gdn_replay(states, records, hk, int(read[i]), scratch, 1 + i * (m - 1), kept)
            for layer, (fixed, pools, inp) in enumerate(per_layer):
                want = pools["state"][slots].clone()
                rows = lambda t: t.view(bsz, m, -1)[:, :kept].reshape(bsz * kept, -1)  # noqa: E731
                gdn_decode(rows(inp["qkv"]), rows(inp["z"]), rows(inp["b"]), rows(inp["a"]), pools["conv_state"][slots],
                           fixed["conv_weight"], fixed["A_log"], fixed["dt_bias"], fixed["norm_weight"], want, hk,
                           positions=step_positions(starts, kept, device), tokens_per_seq=kept, block_v=block_v,
                           num_warps=num_warps)
                assert torch.equal(states[layer, scratch], want[i]), f"sequence {i}, kept {kept}, layer {layer}"
    assert torch.equal(records[:, 0].isnan(), torch.ones_like(records[:, 0], dtype=torch.bool)), "record 0 untouched"


@cpu
@pytest.mark.parametrize("bsz,m,hk,hv,dk,dv", [(2, 4, 2, 4, 16, 8), (1, 3, 1, 3, 8, 12)])
def test_gdn_replay_interpreter(bsz, m, hk, hv, dk, dv):
    check_gdn_replay(bsz, m, hk, hv, dk, dv, torch.float32, "cpu")


@gpu
@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("tile", [gdn_decode_module.ONE_TOKEN_TILE, gdn_decode_module.VERIFY_TILE])
def test_gdn_replay_gpu(m, tile):
    """Both (V block, warps) tiles: the comparison's one-token run takes the verify's tile, since the reductions over
    dk (and so the bits) depend on it."""
    check_gdn_replay(2, m, 16, 64, 128, 128, torch.bfloat16, GPU, *tile)


def _apply_records(state, records, num_k_heads, kept):
    """The state after `kept` tokens from the state before them and their records (gdn_replay's math, in torch)."""
    hv, dk, dv = state.shape[-3:]
    s = state.clone()
    for j in range(kept):
        k, d, decay = records[..., j, :].split([num_k_heads * dk, hv * dv, hv], dim=-1)
        k = k.reshape(*k.shape[:-1], num_k_heads, dk).repeat_interleave(hv // num_k_heads, dim=-2)
        s = s * decay[..., None, None]
        s = s + k[..., :, None] * d.reshape(*d.shape[:-1], hv, dv)[..., None, :]
    return s


def test_gdn_reference_tokens_are_steps():
    """The reference with M tokens per sequence is M successive one-token reference calls (slots too), and its
    records rebuild the states between those calls."""
    bsz, pool, m, hk, hv, dk, dv = 2, 3, 4, 2, 4, 8, 8
    fixed, pools, inp = gdn_pool_inputs(bsz, pool, m, hk, hv, dk, dv, torch.float32, "cpu")
    slots, starts = torch.tensor([2, 0]), torch.tensor([RING - 1, 5])
    one = {k: v.clone() for k, v in pools.items()}
    start = pools["state"][slots].clone()
    ss = torch.empty(bsz, m - 1, step_record_size(hk, dk, hv, dv))
    y = gdn_decode_reference(inp["qkv"], inp["z"], inp["b"], inp["a"], pools["conv_state"], **fixed,
                             state=pools["state"], num_k_heads=hk, positions=step_positions(starts, m, "cpu"),
                             slots=slots, tokens_per_seq=m, step_records=ss)
    rows = lambda t, j: t.view(bsz, m, -1)[:, j]  # noqa: E731
    for j in range(m):
        yj = gdn_decode_reference(rows(inp["qkv"], j), rows(inp["z"], j), rows(inp["b"], j), rows(inp["a"], j),
                                  one["conv_state"], **fixed, state=one["state"], num_k_heads=hk,
                                  positions=starts + j, slots=slots)
        torch.testing.assert_close(rows(y, j), yj, rtol=0, atol=0)
        if j < m - 1:
            torch.testing.assert_close(_apply_records(start, ss, hk, j + 1), one["state"][slots], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools["state"], one["state"], rtol=0, atol=0)
    torch.testing.assert_close(pools["conv_state"], one["conv_state"], rtol=0, atol=0)


def test_gdn_reference_tokens_match_model():
    """The M-token reference is GatedDeltaNet's multi-token causal_conv + recurrence + gated_norm (one
    sequence): the same outputs, state and window after the step, and records that rebuild the model's recorded
    states."""
    from roofline.engine.cache import SequenceCache
    from roofline.model.layers import GatedDeltaNet

    m, hk, hv, dk, dv, kernel = 3, 2, 4, 8, 8, 4
    fixed, pools, inp = gdn_pool_inputs(1, 2, m, hk, hv, dk, dv, torch.float32, "cpu")
    c = inp["qkv"].shape[1]
    first = RING + 14  # the step's rows wrap around the ring
    layer = types.SimpleNamespace(
        layer_idx=0, kernel=kernel, conv_size=c, conv1d=types.SimpleNamespace(weight=fixed["conv_weight"]),
        key_size=hk * dk, value_size=hv * dv, num_v_heads=hv, num_k_heads=hk, k_dim=dk, v_dim=dv, eps=1e-6,
        norm=types.SimpleNamespace(weight=fixed["norm_weight"]),
    )
    cache = SequenceCache(record_steps=True)
    cache.conv[0] = ring_window(pools["conv_state"][1], first)
    cache.recurrent[0] = pools["state"][1].clone()
    beta = torch.sigmoid(inp["b"]).float()
    decay = -fixed["A_log"].exp() * torch.nn.functional.softplus(inp["a"].float() + fixed["dt_bias"])
    mixed = GatedDeltaNet.causal_conv(layer, inp["qkv"], cache)
    core = GatedDeltaNet.recurrence(layer, mixed, beta, decay, cache)
    model_out = GatedDeltaNet.gated_norm(layer, core, inp["z"])
    ss = torch.empty(1, m - 1, step_record_size(hk, dk, hv, dv))
    start = pools["state"][1:2].clone()
    ref_out = gdn_decode_reference(inp["qkv"], inp["z"], inp["b"], inp["a"], pools["conv_state"], **fixed,
                                   state=pools["state"], num_k_heads=hk, positions=step_positions([first], m, "cpu"),
                                   slots=torch.tensor([1]), tokens_per_seq=m, step_records=ss)
    torch.testing.assert_close(ref_out, model_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools["state"][1], cache.recurrent[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring_window(pools["conv_state"][1], first + m), cache.conv[0], rtol=0, atol=0)
    for j in range(m - 1):
        torch.testing.assert_close(_apply_records(start, ss, hk, j + 1)[0], cache.step_recurrent[0][j], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- decode attention


def check_attention(bsz, m, hq, hkv, d, cap, lengths, dtype, device, config=None, tol=1e-2, pool=None, gated=False):
    """decode_attention vs the reference; with `pool` (> bsz) the caches are a pool read through random slots;
    with `gated` the output gate is the second half of each head's [query | gate] row, as q_proj writes it."""
    torch.manual_seed(bsz + m + cap)
    rows = pool or bsz
    q = torch.randn(bsz, m, hq, d, device=device).to(dtype)
    k = torch.randn(rows, cap, hkv, d, device=device).to(dtype)
    v = torch.randn(rows, cap, hkv, d, device=device).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    slots = torch.arange(rows - 1, -1, -1)[:bsz].to(device) if pool else None  # never the identity rows
    gate = torch.randn(bsz * m, hq, 2 * d, device=device).to(dtype)[..., d:] if gated else None
    y = decode_attention(q, k, v, lens, out=nan_like(q), config=config, slots=slots, gate=gate)
    want = decode_attention_reference(q, k, v, lens, slots=slots)
    if gated:  # GatedAttention: out * sigmoid(gate)
        want = (want.reshape(bsz * m, hq, d) * torch.sigmoid(gate)).reshape(want.shape)
    assert rel_err(y, want) < tol
    assert_counters_zero()


@cpu
@pytest.mark.parametrize("bsz,m,hq,hkv,d,cap,lengths,config,pool", [
    (2, 1, 4, 2, 32, 50, [37, 50], None, None),
    (3, 3, 8, 2, 24, 70, [3, 40, 70], {"NSPLIT": 3}, None),   # M=3 causal verify rows, a context shorter than the split
    (1, 4, 6, 1, 64, 33, [33], {"NSPLIT": 5, "merge_dims": 16}, None),  # the merge in four dim chunks
    (2, 2, 4, 4, 256, 20, [20, 7], None, None),               # head dim 256
    (2, 1, 4, 2, 32, 50, [50, 21], {"NSPLIT": 7}, 5),         # slots into a pool of 5
    (3, 2, 8, 2, 16, 40, [40, 2, 17], {"NSPLIT": 9}, 4),      # slots; a sequence whose keys fill one split
    (1, 3, 4, 1, 32, 30, [30], {"NSPLIT": 1}, 3),             # slots; one split: no merge launch
])
@pytest.mark.parametrize("by_length", [True, False])
def test_decode_attention_interpreter(bsz, m, hq, hkv, d, cap, lengths, config, pool, by_length, monkeypatch):
    """Splits sharing each sequence's own keys (SPLIT_BY_LENGTH, the default) or the span's (before)."""
    from roofline.kernels import decode_attention as da

    monkeypatch.setattr(da, "SPLIT_BY_LENGTH", by_length)
    check_attention(bsz, m, hq, hkv, d, cap, lengths, torch.float32 if m % 2 else torch.float16, "cpu", config,
                    tol=2e-3, pool=pool, gated=m > 1)


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_decode_attention_gpu(m):
    check_attention(2, m, 32, 2, 256, 8192, [8192, 3001], torch.bfloat16, GPU)


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_decode_attention_gpu_slots(m):
    check_attention(2, m, 32, 2, 256, 8192, [8100, 3001], torch.bfloat16, GPU, pool=3, gated=True)


@gpu
def test_decode_attention_gpu_long():
    check_attention(1, 1, 32, 2, 256, 32768, [32768], torch.bfloat16, GPU)


def test_attention_reference_matches_model():
    """decode_attention_reference is GatedAttention.attend for the last M positions of a sequence."""
    from roofline.model.layers import GatedAttention

    torch.manual_seed(5)
    m, hq, hkv, d, length = 3, 4, 2, 16, 11
    q = torch.randn(1, m, hq, d)
    k = torch.randn(1, length, hkv, d)
    v = torch.randn(1, length, hkv, d)
    layer = types.SimpleNamespace(head_dim=d)
    ref = GatedAttention.attend(layer, q[0], k[0], v[0])
    ours = decode_attention_reference(q, k, v, torch.tensor([length]))
    torch.testing.assert_close(ours[0], ref, rtol=1e-5, atol=1e-5)
