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

The kernel here is that structure, reduced to a chain of S GEMVs y_s = W_s x_s (W_s [n, n], x fp32), each needing
all of the previous stage's output:
- one CTA per SM (persistent: one launch runs all S stages), or one launch per stage (the same code with S = 1,
  with and without programmatic dependent launch);
- CTA b owns items b, b + G, ... of every stage, an item being the rows of W in one page;
- the producer warp copies each item's page with cp.async into a ring of PAGES pages, completion arriving on the
  page's mbarrier; it runs ahead into later stages as far as the ring allows;
- the consumer warps wait for the stage's input (thread 0 polls the previous stage's counter with ld.acquire, no
  sleep), load x into shared memory, reduce each page against it, release the page, and one thread writes the
  item's rows and, after the CTA's last item of the stage, adds its item count to the stage's counter (release);
- `tagged` builds: each output travels as a 64-bit (tag, value) word and a stage waits on its inputs' tags, with no
  counter, release or barrier at the boundary;
- `int4` builds: W in GPTQ's INT4 (a page: 16 KB of words, then those rows' fp16 scales), dequantised as fp16
  pairs (the 0x6400 trick), x as fp16 in shared memory: the real step's format and its arithmetic;
- `routed`: every 4th stage picks its weight (one of two) from the sign of its input's first element, so its
  producer must wait for the input first: the routed experts' data dependency.
Every wait gives up after ~20 ms of clock and records it, so a bug costs a failed check, not a hung device call.
"""

from __future__ import annotations

import argparse
import ctypes
import math
from typing import NamedTuple

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

/* Set by compile_cubin (-D), from the Python constants below and the Build: PAGES and PAGE_BYTES (the ring), TAGGED
   (x_s travels as 64-bit (tag s + 1, value) words and a stage waits on its inputs' tags), INT4 (W in GPTQ's INT4:
   8 nibbles a word along K, offset 8, an fp16 scale per 128; x as fp16), CONSUMER_WARPS, PARTIALS (an item's warp
   partials: 2 rows a warp at most) and X_PER_THREAD (the tagged x load's registers: n <= X_PER_THREAD * CONSUMERS). */
#if INT4 && TAGGED
#error "the INT4 build keeps the counters"
#endif
#if INT4
#define Q_BYTES (PAGE_BYTES / 33 * 32)  /* an INT4 page: Q_BYTES of words, then Q_BYTES / 32 of fp16 scales */
#endif
#define CONSUMERS (CONSUMER_WARPS * 32)
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
__device__ __forceinline__ u32 half2_of(float lo, float hi) {
    u32 r;
    asm("{ .reg .b16 l, h; cvt.rn.f16.f32 l, %1; cvt.rn.f16.f32 h, %2; mov.b32 %0, {l, h}; }"
        : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}
__device__ __forceinline__ float sum_of_half2(u32 v) {
    float lo, hi;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(v));
    return lo + hi;
}
__device__ __forceinline__ float float_of_half(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
/* acc + (w's nibbles j and j + 4 - 8, as an fp16 pair: 0x6400 | q is 1024 + q exactly) * x's pair (x_j, x_{j+4}) */
__device__ __forceinline__ u32 nibble_pair_fma(u32 w, int j, u32 x_pair, u32 acc) {
    const u32 q = ((w >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
    u32 r;
    asm("{ .reg .b32 d; sub.f16x2 d, %1, %2; fma.rn.f16x2 %0, d, %3, %4; }"
        : "=r"(r) : "r"(q), "r"(0x64086408u), "r"(x_pair), "r"(acc));  /* 0x6408: 1032 = 1024 + 8 */
    return r;
}
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

#if INT4
/* One INT4 page against x (fp16, each 8 stored as the pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7)): a warp's 512 words,
   word o of the page at lane + 32 i, its row o / (n / 8); a warp covers two rows where a row has 256 words. */
__device__ __forceinline__ void item_partials(const unsigned char* page, const unsigned short* x_h, int n, int warp,
                                              int lane, float* part) {
    const u32* q = (const u32*)page;
    const unsigned short* scale = (const unsigned short*)(page + Q_BYTES);
    const int words_per_row = n / 8;
    const bool two_rows = words_per_row < 512;
    float acc0 = 0.f, acc1 = 0.f;
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int o = warp * 512 + lane + 32 * i, r = o / words_per_row, c = o - r * words_per_row;
        const u32 w = q[o];
        const uint4 xp = *(const uint4*)&x_h[c * 8];
        u32 dot = 0;
        dot = nibble_pair_fma(w, 0, xp.x, dot);
        dot = nibble_pair_fma(w, 1, xp.y, dot);
        dot = nibble_pair_fma(w, 2, xp.z, dot);
        dot = nibble_pair_fma(w, 3, xp.w, dot);
        const float d = sum_of_half2(dot) * float_of_half(scale[r * (n / 128) + c / 16]);
        if (two_rows && i >= 8) acc1 += d; else acc0 += d;
    }
    for (int o = 16; o > 0; o /= 2) {
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, o);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, o);
    }
    if (lane == 0) {
        if (two_rows) { part[2 * warp] = acc0; part[2 * warp + 1] = acc1; } else { part[warp] = acc0; }
    }
}
#else
/* One bf16 page (rows of n) against x (fp32): warp w reduces span = n * rows / CONSUMER_WARPS elements of one row. */
__device__ __forceinline__ void item_partials(const unsigned char* page, const float* x_sh, int n, int warp,
                                              int lane, float* part) {
    const int rows = PAGE_BYTES / (2 * n), warps_per_row = CONSUMER_WARPS / rows;
    const int row = warp / warps_per_row, span = n / warps_per_row, k0 = (warp % warps_per_row) * span;
    const uint4* w = (const uint4*)(page + ((size_t)row * n + k0) * 2);
    float acc = 0.f;
    for (int v = lane; v < span / 8; v += 32) {
        const uint4 q = w[v];
        const float4 xa = *(const float4*)&x_sh[k0 + v * 8], xb = *(const float4*)&x_sh[k0 + v * 8 + 4];
        acc += __uint_as_float(q.x << 16) * xa.x + __uint_as_float(q.x & 0xffff0000u) * xa.y
             + __uint_as_float(q.y << 16) * xa.z + __uint_as_float(q.y & 0xffff0000u) * xa.w
             + __uint_as_float(q.z << 16) * xb.x + __uint_as_float(q.z & 0xffff0000u) * xb.y
             + __uint_as_float(q.w << 16) * xb.z + __uint_as_float(q.w & 0xffff0000u) * xb.w;
    }
    for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) part[warp] = acc;
}
#endif

__device__ __forceinline__ int items_of(int items, int cta, int grid) {
    return cta < items ? (items - cta + grid - 1) / grid : 0;
}

/* weights: 2 * stages bf16 [n, n] pointers (stage s: entries 2s, 2s+1, the second used only by routed stages);
   xs: [(stages + 1) * n] fp32 (TAGGED: 64-bit words, the tag high), x_s at s * n; counters (not TAGGED): per stage,
   items finished; error: 0, or which wait gave up; independent: every stage reads x_0 and waits for nothing (the
   ring's streaming bound). */
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_chain(const unsigned short* const* weights, float* xs, int* counters, int* error,
             int first_stage, int stages, int n, int routed_every, int pdl, int independent) {
    extern __shared__ __align__(128) unsigned char shared[];
    unsigned char* pages = shared;
#if INT4
    unsigned short* x_sh = (unsigned short*)(shared + PAGES * PAGE_BYTES);
    const int rows = 2 * Q_BYTES / n;                 /* rows of W an item (a page) holds */
    const int per_row = n / 8 < 512 ? 1 : n / 8 / 512; /* warp partials a row */
#else
    float* x_sh = (float*)(shared + PAGES * PAGE_BYTES);
    const int rows = PAGE_BYTES / (2 * n);
    const int per_row = CONSUMER_WARPS / rows;
#endif
    float* partial = (float*)(x_sh + n);              /* [2][PARTIALS], by item parity */
    u64* full = (u64*)(partial + 2 * PARTIALS);
    u64* empty = full + PAGES;

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

    /* the consumer warps: every warp takes its part of every item */
    int k = 0;
    for (int s = first_stage; s < first_stage + stages; ++s) {
        if (s == first_stage && pdl) grid_dependency_wait();
        const int input = independent ? 0 : s;
#if TAGGED  /* the previous item's closing barrier has every warp done with x_sh: no barrier before the load */
        load_tagged(x_sh, (const u64*)xs + (size_t)input * n, n, input + 1, error, gave_up);
#else
        if (threadIdx.x == 0 && s > first_stage && !independent) {
            spin([&] { return ld_acquire(&counters[s - 1]) >= items; }, error, 3, gave_up);
        }
        consumers_sync();
        const float* x = xs + (size_t)input * n;
#if INT4  /* as fp16, each 8 as the pairs the nibbles pair with */
        for (int c = threadIdx.x; c < n / 8; c += CONSUMERS) {
            const float4 a = __ldcg((const float4*)&x[c * 8]), b = __ldcg((const float4*)&x[c * 8 + 4]);
            *(uint4*)&x_sh[c * 8] = make_uint4(half2_of(a.x, b.x), half2_of(a.y, b.y), half2_of(a.z, b.z),
                                               half2_of(a.w, b.w));
        }
#else
        for (int i = threadIdx.x * 4; i < n; i += CONSUMERS * 4) {
            *(float4*)&x_sh[i] = __ldcg((const float4*)&x[i]);
        }
#endif
#endif
        consumers_sync();
        int done_here = 0;
        for (int item = cta; item < items; item += grid, ++k) {
            const int page = k % PAGES, use = k / PAGES;
            spin([&] { return mbar_done(&full[page], use & 1); }, error, 4, gave_up);
            float* part = partial + (k & 1) * PARTIALS;
            item_partials(pages + page * PAGE_BYTES, x_sh, n, warp, lane, part);
            __syncwarp();  /* the page's reads are done (their values summed): give it back */
            if (lane == 0) mbar_arrive(&empty[page]);
            consumers_sync();
            if (threadIdx.x == 0) {  /* one thread writes the item's rows, so its release covers them */
                for (int r = 0; r < rows; ++r) {
                    float sum = 0.f;
                    for (int j = 0; j < per_row; ++j) sum += part[r * per_row + j];
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
CONSUMER_WARPS = 8  # SOURCE's constants (compile_cubin passes them), which shared_bytes and the checks read too
PARTIALS = 16
X_PER_THREAD = 16
INT4_GROUP = 128
INT4_Q_BYTES = 16384  # an INT4 page: these bytes of words, then 1/32 of them of fp16 scales


class Build(NamedTuple):
    """One compilation of SOURCE."""
    pages: int           # the ring's pages
    tagged: bool = False  # x as tagged words, no counters
    int4: bool = False    # W in GPTQ's INT4, x as fp16 in shared memory

    @property
    def page_bytes(self) -> int:
        return INT4_Q_BYTES // 32 * 33 if self.int4 else 16384

    def name(self) -> str:
        return f"{self.pages} pages" + ", tagged" * self.tagged + ", int4" * self.int4


class Variant(NamedTuple):
    label: str
    build: Build
    persistent: bool    # one launch for all stages, or one launch a stage
    pdl: bool = False   # programmatic dependent launch between the one-stage launches
    routed_every: int = 0  # every how many stages one picks its weight from its input (0: none)
    independent: bool = False  # every stage reads x_0 and waits for nothing: the ring's streaming bound


# The ring as 4 pages (two blocks fit an SM, so a launch's blocks can start beside the previous one's under PDL) or
# 12 (~200 KB: the producer runs up to 12 pages ahead, across stages); tagged: a stage waits on its inputs' tags (one
# load and its retries) in place of a release, a poll of a counter and then the load; int4: the real step's format
VARIANTS = [Variant("one launch a stage", Build(4), False),
            Variant("one launch a stage, pdl", Build(4), False, pdl=True),
            Variant("persistent", Build(4), True),
            Variant("persistent", Build(12), True),
            Variant("persistent, tagged x", Build(12, tagged=True), True),
            Variant("persistent, stages independent (the bound)", Build(12), True, independent=True),
            Variant("persistent, every 4th stage routed", Build(12), True, routed_every=4),
            Variant("persistent, tagged x, every 4th stage routed", Build(12, tagged=True), True, routed_every=4),
            Variant("one launch a stage, pdl, every 4th stage routed", Build(4), False, pdl=True, routed_every=4),
            Variant("int4, one launch a stage, pdl", Build(4, int4=True), False, pdl=True),
            Variant("int4, persistent", Build(12, int4=True), True),
            Variant("int4, persistent, stages independent (the bound)", Build(12, int4=True), True, independent=True)]
BUILDS = sorted({v.build for v in VARIANTS})


SIZES_MB = (2, 8, 32)


def stage_n(mb: int, int4: bool) -> int:
    """n of the [n, n] weight of about mb MB: bf16 1024 / 2048 / 4096, INT4 2048 / 4096 / 8192 (its scales 1/32 more)."""
    return math.isqrt(mb * 2**20 * (4 if int4 else 1) // 2)


def layout_problems(build: Build, n: int) -> list[str]:
    """What in SOURCE's assumptions n breaks for `build` (empty: none): pages of whole rows that the 8 consumer warps
    split evenly, INT4 groups of 128 and at most two rows a warp, the tagged load's 16 words a thread."""
    problems = []
    if build.int4:
        rows, row_words = 2 * INT4_Q_BYTES // n, n // 8
        if 2 * INT4_Q_BYTES % n or n % INT4_GROUP or row_words < 256 or (row_words > 512 and row_words % 512):
            problems.append(f"an INT4 page of {INT4_Q_BYTES} bytes does not split into warps of 512 words at n = {n}")
    else:
        rows = build.page_bytes // (2 * n)
        if build.page_bytes % (2 * n) or rows > CONSUMER_WARPS or CONSUMER_WARPS % rows or n % (8 * 32):
            problems.append(f"a bf16 page of {build.page_bytes} bytes does not split into the 8 warps at n = {n}")
    if n % rows:
        problems.append(f"{n} rows are not whole pages of {rows}")
    if build.tagged and n > X_PER_THREAD * CONSUMER_WARPS * 32:
        problems.append(f"the tagged build loads at most {X_PER_THREAD * CONSUMER_WARPS * 32} inputs, not {n}")
    return problems


def shared_bytes(build: Build, n: int) -> int:
    """The kernel's dynamic shared memory: the ring, x (fp32, or fp16 for INT4), the partials, the barriers."""
    return build.pages * build.page_bytes + (2 if build.int4 else 4) * n + 4 * 2 * PARTIALS + 8 * 2 * build.pages


def _checked(result, success, what: str):
    """The value(s) a cuda.bindings call returns after its status; RuntimeError naming `what` and the status."""
    status, *values = result
    if status != success:
        raise RuntimeError(f"{what}: {status}")
    return values[0] if len(values) == 1 else values


def compile_cubin(arch: int, build: Build) -> tuple[bytes, str]:
    """(cubin, NVRTC's log with ptxas' resource lines) of SOURCE for sm_`arch`; RuntimeError with the log."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    prog = _checked(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"persistent_chain.cu", 0, [], []), ok, "NVRTC")
    try:
        opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "--ptxas-options=-v", f"-DPAGES={build.pages}",
                f"-DPAGE_BYTES={build.page_bytes}", f"-DTAGGED={int(build.tagged)}", f"-DINT4={int(build.int4)}",
                f"-DCONSUMER_WARPS={CONSUMER_WARPS}", f"-DPARTIALS={PARTIALS}", f"-DX_PER_THREAD={X_PER_THREAD}"]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        log = b" " * _checked(nvrtc.nvrtcGetProgramLogSize(prog), ok, "NVRTC log")
        _checked(nvrtc.nvrtcGetProgramLog(prog, log), ok, "NVRTC log")
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if status != ok:
            raise RuntimeError(f"NVRTC could not compile {KERNEL} ({build.name()}) for sm_{arch} ({status}):\n{log}")
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
    """SOURCE compiled for this GPU as `build` for stages of n x n, launched with cuLaunchKernelEx on torch's
    current stream (so a CUDA graph captures it)."""

    def __init__(self, build: Build, n: int):
        import torch
        from cuda.bindings import driver

        if problems := layout_problems(build, n):
            raise ValueError(f"{build.name()}: " + "; ".join(problems))
        major, minor = torch.cuda.get_device_capability()
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread: the module loads into it
        _drv(driver.cuInit(0))
        cubin, self.ptxas = compile_cubin(major * 10 + minor, build)
        module = _drv(driver.cuModuleLoadData(cubin))
        self.fn = _drv(driver.cuModuleGetFunction(module, KERNEL.encode()))
        self.shared = shared_bytes(build, n)
        _drv(driver.cuFuncSetAttribute(
            self.fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.shared))
        self.per_sm = _drv(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.fn, (CONSUMER_WARPS + 1) * 32, self.shared))
        self.build, self.n, self._module = build, n, module

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
        types = (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 6
        _drv(driver.cuLaunchKernelEx(config, self.fn, (args, types), 0))


def pack_int4_pages(q, scales):
    """The INT4 build's weight: q [n, n] in 0..15 (value (q - 8) * scale) and fp16 scales [n, n / 128] as pages of
    INT4_Q_BYTES of GPTQ words (8 nibbles a word along K, nibble i at bits 4i) followed by the same rows' scales."""
    import torch

    from roofline.quant.int4 import pack_cols

    n = q.shape[0]
    words = pack_cols(q)  # [n, n / 8]: 8 nibbles along K a word, the checkpoint's bit patterns
    items = n * n // 2 // INT4_Q_BYTES
    return torch.cat([words.reshape(items, -1).view(torch.uint8), scales.reshape(items, -1).view(torch.uint8)], 1)


def dequantize_int4_pages(pages, n: int):
    """fp32 [n, n] of pack_int4_pages' output."""
    import torch

    from roofline.quant.int4 import unpack_cols

    q = unpack_cols(pages[:, :INT4_Q_BYTES].contiguous().view(torch.int32).reshape(n, n // 8))
    scales = pages[:, INT4_Q_BYTES:].contiguous().view(torch.float16).reshape(n, n // INT4_GROUP)
    return (q - 8).float() * scales.float().repeat_interleave(INT4_GROUP, dim=1)


def reference_chain(weights, x0, routed_every: int, int4: bool = False, independent: bool = False) -> list:
    """x_1..x_S in fp32 from the weights (bf16 [n, n], or INT4 pages with x rounded to fp16 as the kernel's),
    a routed stage taking its second weight where its input's x[0] > 0; `independent`: every stage from x_0."""
    xs, x = [], x0
    for s in range(len(weights) // 2):
        x_in = x0 if independent else x
        routed = routed_every > 0 and s % routed_every == routed_every - 1
        w = weights[2 * s + (1 if routed and x_in[0] > 0 else 0)]
        x = dequantize_int4_pages(w, x.numel()) @ x_in.half().float() if int4 else w.float() @ x_in
        xs.append(x)
    return xs


class Chain:
    """A chain of `stages` GEMVs of [n, n] weights on the GPU (bf16, or INT4 pages): two distinct weights a stage
    (so none is in L2 from an earlier stage, and a routed stage has its choice), scaled to keep x near 1, with the
    kernel's buffers. x_0..x_S live in one buffer of 8 bytes an element: fp32 values in its first half, or tagged
    64-bit words."""

    def __init__(self, n: int, stages: int, int4: bool = False):
        import torch

        dev = torch.device("cuda")
        self.n, self.stages, self.int4 = n, stages, int4
        if int4:  # (q - 8) has std ~4.6: scales of ~1 / (4.6 sqrt(n)) keep x near 1
            self.weights = [pack_int4_pages(torch.randint(0, 16, (n, n), device=dev),
                                            ((torch.rand(n, n // INT4_GROUP, device=dev) + 0.5)
                                             / (4.6 * math.sqrt(n))).half()) for _ in range(2 * stages)]
        else:
            self.weights = [(torch.randn(n, n, device=dev) / math.sqrt(n)).to(torch.bfloat16)
                            for _ in range(2 * stages)]
        self.bytes_per_stage = self.weights[0].numel() * self.weights[0].element_size()
        self.pointers = torch.tensor([w.data_ptr() for w in self.weights], dtype=torch.int64, device=dev)
        self.xs = torch.zeros((stages + 1) * n, 2, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(stages, dtype=torch.int32, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)

    def runner(self, kernel: ChainKernel, grid: int, variant: Variant):
        """A function that runs the whole chain once: one launch of all stages, or one launch a stage."""
        if kernel.per_sm < 1:
            raise RuntimeError(f"{kernel.shared} bytes of shared memory do not fit a block on this GPU")
        if kernel.build.int4 != self.int4 or kernel.n != self.n:
            raise ValueError(f"a kernel built for {kernel.build.name()}, n = {kernel.n} on a chain of n = {self.n}")
        buffers = (self.pointers.data_ptr(), self.xs.data_ptr(), self.counters.data_ptr(), self.error.data_ptr())
        routed, pdl, independent = variant.routed_every, variant.pdl, int(variant.independent)

        def run():
            self.counters.zero_()
            if kernel.build.tagged:  # x_1..x_S lose their tags; x_0's (1) stays
                self.xs[self.n:].zero_()
            if variant.persistent:
                kernel.launch(grid, buffers + (0, self.stages, self.n, routed, 0, independent), pdl=False)
            else:
                for s in range(self.stages):
                    kernel.launch(grid, buffers + (s, 1, self.n, routed, int(pdl), independent), pdl=pdl)

        return run

    def check(self, run, variant: Variant) -> tuple[int, float]:
        """(the kernel's error word, the largest error of any stage's output relative to that output's largest value)
        for one run from a fresh random x_0 against reference_chain; tagged outputs must carry their stage's tag."""
        import torch

        tagged = variant.build.tagged
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
        want = reference_chain(self.weights, x0, variant.routed_every, self.int4, variant.independent)
        if tagged:
            tags = self.xs[self.n:, 1].view(self.stages, self.n)
            expected = torch.arange(2, self.stages + 2, device=tags.device, dtype=tags.dtype)[:, None]
            if not torch.equal(tags, expected.expand_as(tags)):
                return int(self.error.item()), math.inf
            got = self.xs[self.n:, 0].contiguous().view(torch.float32)
        else:
            got = self.xs.view(-1)[self.n: (self.stages + 1) * self.n].view(torch.float32)
        got = got.view(self.stages, self.n)
        return int(self.error.item()), max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def tolerance(build: Build) -> float:
    """How far a stage's output may be from the reference's, relative to its largest value: fp32 sums in any order
    (bf16), or fp16 sums of 8 products before the fp32 ones (INT4)."""
    return 1e-2 if build.int4 else 1e-3


def main():
    import torch

    from kernels import copy_bandwidth_gbps, median_us, write_result
    from roofline.bench.environment import git_commit

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    copy, ways = copy_bandwidth_gbps()
    stages = 48
    results = {"experiment": "persistent_chain", "commit": git_commit(), "device": props.name,
               "copy_GBps": round(copy, 1), "copy_ways": ways, "stages": stages, "sms": sms, "rows": [], "ptxas": {}}
    for mb in SIZES_MB:
        for int4 in (False, True):
            n = stage_n(mb, int4)
            chain = Chain(n, stages, int4)
            variants = [v for v in VARIANTS if v.build.int4 == int4]
            kernels = {b: ChainKernel(b, n) for b in sorted({v.build for v in variants})}
            results["ptxas"].update({f"{b.name()}, n={n}": k.ptxas for b, k in kernels.items()})
            for variant in variants:
                name, kernel = f"{mb} MB, {variant.label}, {variant.build.pages} pages", kernels[variant.build]
                # one block an SM either way, so that the items fall alike and (where two fit) a launch leaves room
                # beside it for the next one's blocks under PDL
                entry = {"variant": name, "n": n, "bytes_per_stage": chain.bytes_per_stage, "grid": sms,
                         "build": variant.build._asdict(), "blocks_an_sm_fit": kernel.per_sm}
                results["rows"].append(entry)
                try:
                    run = chain.runner(kernel, sms, variant)
                    entry["error_word"], entry["max_rel_err"] = chain.check(run, variant)
                    if entry["error_word"] or not entry["max_rel_err"] < tolerance(variant.build):
                        entry["failed"] = "a wait gave up" if entry["error_word"] else "outputs differ from the reference"
                        print(f"{name:64s} FAILED: {entry['failed']} (error word {entry['error_word']}, "
                              f"rel err {entry['max_rel_err']:.2e})", flush=True)
                        continue
                    us = median_us(run, rep_ms=50) / stages
                except Exception as exc:  # a variant that does not run is a result too
                    entry["error"] = repr(exc)[:300]
                    print(f"{name:64s} ERROR {entry['error'][:200]}", flush=True)
                    continue
                frac = chain.bytes_per_stage / (us * 1e-6) / 1e9 / copy
                entry.update(us_per_stage=round(us, 2), frac_copy=round(frac, 3))
                print(f"{name:64s} {us:7.2f} us a stage  {frac:.2f} of copy", flush=True)
            del chain, kernels
    write_result("persistent_chain", results)


def compile_only(archs: list[int]) -> int:
    """Compile the builds for each target; print ptxas' resource lines; 1 if any failed."""
    failed = 0
    for arch in archs:
        for build in BUILDS:
            try:
                _, log = compile_cubin(arch, build)
                print(f"sm_{arch}, {build.name()}: ok")
                print("\n".join("  " + line for line in log.splitlines() if "Used" in line or "spill" in line))
            except RuntimeError as exc:
                failed = 1
                print(f"sm_{arch}, {build.name()}: {exc}")
    return failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", nargs="+", type=int, metavar="SM", help="only compile for these targets")
    args = parser.parse_args()
    raise SystemExit(compile_only(args.compile_only) if args.compile_only else main())
