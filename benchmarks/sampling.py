"""Experiment: a decoded token's sampling on the GPU, PyTorch's kernels against the fused ones (ROOFLINE_FUSED_SAMPLING:
the draw, and the argmax and logsumexp of `row_stats`).

    PYTHONPATH=$PWD python benchmarks/sampling.py      (CUDA; JSON to $OUT/sampling.json)

Why: the 122B's engine loop decodes a sampled token ~0.15 ms slower than a greedy one (H100, session 20: 262.1
against 272.8 tok/s), and everything after the captured step runs eagerly, as small kernels on the critical path:
the next step waits for the token. Per parameter set (greedy; Qwen3.5's thinking and non-thinking defaults; min_p),
for the PyTorch filters and the fused draw (kernels/sample_draw.py): the tokens of 32 seeds compared first, then the
GPU's kernels per token and their summed time (torch.profiler), and the time per token of back-to-back calls on one
row of the 122B's vocabulary (whichever of the host's enqueueing and the GPU's draining is slower).
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kernels import write_result
from roofline.bench.environment import environment
from roofline.engine import sampling
from roofline.engine.sampling import Sampler, SamplingParams, make_generator

VOCAB = 248320  # Qwen3.5
PARAMETER_SETS = {
    "greedy": SamplingParams(temperature=0.0),
    "thinking: T 0.6, top_p 0.95, top_k 20": SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
    "non-thinking: T 0.7, top_p 0.8, top_k 20": SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
    "T 1.0, top_k 40, min_p 0.05": SamplingParams(temperature=1.0, top_k=40, min_p=0.05),
}
CALLS, PROFILED = 300, 50


def main():
    sampler = Sampler()
    logits = torch.randn(1, VOCAB, device="cuda") * 3  # fp32, as the model's logits() returns them
    generator = make_generator(0, "cuda")
    result = {"benchmark": "sampling", "environment": environment("cuda"), "vocab": VOCAB, "rows": []}
    for name, params in PARAMETER_SETS.items():
        def call():
            return sampler.sample(logits, [params], None, [0], [generator]).token_ids

        def tokens(fused: bool) -> list[int]:
            sampling.FUSED_SAMPLING = fused
            return [sampler.sample(logits, [params], None, [0], [make_generator(seed, "cuda")]).token_ids.item()
                    for seed in range(32)]

        same = tokens(False) == tokens(True)
        for fused in (False, True):
            sampling.FUSED_SAMPLING = fused
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - start) / CALLS * 1e6
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED):
                    call()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time_total > 0]
            row = {"parameters": name, "fused": fused, "us_per_token": round(wall_us, 1),
                   "kernels_per_token": len(kernels) / PROFILED,
                   "kernel_us_per_token": round(sum(e.device_time_total for e in kernels) / PROFILED, 1),
                   "same_tokens_as_pytorch": same}
            result["rows"].append(row)
            print(f"{name:42s} {'fused' if fused else 'pytorch':8s} {wall_us:7.1f} us a token back to back, "
                  f"{row['kernels_per_token']:5.1f} kernels ({row['kernel_us_per_token']:6.1f} us of kernel time)"
                  f"  same tokens: {same}", flush=True)
    write_result("sampling", result)


if __name__ == "__main__":
    main()
