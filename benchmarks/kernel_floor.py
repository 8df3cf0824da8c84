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
- `fused pair`: two `stream` stages in one launch, the second's items waiting inside the kernel for all of the first's
  (ticket order, a spin on a counter), against the same stages as two launches: what a persistent per-layer kernel
  would save at each dependency; `persistent pair` (session 21): the same two stages where each program owns one
  item of each, loads its whole B share before the dependency is met and polls with a sleep, not an atomic: the
  session-17 pair spun on an atomic add and loaded only B's first step first, so it measured the spin, not the idea.
  Against `stream ... no split, whole share before the wait` (two launches, same programs, same shares);
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
def _fused_pair_kernel(in_ptr, mid_ptr, out_ptr, wa_ptr, wb_ptr, sync_ptr, WORDS_PER_ITEM, ITEMS,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Two dependent streaming stages in one launch, the way a persistent per-layer kernel would chain a layer's ops:
    ITEMS items of stage A, then ITEMS of stage B, handed out in ticket order (sync_ptr[0], so every A item is held by
    a running program before any B item is taken: no deadlock); a B item loads its first step, then waits until every
    A item has written (sync_ptr[1] == ITEMS), as a GEMV needs its whole input vector. The last program out resets
    the counters (sync_ptr[2]) for the next launch."""
    wait_for_inputs(PDL)
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    item = t % ITEMS
    base = item.to(tl.int64) * WORDS_PER_ITEM
    end = base + WORDS_PER_ITEM
    offs = base + tl.arange(0, BLOCK)
    if t < ITEMS:
        acc = _stream_share(wa_ptr, offs, end, tl.load(wa_ptr + offs, mask=offs < end, other=0), WORDS_PER_ITEM, BLOCK)
        x = tl.load(in_ptr + item % 64)
        tl.store(mid_ptr + item, (tl.reduce(acc, 0, _xor) ^ x) & 1)
        arrive(sync_ptr + 1, ITEMS)  # publishes the store (barrier, then an acq_rel add)
    else:
        w_first = tl.load(wb_ptr + offs, mask=offs < end, other=0)  # before the wait
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        while done < ITEMS:
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        x = tl.load(mid_ptr + (item * 7) % ITEMS, cache_modifier=".cg")
        acc = _stream_share(wb_ptr, offs, end, w_first, WORDS_PER_ITEM, BLOCK)
        tl.store(out_ptr + item % 64, (tl.reduce(acc, 0, _xor) ^ x) & 1)
    if arrive(sync_ptr + 2, 2 * ITEMS):
        reset(sync_ptr)
        reset(sync_ptr + 1)
        reset(sync_ptr + 2)


# One poll of a counter after a short sleep: ld.acquire at gpu scope (the data read after it sees what the producers
# stored before their release add), no read-modify-write on the hot line.
POLL_ASM = tl.constexpr("{ nanosleep.u32 200; ld.acquire.gpu.global.b32 $0, [$1]; }")


@triton.jit
def _poll(ptr):
    got = tl.inline_asm_elementwise(POLL_ASM, "=r,l", [ptr + tl.zeros([1], dtype=tl.int32)], dtype=tl.int32,
                                    is_pure=False, pack=1)
    return tl.max(got, 0)


@triton.jit
def _persistent_pair_kernel(in_ptr, mid_ptr, out_ptr, wa_ptr, wb_ptr, sync_ptr, WORDS, ITEMS, GROUP,
                            SHARE: tl.constexpr, PDL: tl.constexpr):
    """Two dependent streaming stages in one launch, as a persistent per-layer kernel would chain a GEMV into the
    next: program p owns item p of stage A and item p of stage B (ITEMS programs, all resident). It loads its whole A
    share before the PDL wait, reduces it, publishes its output with a release add on its group's counter (GROUP A
    items a counter, counters 32 words apart), loads its whole B share at once, and only then polls the counter of the
    A group its B item reads (GROUP == ITEMS: all of A, as a GEMV over the whole vector; smaller: a K-split GEMV's
    slice). So B's weight reads overlap A's tail on every SM, which two launches cannot do. The last program out resets
    the counters for the next launch."""
    item = tl.program_id(0)
    words = tl.arange(0, SHARE)
    wmask = words < WORDS
    base = item.to(tl.int64) * WORDS
    share = tl.load(wa_ptr + base + words, mask=wmask, other=0)
    wait_for_inputs(PDL)
    x = tl.load(in_ptr + item % 64)
    tl.store(mid_ptr + item, (tl.reduce(share, 0, _xor) ^ x) & 1)
    groups = tl.cdiv(ITEMS, GROUP)
    arrive(sync_ptr + 32 * (item // GROUP), 0)  # the barrier and release add publish the store (result unused)
    share = tl.load(wb_ptr + base + words, mask=wmask, other=0)  # before B's dependency is met
    src = (item * 7 + 3) % groups  # a group other than its own, where there are several
    need = tl.minimum(GROUP, ITEMS - src * GROUP)
    done = _poll(sync_ptr + 32 * src)
    while done < need:
        done = _poll(sync_ptr + 32 * src)
    x = tl.load(mid_ptr + src * GROUP + item % need, cache_modifier=".cg")
    tl.store(out_ptr + item % 64, (tl.reduce(share, 0, _xor) ^ x) & 1)
    finish = sync_ptr + 32 * groups
    if arrive(finish, ITEMS):
        for g in range(groups):
            reset(sync_ptr + 32 * g)
        reset(finish)


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

    def pair_row(name, mb, pps, pdl=True, block=512):
        """CHAIN / 2 launches of _fused_pair_kernel: two mb-MB stages each, pps programs per SM a stage."""
        items = pps * sms
        words, weights = weights_of(mb, items, block)
        mid = torch.zeros(items, dtype=torch.int32, device=dev)
        sync = torch.zeros(4, dtype=torch.int32, device=dev)
        opts = pdl_options(dev) if pdl else {"PDL": False}

        def chain():
            for i in range(CHAIN // 2):
                _fused_pair_kernel[(2 * items,)](bufs[i % 2], mid, bufs[(i + 1) % 2], weights[2 * i], weights[2 * i + 1],
                                                 sync, words, items, BLOCK=block, num_warps=4, **opts)

        measure(name, chain, "stage", 2 * items, items * words * 4)  # per stage: comparable with one kernel's row

    def persistent_row(name, mb, pps, group):
        """CHAIN / 2 launches of _persistent_pair_kernel: two mb-MB stages each, pps programs per SM, B items waiting
        on `group` A items (None: all of A)."""
        items = pps * sms
        words, weights = weights_of(mb, items, 1)
        share = triton.next_power_of_2(words)
        mid = torch.zeros(items, dtype=torch.int32, device=dev)
        sync = torch.zeros(32 * (items + 1), dtype=torch.int32, device=dev)

        def chain():
            for i in range(CHAIN // 2):
                _persistent_pair_kernel[(items,)](bufs[i % 2], mid, bufs[(i + 1) % 2], weights[2 * i],
                                                  weights[2 * i + 1], sync, words, items, group or items, SHARE=share,
                                                  num_warps=4, **pdl_options(dev))

        measure(name, chain, "stage", items, items * words * 4)

    for pdl in (True, False):
        tag = "pdl" if pdl else "no pdl"
        row(f"empty, {sms} programs, {tag}", sms, 1, pdl=pdl)
        row(f"empty, {6 * sms} programs, {tag}", 6 * sms, 1, pdl=pdl)
        row(f"arrive, {6 * sms // SPLIT} tiles x split {SPLIT}, {tag}", 6 * sms // SPLIT, SPLIT, pdl=pdl)
        row(f"atomic add, {6 * sms // SPLIT} tiles x split {SPLIT}, {tag}", 6 * sms // SPLIT, SPLIT, pdl=pdl, atomic=True)
    for mb in (2, 8):  # one launch per dependent stage (no split-K: each program's share is a whole output) against
        # two stages in one launch, the dependency met inside it
        row(f"stream {mb} MB, 6 programs/SM, no split, pdl", 6 * sms, 1, stream_mb=mb)
        pair_row(f"fused pair {mb} + {mb} MB, 6 programs/SM a stage, pdl", mb, 6)
    for mb in (2, 8):  # session 21: two stages in one persistent launch, each program's B share loaded before its
        # dependency is met, against two launches with whole shares before the PDL wait (same programs, same shares)
        for pps in (3, 6):
            row(f"stream {mb} MB, {pps} programs/SM, no split, pdl, whole share before the wait", pps * sms, 1,
                stream_mb=mb, whole=True)
            persistent_row(f"persistent pair {mb} + {mb} MB, {pps}/SM, B waits on all of A", mb, pps, None)
            persistent_row(f"persistent pair {mb} + {mb} MB, {pps}/SM, B waits on 8 A items", mb, pps, 8)
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
