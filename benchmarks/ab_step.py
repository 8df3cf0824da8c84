"""Experiment: several A/B comparisons of the decode step in one process, on one synthetic model built once.

    PYTHONPATH=$PWD python benchmarks/ab_step.py --variants router-split,int4-split-verify [--shape qwen3.5-122b-a10b]
        [--rounds 3] [--repeats 20] [--context 0] [--capacity N] [--out FILE]
        (CUDA; JSON to FILE, else ab_step.json in $OUT, else in benchmarks/results/)

Why: each `experiments.sh ab*` phase runs `bench synthetic` four times, and each run builds the 122B's random weights
(~70 GB) again: ~8 minutes of a 30-minute device budget for one comparison. Every switch below is read when a kernel
is launched, not when the fast path is installed, so one build serves them all: per round, each variant (the default
first, the order reversed every other round so drift shows) sets its module flags, captures a fresh decode graph and
times the one-token step and the MTP-2 verify step (M = 3, distinct token ids, saving the rollback state, as the
engine runs it), then puts the flags back. The figure is the graph replay (the stable one; the step with its host
part is recorded too). Switches read at install time (the INT4 qweight order, the norm in the MoE GEMVs) need
`bench synthetic` runs of their own (`experiments.sh ab-order`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics


def _no_shared_expert(mlp, x, norm=None):
    """blocks.mlp_forward for the `timing-no-shared-expert` variant: zeros in place of the shared expert's output."""
    import torch

    return torch.zeros_like(x)


def _no_routed_gate_up(x, ids, qweight, *args, **kwargs):
    """int4_experts.experts_gate_up for `timing-no-routed-experts`: an unfilled act, no kernel."""
    import torch

    return torch.empty(x.shape[0], ids.shape[1], qweight.shape[-1] // 2, dtype=x.dtype, device=x.device)


def _no_routed_down(act, *args, residual=None, **kwargs):
    """int4_experts.experts_down for `timing-no-routed-experts`: the residual as the block's output, no kernel."""
    return residual


def _no_input_projections(projections, x):
    """merge.Projections.__call__ for `timing-no-input-projections`: zeros of each part's width, no GEMV."""
    return list(x.new_zeros(*x.shape[:-1], sum(projections.sizes)).split(projections.sizes, dim=-1))


def _no_gdn_kernel(qkv, z, *args, defer_norm=False, **kwargs):
    """mixers.gdn_decode for `timing-no-gdn-kernel`: zeros of the core output's shape (and unit sums of squares
    where the norm is left to the out projection), no recurrence."""
    import torch

    return (torch.zeros_like(z), torch.ones(*z.shape[:-1], 1, 1, device=z.device)) if defer_norm else torch.zeros_like(z)


def _no_out_projection(weight, x, residual, head_norm=None):
    """mixers.out_projection for `timing-no-out-projections`: the residual as h (and unit sums of squares), no GEMV."""
    import torch

    if residual is None:
        return x.new_zeros(*x.shape[:-1], weight.out_features)
    return residual, torch.ones(residual.shape[-1] // 128, 4, dtype=torch.float32, device=x.device)


_FIXED_ROUTES: dict = {}  # (rows, top_k, dtype, device) -> the stand-ins' constant routing tensors


def _fixed_routes(x, top_k: int) -> tuple:
    """(experts 0..k-1, equal weights, a zero shared-expert gate logit) for x's rows, made once per row count (a fill
    in the first capture that needs them)."""
    import torch

    rows = x.reshape(-1, x.shape[-1]).shape[0]
    key = (rows, top_k, x.dtype, x.device)
    if key not in _FIXED_ROUTES:
        _FIXED_ROUTES[key] = (torch.arange(top_k, device=x.device).expand(rows, -1).contiguous(),
                              torch.full((rows, top_k), 1 / top_k, device=x.device),
                              torch.zeros(rows, 1, dtype=x.dtype, device=x.device))
    return _FIXED_ROUTES[key]


def _no_router(moe, x, norm=None):
    """blocks._route for `timing-no-router`: fixed experts 0..k-1 at equal weights, no router kernel; the normed rows
    the router's kernel would write stay unfilled."""
    return _fixed_routes(x, moe.top_k)


def _no_input_norm(x, weight, eps):
    """small_ops.rms_norm for `timing-no-input-norm`: x itself, no kernel (also the final norm's, one launch)."""
    return x


def _no_attention_prologue(qg, k, v, *args):
    """small_ops.attention_prologue for `timing-no-attention-kernels`: an unfilled q, no kernel (no KV write)."""
    import torch

    return torch.empty(qg.shape[0], qg.shape[1], k.shape[-1], dtype=qg.dtype, device=qg.device)


def _no_decode_attention(q, *args, **kwargs):
    """mixers.decode_attention for `timing-no-attention-kernels`: an unfilled output, no kernel."""
    import torch

    return torch.empty_like(q)


_CONSTANT_ZEROS: dict = {}  # (part, rows, width, dtype, device) -> a stand-in's constant zeros


def _constant_zeros(part: str, x, width: int):
    """Zeros [rows of x, width] standing in for `part`'s output, made once per shape (a fill in the first capture that
    needs them)."""
    key = (part, x.shape[0], width, x.dtype, x.device)
    if key not in _CONSTANT_ZEROS:
        _CONSTANT_ZEROS[key] = x.new_zeros(x.shape[0], width)
    return _CONSTANT_ZEROS[key]


def _no_b_a(device, fn, x):
    """mixers.beside for `timing-no-b-a`: constant b and a (zeros) in place of the GDN's b/a projection, no kernel
    and no second-stream fork or join."""
    heads = fn.sizes[0]
    return (_constant_zeros("b", x, heads), _constant_zeros("a", x, heads)), lambda: None


_ORIGINALS: dict = {}  # (module, attribute) -> its value before the running variant replaced it
_PROJECTIONS_CALL = ("roofline.kernels.merge.Projections", "__call__")


def _qkv_alone(projections, x):
    """For the GDN's merged in_proj_qkv+z at 1-4 rows: [in_proj_qkv's GEMV alone, a constant z]; else None. The
    weight alone is made once, in the capture's warm-up: its block-repacked qweight is a contiguous view of the
    merged one already, its scales and zeros are copied. It is kept on the Projections object (an id() of a freed
    model's could be reused)."""
    import copy
    from collections import OrderedDict

    from roofline.kernels.dispatch import install_weight_kernel
    from roofline.quant import Int4Weight

    if len(projections.parts) != 2 or not all(isinstance(p, Int4Weight) for p in projections.parts) \
            or not 1 <= x.shape[0] <= 4:
        return None
    if "ab_step_qkv" not in projections.__dict__:
        w = copy.copy(projections.parts[0])
        w._buffers = OrderedDict((k, v.contiguous()) for k, v in w._buffers.items())
        w.__dict__.pop("forward", None)
        install_weight_kernel(w)
        projections.ab_step_qkv = w
    return [projections.ab_step_qkv(x), _constant_zeros("z", x, projections.sizes[1])]


def _no_z(projections, x):
    """merge.Projections.__call__ for `timing-no-z`: the GDN's in_proj_qkv GEMV alone and a constant z: what z's 8192
    columns cost the step. Other projections as they are."""
    out = _qkv_alone(projections, x)
    return _ORIGINALS[_PROJECTIONS_CALL](projections, x) if out is None else out


def _no_embedding(text_model, input_ids):
    """TextModel.embed for `timing-no-embedding`: constant zeros in place of the embedding rows, no gather kernel:
    what the step's first kernel (PyTorch's, not under PDL) and the gap after it cost."""
    weight = text_model.embed_tokens.weight
    return _constant_zeros("embedding", weight[: len(input_ids)], weight.shape[1])


def _no_silu_mul(gate_up):
    """blocks.silu_mul for `timing-no-silu-mul`: constant zeros as the shared expert's activation, no kernel between
    its two FP8 GEMVs on the second stream."""
    return _constant_zeros("act", gate_up, gate_up.shape[-1] // 2)


def resolve(name: str):
    """The module, or the class inside one ("package.module.Class"), that a variant's attribute belongs to."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        parent, _, attr = name.rpartition(".")
        return getattr(resolve(parent), attr)


def _module_setting(module: str, attr: str, value) -> tuple[str, list]:
    """A module constant set to `value` (a measured default's previous value, or a candidate) as a variant: its
    "module.ATTR=value" label and its one flag."""
    return f"{module}.{attr}={value}", [(module, attr, value)]


def _timing_only(what: str, *stand_ins: tuple) -> tuple[str, list]:
    """A timing-only variant (its outputs are wrong by design): the stand-ins (module, attribute, replacement), labelled
    by the first one's attribute and `what` it returns in place of the part."""
    module, attr, _ = stand_ins[0]
    return f"{module}.{attr}={what} (timing only: wrong outputs)", list(stand_ins)


# variant -> (the environment switch it mirrors, or for a measured default's previous behaviour (or a timing-only
# stand-in) the module attribute it sets as "module.ATTR=value", [(module, attribute, value while the variant runs)])
VARIANTS = {
    "depth-one-row": ("ROOFLINE_INT4_DEPTH=one-row", [("roofline.kernels.int4_tc", "WIDE_TILES", None)]),
    "depth-2": ("ROOFLINE_INT4_DEPTH=2", [("roofline.kernels.int4_tc", "INT4_DEPTH", 2)]),
    "router-two-rows": ("ROOFLINE_ROUTER_ROWS=2", [("roofline.kernels.blocks", "FUSED_ROUTE_ROWS", 2)]),
    # session 18's defaults against what they replaced: the router's 1-2 rows on the split config, no INT4 GEMV of the
    # verify rows without a K split
    "router-split": _module_setting("roofline.kernels.blocks", "ROUTER_FEW_ROWS_CONFIG", None),
    "int4-split-verify": _module_setting("roofline.kernels.int4_tc", "NO_SPLIT_MAX_ROWS", 1),
    # session 24, timing only: the MoE shared expert's three FP8 kernels on the second stream replaced by one
    # zero-fill, so the difference is what the shared expert costs the step beside the routed chain
    "timing-no-shared-expert": _timing_only("zeros", ("roofline.kernels.blocks", "mlp_forward", _no_shared_expert)),
    # the same for the routed experts' two kernels (the router still runs): what they cost the step
    "timing-no-routed-experts": _timing_only(
        "none", ("roofline.kernels.int4_experts", "experts_gate_up", _no_routed_gate_up),
        ("roofline.kernels.int4_experts", "experts_down", _no_routed_down)),
    # and for the mixers' parts: the merged input projections (GDN in_proj_qkv+z and b/a, attention q/k/v), the GDN
    # decode kernel, the out projections (GDN and attention, with the residual add and the norm's sums)
    "timing-no-input-projections": _timing_only(
        "zeros", ("roofline.kernels.merge.Projections", "__call__", _no_input_projections)),
    "timing-no-gdn-kernel": _timing_only("zeros", ("roofline.kernels.mixers", "gdn_decode", _no_gdn_kernel)),
    "timing-no-out-projections": _timing_only(
        "residual", ("roofline.kernels.mixers", "out_projection", _no_out_projection)),
    # session 25, timing only: the router (its GEMV and routing; fixed experts instead), each layer's input norm (and
    # the final norm), the full-attention layers' prologue and attention kernels
    "timing-no-router": _timing_only("fixed experts", ("roofline.kernels.blocks", "_route", _no_router)),
    "timing-no-input-norm": _timing_only("identity", ("roofline.kernels.small_ops", "rms_norm", _no_input_norm)),
    "timing-no-attention-kernels": _timing_only(
        "empty", ("roofline.kernels.small_ops", "attention_prologue", _no_attention_prologue),
        ("roofline.kernels.mixers", "decode_attention", _no_decode_attention)),
    # session 26: the GDN's b/a projection (0.8 MB of BF16 on the second stream beside in_proj_qkv+z; the GDN kernel
    # waits on its join): what it costs the step
    "timing-no-b-a": _timing_only("zeros", ("roofline.kernels.mixers", "beside", _no_b_a)),
    # session 38, timing only: the GDN's z projection (8192 of in_proj_qkv+z's 20480 columns, read only by the GDN
    # kernel's output gate) not computed, in_proj_qkv alone on the main stream: what z's GEMV costs the step. Its GEMV
    # on the second stream instead (joined before the out projection), launched beside in_proj_qkv or after it
    # (beside the GDN kernel), lost at M = 3 and won at most 0.048 ms at one token: removed (NOTES-kernels, session 38).
    # Session 44's real-output versions, H100 (session 46): z's GEMV on the second stream after b/a +0.020 / +0.009 ms
    # at M = 1 / 3; the GDN kernel computing z (or z, b and a) from z's INT4 weight +2.3 / +16.6 ms: all removed
    "timing-no-z": _timing_only("constant z", (*_PROJECTIONS_CALL, _no_z)),
    # session 39, timing only: the step's embedding gather (its first kernel, PyTorch's; in the profile ~6 us idle
    # follow it), and the shared expert's silu_mul launch. H100, 122B: +0.002 / -0.002 ms and -0.001 / -0.018 at
    # M = 1 / 3, so a Triton gather under PDL (-0.004 / -0.002 in the same A/B) was not kept (NOTES-kernels, session 39)
    "timing-no-embedding": _timing_only("zeros", ("roofline.model.qwen35.TextModel", "embed", _no_embedding)),
    "timing-no-silu-mul": _timing_only("zeros", ("roofline.kernels.blocks", "silu_mul", _no_silu_mul)),
    # session 25's verify-step defaults against what they replaced: the GDN kernel's tile at 2..5 tokens, the out
    # projections' K split at 2..4 rows
    "gdn-verify-tile-16x2": _module_setting("roofline.kernels.gdn_decode", "VERIFY_TILE", (16, 2)),
    # session 39: the verify's GDN tile's neighbours not timed at M = 3 before (V block, warps)
    "gdn-verify-tile-16x4": _module_setting("roofline.kernels.gdn_decode", "VERIFY_TILE", (16, 4)),
    "gdn-verify-tile-32x2": _module_setting("roofline.kernels.gdn_decode", "VERIFY_TILE", (32, 2)),
    "gdn-verify-tile-64x4": _module_setting("roofline.kernels.gdn_decode", "VERIFY_TILE", (64, 4)),
    # session 27's verify default against the value it replaced: the routed experts' programs a SM at 2-4 rows
    "experts-rows-4-per-sm": ("roofline.kernels.int4_experts.ROWS_PROGRAMS_PER_SM=4.0, ROWS_DOWN_PROGRAMS_PER_SM=4.0", [
        ("roofline.kernels.int4_experts", "ROWS_PROGRAMS_PER_SM", 4.0),
        ("roofline.kernels.int4_experts", "ROWS_DOWN_PROGRAMS_PER_SM", 4.0)]),
    # session 39's verify default against the rule before: the routed experts' 2-4 row programs over block-repacked
    # weights with two weight steps in flight
    "experts-rows-depth-2": _module_setting("roofline.kernels.int4_experts", "ROWS_DEPTH", 2),
    # session 28: the INT4 GEMVs' K-split sum at one row on the multi-row tile's lanes (4 splits' loads at a time, a
    # quarter of the lanes holding the row) against every lane summing its column's splits, 32 splits' loads at once
    "int4-one-row-tile-sum": _module_setting("roofline.kernels.int4_tc", "ONE_ROW_FLAT_SUM", False),
    "out-proj-verify-2-per-sm": _module_setting("roofline.kernels.int4_tc", "RESIDUAL_ROWS_PROGRAMS_PER_SM", 2.0),
    # session 34: the GDN kernel's gated norm whole, in its arrival round (mixers.GDN_NORM_IN_OUT_PROJ off)
    "gdn-norm-round": _module_setting("roofline.kernels.mixers", "GDN_NORM_IN_OUT_PROJ", False),
    # session 36: the dense (27B) layers' residual adds in out_proj's and down_proj's epilogues, against add_rms_norm
    # and a separate add after the MLP (and the GDN kernel's norm round)
    "dense-residual-apart": ("ROOFLINE_DENSE_RESIDUAL_IN_GEMVS=0",
                             [("roofline.kernels.blocks", "DENSE_RESIDUAL_IN_GEMVS", False)]),
    # session 37: the decode attention's 2-4 token tiles (the verify step's) in 2 K/V pipeline stages, the rule before
    "attention-wide-2-stages": _module_setting("roofline.kernels.decode_attention", "WIDE_TILE_STAGES", 2),
    # session 37: the attention splits' keys as shares of the graph's span, not of the sequence's length (before)
    "attention-splits-by-span": _module_setting("roofline.kernels.decode_attention", "SPLIT_BY_LENGTH", False),
    # session 38: the INT8 LM head's 16-bit logits widened to fp32 by a copy kernel after it (before)
    "logits-copy": _module_setting("roofline.kernels.dispatch", "FP32_LOGITS", False),
    "int8-lanes": ("ROOFLINE_INT8_DOT=0", [("roofline.kernels.int8_lm_head", "DOT_ROWS", False)]),
    "one-stream": ("ROOFLINE_SECOND_STREAM=0", [("roofline.kernels._common", "SECOND_STREAM", False)]),
    "no-pdl": ("ROOFLINE_PDL=0", [("roofline.kernels._common", "PDL_ENABLED", False)]),
}


@contextlib.contextmanager
def variant(name: str):
    """Inside the block the kernels run as with the variant's environment switch (or module constant); the defaults
    come back after."""
    if name == "default":
        yield
        return
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    saved = []
    try:
        for module_name, attr, value in VARIANTS[name][1]:
            module = resolve(module_name)
            if not hasattr(module, attr):
                raise AttributeError(f"{module_name} has no {attr}: the variant {name!r} no longer matches the code")
            saved.append((module, attr, getattr(module, attr)))
            _ORIGINALS[(module_name, attr)] = getattr(module, attr)
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def one_sequence_setup(shape: str, device, capacity: int, layers: int | None = None):
    """(model, fast path, pool, cache): the synthetic model in the default layout (INT8 LM head) with its fast path,
    a one-slot cache pool of `capacity` tokens with two GDN state buffers (as with MTP) and its sequence, what the
    one-process experiments here (this script, graph_order.py) time on one build. Here, not in the package:
    `experiments.sh trees` runs this script against earlier trees' packages."""
    import torch

    from roofline.bench.synthetic import DEFAULT_LAYOUT, build_synthetic_model
    from roofline.checkpoint.shapes import resolve_layout
    from roofline.engine.cache import CachePool
    from roofline.kernels.dispatch import install_fast_path

    model, _ = build_synthetic_model(shape, resolve_layout(DEFAULT_LAYOUT, {"lm_head": "int8"}), device, layers=layers)
    fast = install_fast_path(model, allow_cpu=torch.device(device).type != "cuda")
    pool = CachePool(model.config, model.config.layer_types, 1, capacity, model.device, model.dtype, state_buffers=2)
    return model, fast, pool, pool.acquire()


def run_ab(shape: str, variants: list[str], rounds: int, repeats: int, layers: int | None = None,
           device: str = "cuda", progress=print, context: int = 0, capacity: int | None = None) -> dict:
    """The comparison as a JSON-ready dict, with the sequence holding `context` tokens (random KV) before the timed
    steps in a cache pool of `capacity` tokens (default below). On device "cpu" under TRITON_INTERPRET=1 (the tests'
    dry run on the tiny shape) the kernels run in the interpreter in fp32 and nothing is captured."""
    import torch

    from roofline.bench.environment import environment
    from roofline.bench.synthetic import SyntheticRun, decode_ms, fill_context
    from roofline.engine.graphs import DecodeGraphs
    from roofline.kernels._common import next_pow2

    names = ["default"] + list(variants)
    for name in names:
        with variant(name):  # an unknown name or a renamed flag fails here, before the model is built
            pass
    capacity = capacity or next_pow2(context + 4096)
    if capacity < context + 4096:  # checked before the model is built, as the variants are
        raise ValueError(f"--capacity {capacity} leaves no room for the timed steps past a {context}-token context")
    cuda = torch.device(device).type == "cuda"
    # room past the context for every round's timed steps (each advances the sequence), rounded up to a power of two
    # as the engine's pools of max_model_len are: the decode graphs' attention span is the power-of-two bucket past the
    # sequence (64K at a 32K context), as in `bench synthetic` and serving (before session 37: context + 4096, a 36K
    # span at 32K). `bench synthetic` and a server allocate their whole capacity (256K by default) instead: the span is
    # the same, the pool's rows far longer
    model, fast, pool, cache = one_sequence_setup(shape, device, capacity, layers)
    fill_context(SyntheticRun(model, pool, None, cache, None), context)

    def measure(name: str, repeats: int) -> dict:
        with variant(name):
            graphs = DecodeGraphs(model, pool, 1, use_graphs=cuda)  # captured under the variant's flags
            run = SyntheticRun(model, pool, graphs, cache, None)
            got = {}
            for m in (1, 3):
                got[f"m{m}_step_ms"], got[f"m{m}_graph_ms"] = decode_ms(run, m, repeats, rollback=m > 1, distinct=m > 1)
            del graphs, run
            if cuda:
                torch.cuda.empty_cache()
        return got

    times = {name: {"m1_graph_ms": [], "m3_graph_ms": [], "m1_step_ms": [], "m3_step_ms": []} for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        # session 29: whichever variant ran first in a round read its M = 3 ~0.03 ms slower; one untimed pass of it
        # (capture and replays) before the timed ones puts every variant behind the same kind of work
        measure(order[0], max(1, repeats // 4))
        for name in order:
            for key, value in measure(name, repeats).items():
                times[name][key].append(value)
            t = times[name]
            progress(f"round {r} {name:16s} M=1 graph {t['m1_graph_ms'][-1]:.3f} ms, M=3 graph {t['m3_graph_ms'][-1]:.3f} ms")
    summary = {name: {key: statistics.median(values) for key, values in t.items()} for name, t in times.items()}
    return {"benchmark": "ab_step", "shape": shape, "layers": layers, "context": context, "capacity": capacity,
            "environment": environment(device),
            "kernels": dict(fast.installed), "rounds": rounds, "repeats": repeats,
            "variants": {name: VARIANTS[name][0] if name != "default" else "defaults" for name in names},
            "median": summary, "per_round": times,
            "note": "graph = device time of one captured step's replay; step adds its host part (inputs in, token "
                    "read back); M = 3 is the verify step on distinct token ids with the rollback saves"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-122b-a10b")
    ap.add_argument("--variants", required=True, help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=0, help="tokens the sequence holds before the timed steps")
    ap.add_argument("--capacity", type=int, default=None,
                    help="the cache pool's tokens (default: the power of two past context + 4096)")
    ap.add_argument("--out", default=None, help="the JSON's path (default: ab_step.json in $OUT, else "
                                                "benchmarks/results/): runs in one call each need their own")
    args = ap.parse_args()
    result = run_ab(args.shape, [v for v in args.variants.split(",") if v], args.rounds, args.repeats, args.layers,
                    context=args.context, capacity=args.capacity)
    base = result["median"]["default"]
    for name, s in result["median"].items():
        print(f"{name:16s} M=1 {s['m1_graph_ms']:.3f} ms ({s['m1_graph_ms'] - base['m1_graph_ms']:+.3f}), "
              f"M=3 {s['m3_graph_ms']:.3f} ms ({s['m3_graph_ms'] - base['m3_graph_ms']:+.3f})")
    from kernels import write_result  # beside this script (its folder is on sys.path when it runs)

    write_result("ab_step", result, args.out)


if __name__ == "__main__":
    main()
