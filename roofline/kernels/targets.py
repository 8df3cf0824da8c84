"""Compile the decode fast path's Triton kernels for a GPU target without a GPU: a portability check.

    python -m roofline.kernels.targets 90 121        (TRITON_INTERPRET unset; needs Triton's bundled ptxas)

Why: the benchmarks run on an H200 (sm_90), the users' DGX Spark is sm_121 (GB10: ~99 KB of shared memory a
block against the H200's 227 KB), and no sm_121 machine is lent. Each kernel is compiled at its GPU configuration
(the tiles `default_config`s pick on CUDA) as the JIT would: pointers and the integer arguments that are multiples
of 16 in practice marked so (without that Triton neither vectorises nor pipelines the loads, and a kernel's shared
memory would look smaller than it is). A kernel that does not compile for a target, or needs more shared memory
than a block of it has, is a problem; `check_targets` returns one line per problem. The INT4 tensor-core GEMV and
experts kernels are also checked by `int4_tc.check_asm_layouts`, which takes a target too.
"""

from __future__ import annotations

import sys

# Per-block shared memory (opt-in maximum), bytes: Hopper; consumer / GB10 Blackwell.
SHARED_LIMIT = {90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024, 121: 99 * 1024}
# Integer arguments that are not multiples of 16 in practice (counts of heads, splits, rows, steps).
NOT_DIV16 = {"HKV", "NSPLIT", "A_ROW_DIV", "M", "T", "SPLIT_K", "GROUPS", "GPS", "HK", "NVB", "X_PER_ROW", "NT",
             "S_COLS", "WS_STRIDE", "C", "row_in", "row_out", "first_record", "kept", "CHUNKS"}


def _cases(arch: int):
    """(name, jit function, constexprs, pointer types, float args, num_warps, num_stages) at sm_`arch`'s GPU configs."""
    import triton.language as tl

    from .decode_attention import _decode_attn_kernel, _decode_attn_merge_kernel, pipeline_stages
    from .fp8_gemv import _fp8_gemv_kernel
    from .gdn_decode import _gdn_decode_kernel, _gdn_replay_kernel
    from .int4_gemm import _grouped_kernel
    from .int8_lm_head import _int8_rows_dot_kernel
    from .sample_draw import PARAMS, ROW_CHUNK, _draw_candidates_kernel, _row_stats_kernel

    cases = [("int8 lm head (tensor cores, 32 x 256, fp32 logits)", _int8_rows_dot_kernel,
              {"BV": 32, "BH": 256, "ROUND_TO_X": True, "PDL": True},
              {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*fp32"}, (), 2, 3)]
    attn = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i32", "slot_ptr": "*i32",
            "out_ptr": "*bf16", "ws_ptr": "*fp32", "gate_ptr": "*bf16"}
    for m, bq, warps in [(1, 16, 4), (2, 32, 8), (4, 64, 8)]:  # decode_attention's choices by rows
        stages = pipeline_stages(bq, SHARED_LIMIT.get(arch, 0))  # a target of unknown size: its smallest pick
        cases.append((f"decode attention M={m} ({stages} stages)", _decode_attn_kernel,
                      {"M": m, "HG": 16, "BQ": bq, "BD": 256, "BT": 32, "HAS_SLOTS": True, "HAS_GATE": True,
                       "BY_LENGTH": True, "PDL": True}, attn, ("scale_log2",), warps, stages))
    cases.append(("decode attention merge", _decode_attn_merge_kernel,
                  {"M": 1, "HG": 16, "BQ": 16, "BD": 256, "DC": 64, "SP": 128, "HAS_GATE": True, "PDL": True},
                  {"ws_ptr": "*fp32", "out_ptr": "*bf16", "gate_ptr": "*bf16"}, (), 4, 1))
    gemm = {"a_ptr": "*bf16", "rows_ptr": "*i32", "block_expert_ptr": "*i32", "qw_ptr": "*i32", "qz_ptr": "*i32",
            "sc_ptr": "*fp16", "rw_ptr": "*fp32", "out_ptr": "*bf16"}
    for bm, bn, bk in [(64, 128, 64), (16, 128, 128)]:  # int4_gemm._config: prefill, and <= 16 rows a group
        cases.append((f"int4 gemm {bm} x {bn} x {bk}", _grouped_kernel,
                      {"GROUP": 128, "BLOCKED": True, "SWIGLU": True, "WEIGHTED": False, "BM": bm, "BN": bn, "BK": bk},
                      gemm, (), 4, 3))
    gdn = {p: "*bf16" for p in ("qkv_ptr", "z_ptr", "b_ptr", "a_ptr", "conv_ptr", "convw_ptr", "dtb_ptr", "nw_ptr",
                                "out_ptr")}
    gdn.update(alog_ptr="*fp32", state_ptr="*fp32", o_ws="*fp32", cnt_ptr="*i32", pos_ptr="*i64", slot_ptr="*i32",
               rin_ptr="*i32", rout_ptr="*i32", srec_ptr="*fp32", parts_ptr="*fp32")
    for m in (1, 3):
        consts = {"GROUP": 4, "GROUPP": 4, "BDK": 128, "BDV": 128, "BV": 16, "KERNEL": 4, "RING": 16,
                  "CONV_TY": tl.bfloat16, "M": m, "HAS_SLOTS": True, "SAVE_STEPS": m > 1, "PDL": True}
        cases.append((f"gdn decode M={m}", _gdn_decode_kernel, {**consts, "DEFER": False}, gdn, ("eps",), 2, 1))
        cases.append((f"gdn decode M={m}, the gated norm's rms left to out_proj (mixers.GDN_NORM_IN_OUT_PROJ)",
                      _gdn_decode_kernel, {**consts, "DEFER": True}, gdn, ("eps",), 2, 1))
    cases.append(("gdn replay (the verify's rollback)", _gdn_replay_kernel, {"GROUP": 4, "BDK": 128, "BV": 16},
                  {"state_ptr": "*fp32", "rec_ptr": "*fp32"}, (), 2, 1))
    fp8 = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "ss_ptr": "*fp32", "nw_ptr": "*bf16", "normed_ptr": "*bf16", "experts_ptr": "*i64",
           "weights_ptr": "*fp32", "ids_ptr": "*i64"}
    base = {"SBN": 128, "SBK": 128, "SPLITP": 8, "PDL": True, "KP": 1, "BE": 1, "NTP": 32, "GROUPED": False,
            "NORM_OUT": False, "ids_ptr": None}
    router = {"HAS_SCALE": False, "TOPK": 8, "KP": 8, "BE": 256, "NORM": True, "NORM_OUT": True, "GATED": False}
    for name, extra, warps in [
        ("shared gate_up (8 x 128, norm on load)", {"BM": 1, "BN": 8, "BK": 128, "HAS_SCALE": True, "TOPK": 0,
                                                    "NORM": True, "GATED": False, "experts_ptr": None, "weights_ptr": None}, 1),
        ("shared down (8 x 128), 4 rows", {"BM": 4, "BN": 8, "BK": 128, "HAS_SCALE": True, "TOPK": 0, "NORM": False,
                                           "GATED": False, "experts_ptr": None, "weights_ptr": None, "ss_ptr": None,
                                           "nw_ptr": None, "normed_ptr": None}, 1),
        ("router + top-8 without a K split (blocks.ROUTER_FEW_ROWS_CONFIG)", {"BM": 1, "BN": 1, "BK": 1024, **router}, 2),
        ("router + top-8 without a K split, 2 rows", {"BM": 2, "BN": 1, "BK": 1024, **router}, 2),
        ("router + top-8, 4 rows (blocks.ROUTER_ROWS_CONFIG)", {"BM": 4, "BN": 8, "BK": 256, **router}, 2),
    ]:
        pointers = {**fp8, "w_ptr": "*bf16"} if extra["TOPK"] else fp8  # the router's weight is 16-bit
        cases.append((f"fp8 gemv: {name}", _fp8_gemv_kernel, {**base, **extra}, pointers, ("eps",), warps, 1))
    cases.append(("sampling draw over 84 candidates (top_k 20)", _draw_candidates_kernel, {"BC": 128, "NP": PARAMS},
                  {"vals_ptr": "*fp32", "ids_ptr": "*i64", "noise_ptr": "*fp32", "params_ptr": "*fp32",
                   "out_ptr": "*i64"}, (), 4, 1))
    cases.append(("a row's argmax and logsumexp (61 chunks of 4096)", _row_stats_kernel,
                  {"BV": ROW_CHUNK, "CP": 64}, {"x_ptr": "*fp32", "ids_ptr": "*i64", "logz_ptr": "*fp32",
                                                "lp_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}, (), 4, 1))
    return cases


def compile_offline(fn, signature: dict, constexprs: dict, aligned, arch: int, num_warps: int, num_stages: int = 1):
    """`fn` compiled for sm_`arch` with no GPU: `signature` gives every argument's type ("constexpr" for those in
    `constexprs`), `aligned` the arguments the JIT would mark as multiples of 16 (pointers from torch; integers that are,
    in practice)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: signature[a] for a in fn.arg_names}
    marks = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=marks),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def check_targets(archs=(90, 121)) -> list[str]:
    """Compile every case for each sm_`arch`; a line per kernel that fails or overflows the target's shared memory."""
    problems = []
    for arch in archs:
        for name, fn, consts, pointers, floats, warps, stages in _cases(arch):
            # constexprs a case leaves out take their defaults, as the JIT gives them (not runtime integers)
            consts = {**{q.name: q.default for q in fn.params if q.is_constexpr and q.has_default}, **consts}
            sig = {a: "constexpr" if a in consts else pointers.get(a, "fp32" if a in floats else "i32")
                   for a in fn.arg_names}
            aligned = {a for a in fn.arg_names if a not in consts and a not in floats and a not in NOT_DIV16}
            try:
                kernel = compile_offline(fn, sig, consts, aligned, arch, warps, stages)
            except Exception as exc:  # a compile failure is what this check reports
                problems.append(f"sm_{arch} {name}: does not compile: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            shared, limit = kernel.metadata.shared, SHARED_LIMIT.get(arch)
            if limit is not None and shared > limit:
                problems.append(f"sm_{arch} {name}: {shared} bytes of shared memory, over the {limit} a block has")
    return problems


if __name__ == "__main__":
    found = check_targets([int(a) for a in sys.argv[1:]] or (90, 121))
    print("\n".join(found) or "every kernel compiles within its target's shared memory")
    sys.exit(1 if found else 0)
