"""Experiment: does a hand-written CUDA persistent kernel stream a chain of dependent GEMVs nearer the copy bandwidth
than one launch a GEMV? The question the persistent-decoder direction turns on (NOTES-kernels, session 47).

    PYTHONPATH=$PWD python benchmarks/persistent_chain.py      (CUDA sm_90+, cuda-bindings; JSON to $OUT)
    python benchmarks/persistent_chain.py --compile-only 90 121   (no GPU: NVRTC compile for the targets)

Why: a 122B layer's ~7 kernels each pay 2.5-10 us over their bytes (session 46's profile), and `kernel_floor.py`
found that even a pure streaming kernel in a PDL chain, its whole share loaded before the wait, reaches only 0.28 /
0.69 of copy at 2 / 8 MB (H100, session 24). Session 24's Triton persistent pair did no better (4.25 against 3.86
us a stage at 8 MB): each program loaded the next stage's share only after finishing its current one, into
registers, and polled with a 200 ns sleep. Hazy Research's "No Bubbles" megakernel (78% of an H100's bandwidth on
Llama-1B, whose layers are about the size of ours) does what Triton cannot express: a producer warp per SM streams
the weights of the SM's next work items into a ring of shared-memory pages across stage boundaries (the weights
never depend on the activations), while consumer warps wait for their inputs on counters in global memory.

The kernel here is that structure, reduced to a chain of S GEMVs y_s = W_s x_s (W_s bf16 [N, N], x fp32), each
needing all of the previous stage's output:
- one CTA per SM (persistent: one launch runs all S stages), or one launch per stage (the same code with S = 1,
  with and without programmatic dependent launch);
- CTA b owns items b, b + G, ... of every stage, an item being the rows of one page (PAGE_BYTES of W);
- the producer warp copies each item's page with cp.async into a ring of PAGES pages, completion arriving on the
  page's mbarrier; it runs ahead into later stages as far as the ring allows;
- the consumer warps wait for the stage's input (thread 0 polls the previous stage's counter with ld.acquire, no
  sleep), load x into shared memory, reduce each page against it, release the page, and one thread writes the
  item's rows and, after the CTA's last item of the stage, adds its item count to the stage's counter (release);
- `routed`: every ROUTED-th stage picks its weight (one of two) from the sign of its input's first element, so its
  producer must wait for the input first: the routed experts' data dependency.
Every wait gives up after ~2 s of clock and records it, so a bug costs a failed check, not a hung device call.
"""

from __future__ import annotations

import argparse
import ctypes
import math

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef PAGES
#define PAGES 4
#endif
#ifndef PAGE_BYTES
#define PAGE_BYTES 16384
#endif
#ifndef TAGGED
#define TAGGED 0  /* 1: x_s travels as 64-bit (tag s + 1, value) words and a stage waits on its inputs' tags */
#endif
#define CONSUMER_WARPS 8
#define CONSUMERS (CONSUMER_WARPS * 32)
#define X_PER_THREAD 16  /* the tagged x load's registers: n <= 16 * CONSUMERS */
#define SPIN_LIMIT 40000000ULL  /* clock cycles, ~20 ms (a real wait is < 0.1 ms): then give up and record it */

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"(smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.shared.b64 state, [%0]; }" :: "r"(smem(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_done(u64* bar, u32 parity) {
    u32 done;
    asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
    return done;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 ld_relaxed64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed64(u64* p, u64 v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u32 tag_of(u64 v) { return (u32)(v >> 32); }
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Spin until `done()`; false, with the error word set, after SPIN_LIMIT cycles, and at once for a thread that gave up
   before (the thread then runs on without waiting, so that no barrier of its CTA hangs). */
template <typename F>
__device__ __forceinline__ bool spin(F done, int* error, int code, bool& gave_up) {
    if (gave_up) return false;
    const u64 start = clock64();
    while (!done()) {
        if (clock64() - start > SPIN_LIMIT) { atomicExch(error, code); gave_up = true; return false; }
    }
    return true;
}

/* x_s into shared memory from its tagged words: each consumer thread loads its (up to X_PER_THREAD) words at once,
   then, while any lacks the tag, polls the first of those until it arrives and loads the rest that lack it again.
   One 64-bit access is single-copy atomic, so a word with the tag holds its value: no counter, no fence. */
__device__ __forceinline__ void load_tagged(float* x_sh, const u64* x, int n, u32 tag, int* error, bool& gave_up) {
    u64 v[X_PER_THREAD];
#pragma unroll
    for (int j = 0; j < X_PER_THREAD; ++j) {
        const int i = threadIdx.x + j * CONSUMERS;
        v[j] = i < n ? ld_relaxed64(&x[i]) : (u64)tag << 32;
    }
    for (;;) {
        bool missing = false;
#pragma unroll
        for (int j = 0; j < X_PER_THREAD; ++j) missing |= tag_of(v[j]) != tag;
        if (!missing) break;
        bool first = true;
#pragma unroll
        for (int j = 0; j < X_PER_THREAD; ++j) {
            if (first && tag_of(v[j]) != tag) {
                first = false;
                if (!spin([&] { v[j] = ld_relaxed64(&x[threadIdx.x + j * CONSUMERS]); return tag_of(v[j]) == tag; },
                          error, 5, gave_up)) {
                    return;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < X_PER_THREAD; ++j) {
            if (tag_of(v[j]) != tag) v[j] = ld_relaxed64(&x[threadIdx.x + j * CONSUMERS]);
        }
    }
#pragma unroll
    for (int j = 0; j < X_PER_THREAD; ++j) {
        const int i = threadIdx.x + j * CONSUMERS;
        if (i < n) x_sh[i] = __uint_as_float((u32)v[j]);
    }
}

__device__ __forceinline__ int items_of(int items, int cta, int grid) {
    return cta < items ? (items - cta + grid - 1) / grid : 0;
}

/* weights: 2 * stages bf16 [n, n] pointers (stage s: entries 2s, 2s+1, the second used only by routed stages);
   xs: [(stages + 1) * n] fp32 (TAGGED: 64-bit words, the tag high), x_s at s * n; counters (not TAGGED): per stage,
   items finished; error: 0, or which wait gave up. */
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_chain(const unsigned short* const* weights, float* xs, int* counters, int* error,
             int first_stage, int stages, int n, int routed_every, int pdl) {
    extern __shared__ __align__(128) unsigned char shared[];
    unsigned char* pages = shared;
    float* x_sh = (float*)(shared + PAGES * PAGE_BYTES);
    float* partial = x_sh + n;                       /* [2][CONSUMER_WARPS], by item parity */
    u64* full = (u64*)(partial + 2 * CONSUMER_WARPS);
    u64* empty = full + PAGES;

    const int rows = PAGE_BYTES / (2 * n);            /* rows of W an item (a page) holds */
    const int items = n / rows;
    const int grid = gridDim.x, cta = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    bool gave_up = false;
    if (threadIdx.x == 0) {
        for (int p = 0; p < PAGES; ++p) { mbar_init(&full[p], 32); mbar_init(&empty[p], CONSUMER_WARPS); }
    }
    __syncthreads();
    if (pdl) launch_dependents();
    const int mine = items_of(items, cta, grid);
    if (mine == 0) return;

    if (warp == CONSUMER_WARPS) {  /* the producer warp */
        int k = 0;  /* this CTA's item count so far: page k % PAGES, its use k / PAGES */
        for (int s = first_stage; s < first_stage + stages; ++s) {
            const bool routed = routed_every > 0 && s % routed_every == routed_every - 1;
            int choice = 0;
            if (routed) {  /* the weight depends on the input: wait for it as the consumers do */
                if (s == first_stage && pdl) grid_dependency_wait();
#if TAGGED
                u64 v = 0;
                const u64* x0 = (const u64*)xs + (size_t)s * n;
                if (!spin([&] { v = ld_relaxed64(x0); return tag_of(v) == (u32)(s + 1); }, error, 1, gave_up)) return;
                choice = __uint_as_float((u32)v) > 0.f;
#else
                if (s > first_stage &&
                    !spin([&] { return ld_acquire(&counters[s - 1]) >= items; }, error, 1, gave_up)) return;
                choice = __ldcg(&xs[(size_t)s * n]) > 0.f;
#endif
            }
            const unsigned char* w = (const unsigned char*)weights[2 * s + choice];
            for (int item = cta; item < items; item += grid, ++k) {
                const int page = k % PAGES, use = k / PAGES;
                if (use > 0 && !spin([&] { return mbar_done(&empty[page], (use - 1) & 1); }, error, 2, gave_up)) return;
                const unsigned char* src = w + (size_t)item * PAGE_BYTES;
                unsigned char* dst = pages + page * PAGE_BYTES;
                for (int off = lane * 16; off < PAGE_BYTES; off += 32 * 16) {
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem(dst + off)), "l"(src + off)
                                 : "memory");
                }
                asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" :: "r"(smem(&full[page])) : "memory");
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    /* the consumer warps: each reduces `span` elements of one row of every item against x */
    const int warps_per_row = CONSUMER_WARPS / rows;
    const int row = warp / warps_per_row, span = n / warps_per_row, k0 = (warp % warps_per_row) * span;
    int k = 0;
    for (int s = first_stage; s < first_stage + stages; ++s) {
        if (s == first_stage && pdl) grid_dependency_wait();
#if TAGGED  /* the previous item's closing barrier has every warp done with x_sh: no barrier before the load */
        load_tagged(x_sh, (const u64*)xs + (size_t)s * n, n, s + 1, error, gave_up);
#else
        if (threadIdx.x == 0 && s > first_stage) {
            spin([&] { return ld_acquire(&counters[s - 1]) >= items; }, error, 3, gave_up);
        }
        consumers_sync();
        const float* x = xs + (size_t)s * n;
        for (int i = threadIdx.x * 4; i < n; i += CONSUMERS * 4) {
            *(float4*)&x_sh[i] = __ldcg((const float4*)&x[i]);
        }
#endif
        consumers_sync();
        int done_here = 0;
        for (int item = cta; item < items; item += grid, ++k) {
            const int page = k % PAGES, use = k / PAGES;
            spin([&] { return mbar_done(&full[page], use & 1); }, error, 4, gave_up);
            const uint4* w = (const uint4*)(pages + page * PAGE_BYTES + ((size_t)row * n + k0) * 2);
            float acc = 0.f;
            for (int v = lane; v < span / 8; v += 32) {
                const uint4 q = w[v];
                const float4 xa = *(const float4*)&x_sh[k0 + v * 8], xb = *(const float4*)&x_sh[k0 + v * 8 + 4];
                acc += __uint_as_float(q.x << 16) * xa.x + __uint_as_float(q.x & 0xffff0000u) * xa.y
                     + __uint_as_float(q.y << 16) * xa.z + __uint_as_float(q.y & 0xffff0000u) * xa.w
                     + __uint_as_float(q.z << 16) * xb.x + __uint_as_float(q.z & 0xffff0000u) * xb.y
                     + __uint_as_float(q.w << 16) * xb.z + __uint_as_float(q.w & 0xffff0000u) * xb.w;
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[page]);
            for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            float* part = partial + (k & 1) * CONSUMER_WARPS;
            if (lane == 0) part[warp] = acc;
            consumers_sync();
            if (threadIdx.x == 0) {  /* one thread writes the item's rows, so its release covers them */
                for (int r = 0; r < rows; ++r) {
                    float sum = 0.f;
                    for (int j = 0; j < warps_per_row; ++j) sum += part[r * warps_per_row + j];
#if TAGGED
                    st_relaxed64((u64*)xs + (size_t)(s + 1) * n + item * rows + r,
                                 (u64)(s + 2) << 32 | __float_as_uint(sum));
#else
                    xs[(size_t)(s + 1) * n + item * rows + r] = sum;
#endif
                }
                if (!TAGGED && ++done_here == mine) red_release(&counters[s], mine);
            }
        }
    }
}
"""

KERNEL = "stream_chain"
CONSUMER_WARPS = 8
X_PER_THREAD = 16


def shared_bytes(pages: int, page_bytes: int, n: int) -> int:
    """The kernel's dynamic shared memory: the ring, x, the partials, the barriers."""
    return pages * page_bytes + 4 * n + 4 * 2 * CONSUMER_WARPS + 8 * 2 * pages


def _checked(result, success, what: str):
    """The value(s) a cuda.bindings call returns after its status; RuntimeError naming `what` and the status."""
    status, *values = result
    if status != success:
        raise RuntimeError(f"{what}: {status}")
    return values[0] if len(values) == 1 else values


def compile_cubin(arch: int, pages: int, page_bytes: int, tagged: bool = False) -> tuple[bytes, str]:
    """(cubin, NVRTC's log with ptxas' resource lines) of SOURCE for sm_`arch`; RuntimeError with the log."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    prog = _checked(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"persistent_chain.cu", 0, [], []), ok, "NVRTC")
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17", b"--ptxas-options=-v",
                f"-DPAGES={pages}".encode(), f"-DPAGE_BYTES={page_bytes}".encode(), f"-DTAGGED={int(tagged)}".encode()]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log = b" " * _checked(nvrtc.nvrtcGetProgramLogSize(prog), ok, "NVRTC log")
        _checked(nvrtc.nvrtcGetProgramLog(prog, log), ok, "NVRTC log")
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if status != ok:
            raise RuntimeError(f"NVRTC could not compile {KERNEL} for sm_{arch} ({status}):\n{log}")
        cubin = b" " * _checked(nvrtc.nvrtcGetCUBINSize(prog), ok, "NVRTC cubin")
        _checked(nvrtc.nvrtcGetCUBIN(prog, cubin), ok, "NVRTC cubin")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _drv(result):
    """The value(s) of a cuda.bindings driver call; RuntimeError naming the CUDA error otherwise."""
    from cuda.bindings import driver

    return _checked(result, driver.CUresult.CUDA_SUCCESS, "CUDA driver")


class ChainKernel:
    """SOURCE compiled for this GPU with a ring of `pages` pages (`tagged`: x as tagged words, no counters), launched
    with cuLaunchKernelEx on torch's stream."""

    def __init__(self, pages: int, page_bytes: int, n: int, tagged: bool = False):
        import torch
        from cuda.bindings import driver

        if tagged and n > X_PER_THREAD * CONSUMER_WARPS * 32:
            raise ValueError(f"n = {n}: the tagged build loads at most {X_PER_THREAD * CONSUMER_WARPS * 32} inputs")
        major, minor = torch.cuda.get_device_capability()
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread: the module loads into it
        _drv(driver.cuInit(0))
        cubin, self.ptxas = compile_cubin(major * 10 + minor, pages, page_bytes, tagged)
        module = _drv(driver.cuModuleLoadData(cubin))
        self.fn = _drv(driver.cuModuleGetFunction(module, KERNEL.encode()))
        self.shared = shared_bytes(pages, page_bytes, n)
        _drv(driver.cuFuncSetAttribute(
            self.fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.shared))
        self.per_sm = _drv(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.fn, (CONSUMER_WARPS + 1) * 32, self.shared))
        self.pages, self.page_bytes, self.n, self.tagged, self._module = pages, page_bytes, n, tagged, module

    def launch(self, grid: int, args: tuple, pdl: bool):
        import torch
        from cuda.bindings import driver

        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = (CONSUMER_WARPS + 1) * 32, 1, 1
        config.sharedMemBytes = self.shared
        config.hStream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs, config.numAttrs = [attr], 1
        else:
            config.numAttrs = 0
        types = (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 5
        _drv(driver.cuLaunchKernelEx(config, self.fn, (args, types), 0))


def reference_chain(weights, x0, routed_every: int) -> list:
    """x_1..x_S in fp32 from the bf16 weights, a routed stage taking its second weight where its input's x[0] > 0."""
    xs, x = [], x0
    for s in range(len(weights) // 2):
        routed = routed_every > 0 and s % routed_every == routed_every - 1
        x = weights[2 * s + (1 if routed and x[0] > 0 else 0)].float() @ x
        xs.append(x)
    return xs


class Chain:
    """A chain of `stages` GEMVs of bf16 [n, n] weights on the GPU: two distinct weights a stage (so none is in L2
    from an earlier stage, and a routed stage has its choice), scaled to keep x near 1, with the kernel's buffers.
    x_0..x_S live in one buffer of 8 bytes an element: fp32 values in its first half, or tagged 64-bit words."""

    def __init__(self, n: int, stages: int):
        import torch

        dev = torch.device("cuda")
        self.n, self.stages = n, stages
        self.weights = [(torch.randn(n, n, device=dev) / math.sqrt(n)).to(torch.bfloat16) for _ in range(2 * stages)]
        self.pointers = torch.tensor([w.data_ptr() for w in self.weights], dtype=torch.int64, device=dev)
        self.xs = torch.zeros((stages + 1) * n, 2, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(stages, dtype=torch.int32, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)

    def runner(self, kernel: ChainKernel, grid: int, persistent: bool, pdl: bool, routed_every: int):
        """A function that runs the whole chain once: one launch of all stages, or one launch a stage."""
        if kernel.per_sm < 1:
            raise RuntimeError(f"{kernel.shared} bytes of shared memory do not fit a block on this GPU")
        buffers = (self.pointers.data_ptr(), self.xs.data_ptr(), self.counters.data_ptr(), self.error.data_ptr())

        def run():
            self.counters.zero_()
            if kernel.tagged:  # x_1..x_S lose their tags; x_0's (1) stays
                self.xs[self.n:].zero_()
            if persistent:
                kernel.launch(grid, buffers + (0, self.stages, self.n, routed_every, 0), pdl=False)
            else:
                for s in range(self.stages):
                    kernel.launch(grid, buffers + (s, 1, self.n, routed_every, int(pdl)), pdl=pdl)

        return run

    def check(self, run, routed_every: int, tagged: bool) -> tuple[int, float]:
        """(the kernel's error word, the largest error of any stage's output relative to that output's largest value)
        for one run from a fresh random x_0 against reference_chain; tagged outputs must carry their stage's tag."""
        import torch

        x0 = torch.randn(self.n, device=self.xs.device)
        self.xs.zero_()
        if tagged:
            self.xs[: self.n, 0] = x0.view(torch.int32)
            self.xs[: self.n, 1] = 1
        else:
            self.xs.view(-1)[: self.n] = x0.view(torch.int32)
        self.error.zero_()
        run()
        torch.cuda.synchronize()
        want = reference_chain(self.weights, x0, routed_every)
        if tagged:
            tags = self.xs[self.n:, 1].view(self.stages, self.n)
            expected = torch.arange(2, self.stages + 2, device=tags.device)[:, None]
            if not torch.equal(tags, expected.expand_as(tags).to(tags.dtype)):
                return int(self.error.item()), math.inf
            got = self.xs[self.n:, 0].contiguous().view(torch.float32)
        else:
            got = self.xs.view(-1)[self.n: (self.stages + 1) * self.n].view(torch.float32)
        got = got.view(self.stages, self.n)
        return int(self.error.item()), max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


# (name, ring pages, persistent, pdl, every how many stages one is routed, tagged x): the pages as two builds, 4 (two
# blocks fit an SM, so a launch's blocks can start beside the previous one's under PDL) and 12 (192 KB: the producer
# runs up to 12 pages ahead, across stages); tagged: a stage waits on its inputs' tags (one load and its retries) in
# place of a release, a poll of a counter and then the load
VARIANTS = [("one launch a stage", 4, False, False, 0, False),
            ("one launch a stage, pdl", 4, False, True, 0, False),
            ("persistent", 4, True, False, 0, False),
            ("persistent", 12, True, False, 0, False),
            ("persistent, tagged x", 12, True, False, 0, True),
            ("persistent, every 4th stage routed", 12, True, False, 4, False),
            ("persistent, tagged x, every 4th stage routed", 12, True, False, 4, True),
            ("one launch a stage, pdl, every 4th stage routed", 4, False, True, 4, False)]
BUILDS = sorted({(pages, tagged) for _, pages, _, _, _, tagged in VARIANTS})


def main():
    import torch

    from kernels import copy_bandwidth_gbps, median_us, write_result
    from roofline.bench.environment import git_commit

    props = torch.cuda.get_device_properties(0)
    copy, ways = copy_bandwidth_gbps()
    stages, page_bytes = 48, 16384
    results = {"experiment": "persistent_chain", "commit": git_commit(), "device": props.name,
               "copy_GBps": round(copy, 1), "copy_ways": ways, "stages": stages, "sms": props.multi_processor_count,
               "page_bytes": page_bytes, "rows": [], "ptxas": {}}
    for mb in (2, 8, 32):
        n = math.isqrt(mb * 2**20 // 2)  # bf16 [n, n] of mb MB: 1024, 2048, 4096
        chain = Chain(n, stages)
        kernels = {build: ChainKernel(build[0], page_bytes, n, tagged=build[1]) for build in BUILDS}
        results["ptxas"][f"n={n}"] = {f"{pages} pages{', tagged' if tagged else ''}": k.ptxas
                                      for (pages, tagged), k in kernels.items()}
        for label, pages, persistent, pdl, routed, tagged in VARIANTS:
            name, kernel = f"{mb} MB, {label}, {pages} pages", kernels[pages, tagged]
            # one block an SM either way, so that the items fall alike and (where two fit) a launch leaves room
            # beside it for the next one's blocks under PDL
            entry = {"variant": name, "n": n, "bytes_per_stage": n * n * 2, "grid": props.multi_processor_count,
                     "pages": pages, "blocks_an_sm_fit": kernel.per_sm}
            results["rows"].append(entry)
            try:
                run = chain.runner(kernel, props.multi_processor_count, persistent, pdl, routed)
                entry["error_word"], entry["max_rel_err"] = chain.check(run, routed, tagged)
                if entry["error_word"] or not entry["max_rel_err"] < 1e-3:
                    entry["failed"] = "a wait gave up" if entry["error_word"] else "outputs differ from the reference"
                    print(f"{name:64s} FAILED: {entry['failed']} (error word {entry['error_word']}, "
                          f"rel err {entry['max_rel_err']:.2e})", flush=True)
                    continue
                us = median_us(run, rep_ms=50) / stages
            except Exception as exc:  # a variant that does not run is a result too
                entry["error"] = repr(exc)[:300]
                print(f"{name:64s} ERROR {entry['error'][:200]}", flush=True)
                continue
            entry.update(us_per_stage=round(us, 2), frac_copy=round(n * n * 2 / (us * 1e-6) / 1e9 / copy, 3))
            print(f"{name:64s} {us:7.2f} us a stage  {entry['frac_copy']:.2f} of copy", flush=True)
        del chain
    write_result("persistent_chain", results)


def compile_only(archs: list[int]) -> int:
    """Compile the builds for each target; print ptxas' resource lines; 1 if any failed."""
    failed = 0
    for arch in archs:
        for pages, tagged in BUILDS:
            try:
                _, log = compile_cubin(arch, pages, 16384, tagged)
                print(f"sm_{arch}, {pages} pages{', tagged' if tagged else ''}: ok")
                print("\n".join("  " + line for line in log.splitlines() if "Used" in line or "spill" in line))
            except RuntimeError as exc:
                failed = 1
                print(f"sm_{arch}, {pages} pages{', tagged' if tagged else ''}: {exc}")
    return failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", nargs="+", type=int, metavar="SM", help="only compile for these targets")
    args = parser.parse_args()
    raise SystemExit(compile_only(args.compile_only) if args.compile_only else main())
