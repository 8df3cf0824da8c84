"""Decode attention and the GDN step at Qwen3.5-122B-A10B shapes, as the pooled CUDA-graph decode step runs them.

    PYTHONPATH=$PWD python benchmarks/mixer_kernels.py [--budget-s 120]

Attention (32 q heads, 2 kv heads, d 256, bf16, contexts 8K and 32K): M = 1 over a few launch
configurations (each checked against the fp32 reference first), then M = 2..4 (MTP verify), against
torch SDPA (enable_gqa; with a causal mask for M > 1). GDN (16 key / 64 value heads, 128 x 128
fp32 state, conv dim 12288): M = 1..4 tokens of one sequence in one launch, with and without the
rollback outputs, against M successive one-token launches. Timing as benchmarks/kernels.py
(do_bench_cudagraph medians, inputs rotated so one call's data is not in L2 from an earlier one).
Cases run in order of importance and stop at --budget-s. Writes $OUT/mixer_kernels.json (or
benchmarks/results/<date>-mixer-kernels.json); a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from kernels import Rotor, copies_for, median_us  # noqa: E402

from roofline.bench.environment import git_commit  # noqa: E402

ROWS: list[dict] = []
STARTED = time.time()
DEV = "cuda"
DT = torch.bfloat16
# 122B shapes; --dry-cpu (a check of this script under TRITON_INTERPRET=1) shrinks them
S = dict(hq=32, hkv=2, d=256, ctxs=(8192, 32768), hk=16, hv=64, dk=128, dv=128)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def record(kernel, shape, config, t_us, nbytes, copy, baseline=None, err=None, note=""):
    row = {"kernel": kernel, "shape": shape, "config": config, "time_us": round(t_us, 2), "bytes": int(nbytes),
           "GBps": round(nbytes / (t_us * 1e-6) / 1e9, 1), "frac_copy": round(nbytes / (t_us * 1e-6) / 1e9 / copy, 3)}
    if baseline is not None:
        row["baseline_us"] = round(baseline, 2)
        row["speedup_vs_baseline"] = round(baseline / t_us, 2)
    if err is not None:
        row["rel_err"] = err
    if note:
        row["note"] = note
    ROWS.append(row)
    print(f"  {kernel:10s} {shape:28s} {config:26s} {t_us:8.2f} us {row['GBps']:6.0f} GB/s"
          + (f"  base {baseline:8.2f}" if baseline is not None else "") + (f"  err {err:.1e}" if err is not None else ""),
          flush=True)
    return row


def over(budget):
    return time.time() - STARTED > budget


def bench_attention(copy, budget, ms=(1,), sweep=True):
    from roofline.kernels.decode_attention import decode_attention, decode_attention_reference

    hq, hkv, d = S["hq"], S["hkv"], S["d"]
    m1_configs = [
        ("default", None),
        ("BT32 st3 pps0.5", {"BT": 32, "num_stages": 3, "programs_per_sm": 0.5}),
        ("BT32 st3 pps2", {"BT": 32, "num_stages": 3, "programs_per_sm": 2}),
        ("BT64 st2 pps1", {"BT": 64, "num_stages": 2, "programs_per_sm": 1}),
        ("BT64 st3 w8 pps1", {"BT": 64, "num_stages": 3, "num_warps": 8, "programs_per_sm": 1}),
        ("BT32 st4 pps1", {"BT": 32, "num_stages": 4, "programs_per_sm": 1}),
        ("BT32 st3 pps1 merge32", {"BT": 32, "num_stages": 3, "programs_per_sm": 1, "merge_dims": 32}),
    ]
    mn_configs = [("default", None), ("pps0.5", {"programs_per_sm": 0.5})]
    for ctx in S["ctxs"]:
        kv_bytes = 2 * ctx * hkv * d * 2
        n_sets = copies_for(kv_bytes, floor=2, cap=12)
        caches = [(torch.randn(1, ctx, hkv, d, device=DEV, dtype=DT),
                   torch.randn(1, ctx, hkv, d, device=DEV, dtype=DT)) for _ in range(n_sets)]
        lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        slots = torch.zeros(1, dtype=torch.int32, device=DEV)
        for m in ms:
            if over(budget):
                return
            q = torch.randn(1, m, hq, d, device=DEV, dtype=DT)
            nbytes = kv_bytes + 2 * q.numel() * 2
            shape = f"ctx={ctx} M={m}"
            ref = decode_attention_reference(q, *caches[0], lens)
            qt = q.transpose(1, 2)
            mask = None
            if m > 1:
                mask = torch.arange(ctx, device=DEV)[None, :] <= torch.arange(ctx - m, ctx, device=DEV)[:, None]
            base = median_us(Rotor(lambda k, v: F.scaled_dot_product_attention(
                qt, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True), caches))
            configs = (m1_configs if m == 1 else mn_configs) if sweep else [("default", None)]
            for name, cfg in configs:
                if over(budget):
                    return
                try:
                    err = rel_err(decode_attention(q, *caches[0], lens, max_len=ctx, config=cfg, slots=slots), ref)
                    t = median_us(Rotor(lambda k, v, cfg=cfg: decode_attention(q, k, v, lens, max_len=ctx, config=cfg,
                                                                              slots=slots), caches))
                except Exception as exc:
                    print(f"  attention {shape} {name}: ERROR {repr(exc)[:200]}", flush=True)
                    ROWS.append({"kernel": "attention", "shape": shape, "config": name, "error": repr(exc)[:300]})
                    continue
                record("attention", shape, name, t, nbytes, copy, baseline=base, err=err,
                       note="baseline: torch SDPA enable_gqa" + (" + causal mask" if mask is not None else ""))
        del caches
        torch.cuda.empty_cache()


def bench_gdn(copy, budget, batch=1):
    from roofline.engine.cache import conv_ring_rows, step_record_size
    from roofline.kernels.gdn_decode import gdn_decode, gdn_decode_reference

    hk, hv, dk, dv, kernel = S["hk"], S["hv"], S["dk"], S["dv"], 4
    c = 2 * hk * dk + hv * dv
    state_bytes = batch * hv * dk * dv * 4
    row_bytes = batch * c * 2  # one conv ring row of each sequence
    fixed = dict(conv_weight=torch.randn(c, 1, kernel, device=DEV, dtype=DT) * 0.3,
                 A_log=torch.randn(hv, device=DEV) * 0.3, dt_bias=torch.randn(hv, device=DEV) * 0.3,
                 norm_weight=torch.ones(dv, device=DEV, dtype=DT))
    slots = torch.arange(batch, dtype=torch.int32, device=DEV)
    first = 37  # each sequence's first position: past the ring's first wrap
    one_token = {}
    for m in (1, 2, 3, 4):
        if over(budget):
            return
        n = batch * m
        n_sets = copies_for(2 * state_bytes)
        sets = [dict(qkv=torch.randn(n, c, device=DEV, dtype=DT),
                     z=torch.randn(n, hv * dv, device=DEV, dtype=DT),
                     b=torch.randn(n, hv, device=DEV, dtype=DT),
                     a=torch.randn(n, hv, device=DEV, dtype=DT),
                     conv_state=torch.randn(batch, conv_ring_rows(kernel), c, device=DEV, dtype=DT),
                     state=torch.randn(batch, hv, dk, dv, device=DEV) * 0.1,
                     ss=torch.empty(batch, m - 1, step_record_size(hk, dk, hv, dv), device=DEV))
                for _ in range(n_sets)]
        io = n * (c * 2 + 2 * hv * dv * 2 + 4 * hv)
        nbytes = 2 * state_bytes + (kernel - 1 + m) * row_bytes + io  # the ring: K-1 rows read, M written
        save_bytes = (m - 1) * batch * step_record_size(hk, dk, hv, dv) * 4
        shape = f"GDN B={batch} M={m}"

        positions = (first + torch.arange(m, device=DEV)).repeat(batch)

        def call(s, save=False, m=m):
            return gdn_decode(s["qkv"], s["z"], s["b"], s["a"], s["conv_state"], fixed["conv_weight"], fixed["A_log"],
                              fixed["dt_bias"], fixed["norm_weight"], s["state"], hk, positions=positions, slots=slots,
                              tokens_per_seq=m, step_records=s["ss"] if save else None)

        for s in sets:  # each token's rows of the batch, contiguous, for the one-token launches
            s["tokens"] = [tuple(s[k][j::m].contiguous() for k in ("qkv", "z", "b", "a")) for j in range(m)]

        def m_singles(s, m=m):  # the same M tokens as M one-token launches
            for j, (qkv, z, b, a) in enumerate(s["tokens"]):
                gdn_decode(qkv, z, b, a, s["conv_state"], fixed["conv_weight"], fixed["A_log"], fixed["dt_bias"],
                           fixed["norm_weight"], s["state"], hk, positions=positions[j::m], slots=slots)

        s0 = sets[0]
        chk = {k: v.clone() for k, v in s0.items() if k != "tokens"}
        y = call(chk, save=True)
        ref_state, ref_conv = s0["state"].clone(), s0["conv_state"].clone()
        rss = torch.empty_like(s0["ss"])
        ref = gdn_decode_reference(s0["qkv"], s0["z"], s0["b"], s0["a"], ref_conv, fixed["conv_weight"], fixed["A_log"],
                                   fixed["dt_bias"], fixed["norm_weight"], ref_state, hk, positions=positions,
                                   slots=slots, tokens_per_seq=m, step_records=rss)
        err = max(rel_err(y, ref), rel_err(chk["state"], ref_state), rel_err(chk["ss"], rss) if m > 1 else 0.0)
        t = median_us(Rotor(call, [(s,) for s in sets]))
        base = median_us(Rotor(m_singles, [(s,) for s in sets])) if m > 1 else None
        if m == 1:
            one_token[batch] = t
        record("gdn", shape, "one launch", t, nbytes, copy, baseline=base, err=err,
               note="baseline: M one-token launches (state read and written M times)")
        if m > 1:
            t2 = median_us(Rotor(lambda s: call(s, save=True), [(s,) for s in sets]))
            record("gdn", shape, "one launch + step outputs", t2, nbytes + save_bytes, copy, baseline=base,
                   note=f"+{save_bytes / 1e6:.1f} MB of rollback step records")
        del sets
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=150, help="stop starting new cases after this many seconds")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--dry-cpu", action="store_true", help="check this script on the CPU (interpreter, tiny shapes)")
    args = ap.parse_args()
    global DEV, DT, median_us
    if args.dry_cpu:
        DEV, DT = "cpu", torch.float16  # the interpreter computes bf16 wrongly
        S.update(hq=4, hkv=2, d=32, ctxs=(40, 70), hk=2, hv=4, dk=16, dv=16)

        def median_us(fn, rep_ms=10):  # noqa: F811
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/mixer_kernels.py needs a CUDA device")
    import triton

    torch.manual_seed(0)
    n = 1 << 29 if DEV == "cuda" else 1 << 16
    src = torch.empty(n // 2, dtype=DT, device=DEV).normal_()
    dst = torch.empty_like(src)
    copy = 2 * n / (median_us(lambda: torch.mul(src, 1.0, out=dst), rep_ms=30) * 1e-6) / 1e9
    del src, dst
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"device {device}  copy bandwidth {copy:.0f} GB/s (elementwise, graph)", flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("mixer_kernels.json" if os.environ.get("OUT") else f"{datetime.date.today().isoformat()}-mixer-kernels.json")

    def write():
        path.write_text(json.dumps({
            "benchmark": "mixer_kernels", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit() or "unknown", "device": device, "torch": torch.__version__,
            "triton": triton.__version__, "copy_bandwidth_GBps": round(copy, 1),
            "timing": "triton.testing.do_bench_cudagraph median, rotated inputs", "seconds": round(time.time() - STARTED, 1),
            "results": ROWS}, indent=1))

    steps = [
        ("attention M=1", lambda: bench_attention(copy, args.budget_s, ms=(1,), sweep=not args.no_sweep)),
        ("gdn B=1", lambda: bench_gdn(copy, args.budget_s, batch=1)),
        ("attention M=2..4", lambda: bench_attention(copy, args.budget_s, ms=(2, 3, 4), sweep=not args.no_sweep)),
        ("gdn B=4", lambda: bench_gdn(copy, args.budget_s, batch=4)),
    ]
    for name, fn in steps:
        if over(args.budget_s):
            print(f"[{name}] skipped: budget", flush=True)
            continue
        print(f"[{name}]", flush=True)
        try:
            fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            ROWS.append({"kernel": name, "error": repr(exc)[:500]})
        write()
    write()
    print(f"\nwrote {path} ({time.time() - STARTED:.0f} s)")
    print(f"\n{'kernel':10s} {'shape':20s} {'config':26s} {'us':>8s} {'GB/s':>6s} {'frac':>5s} {'base us':>8s} {'x':>5s} {'err':>7s}")
    for r in ROWS:
        if "error" in r:
            print(f"{r['kernel']:10s} {r.get('shape', ''):20s} {r.get('config', ''):26s} ERROR {r['error'][:60]}")
            continue
        err = r.get("rel_err")
        print(f"{r['kernel']:10s} {r['shape']:20s} {r['config']:26s} {r['time_us']:8.2f} {r['GBps']:6.0f} {r['frac_copy']:5.2f} "
              f"{r.get('baseline_us', ''):>8} {r.get('speedup_vs_baseline', ''):>5} {'' if err is None else f'{err:.0e}':>7}")


if __name__ == "__main__":
    main()
