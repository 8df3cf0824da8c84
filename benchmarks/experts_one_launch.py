"""Experiment: the 122B's routed experts as one launch (`experts_tc_one_launch`) against the two it replaces.

    PYTHONPATH=$PWD python benchmarks/experts_one_launch.py      (CUDA sm_90+; JSON to $OUT/experts_one_launch.json)

Why (benchmarks/NOTES-kernels.md, sessions 21-22): the decode step is bound by its chain of ~7 dependent kernels a
layer, each paying a launch, a wait for the previous one and its own ramp, more than by its bytes. The routed gate_up
and down are two links of that chain; in one launch the down programs issue their weight loads while gate_up still
runs and wait only for the act tiles of their own K slice. This times both forms where the step runs them: CHAIN
calls in one CUDA graph under programmatic dependent launch, each call a layer of its own (LAYERS distinct expert
weights, cycled, so nothing is in L2 from an earlier call; distinct random routings), at one token (block-repacked
qweights, plain decode's layout) and three (GPTQ order, the MTP verify's), with the MoE block's shared-expert and
residual terms in the epilogue as the step adds them. Per row: microseconds a layer and the fraction of the copy
bandwidth on the expert bytes read. Both forms' outputs are compared bit for bit first.
"""

from __future__ import annotations

import torch

from kernels import copy_bandwidth_gbps, int4_bytes, median_us, random_int4, write_result
from roofline.kernels.int4_experts import experts_down, experts_gate_up, experts_tc_one_launch
from roofline.quant.int4 import block_qweight

EXPERTS, HIDDEN, INTER, TOP_K = 256, 3072, 1024, 8  # Qwen3.5-122B-A10B
LAYERS, CHAIN = 6, 48


def random_experts(n: int, k: int, blocked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.random_int4's EXPERTS experts [n, k] (symmetric), the qweight block-repacked where `blocked`."""
    qweight, qzeros, scales = random_int4(n, k, experts=EXPERTS)
    return (block_qweight(qweight) if blocked else qweight), qzeros, scales


def main():
    dev = torch.device("cuda")
    copy, _ = copy_bandwidth_gbps()
    results = {"copy_GBps": round(copy, 1), "chain": CHAIN, "layers": LAYERS, "rows": []}
    for t, blocked in ((1, True), (3, False)):
        cfg = {"qblk": True} if blocked else None
        layers = [(random_experts(2 * INTER, HIDDEN, blocked), random_experts(HIDDEN, INTER, blocked))
                  for _ in range(LAYERS)]
        gen = torch.Generator(device="cpu").manual_seed(t)
        routes = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]).to(dev)
                  for _ in range(CHAIN)]
        weights = torch.softmax(torch.randn(t, TOP_K, device=dev), -1).to(torch.bfloat16)
        x = torch.randn(t, HIDDEN, device=dev).to(torch.bfloat16)
        terms = {"shared": torch.randn(t, HIDDEN, device=dev).to(torch.bfloat16),
                 "shared_gate": torch.randn(t, 1, device=dev).to(torch.bfloat16),
                 "residual": torch.randn(t, HIDDEN, device=dev).to(torch.bfloat16)}
        outs = [torch.empty(t, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(CHAIN)]

        def two_launches(i):
            gate_up, down = layers[i % LAYERS]
            act = experts_gate_up(x, routes[i], *gate_up, 128, sym=True, config=cfg)
            return experts_down(act, routes[i], weights, *down, 128, sym=True, config=cfg, out=outs[i], **terms)

        def one_launch(i):
            gate_up, down = layers[i % LAYERS]
            return experts_tc_one_launch(x, routes[i], weights, gate_up, down, syms=(True, True), configs=(cfg, cfg),
                                         out=outs[i], **terms)

        same = all(torch.equal(two_launches(i).clone(), one_launch(i)) for i in range(LAYERS))
        distinct = sum(len(torch.unique(r)) for r in routes) / CHAIN
        nbytes = distinct * (int4_bytes(2 * INTER, HIDDEN) + int4_bytes(HIDDEN, INTER))  # qzeros unread (symmetric)
        for name, fn in (("two launches", two_launches), ("one launch", one_launch)):
            try:
                us = median_us(lambda: [fn(i) for i in range(CHAIN)], rep_ms=50) / CHAIN
            except Exception as exc:  # a variant that fails to compile or run is a result too
                results["rows"].append({"tokens": t, "variant": name, "error": repr(exc)[:300]})
                print(f"T={t} {name:14s} ERROR {repr(exc)[:200]}", flush=True)
                continue
            frac = nbytes / (us * 1e-6) / 1e9 / copy
            results["rows"].append({"tokens": t, "qblk": blocked, "variant": name, "us_per_layer": round(us, 2),
                                    "expert_bytes": int(nbytes), "frac_copy": round(frac, 3), "same_bits": same})
            print(f"T={t} {'qblk' if blocked else 'gptq'} {name:14s} {us:7.2f} us a layer  {frac:.2f} of copy"
                  f"  (same bits as two launches: {same})", flush=True)
        del layers
        torch.cuda.empty_cache()
    write_result("experts_one_launch", results)


if __name__ == "__main__":
    main()
