"""Experiment: the one-row decode GEMVs at Qwen3.5-122B-A10B shapes, for Nsight Compute (CUDA only).

    ncu -k regex:"_gemv_tc_kernel|_fp8_gemv_kernel" --launch-skip 3 --launch-count 3 python3 benchmarks/ncu_gemvs.py

Calls each of the merged GDN in_proj_qkv+z (INT4, 20480 x 3072), the GDN out_proj with the residual (INT4, 3072 x
8192) and the router with its routing (BF16, 257 x 3072, the engine's one-row config) three times on random weights,
so ncu can profile the second round's launches (the first compiles and warms up). `experiments.sh ncu` runs it beside
the experts' and the GDN kernels' profiles (benchmarks/kernels.py under ncu).
"""

import torch

from roofline.kernels.blocks import router_config
from roofline.kernels.fp8_gemv import router_top_k
from roofline.kernels.int4_gemv import int4_matmul
from roofline.kernels.int4_tc import int4_matmul_residual

from kernels import random_int4  # benchmarks/kernels.py, beside this script (run as benchmarks/ncu_gemvs.py)


def main():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, core, residual = torch.randn(1, 3072, **bf16), torch.randn(1, 8192, **bf16), torch.randn(1, 3072, **bf16)
    in_proj, out_proj = random_int4(20480, 3072), random_int4(3072, 8192)
    router = torch.randn(257, 3072, **bf16) * 0.02
    for _ in range(3):
        int4_matmul(x, *in_proj, 128, sym=True)
        int4_matmul_residual(core, *out_proj, residual, sym=True)
        router_top_k(x, router, None, (128, 128), 256, 8, config=router_config(1))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
