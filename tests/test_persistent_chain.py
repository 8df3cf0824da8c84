"""The persistent-chain experiment's hand-written CUDA kernel (benchmarks/persistent_chain.py): it compiles through
NVRTC for the H100/H200 (sm_90) and the DGX Spark (sm_121) without spills and fits their blocks (CPU), and on a GPU
every launch mode's outputs match the fp32 reference chain."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

# loaded by path: benchmarks/ on sys.path would shadow the `kernels` package transformers imports with kernels.py
_spec = importlib.util.spec_from_file_location("persistent_chain",
                                               Path(__file__).parents[1] / "benchmarks/persistent_chain.py")
chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain)

# GB10 (sm_121): ~99 KB of shared memory a block, 64K registers an SM
GB10_SHARED = 99 * 1024
REGISTERS_AN_SM = 65536


def _nvrtc_or_skip():
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda-bindings or libnvrtc missing: the test extra installs both
        pytest.skip(f"needs NVRTC through cuda-bindings: {exc!r}"[:200])


@pytest.mark.parametrize("arch", [90, 121])
@pytest.mark.parametrize("build", chain.BUILDS, ids=lambda b: b.name())
def test_the_kernel_compiles_for_hopper_and_gb10_without_spills(arch, build):
    _nvrtc_or_skip()
    cubin, log = chain.compile_cubin(arch, build)
    assert cubin[:4] == b"\x7fELF", "NVRTC returned no ELF cubin"
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    threads = (chain.CONSUMER_WARPS + 1) * 32
    assert registers * threads * 2 <= REGISTERS_AN_SM, f"{registers} registers: two blocks no longer fit an SM"


@pytest.mark.parametrize("mb", chain.SIZES_MB)
def test_every_build_runs_every_size_within_the_kernels_layout(mb):
    """The sizes main() runs fit what the kernel's indexing assumes, and the check names a size that does not."""
    assert chain.stage_n(mb, False) ** 2 * 2 == chain.stage_n(mb, True) ** 2 // 2 == mb * 2**20  # bf16, INT4 words
    for build in chain.BUILDS:
        n = chain.stage_n(mb, build.int4)
        assert chain.layout_problems(build, n) == [], (build, n)
        assert chain.shared_bytes(build, n) <= 227 * 1024, (build, n)
    assert chain.layout_problems(chain.Build(4, int4=True), 1448)  # session 47's first INT4 sizes
    assert chain.layout_problems(chain.Build(12, tagged=True), 8192)


def test_the_small_ring_fits_a_gb10_block_at_every_size_the_experiment_runs():
    """The 4-page builds (the one-launch-a-stage rows) must fit the Spark's block at the largest stage (bf16 n = 4096,
    INT4 n = 8192); the 12-page ones are for Hopper's 227 KB only."""
    small, deep = chain.Build(4), chain.Build(12)
    assert chain.shared_bytes(small, 4096) <= GB10_SHARED < chain.shared_bytes(deep, 1024)
    assert chain.shared_bytes(chain.Build(4, int4=True), 8192) <= GB10_SHARED
    for build in chain.BUILDS:
        assert chain.shared_bytes(build, 8192 if build.int4 else 4096) <= 227 * 1024, build


def test_int4_pages_hold_gptq_words_then_their_rows_scales():
    torch.manual_seed(0)
    n = 2048
    q = torch.randint(0, 16, (n, n))
    scales = torch.rand(n, n // 128).half()
    pages = chain.pack_int4_pages(q, scales)
    assert pages.shape == (n * n // 2 // chain.INT4_Q_BYTES, chain.INT4_Q_BYTES * 33 // 32)
    rows = 2 * chain.INT4_Q_BYTES // n  # 16 rows a page
    words = pages[1, : chain.INT4_Q_BYTES].view(torch.int32).view(rows, n // 8)
    assert int(words[0, 0]) & 0xF == q[rows, 0] and (int(words[0, 0]) >> 28) & 0xF == q[rows, 7]
    assert torch.equal(pages[1, chain.INT4_Q_BYTES:].view(torch.float16).view(rows, -1), scales[rows: 2 * rows])
    want = (q - 8).float() * scales.float().repeat_interleave(128, dim=1)
    assert torch.equal(chain.dequantize_int4_pages(pages, n), want)


def test_the_reference_chain_routes_on_the_sign_of_its_input():
    torch.manual_seed(0)
    n = 8
    weights = [torch.randn(n, n).to(torch.bfloat16) for _ in range(4)]
    x0 = torch.randn(n)
    for sign in (1.0, -1.0):
        x0[0] = sign * abs(x0[0])
        x1 = weights[0].float() @ x0  # stage 0 is plain with routed_every = 2; stage 1 is routed on x1[0]
        x2 = weights[3 if x1[0] > 0 else 2].float() @ x1
        got = chain.reference_chain(weights, x0, routed_every=2)
        assert torch.equal(got[0], x1) and torch.equal(got[1], x2)
    plain = chain.reference_chain(weights, x0, routed_every=0)
    assert torch.equal(plain[1], weights[2].float() @ plain[0])
    independent = chain.reference_chain(weights, x0, routed_every=0, independent=True)
    assert torch.equal(independent[1], weights[2].float() @ x0)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [0, 1, 2], ids=["2MB", "8MB", "32MB"])
@pytest.mark.parametrize("variant", chain.VARIANTS, ids=lambda v: f"{v.label}, {v.build.pages} pages")
def test_every_launch_mode_matches_the_reference_chain(size, variant):
    if variant.pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    n = chain.stage_n(chain.SIZES_MB[size], variant.build.int4)
    kernel = chain.ChainKernel(variant.build, n)
    if kernel.per_sm < 1:
        pytest.skip(f"{kernel.shared} bytes of shared memory do not fit a block of this GPU")
    data = chain.Chain(n, 9, variant.build.int4)  # routed stages 3 and 7 where every 4th is
    run = data.runner(kernel, torch.cuda.get_device_properties(0).multi_processor_count, variant)
    for _ in range(2):  # a second run from other inputs: the counters and barriers start clean each time
        error_word, rel_err = data.check(run, variant)
        assert error_word == 0, f"a wait gave up (code {error_word})"
        assert rel_err < chain.tolerance(variant.build)
