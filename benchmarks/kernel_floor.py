"""Experiment: what one decode kernel costs in a captured chain, before any math: the floor the step's structure sets.

    PYTHONPATH=$PWD python benchmarks/kernel_floor.py          (CUDA sm_90+; JSON to $OUT/kernel_floor.json)

Why: the 122B step runs ~7 dependent kernels a layer on its critical path, and each costs ~6.5 us more than its bytes
at the copy bandwidth (run 12's profile: in_proj 14.4 us for 7.3 us of bytes, GDN 8.6 / 2, out_proj 9.1 / 1.5, router
7 / 0.35, experts gate_up 12.7 / 5.9, down 8.9 / 2.9). Whether 0.70 of the ceiling (1.9 ms) is reachable with ~7
kernels a layer, or needs fewer (a persistent kernel per layer), turns on how much of that ~6.5 us any kernel pays.
This times chains of 48 synthetic kernels, each reading the previous one's output (as the step's kernels do), in one
CUDA graph, with and without programmatic dependent launch (the project's `wait_for_inputs`):

- `empty`: every program waits, reads one word of the previous kernel's output, writes one: launch + hand-off;
- `arrive`: `empty` plus the split-K reduction the GEMVs run (a partial each, `_common.arrive`, the last program of
  each column tile sums its tile's partials): what one arrival round adds; `atomic add`: the same splits each add
  into the output with one relaxed atomic instead (what a GEMV whose consumer reads fp32 sums could do);
- two stages in one launch, the way a persistent per-layer kernel would chain a layer's ops, were rows here until
  session 24: spinning on an atomic counter (session 17, H200) 6.56 us a stage at 8 MB against 3.75 as two launches;
  each program owning an item of both stages, its B share loaded before it polls (session 21's design, H100, session
  24) 4.25 us a stage at 8 MB against 3.86 as two launches with the whole share before the PDL wait, and 2-4x slower
  where B waits on 8 A items. A persistent kernel saves nothing at the dependency that PDL does not, so the rows went;
- `stream S MB`: every program streams its contiguous share of an S MB weight (a distinct weight per kernel, so none
  is in L2 from an earlier one) in 2 KB steps (a 4-warp GEMV program's step), one step ahead of its use, as the
  GEMVs' loop does, then the arrival round: the most any GEMV of that size can reach in the chain. At 2-3 programs per SM the
  next kernel's programs fit beside the running ones under PDL; `prefetch` asks L2 for the program's whole share
  before the wait (run 10 tried that with full SMs, where it only added work); `whole share` loads the program's whole
  share into registers before the wait (session 20): under PDL a kernel's weight reads then overlap the previous
  kernel's tail entirely, not just its first step. If that row streams near the copy bandwidth where the one-step rows
  reach ~0.55 at 8 MB, the GEMVs should issue all their weight loads before the wait (the decode step's weights never
  depend on the previous kernel).

Per row: microseconds per kernel (median of graph replays / 48) and, for `stream`, the fraction of the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import copy_bandwidth_gbps, median_us, write_result
from l2_chain import prefetch_l2
from roofline.kernels._common import arrive, pdl_options, reset, sum_splits, wait_for_inputs

CHAIN = 48
SPLIT = 8  # K splits per column tile in the arrive / stream rows, as the GEMVs' ~6-8


@triton.jit
def _stream_share(w_ptr, offs, end, w_first, WORDS, BLOCK: tl.constexpr):
    """xor of the words [offs[0], end) in BLOCK-word steps, each step's load issued one step ahead of its use, as the
    GEMVs' loop does; w_first is the first step, loaded by the caller (before its wait)."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    w_next = w_first
    for step in range(0, WORDS, BLOCK):
        w = w_next
        nxt = offs + step + BLOCK
        w_next = tl.load(w_ptr + nxt, mask=nxt < end, other=0)
        acc ^= w
    return acc


@triton.jit
def _floor_kernel(in_ptr, out_ptr, w_ptr, ws_ptr, cnt_ptr, WORDS_PER_PROGRAM, SPLIT_K, BLOCK: tl.constexpr,
                  STREAM: tl.constexpr, ARRIVE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                  ATOMIC: tl.constexpr = False, SHARE: tl.constexpr = 0):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    pid = tile * SPLIT_K + split
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if STREAM:  # this program's share of the weight: words [base, end)
        base = pid.to(tl.int64) * WORDS_PER_PROGRAM
        end = base + WORDS_PER_PROGRAM
        offs = base + tl.arange(0, BLOCK)
        if PREFETCH:
            for p in range(0, WORDS_PER_PROGRAM, BLOCK * 32):  # one prefetch per 128-byte line (32 words)
                lines = base + p + tl.arange(0, BLOCK) * 32
                prefetch_l2(w_ptr + lines, lines < end)
        if SHARE:  # the whole share (SHARE >= WORDS_PER_PROGRAM words, a power of two) before the wait
            words = tl.arange(0, SHARE)
            share = tl.load(w_ptr + base + words, mask=words < WORDS_PER_PROGRAM, other=0)
        else:
            w_next = tl.load(w_ptr + offs, mask=offs < end, other=0)  # the first step, before the wait (as the GEMVs)
    wait_for_inputs(PDL)
    x = tl.load(in_ptr + tile)  # the previous kernel's output
    if STREAM:
        if SHARE:
            acc = tl.reduce(tl.reshape(share, [SHARE // BLOCK, BLOCK]), 0, _xor)
        else:
            acc = _stream_share(w_ptr, offs, end, w_next, WORDS_PER_PROGRAM, BLOCK)
    total = tl.reduce(acc, 0, _xor) ^ x
    if ATOMIC:  # the split-K sum as one relaxed atomic add per program into the output: no arrival round
        tl.atomic_add(out_ptr + tile, total & 1, sem="relaxed", scope="gpu")
    elif ARRIVE:
        tl.store(ws_ptr + split * tl.num_programs(0) + tile, (total & 1).to(tl.float32))
        if arrive(cnt_ptr + tile, SPLIT_K):
            s = tl.arange(0, 1)
            part = sum_splits(ws_ptr, tl.num_programs(0), tile + s[:, None], s[:, None] >= 0, SPLIT_K, 8, 8)
            tl.store(out_ptr + tile + s, tl.sum(part, axis=1).to(tl.int32))
            reset(cnt_ptr + tile)
    elif split == 0:
        tl.store(out_ptr + tile, total & 1)


@triton.jit
def _xor(a, b):
    return a ^ b


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy, ways = copy_bandwidth_gbps()
    results = {"copy_GBps": round(copy, 1), "copy_ways": ways, "chain": CHAIN, "sms": sms, "rows": []}
    bufs = [torch.zeros(64 * sms, dtype=torch.int32, device=dev) for _ in range(2)]
    cnt = torch.zeros(64 * sms, dtype=torch.int32, device=dev)

    def weights_of(mb, programs, block):
        """(words a program, CHAIN distinct weights of about mb MB: none is in L2 from an earlier kernel)."""
        words = int(mb * 2**20 / 4 / programs) // block * block
        return words, [torch.randint(-2**31, 2**31 - 1, (programs * words,), dtype=torch.int32, device=dev)
                       for _ in range(CHAIN)]

    def measure(name, chain, per, programs, nbytes=0):
        """Time `chain` (CHAIN kernels' or stages' worth) and record its row: microseconds `per` kernel or stage."""
        try:
            us = median_us(chain, rep_ms=50) / CHAIN
        except Exception as exc:  # a variant that does not compile or run is a result too
            results["rows"].append({"variant": name, "error": repr(exc)[:300]})
            print(f"{name:52s} ERROR {repr(exc)[:150]}", flush=True)
            return
        entry = {"variant": name, "programs": programs, f"us_per_{per}": round(us, 2)}
        if nbytes:
            entry.update(bytes=nbytes, frac_copy=round(nbytes / (us * 1e-6) / 1e9 / copy, 3))
        results["rows"].append(entry)
        print(f"{name:52s} {us:7.2f} us a {per}" + (f"  {entry['frac_copy']:.2f} of copy" if nbytes else ""), flush=True)

    def row(name, tiles, split, stream_mb=0.0, pdl=True, prefetch=False, block=512, warps=4, atomic=False,
            whole=False):
        """CHAIN launches of _floor_kernel on a (tiles, split) grid (`atomic`: the splits add into the output
        instead of an arrival round; `whole`: each program loads its whole share before the wait, on enough warps
        for ~64 words a thread)."""
        programs = tiles * split
        words, weights = weights_of(stream_mb, programs, block) if stream_mb else (0, [None])
        share = max(block, triton.next_power_of_2(words)) if whole else 0
        warps = max(warps, min(16, share // (64 * 32))) if whole else warps
        ws = torch.zeros(split * tiles, dtype=torch.float32, device=dev)
        opts = pdl_options(dev) if pdl else {"PDL": False}

        def chain():
            for i in range(CHAIN):
                w = weights[i % len(weights)]
                _floor_kernel[(tiles, split)](bufs[i % 2], bufs[(i + 1) % 2], w if w is not None else ws, ws, cnt,
                                              words, split, BLOCK=block, STREAM=bool(stream_mb), ARRIVE=split > 1,
                                              PREFETCH=prefetch, ATOMIC=atomic, SHARE=share, num_warps=warps, **opts)

        measure(name, chain, "kernel", programs, programs * words * 4)

    for pdl in (True, False):
        tag = "pdl" if pdl else "no pdl"
        row(f"empty, {sms} programs, {tag}", sms, 1, pdl=pdl)
        row(f"empty, {6 * sms} programs, {tag}", 6 * sms, 1, pdl=pdl)
        row(f"arrive, {6 * sms // SPLIT} tiles x split {SPLIT}, {tag}", 6 * sms // SPLIT, SPLIT, pdl=pdl)
        row(f"atomic add, {6 * sms // SPLIT} tiles x split {SPLIT}, {tag}", 6 * sms // SPLIT, SPLIT, pdl=pdl, atomic=True)
    for mb in (2, 8):  # no split-K: each program's share is a whole output (no arrival round at all)
        row(f"stream {mb} MB, 6 programs/SM, no split, pdl", 6 * sms, 1, stream_mb=mb)
        for pps in (3, 6):
            row(f"stream {mb} MB, {pps} programs/SM, no split, pdl, whole share before the wait", pps * sms, 1,
                stream_mb=mb, whole=True)
    for mb in (2, 8, 32):
        for pps in (2, 3, 6):
            tiles = pps * sms // SPLIT
            row(f"stream {mb} MB, {pps} programs/SM, pdl", tiles, SPLIT, stream_mb=mb)
            row(f"stream {mb} MB, {pps} programs/SM, pdl, prefetch", tiles, SPLIT, stream_mb=mb, prefetch=True)
            row(f"stream {mb} MB, {pps} programs/SM, pdl, whole share before the wait", tiles, SPLIT, stream_mb=mb,
                whole=True)
        row(f"stream {mb} MB, 6 programs/SM, pdl, atomic add", 6 * sms // SPLIT, SPLIT, stream_mb=mb, atomic=True)
        row(f"stream {mb} MB, 6 programs/SM, no pdl", 6 * sms // SPLIT, SPLIT, stream_mb=mb, pdl=False)
    write_result("kernel_floor", results)


if __name__ == "__main__":
    main()
