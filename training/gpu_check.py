"""Check that transformers picked up fla's chunked gated delta rule and that it agrees with the
reference PyTorch version (forward and backward) on a small random problem; exit 1 otherwise.

    python -m training.gpu_check      # on the GPU machine, before training with fla on PYTHONPATH
"""

import sys
import time

import torch


def main():
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA")
        return 1
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm
    except Exception as e:  # noqa: BLE001
        print(f"gpu_check: fla import failed: {e!r}")
        return 1
    print(f"gpu_check: fla {fla.__version__}; transformers' chunk_gated_delta_rule -> "
          f"{getattr(qm.torch_chunk_gated_delta_rule, '__wrapped__', qm.torch_chunk_gated_delta_rule).__module__}")
    torch.manual_seed(0)
    B, T, H, D = 2, 300, 4, 64
    dev = "cuda"
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(B, T, H, device=dev) * 0.5).requires_grad_(True)
    beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    outs, grads = [], []
    ref_fn = qm.torch_chunk_gated_delta_rule
    ref_fn = getattr(ref_fn, "__wrapped__", ref_fn)
    t0 = time.time()
    for fn in (chunk_gated_delta_rule, ref_fn):
        for x in (q, k, v, g, beta):
            x.grad = None
        o, _ = fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        o.float().square().sum().backward()
        outs.append(o.float())
        grads.append(torch.cat([x.grad.float().flatten() for x in (q, k, v, g, beta)]))
    with torch.no_grad():  # what transformers' GDN layer calls: must be fla's kernel
        o_tf, _ = qm.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                                  use_qk_l2norm_in_kernel=True)
    uses_fla = torch.equal(o_tf.float(), outs[0]) and ref_fn is not chunk_gated_delta_rule
    print(f"gpu_check: transformers calls fla: {uses_fla}")
    err_o = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    err_g = ((grads[0] - grads[1]).norm() / grads[1].norm()).item()
    print(f"gpu_check: fla vs reference: output rel err {err_o:.2e}, grad rel err {err_g:.2e} ({time.time() - t0:.1f}s)")
    ok = uses_fla and err_o < 3e-2 and err_g < 5e-2
    print("gpu_check:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
