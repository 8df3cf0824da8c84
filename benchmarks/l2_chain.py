"""Experiment: does reading the next kernel's weights into L2 beside the current kernel shorten a chain of GEMVs?

    PYTHONPATH=$PWD python benchmarks/l2_chain.py            (CUDA only; JSON to $OUT/l2_chain.json)

Why: each decode kernel moves 5-30 MB and reaches 0.3-0.5 of the copy bandwidth; cuBLAS does no better at
these sizes (BF16 GEMV of 12.6 MB: 0.35, NOTES-kernels run 5), so the loss is per kernel (ramp, tail, latency
chain), not the kernels' loops. In-kernel L2 prefetch of a kernel's own slice did not help (run 10). Here a
second stream streams kernel j+1's weights (qweight) while kernel j runs, so kernel j+1 finds them in L2.

Chain: pairs (in_proj_qkv 12288x3072 INT4, out_proj 3072x8192 INT4) at M=1, rotating over enough weight sets
that none is in L2 from an earlier use. Variants: plain; a reader of loads beside; a reader of
prefetch.global.L2 beside; and the chain with one weight set repeated (all in L2: the bound of the idea).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import copy_bandwidth_gbps, int4_bytes, median_us, random_int4, write_result


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 128-byte lines holding `ptrs` where `mask` (one `prefetch.global.L2` per element)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read_kernel(ptr, n, out_ptr, BLOCK: tl.constexpr):
    """Load n int32 words through L2 (grid-strided); store only if an impossible xor comes out (keeps the loads)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    total = tl.reduce(acc, 0, _xor)
    tl.store(out_ptr + pid, total, mask=total == 0x1234567)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _prefetch_kernel(ptr, n, BLOCK: tl.constexpr):
    """prefetch.global.L2 of every 128-byte line of n int32 words (grid-strided)."""
    pid = tl.program_id(0)
    for start in range(pid * BLOCK * 32, n, tl.num_programs(0) * BLOCK * 32):
        offs = start + tl.arange(0, BLOCK) * 32
        prefetch_l2(ptr + offs, offs < n)


def main():
    from roofline.kernels.int4_gemv import int4_matmul

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy, ways = copy_bandwidth_gbps()
    shapes = [(12288, 3072), (3072, 8192)]
    pair_bytes = sum(int4_bytes(n, k) for n, k in shapes)
    sets = [[random_int4(n, k) for n, k in shapes] for _ in range(6)]  # 6 x 32 MB: > 3x L2
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]
    sink = torch.zeros(4 * sms, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    pairs = 24

    def gemv(i, j):
        qw, qz, sc = sets[i % len(sets)][j]
        int4_matmul(xs[j], qw, qz, sc, 128, sym=True)

    def reader(kind, programs):
        def run(i, j):
            qw = sets[i % len(sets)][j][0]
            if kind == "load":
                _read_kernel[(programs,)](qw, qw.numel(), sink, BLOCK=4096, num_warps=4)
            else:
                _prefetch_kernel[(programs,)](qw, qw.numel(), BLOCK=128, num_warps=4)
        return run

    def chain(read=None, one_set=False):
        def fn():
            main = torch.cuda.current_stream()
            for p in range(pairs):
                i = 0 if one_set else p
                for j in range(2):
                    if read is not None:  # kernel (i, j)'s successor's weights, beside kernel (i, j)
                        ni, nj = (i, 1) if j == 0 else ((0 if one_set else p + 1), 0)
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            read(ni, nj)
                    gemv(i, j)
            if read is not None:
                main.wait_stream(side)
        return fn

    results = {"copy_GBps": round(copy, 1), "copy_ways": ways, "pair_bytes": pair_bytes, "pairs": pairs, "variants": {}}
    variants = {"plain": chain(), "all in L2 (one set)": chain(one_set=True)}
    for programs in (sms, 2 * sms):
        variants[f"load reader x{programs}"] = chain(reader("load", programs))
        variants[f"prefetch reader x{programs}"] = chain(reader("prefetch", programs))
    for name, fn in variants.items():
        t = median_us(fn, rep_ms=50) / pairs
        results["variants"][name] = {"pair_us": round(t, 2), "frac_copy": round(pair_bytes / (t * 1e-6) / 1e9 / copy, 3)}
        print(f"{name:28s} {t:8.2f} us a pair   {pair_bytes / (t * 1e-6) / 1e9 / copy:5.2f} of copy", flush=True)
    for programs in (sms, 2 * sms):  # the reader alone: how fast it streams
        qw = sets[0][0][0]
        t = median_us(lambda: _read_kernel[(programs,)](qw, qw.numel(), sink, BLOCK=4096, num_warps=4), rep_ms=20)
        results["variants"][f"reader alone x{programs} (in_proj, L2-warm)"] = {"us": round(t, 2)}
        print(f"reader alone x{programs}: {t:.2f} us for {qw.numel() * 4 / 1e6:.1f} MB (L2-warm)", flush=True)
    write_result("l2_chain", results)


if __name__ == "__main__":
    main()
