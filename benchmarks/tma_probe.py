"""Experiment: how fast can the INT4 GEMV's weight slices be read, by plain loads and by TMA (tensor descriptors)?

    PYTHONPATH=$PWD python benchmarks/tma_probe.py            (CUDA sm_90+; JSON to $OUT/tma_probe.json)

Why: the INT4 tc kernels spend most of their time loading (the loads-only probe of NOTES-kernels run 4), keep
~64 KB in flight per SM in registers, and neither more register buffers (run 7), a cp.async pipeline (run 9) nor
L2 prefetch (run 10) helped. TMA moves a whole [rows, 128-column] tile per instruction into shared memory with no
register held while in flight, and Triton pipelines descriptor loads over `num_stages`. This probe reads the
qweight [K/8, N] of in_proj_qkv (12288 x 3072, 18.9 MB) the way the GEMV's programs do (a column tile, a range of
packed rows per K split) and xors it into a register (no math), so the time is what the loads alone cost. Rows:
plain `tl.load` (stages 1, the register loop; stages 3, Triton's cp.async pipeline) against `desc.load` at 2-4
stages, over tile heights, K splits and programs. Weights rotate over 6 copies (> 3x L2); timing as
benchmarks/kernels.py (graph replays, median).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import Rotor, copy_bandwidth_gbps, median_us, write_result


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _finish(acc, out_ptr):
    total = tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out_ptr + pid, total, mask=total == 0x1234567)  # never true in practice: keeps the loads


@triton.jit
def _probe_loads(qw, N, ROWS_PER_SPLIT, out_ptr, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    r0 = tl.program_id(1) * ROWS_PER_SPLIT
    cols = tl.program_id(0) * BC + tl.arange(0, BC)[None, :]
    acc = tl.zeros([BR, BC], dtype=tl.int32)
    for r in tl.range(r0, r0 + ROWS_PER_SPLIT, BR, num_stages=STAGES):
        acc ^= tl.load(qw + (r + tl.arange(0, BR)[:, None]) * N + cols)
    _finish(acc, out_ptr)


@triton.jit
def _probe_tma(desc, ROWS_PER_SPLIT, out_ptr, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    r0 = tl.program_id(1) * ROWS_PER_SPLIT
    c0 = tl.program_id(0) * BC
    acc = tl.zeros([BR, BC], dtype=tl.int32)
    for r in tl.range(r0, r0 + ROWS_PER_SPLIT, BR, num_stages=STAGES):
        acc ^= desc.load([r, c0])
    _finish(acc, out_ptr)


def main():
    n, k = 12288, 3072
    kp = k // 8
    copy, ways = copy_bandwidth_gbps()
    sets = [torch.randint(-(2**31), 2**31 - 1, (kp, n), dtype=torch.int32, device="cuda") for _ in range(6)]
    nbytes = kp * n * 4
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    rows = []

    def record(name, fn):
        try:
            t = median_us(fn)
        except Exception as exc:  # a variant that does not compile or run is a result too
            rows.append({"variant": name, "error": repr(exc)[:300]})
            print(f"{name:48s} ERROR {repr(exc)[:150]}", flush=True)
            return
        frac = nbytes / (t * 1e-6) / 1e9 / copy
        rows.append({"variant": name, "us": round(t, 2), "frac_copy": round(frac, 3)})
        print(f"{name:48s} {t:8.2f} us  {frac:5.2f} of copy", flush=True)

    for bc in (128,):
        tiles = n // bc
        for split in (1, 2, 4, 8):
            rps = kp // split
            for br in (16, 32, 64):
                if rps % br:
                    continue
                grid = (tiles, split)
                for stages in (1, 3):
                    record(f"loads BC{bc} split{split} BR{br} stages{stages}", Rotor(
                        lambda qw, bc=bc, br=br, stages=stages, grid=grid, rps=rps: _probe_loads[grid](
                            qw, n, rps, sink, BR=br, BC=bc, STAGES=stages, num_warps=4), [(w,) for w in sets]))
                descs = [(TensorDescriptor.from_tensor(w, [br, bc]),) for w in sets]
                for stages in (2, 3, 4):
                    record(f"tma   BC{bc} split{split} BR{br} stages{stages}", Rotor(
                        lambda d, bc=bc, br=br, stages=stages, grid=grid, rps=rps: _probe_tma[grid](
                            d, rps, sink, BR=br, BC=bc, STAGES=stages, num_warps=4), descs))
    result = {"copy_GBps": round(copy, 1), "copy_ways": ways, "bytes": nbytes, "shape": f"qweight [{kp}, {n}] int32",
              "rows": rows}
    write_result("tma_probe", result)
    best = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:8]
    print("best:", *(f"{r['variant']} {r['us']} us {r['frac_copy']}" for r in best), sep="\n  ")


if __name__ == "__main__":
    main()
