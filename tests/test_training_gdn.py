"""training/model.py's roofline_chunk_gated_delta_rule (roofline's chunked_delta_rule behind transformers'
torch_chunk_gated_delta_rule signature) against transformers' own: outputs, final states and the gradients of
q, k, v, g, beta; and set_gdn installing it in the tiny model."""

import pytest
import torch

from training.model import TRANSFORMERS_GDN, roofline_chunk_gated_delta_rule


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def inputs(b, t, hk, hv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(b, t, hk, d), r(b, t, hk, d), r(b, t, hv, d)
    g = -torch.nn.functional.softplus(r(b, t, hv)) * 0.03  # log decay <= 0; weak, so state crosses chunks
    beta = torch.sigmoid(r(b, t, hv))
    state = r(b, hv, d, d) * 0.5
    return q, k, v, g, beta, state


def run(fn, tensors, with_state, l2norm, out_w, state_w):
    xs = [x.clone().requires_grad_(True) for x in tensors[:5]]
    out, final = fn(*xs[:3], g=xs[3], beta=xs[4], initial_state=tensors[5] if with_state else None,
                    output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    ((out * out_w).sum() + (final * state_w).sum()).backward()
    return out.detach(), final.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("hk,l2norm", [(2, True), (4, True), (4, False)])
def test_matches_transformers(with_state, hk, l2norm):
    b, t, hv, d = 2, 150, 4, 32  # 150 tokens: two full chunks of 64 and a padded one
    tensors = inputs(b, t, hk, hv, d, seed=hk + 10 * with_state + 100 * l2norm)
    if not l2norm:  # unit keys, else beta * |k|^2 > 2 and the recurrence blows up
        tensors = (*(x / x.norm(dim=-1, keepdim=True) for x in tensors[:2]), *tensors[2:])
    gen = torch.Generator().manual_seed(1)
    out_w, state_w = torch.randn(b, t, hv, d, generator=gen), torch.randn(b, hv, d, d, generator=gen)
    o_ref, s_ref, g_ref = run(TRANSFORMERS_GDN, tensors, with_state, l2norm, out_w, state_w)
    o, s, gr = run(roofline_chunk_gated_delta_rule, tensors, with_state, l2norm, out_w, state_w)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and s.shape == s_ref.shape
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    for name, a, ref in zip("q k v g beta".split(), gr, g_ref):
        assert a.shape == ref.shape
        assert rel(a, ref) < 1e-4, name


def test_bf16_inputs_and_no_final_state():
    tensors = inputs(2, 70, 2, 4, 16, seed=5)
    q, k, v, g, beta = (x.bfloat16() for x in tensors[:5])
    o_ref, s_ref = TRANSFORMERS_GDN(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    o, s = roofline_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert s is None and s_ref is None and o.dtype == torch.bfloat16
    assert rel(o.float(), o_ref.float()) < 1e-2


def test_set_gdn_in_the_tiny_model(monkeypatch):
    """The tiny model's loss and gradients are the same with either implementation, and 'roofline' calls it."""
    import training.model as tm
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm

    calls = []
    orig = tm.roofline_chunk_gated_delta_rule

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(tm, "roofline_chunk_gated_delta_rule", counted)
    cfg = tm.tiny_config_dict(2048, [2041, 2039])
    model, _ = tm.build_model(cfg, 0)
    ids = torch.randint(0, 2048, (2, 100), generator=torch.Generator().manual_seed(0))
    grads = {}
    try:
        for impl in ("transformers", "roofline"):
            assert tm.set_gdn([model], impl) == 6
            model.zero_grad()
            model(ids, labels=ids).loss.backward()
            grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    finally:
        tm.set_gdn([model], "transformers")
    assert qm.torch_chunk_gated_delta_rule is TRANSFORMERS_GDN
    assert len(calls) == 6  # one call per GDN layer, only with 'roofline'
    assert rel(grads["roofline"], grads["transformers"]) < 1e-4
