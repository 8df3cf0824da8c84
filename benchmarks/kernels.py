"""Kernel-level benchmark of the decode kernels at Qwen3.5-122B-A10B shapes (CUDA only).

    PYTHONPATH=$PWD python benchmarks/kernels.py [--quick] [--no-sweep]

Times each kernel with triton.testing.do_bench_cudagraph (median of graph replays of many
back-to-back calls, the way a captured decode step runs them). Plain do_bench zeroes a 256 MB
buffer before every call to flush L2, which leaves ~60 MB of dirty lines that our kernel's reads
then evict, so it would charge each kernel for write-backs that are not its own; instead every
case rotates through enough copies of its weights (and, for the experts, random routings) that
the data of one call is not in L2 from an earlier one.

Per case: time, bytes the kernel must move (each weight/state byte once, inputs and outputs),
GB/s, the fraction of the device-to-device copy bandwidth measured in the same run (read+write
bytes of a 2 GiB copy), and where it makes sense PyTorch's baseline on the same shapes (cuBLAS
BF16 GEMV on the dequantised weight, SDPA, the eager GDN reference). `--sweep` (default on)
also times a few launch configurations per kernel to choose defaults. Writes JSON to
$OUT/kernels.json when OUT is set, else benchmarks/results/<date>-kernels.json; a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from roofline.bench.environment import git_commit
from roofline.bench.synthetic import device_ms

HIDDEN = 3072
L2_BYTES = 60e6
TARGETS = {"int8_lm_head": 0.85, "experts_gate_up": 0.75, "experts_down": 0.75}


def write_result(name: str, result: dict, path: str | None = None) -> Path:
    """An experiment's JSON at `path` if given, else as $OUT/name.json (a device call's folder), else
    benchmarks/results/name.json."""
    out = Path(path) if path else Path(os.environ.get("OUT") or Path(__file__).parent / "results") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("wrote", out)
    return out


def median_us(fn, rep_ms: int = 10) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def copies_for(nbytes: float, floor: int = 2, cap: int = 64) -> int:
    """Enough copies that one pass over all of them is > 3x L2."""
    return max(floor, min(cap, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


class Rotor:
    """Calls fn(*args[i]) for i = 0, 1, 2, ... cycling through the argument sets."""

    def __init__(self, fn, arg_sets):
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0

    def __call__(self):
        args = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*args)


def copy_bandwidth_gbps() -> tuple[float, dict]:
    """Device copy bandwidth, read + write bytes, the best of three ways of copying 1 GiB.

    Measured on the H200 (run 1): a memcpy captured in a CUDA graph moved only ~2.8 TB/s, while
    cuBLAS streamed the LM head at 4.1 TB/s, so the copy is also timed eagerly and as an
    SM-driven elementwise kernel, and the highest is the reference.
    """
    n = 1 << 30
    src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ways = {}
    ways["memcpy_graph"] = 2 * n / (median_us(lambda: dst.copy_(src), rep_ms=50) * 1e-6) / 1e9
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for fn in [lambda: dst.copy_(src)] * 8:
        fn()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    ways["memcpy_eager"] = 2 * n / (sorted(times)[len(times) // 2] * 1e-6) / 1e9
    ways["elementwise_graph"] = 2 * n / (median_us(lambda: torch.mul(src, 1.0, out=dst), rep_ms=50) * 1e-6) / 1e9
    del src, dst
    return max(ways.values()), {k: round(v, 1) for k, v in ways.items()}


class Bench:
    def __init__(self, copy_gbps: float, sweep: bool):
        self.copy = copy_gbps
        self.sweep = sweep
        self.rows: list[dict] = []
        self.sweeps: list[dict] = []

    def record(self, kernel, shape, nbytes, t_us, config=None, baseline=None, baseline_bytes=None, note=""):
        row = {
            "kernel": kernel, "shape": shape, "config": config or "default", "time_us": round(t_us, 2),
            "bytes": int(nbytes), "GBps": round(nbytes / (t_us * 1e-6) / 1e9, 1),
            "frac_copy": round(nbytes / (t_us * 1e-6) / 1e9 / self.copy, 3),
        }
        if kernel in TARGETS:
            row["target_frac"] = TARGETS[kernel]
        if baseline is not None:
            bb = baseline_bytes if baseline_bytes is not None else nbytes
            row.update(baseline_us=round(baseline, 2), baseline_GBps=round(bb / (baseline * 1e-6) / 1e9, 1))
        if note:
            row["note"] = note
        self.rows.append(row)
        print(f"  {kernel:18s} {shape:34s} {t_us:8.2f} us {row['GBps']:7.0f} GB/s {row['frac_copy']:5.2f}"
              + (f"   baseline {baseline:8.2f} us" if baseline is not None else ""), flush=True)
        return row

    def try_configs(self, kernel, shape, nbytes, make_fn, configs):
        """Time make_fn(cfg) for each config; record the sweep; return {cfg_name: us}."""
        out = {}
        for name, cfg in configs:
            try:
                t = median_us(make_fn(cfg))
            except Exception as exc:  # a config that does not compile or fit is a result too
                self.sweeps.append({"kernel": kernel, "shape": shape, "config": name, "error": repr(exc)[:300]})
                print(f"    sweep {kernel} {shape} {name}: ERROR {repr(exc)[:120]}", flush=True)
                continue
            gbps = nbytes / (t * 1e-6) / 1e9
            self.sweeps.append({"kernel": kernel, "shape": shape, "config": name, "time_us": round(t, 2),
                                "GBps": round(gbps, 1), "frac_copy": round(gbps / self.copy, 3)})
            print(f"    sweep {kernel:16s} {shape:30s} {name:28s} {t:8.2f} us {gbps:7.0f} GB/s", flush=True)
            out[name] = t
        return out


def random_int4(n, k, group=128, experts=0):
    lead = (experts,) if experts else ()
    qweight = torch.randint(-(2**31), 2**31 - 1, (*lead, k // 8, n), dtype=torch.int32, device="cuda")
    qzeros = torch.full((*lead, k // group, n // 8), 0x77777777, dtype=torch.int32, device="cuda")
    scales = (torch.rand(*lead, k // group, n, device="cuda") * 0.02 + 0.001).half()
    return qweight, qzeros, scales


def int4_bytes(n, k, group=128):
    return k // 8 * n * 4 + k // group * n * 2  # qzeros are not read (symmetric)


# ------------------------------------------------------------------------ cases


def bench_int4_dense(b: Bench, quick: bool):
    from roofline.kernels.int4_gemv import int4_matmul
    from roofline.quant.int4 import block_qweight

    shapes = {
        "gdn.in_proj_qkv": (12288, 3072), "gdn.in_proj_z": (8192, 3072), "gdn.out_proj": (3072, 8192),
        "attn.q_proj": (16384, 3072), "attn.k_proj": (512, 3072), "attn.o_proj": (3072, 8192),
        # the merged projections the decode step runs (kernels/merge.py)
        "gdn.in_proj_qkv+z": (20480, 3072), "attn.q+k+v": (17408, 3072),
    }
    if quick:
        shapes = {k: shapes[k] for k in ("gdn.in_proj_qkv", "gdn.out_proj", "gdn.in_proj_qkv+z", "attn.q+k+v")}
    for name, (n, k) in shapes.items():
        wbytes = int4_bytes(n, k)
        sets = [random_int4(n, k) for _ in range(copies_for(wbytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in (1, 2, 4) if name in ("gdn.in_proj_qkv", "gdn.out_proj") else (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = wbytes + m * (k + n) * 2
            shape = f"{name} {n}x{k} M={m}"

            def make(cfg, x=x, sets=sets):
                if (cfg or {}).get("qblk"):  # experiment: the tc kernel on block-repacked weights
                    sets = [(block_qweight(qw), qz, sc) for qw, qz, sc in sets]
                return Rotor(lambda qw, qz, sc: int4_matmul(x, qw, qz, sc, 128, sym=True, config=cfg), sets)

            if b.sweep:
                cfgs = [("lanes (default path)", {"tc": False}), ("tc (its default config)", {"tc": True})]
                if name in ("gdn.in_proj_qkv", "gdn.out_proj") and m != 2:
                    cfgs += [(f"tc WN{wn} KW{kw} pps{pps}" + (f" r{reg}" if reg else ""),
                              {"tc": True, "WN": wn, "KW": kw, "programs_per_sm": pps, **({"maxnreg": reg} if reg else {})})
                             for wn, kw, pps, reg in [(4, 1, 4, 0), (4, 1, 2, 0), (4, 1, 8, 0), (2, 1, 8, 0), (8, 1, 4, 0),
                                                      (4, 1, 4, 96), (2, 2, 4, 0)][: 7 if m == 1 else 2]]
                    cfgs.append(("probe: tc loads only, no math, WN4 pps4", {"tc": True, "WN": 4, "KW": 1, "probe_loads_only": True}))
                    cfgs.append(("tc qblk (repacked weights) WN4 pps4", {"tc": True, "WN": 4, "KW": 1, "qblk": True}))
                    # run 11: more programs per SM or capped registers on the two-buffer loop did not help (pps8 10.4,
                    # r96 8.9 against 8.9 us, in_proj_qkv M=1); run 10c's fast loads probe had ~6 small programs per SM
                    # with one step in flight: the one-buffer loop (tc_groups DEPTH=1) at 4-8 programs per SM
                    cfgs += [(f"tc qblk depth1 WN4 pps{pps}", {"tc": True, "WN": 4, "KW": 1, "qblk": True, "depth": 1,
                                                              "programs_per_sm": pps}) for pps in (4, 6, 8)]
                if "+" in name and m == 1:
                    # the default K split (6 programs per SM, rounded up) gives 800 / 816 programs where 792 are sized
                    # for: fewer splits keep them to one wave (NOTES-kernels, "For the next session")
                    cfgs += [(f"tc qblk depth1 WN4 split{sk}", {"tc": True, "WN": 4, "KW": 1, "qblk": True, "depth": 1,
                                                               "SPLIT_K": sk}) for sk in (4, 5, 6)]
                b.try_configs("int4_gemv", shape, nbytes, make, cfgs)
            t = median_us(make(None))
            base = median_us(Rotor(lambda w: F.linear(x, w), [(w,) for w in dense]))
            b.record("int4_gemv", shape, nbytes, t, baseline=base, baseline_bytes=n * k * 2 + m * (k + n) * 2,
                     note="baseline: cuBLAS BF16 F.linear on a dequantised weight")
        del sets, dense
        torch.cuda.empty_cache()


def bench_experts(b: Bench, quick: bool):
    from roofline.kernels.int4_experts import experts_down, experts_gate_up
    from roofline.quant.int4 import block_qweight

    e, h, inter, topk = 256, HIDDEN, 1024, 8
    gate_up = random_int4(2 * inter, h, experts=e)
    down = random_int4(h, inter, experts=e)
    repacked = []

    def blocked():  # experiment: block-repacked copies of the expert weights (quant.int4.block_qweight), made once
        if not repacked:
            repacked.extend([block_qweight(gate_up[0]), block_qweight(down[0])])
        return repacked
    gu_bytes, dn_bytes = int4_bytes(2 * inter, h), int4_bytes(h, inter)
    for t_tokens in (1, 4) if quick else (1, 2, 4):
        x = torch.randn(t_tokens, h, device="cuda", dtype=torch.bfloat16)
        routings = []
        for _ in range(64):
            first = torch.randperm(e, device="cuda")[:topk]
            rows = [first]
            for _ in range(t_tokens - 1):  # a verify batch of one sequence: the drafts share half the experts
                rest = torch.randperm(e, device="cuda")
                rest = rest[~torch.isin(rest, first[: topk // 2])][: topk - topk // 2]
                rows.append(torch.cat([first[: topk // 2], rest])[torch.randperm(topk, device="cuda")])
            routings.append(torch.stack(rows))
        uniq = sum(len(torch.unique(r)) for r in routings) / len(routings)
        w = torch.softmax(torch.randn(t_tokens, topk, device="cuda"), -1).to(torch.bfloat16)
        act = torch.randn(t_tokens, topk, inter, device="cuda", dtype=torch.bfloat16)
        gu_total = uniq * gu_bytes + t_tokens * (h + topk * inter) * 2
        dn_total = uniq * dn_bytes + t_tokens * (topk * inter + h) * 2
        shape_gu = f"gate_up E{e} {2 * inter}x{h} top{topk} T={t_tokens} ({uniq:.1f} experts)"
        shape_dn = f"down E{e} {h}x{inter} top{topk} T={t_tokens}"

        def make_gu(cfg):
            wts = (blocked()[0], *gate_up[1:]) if (cfg or {}).get("qblk") else gate_up
            return Rotor(lambda ids: experts_gate_up(x, ids, *wts, 128, sym=True, config=cfg), [(r,) for r in routings])

        def make_dn(cfg):
            wts = (blocked()[1], *down[1:]) if (cfg or {}).get("qblk") else down
            return Rotor(lambda ids: experts_down(act, ids, w, *wts, 128, sym=True, config=cfg), [(r,) for r in routings])

        if b.sweep:
            cfgs = [("lanes (default path)", {"tc": False}), ("tc (its default config)", {"tc": True})]
            if t_tokens != 2:
                cfgs += [(f"tc WN{wn} KW{kw} pps{pps}" + (f" r{reg}" if reg else ""),
                          {"tc": True, "WN": wn, "KW": kw, "programs_per_sm": pps, **({"maxnreg": reg} if reg else {})})
                         for wn, kw, pps, reg in [(2, 1, 4, 0), (4, 1, 4, 0), (2, 1, 2, 0), (1, 1, 8, 0), (2, 1, 8, 0),
                                                  (1, 1, 16, 0), (4, 1, 2, 0)][: 7 if t_tokens == 1 else 3]]
                cfgs.append(("tc qblk (repacked weights), its default config", {"tc": True, "qblk": True}))
                cfgs.append(("tc qblk depth1, its default config", {"tc": True, "qblk": True, "depth": 1}))
                cfgs += [(f"tc qblk depth1 WN{wn} KW1 pps{pps}", {"tc": True, "qblk": True, "depth": 1, "WN": wn, "KW": 1,
                                                                 "programs_per_sm": pps}) for wn, pps in [(2, 6), (1, 12)]]
                if t_tokens == 1:  # the K split sets how many programs there are: one wave or more (run 13)
                    cfgs += [(f"tc qblk depth1 WN{wn} split{sk}", {"tc": True, "qblk": True, "depth": 1, "WN": wn,
                                                                   "KW": 1, "SPLIT_K": sk})
                             for wn, sk in [(2, 2), (2, 3), (2, 4), (2, 6), (2, 8), (1, 4), (1, 8), (4, 4), (4, 8)]]
            b.try_configs("experts_gate_up", shape_gu, gu_total, make_gu, cfgs)
            b.try_configs("experts_down", shape_dn, dn_total, make_dn, cfgs)
        # baseline: the same experts as BF16, pre-gathered, one cuBLAS batched GEMV (bmm)
        gu16 = torch.randn(topk, 2 * inter, h, device="cuda", dtype=torch.bfloat16)
        dn16 = torch.randn(topk, h, inter, device="cuda", dtype=torch.bfloat16)
        xb = torch.randn(topk, t_tokens, h, device="cuda", dtype=torch.bfloat16)
        ab = torch.randn(topk, t_tokens, inter, device="cuda", dtype=torch.bfloat16)
        base_gu = median_us(lambda: torch.bmm(xb, gu16.transpose(1, 2)))
        base_dn = median_us(lambda: torch.bmm(ab, dn16.transpose(1, 2)))
        note = "baseline: torch.bmm over the 8 experts' BF16 weights, pre-gathered (48 MB / 25 MB, L2-resident in part)"
        b.record("experts_gate_up", shape_gu, gu_total, median_us(make_gu(None)), baseline=base_gu,
                 baseline_bytes=gu16.numel() * 2, note=note)
        b.record("experts_down", shape_dn, dn_total, median_us(make_dn(None)), baseline=base_dn,
                 baseline_bytes=dn16.numel() * 2, note=note)
        del gu16, dn16
    del gate_up, down
    torch.cuda.empty_cache()


def bench_fp8(b: Bench, quick: bool):
    from roofline.kernels.fp8_gemv import fp8_matmul

    for name, (n, k) in {"shared.gate_up": (2048, HIDDEN), "shared.down": (HIDDEN, 1024)}.items():
        wbytes = n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4
        sets = [(torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn),
                 torch.rand(math.ceil(n / 128), math.ceil(k / 128), device="cuda") * 0.01) for _ in range(copies_for(wbytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = wbytes + m * (n + k) * 2
            shape = f"{name} {n}x{k} M={m}"

            def make(cfg, x=x, sets=sets):
                return Rotor(lambda w, s: fp8_matmul(x, w, s, config=cfg), sets)

            if b.sweep:
                b.try_configs("fp8_gemv", shape, nbytes, make, [
                    ("BN8 BK128 w2 pps4", {"BN": 8, "BK": 128, "num_warps": 2, "programs_per_sm": 4}),
                    ("BN8 BK128 w1 pps16", {"BN": 8, "BK": 128, "num_warps": 1, "programs_per_sm": 16}),
                    ("BN8 BK256 w1 pps8", {"BN": 8, "BK": 256, "num_warps": 1, "programs_per_sm": 8}),
                    ("BN4 BK512 w1 pps8", {"BN": 4, "BK": 512, "num_warps": 1, "programs_per_sm": 8}),
                    ("BN8 BK512 w1 pps4", {"BN": 8, "BK": 512, "num_warps": 1, "programs_per_sm": 4}),
                    ("BN8 BK512 w2 pps4", {"BN": 8, "BK": 512, "num_warps": 2, "programs_per_sm": 4}),
                    ("BN16 BK256 w2 pps4", {"BN": 16, "BK": 256, "num_warps": 2, "programs_per_sm": 4}),
                ])
            t = median_us(make(None))
            base = median_us(Rotor(lambda w: F.linear(x, w), [(w,) for w in dense]))
            b.record("fp8_gemv", shape, nbytes, t, baseline=base, baseline_bytes=n * k * 2 + m * (n + k) * 2,
                     note="baseline: cuBLAS BF16 F.linear")
        del sets, dense


def bench_router(b: Bench, quick: bool):
    """The MoE router of the 122B (256 experts + the shared expert's gate, BF16 [257, 3072]) with its top-8 routing:
    one launch (GEMV + top-k epilogue, `router_top_k`) in several tilings, against the GEMV and a top-k kernel. The
    recorded row runs the config the engine launches at that row count (kernels.blocks), not fp8_gemv's default."""
    from roofline.kernels.blocks import router_config
    from roofline.kernels.fp8_gemv import dense_matmul, router_top_k
    from roofline.kernels.small_ops import route_top_k

    n, k, experts, top = 257, HIDDEN, 256, 8
    sets = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,) for _ in range(copies_for(n * k * 2))]
    for m in (1, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2 + m * (n + k) * 2
        shape = f"router {n}x{k} top{top} M={m}"

        def make(cfg, x=x):
            return Rotor(lambda w: router_top_k(x, w, None, (128, 128), experts, top, config=cfg), sets)

        if b.sweep:
            b.try_configs("router_top_k", shape, nbytes, make, [
                (f"BN{bn} BK{bk} w{w} split{sk}", {"BN": bn, "BK": bk, "num_warps": w, "SPLIT_K": sk})
                for bn, bk, w, sk in [(8, 128, 1, 12), (8, 128, 1, 6), (8, 256, 2, 12), (8, 256, 2, 6), (8, 512, 4, 6),
                                      (8, 512, 4, 3), (4, 512, 2, 6), (4, 256, 1, 12), (16, 256, 2, 6), (16, 512, 4, 3),
                                      (2, 1024, 4, 3), (4, 1024, 4, 3)]
            ])
            apart = median_us(Rotor(lambda w: route_top_k(dense_matmul(x, w)[:, :experts], top), sets))
            b.sweeps.append({"kernel": "router_top_k", "shape": shape, "config": "GEMV, then route_top_k (2 launches)",
                             "time_us": round(apart, 2)})
            print(f"    sweep router_top_k {shape} GEMV then route_top_k: {apart:8.2f} us", flush=True)
        b.record("router_top_k", shape, nbytes, median_us(make(router_config(m))))
    del sets


def bench_int8(b: Bench, quick: bool):
    from roofline.kernels.int8_lm_head import int8_matmul

    v, h = 248320, HIDDEN
    weight = torch.randint(-127, 128, (v, h), dtype=torch.int8, device="cuda")
    scale = torch.rand(v, 1, device="cuda") * 0.01
    dense = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        nbytes = v * h + v * 4 + m * (h + v) * 2
        shape = f"lm_head {v}x{h} M={m}"

        def make(cfg, x=x):  # the default path: the tensor-core variant for 16-bit x
            return lambda: int8_matmul(x, weight, scale, config=cfg)

        def make_lanes(cfg, x=x):  # the lanes loop (ROOFLINE_INT8_DOT=0)
            return lambda: int8_matmul(x, weight, scale, config=cfg, dot=False)

        if b.sweep:  # around session 13's best of seven (32 x 256, 2 warps, 3 stages)
            b.try_configs("int8_lm_head", shape, nbytes, make, [
                (f"BV{bv} BH{bh} w{w} s{st}", {"BV": bv, "BH": bh, "num_warps": w, "num_stages": st})
                for bv, bh, w, st in [(32, 256, 2, 3), (32, 256, 2, 4), (16, 256, 1, 3), (32, 512, 2, 3),
                                      (64, 256, 2, 3), (32, 128, 2, 4), (64, 128, 4, 4)]])
        t = median_us(make(None))
        base = median_us(lambda: F.linear(x, dense))
        b.record("int8_lm_head", shape, nbytes, t, baseline=base, baseline_bytes=v * h * 2 + m * (h + v) * 2,
                 note="tl.dot variant, default config; baseline: cuBLAS BF16 F.linear on the BF16 head (twice the bytes)")
        b.record("int8_lm_head_lanes", shape, nbytes, median_us(make_lanes(None)), note="the lanes loop, its default config")
    del weight, dense
    torch.cuda.empty_cache()


def bench_gdn(b: Bench, quick: bool):
    from roofline.engine.cache import conv_ring_rows
    from roofline.kernels.gdn_decode import gdn_decode, gdn_decode_reference

    hk, hv, dk, dv, kernel = 16, 64, 128, 128, 4
    c = 2 * hk * dk + hv * dv
    for bsz in (1, 4) if not quick else (1,):
        state_bytes = bsz * hv * dk * dv * 4
        n_sets = copies_for(2 * state_bytes)

        def one_set():
            return dict(
                qkv=torch.randn(bsz, c, device="cuda", dtype=torch.bfloat16),
                z=torch.randn(bsz, hv * dv, device="cuda", dtype=torch.bfloat16),
                b=torch.randn(bsz, hv, device="cuda", dtype=torch.bfloat16),
                a=torch.randn(bsz, hv, device="cuda", dtype=torch.bfloat16),
                conv_state=torch.randn(bsz, conv_ring_rows(kernel), c, device="cuda", dtype=torch.bfloat16),
                state=torch.randn(bsz, hv, dk, dv, device="cuda") * 0.1,
                positions=torch.full((bsz,), 37, device="cuda"),  # a position past the ring's first wrap
            )

        sets = [one_set() for _ in range(n_sets)]
        fixed = dict(conv_weight=torch.randn(c, 1, kernel, device="cuda", dtype=torch.bfloat16) * 0.3,
                     A_log=torch.randn(hv, device="cuda") * 0.3, dt_bias=torch.randn(hv, device="cuda") * 0.3,
                     norm_weight=torch.ones(dv, device="cuda", dtype=torch.bfloat16))
        # the state read and written; the ring's K-1 rows read and one written; qkv, z, the output, b and a
        nbytes = 2 * state_bytes + bsz * (kernel * c * 2 + c * 2 + 2 * hv * dv * 2 + hv * dv * 2 + 4 * hv)
        shape = f"GDN B={bsz} {hv}h {dk}x{dv} fp32 state"

        def make(cfg):
            def call(s):
                return gdn_decode(s["qkv"], s["z"], s["b"], s["a"], s["conv_state"], fixed["conv_weight"], fixed["A_log"],
                                  fixed["dt_bias"], fixed["norm_weight"], s["state"], hk, positions=s["positions"],
                                  **(cfg or {}))
            return Rotor(call, [(s,) for s in sets])

        if b.sweep:
            b.try_configs("gdn_decode", shape, nbytes, make, [
                ("BV16 w2", {"block_v": 16, "num_warps": 2}), ("BV32 w4", {"block_v": 32, "num_warps": 4}),
                ("BV8 w1", {"block_v": 8, "num_warps": 1}), ("BV32 w2", {"block_v": 32, "num_warps": 2}),
            ])
        t = median_us(make(None))
        base = median_us(Rotor(lambda s: gdn_decode_reference(
            s["qkv"], s["z"], s["b"], s["a"], s["conv_state"], fixed["conv_weight"], fixed["A_log"], fixed["dt_bias"],
            fixed["norm_weight"], s["state"], hk, positions=s["positions"]), [(s,) for s in sets]))
        b.record("gdn_decode", shape, nbytes, t, baseline=base, note="baseline: the eager PyTorch reference (~25 kernels)")
        del sets


def bench_attention(b: Bench, quick: bool):
    from roofline.kernels.decode_attention import decode_attention

    hq, hkv, d = 32, 2, 256
    for ctx in (8192, 32768):
        kv_bytes = 2 * ctx * hkv * d * 2
        n_sets = copies_for(kv_bytes, floor=2, cap=12)
        caches = [(torch.randn(1, ctx, hkv, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, ctx, hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        for m in (1, 2, 4) if not quick else (1,):
            q = torch.randn(1, m, hq, d, device="cuda", dtype=torch.bfloat16)
            nbytes = kv_bytes + 2 * q.numel() * 2
            shape = f"attn ctx={ctx} M={m} {hq}q/{hkv}kv d{d}"

            def make(cfg, q=q):
                return Rotor(lambda k, v: decode_attention(q, k, v, lens, max_len=ctx, config=cfg), caches)

            if b.sweep:
                # around the default (BT32, 3 stages, 4 warps at one token and 8 at 2-4, one program per SM: 32K at
                # ~0.45 of copy in the step, NOTES-kernels session 16): more warps, deeper or wider tiles, two
                # programs per SM; 2 stages on 8 warps was the 2-4 token default before session 37
                b.try_configs("decode_attention", shape, nbytes, make, [
                    ("BT32 st2 w8 pps1", {"BT": 32, "num_stages": 2, "num_warps": 8, "programs_per_sm": 1}),
                    ("BT32 st3 w8 pps1", {"BT": 32, "num_stages": 3, "num_warps": 8, "programs_per_sm": 1}),
                    ("BT64 st3 w8 pps1", {"BT": 64, "num_stages": 3, "num_warps": 8, "programs_per_sm": 1}),
                    ("BT64 st2 w4 pps1", {"BT": 64, "num_stages": 2, "programs_per_sm": 1}),
                    ("BT32 st4 w4 pps1", {"BT": 32, "num_stages": 4, "programs_per_sm": 1}),
                    ("BT16 st4 w4 pps2", {"BT": 16, "num_stages": 4, "programs_per_sm": 2}),
                    ("BT32 st2 w4 pps2", {"BT": 32, "num_stages": 2, "programs_per_sm": 2}),
                    ("BT32 st3 w4 pps0.5", {"BT": 32, "num_stages": 3, "programs_per_sm": 0.5}),
                ])
            t = median_us(make(None))
            qt = q.transpose(1, 2)  # [1, Hq, M, D]
            mask = None
            if m > 1:
                mask = torch.arange(ctx, device="cuda")[None, :] <= torch.arange(ctx - m, ctx, device="cuda")[:, None]
            base = median_us(Rotor(lambda k, v: F.scaled_dot_product_attention(
                qt, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True), caches))
            b.record("decode_attention", shape, nbytes, t, baseline=base, note="baseline: torch SDPA with enable_gqa")
        del caches
        torch.cuda.empty_cache()
    # 8K keys in the 16K span bucket, at the start of pools of 16K rows (ab_step's) and 256K rows (bench synthetic's
    # and a server's default capacity): the 122B's 8K step read 3.795 ms graph in bench synthetic against 3.60 in
    # ab_step on one H100 (session 41)
    ctx, span = 8192, 16384
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * ctx * hkv * d * 2 + 2 * q.numel() * 2
    for rows in (span, 262144):
        caches = [(torch.randn(1, rows, hkv, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, rows, hkv, d, device="cuda", dtype=torch.bfloat16))
                  for _ in range(copies_for(nbytes, floor=2, cap=12))]
        t = median_us(Rotor(lambda k, v: decode_attention(q, k, v, lens, max_len=span), caches))
        b.record("decode_attention", f"attn ctx={ctx} span={span} pool rows={rows} M=1 {hq}q/{hkv}kv d{d}", nbytes, t)
        del caches
        torch.cuda.empty_cache()


def _gemm_configs(small: bool) -> list[tuple[str, dict]]:
    shapes = ([(16, 32, 128, 2, 3), (16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (32, 64, 128, 4, 3),
               (16, 64, 128, 4, 2)] if small else
              [(64, 128, 64, 4, 3), (32, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (64, 128, 128, 8, 2),
               (128, 64, 64, 4, 4), (64, 256, 64, 8, 3), (16, 128, 128, 4, 3)])
    return [(f"BM{bm} BN{bn} BK{bk} w{w} st{st}", {"BM": bm, "BN": bn, "BK": bk, "num_warps": w, "num_stages": st})
            for bm, bn, bk, w, st in shapes]


def bench_int4_gemm(b: Bench, quick: bool):
    """int4_gemm.py (ROOFLINE_INT4_GEMM=triton) against the default many-rows path (dequantise + torch; the routed
    experts in a loop) at 122B shapes, blocked order: the routed experts of one MoE layer at prefill (4K tokens,
    compute-bound: TFLOP/s in the note) and at a decode batch past the expert kernels' 16 rows (24 tokens: 8
    sequences x MTP-2 verify), and the GDN in_proj_qkv+z (20480 x 3072) at 6 and 48 rows."""
    from roofline.kernels.dispatch import MAX_EXPERT_TOKENS, _block, int4_config, many_rows_forward
    from roofline.kernels.int4_dequant import dequantize_int4
    from roofline.kernels.int4_experts import experts_down, experts_gate_up
    from roofline.kernels.int4_gemm import grouped_experts, int4_gemm
    from roofline.model.layers import Experts
    from roofline.quant import Int4Weight

    def int4_weight(n, k, experts=0):
        weight = Int4Weight(n, k, experts, group_size=128, device="cuda")
        weight.qweight, weight.qzeros, weight.scales = random_int4(n, k, experts=experts)
        _block(weight)
        weight.forward = partial(many_rows_forward, weight)
        return weight

    e, h, inter, topk = 256, HIDDEN, 1024, 8
    module = Experts(e, h, inter)
    module.gate_up, module.down = int4_weight(2 * inter, h, e), int4_weight(h, inter, e)

    def decode_experts(x, experts, weights):
        gu, dn = module.gate_up, module.down
        act = experts_gate_up(x, experts, gu.qweight, gu.qzeros, gu.scales, 128, sym=True, config=int4_config(gu))
        return experts_down(act, experts, weights, dn.qweight, dn.qzeros, dn.scales, 128, sym=True, config=int4_config(dn))

    for tokens in (24, 4096) if quick else (24, 512, 4096):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        experts = torch.rand(tokens, e, device="cuda").topk(topk, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, topk, device="cuda"), -1).to(torch.bfloat16)
        used = len(torch.unique(experts))
        nbytes = used * (int4_bytes(2 * inter, h) + int4_bytes(h, inter))
        flop = 2 * tokens * topk * 3 * inter * h
        shape = f"experts E{e} H{h} I{inter} top{topk} T={tokens} ({used} used)"

        def make(cfg, x=x, experts=experts, weights=weights):
            return lambda: grouped_experts(x, experts, weights, module.gate_up, module.down, config=cfg)

        if b.sweep:
            b.try_configs("int4_gemm experts", shape, nbytes, make, _gemm_configs(tokens * topk <= 256))
        grouped = median_us(make(None))
        if tokens <= 2 * MAX_EXPERT_TOKENS:  # would the decode kernels in chunks of 16 tokens beat it at batch sizes?
            b.record("int4 experts, 16-token chunks", shape, nbytes, median_us(lambda x=x, e=experts, w=weights: [
                decode_experts(x[s:s + MAX_EXPERT_TOKENS], e[s:s + MAX_EXPERT_TOKENS], w[s:s + MAX_EXPERT_TOKENS])
                for s in range(0, tokens, MAX_EXPERT_TOKENS)]), baseline=grouped,
                note="int4_experts' decode kernels (gate_up, down) per chunk of 16 tokens; baseline: int4_gemm grouped")
        loop = device_ms(lambda: Experts.forward(module, x, experts, weights), repeats=2, warmup=1) * 1e3
        b.record("int4_gemm experts", shape, nbytes, grouped, baseline=loop,
                 note=f"grouped {flop / grouped / 1e6:.0f} TFLOP/s; baseline: the loop over experts, each dequantised "
                      f"(int4_dequant), {flop / loop / 1e6:.0f} TFLOP/s")
    weight = int4_weight(20480, h)
    for rows in (6, 48):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        shape = f"in_proj_qkv+z 20480x{h} M={rows}"

        def make(cfg, x=x):
            return lambda: int4_gemm(x, weight, config=cfg)

        if b.sweep:
            b.try_configs("int4_gemm dense", shape, int4_bytes(20480, h), make, _gemm_configs(True))
        b.record("int4_gemm dense", shape, int4_bytes(20480, h), median_us(make(None)),
                 baseline=median_us(lambda x=x: F.linear(x, dequantize_int4(weight, None, x.dtype))),
                 note="baseline: the default path, the weight dequantised in one launch, then cuBLAS")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--no-sweep", action="store_true", help="default configurations only")
    ap.add_argument("--only", default="", help="comma list of: int4,experts,fp8,router,int8,gdn,attn,int4_gemm")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    started = time.time()
    copy, copy_ways = copy_bandwidth_gbps()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {copy:.0f} GB/s (read+write) {copy_ways}", flush=True)
    b = Bench(copy, sweep=not args.no_sweep)
    cases = {"int8": bench_int8, "experts": bench_experts, "int4": bench_int4_dense, "gdn": bench_gdn,
             "attn": bench_attention, "fp8": bench_fp8, "router": bench_router, "int4_gemm": bench_int4_gemm}
    only = [c for c in args.only.split(",") if c] or list(cases)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("kernels.json" if os.environ.get("OUT") else f"{datetime.date.today().isoformat()}-kernels.json")

    def write():  # after every case, so a run cut short keeps what it measured
        result = {
            "benchmark": "kernels", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit() or "unknown", "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "triton": triton.__version__, "copy_bandwidth_GBps": round(copy, 1),
            "copy_bandwidth_ways_GBps": copy_ways,
            "timing": "triton.testing.do_bench_cudagraph, median of 10 replays of a graph of back-to-back calls, rotated inputs",
            "seconds": round(time.time() - started, 1), "results": b.rows, "sweep": b.sweeps,
        }
        path.write_text(json.dumps(result, indent=1))
        return result

    for name in only:
        print(f"[{name}]", flush=True)
        try:
            cases[name](b, args.quick)
        except Exception as exc:  # keep the other results if one case breaks
            import traceback

            traceback.print_exc()
            b.rows.append({"kernel": name, "error": repr(exc)[:500]})
        torch.cuda.empty_cache()
        write()
    result = write()
    print(f"\nwrote {path}  ({result['seconds']} s)")
    print(f"\n{'kernel':18s} {'shape':52s} {'us':>8s} {'GB/s':>7s} {'frac':>5s} {'target':>6s} {'base us':>8s} {'base GB/s':>9s}")
    for r in b.rows:
        if "error" in r:
            print(f"{r['kernel']:18s} ERROR {r['error'][:100]}")
            continue
        print(f"{r['kernel']:18s} {r['shape'][:52]:52s} {r['time_us']:8.2f} {r['GBps']:7.0f} {r['frac_copy']:5.2f} "
              f"{r.get('target_frac', ''):>6} {r.get('baseline_us', ''):>8} {r.get('baseline_GBps', ''):>9}")


if __name__ == "__main__":
    main()
