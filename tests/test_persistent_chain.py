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
@pytest.mark.parametrize("pages, tagged", chain.BUILDS)
def test_the_kernel_compiles_for_hopper_and_gb10_without_spills(arch, pages, tagged):
    _nvrtc_or_skip()
    cubin, log = chain.compile_cubin(arch, pages, 16384, tagged)
    assert cubin[:4] == b"\x7fELF", "NVRTC returned no ELF cubin"
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    threads = (chain.CONSUMER_WARPS + 1) * 32
    assert registers * threads * 2 <= REGISTERS_AN_SM, f"{registers} registers: two blocks no longer fit an SM"


def test_the_small_ring_fits_a_gb10_block_at_every_size_the_experiment_runs():
    """The 4-page build (the one launch-a-stage rows use) must fit the Spark's block at n = 4096 (32 MB stages);
    the 12-page one is for Hopper's 227 KB only."""
    assert chain.shared_bytes(4, 16384, 4096) <= GB10_SHARED < chain.shared_bytes(12, 16384, 1024)
    assert chain.shared_bytes(12, 16384, 4096) <= 227 * 1024


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


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 2048, 4096])
@pytest.mark.parametrize("variant", chain.VARIANTS, ids=lambda v: f"{v[0]}, {v[1]} pages")
def test_every_launch_mode_matches_the_reference_chain(n, variant):
    label, pages, persistent, pdl, routed, tagged = variant
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    kernel = chain.ChainKernel(pages, 16384, n, tagged)
    if kernel.per_sm < 1:
        pytest.skip(f"{kernel.shared} bytes of shared memory do not fit a block of this GPU")
    stages = 9  # routed stages 3 and 7 with routed_every = 4
    data = chain.Chain(n, stages)
    run = data.runner(kernel, torch.cuda.get_device_properties(0).multi_processor_count, persistent, pdl, routed)
    for _ in range(2):  # a second run from other inputs: the counters and barriers start clean each time
        error_word, rel_err = data.check(run, routed, tagged)
        assert error_word == 0, f"a wait gave up (code {error_word})"
        assert rel_err < 1e-3
