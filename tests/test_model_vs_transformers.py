"""Logits of the reference path equal transformers' on tiny checkpoints in every published layout."""

import pytest
import torch

from roofline.checkpoint import load_model
from roofline.engine.cache import SequenceCache
from tiny_checkpoints import FP8_PLAN, INT4_PLAN, reference_model, text_config, write_variant

PROMPT = torch.tensor([5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 1, 200, 31, 8])


def engine_logits(model, ids):
    return model.logits(model(ids, [len(ids)], [SequenceCache()]))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def assert_close(ours, ref, tol=2e-4):
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"relative max error {err:.2e}"


@pytest.mark.parametrize(
    "moe,heads,nested,per_expert",
    [
        (True, (4, 2), False, True),  # save_pretrained layout
        (True, (4, 4), True, False),  # published BF16: nested config, fused 3-D experts
        (True, (8, 2), True, True),
        (False, (4, 1), False, True),  # dense 27B-style
        (False, (2, 2), True, True),
    ],
)
def test_logits_match_transformers(tmp_path, moe, heads, nested, per_expert):
    cfg = text_config(moe=moe, heads=heads)
    hf, mtp = reference_model(cfg, seed=1)
    write_variant(hf, mtp, tmp_path / "ckpt", nested=nested, per_expert=per_expert, cfg=cfg, max_shard_bytes=300_000)
    model, report = load_model(tmp_path / "ckpt", "cpu", torch.float32)
    assert report.has_mtp and report.skipped_vision == (1 if nested else 0)
    assert_close(engine_logits(model, PROMPT), hf_logits(hf, PROMPT))


def test_long_prompt_chunked_recurrence_matches_transformers(tmp_path):
    """A 200-token prompt takes the chunked delta rule (DELTA_CHUNK), then decoding continues token by token
    from its final state: logits as transformers computes them over the whole sequence."""
    from roofline.model.layers import DELTA_CHUNK

    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=3)
    write_variant(hf, mtp, tmp_path / "ckpt", cfg=cfg)
    model, _ = load_model(tmp_path / "ckpt", "cpu", torch.float32)
    ids = torch.randint(0, cfg["vocab_size"], (203,), generator=torch.Generator().manual_seed(0))
    assert len(ids) - 3 >= 3 * DELTA_CHUNK
    cache = SequenceCache()
    ours = [model.logits(model(ids[:-3], [len(ids) - 3], [cache]))]
    ours += [model.logits(model(ids[i : i + 1], [1], [cache])) for i in range(len(ids) - 3, len(ids))]
    assert_close(torch.cat(ours), hf_logits(hf, ids))


def test_chunked_delta_rule_equals_the_token_loop():
    """chunked_delta_rule against GatedDeltaNet.recurrence's loop: a starting state, a span that is not a
    multiple of the chunk, strong and weak decay."""
    import torch.nn.functional as F

    from roofline.model.layers import chunked_delta_rule

    g = torch.Generator().manual_seed(0)
    t, h, dk, dv = 150, 3, 16, 8
    q = F.normalize(torch.randn(t, h, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    beta = torch.rand(t, h, generator=g)
    decay = -torch.rand(t, h, generator=g) * torch.tensor([0.01, 1.0, 4.0])
    state = torch.randn(h, dk, dv, generator=g) * 0.3
    out, final = chunked_delta_rule(q, k, v, beta, decay, state.clone(), chunk=32)
    for i in range(t):
        state = state * decay[i].exp()[:, None, None]
        delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        assert_close(out[i], torch.einsum("hkv,hk->hv", state, q[i]), tol=1e-5)
    assert_close(final, state, tol=1e-5)


@pytest.mark.parametrize("plan", [INT4_PLAN, FP8_PLAN], ids=["int4", "fp8"])
def test_quantized_checkpoint_matches_dequantized_model(tmp_path, plan):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=2)
    reference, _ = write_variant(hf, mtp, tmp_path / "q", plan=plan, cfg=cfg, mtp_in_extra_file=True, max_shard_bytes=400_000)
    model, report = load_model(tmp_path / "q", "cpu", torch.float32)
    assert report.has_mtp, "MTP head in the unindexed extra file must load"
    fmt = "int4" if plan is INT4_PLAN else "fp8-block"
    assert report.formats[fmt] > 0
    ours = engine_logits(model, PROMPT)
    assert_close(ours, hf_logits(reference, PROMPT))
    # and the quantisation really changed the model (the test would pass vacuously otherwise)
    assert (ours - hf_logits(hf, PROMPT)).abs().max() > 1e-3


def test_prefill_then_decode_equals_full_forward(tmp_path):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=3)
    write_variant(hf, mtp, tmp_path / "c", cfg=cfg)
    model, _ = load_model(tmp_path / "c", "cpu", torch.float32)
    full = engine_logits(model, PROMPT)
    cache = SequenceCache()
    steps = [model.logits(model(PROMPT[:6], [6], [cache]))]
    steps.append(model.logits(model(PROMPT[6:9], [3], [cache])))  # several tokens at once (verify-style)
    for t in range(9, len(PROMPT)):
        steps.append(model.logits(model(PROMPT[t : t + 1], [1], [cache])))
    assert_close(torch.cat(steps), full, tol=1e-5)
    assert cache.num_tokens == len(PROMPT)


def test_batch_of_sequences_equals_each_alone(tmp_path):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=4)
    write_variant(hf, mtp, tmp_path / "c", cfg=cfg)
    model, _ = load_model(tmp_path / "c", "cpu", torch.float32)
    a, b = PROMPT[:9], PROMPT[3:]
    caches = [SequenceCache(), SequenceCache()]
    both = model.logits(model(torch.cat([a, b]), [len(a), len(b)], caches))
    assert_close(both[: len(a)], engine_logits(model, a), tol=1e-5)
    assert_close(both[len(a) :], engine_logits(model, b), tol=1e-5)
    # then one decode token each, batched, with different cache lengths
    step = model.logits(model(torch.tensor([9, 10]), [1, 1], caches))
    assert_close(step[0], engine_logits(model, torch.cat([a, torch.tensor([9])]))[-1], tol=1e-5)
    assert_close(step[1], engine_logits(model, torch.cat([b, torch.tensor([10])]))[-1], tol=1e-5)


def test_bfloat16_compute_matches_transformers_in_bfloat16(tmp_path):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=5)
    write_variant(hf, mtp, tmp_path / "c", cfg=cfg)
    model, _ = load_model(tmp_path / "c", "cpu", torch.bfloat16)
    assert model.dtype == torch.bfloat16
    # bf16 rounding moves this random model's logits by ~25% against fp32, in transformers too;
    # against transformers run in bf16 the two implementations agree far closer than that.
    assert_close(engine_logits(model, PROMPT), hf_logits(hf.to(torch.bfloat16), PROMPT), tol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_equal_the_per_token_formula(dtype):
    """The experts' prefill loop (rows grouped by expert, one host read a call) is each token's sum over its chosen
    experts in ascending order of w * down(silu(gate) * up), accumulated in the model's dtype (up to the matmuls'
    rounding: one row at a time here, an expert's rows together there)."""
    import torch.nn.functional as F

    from roofline.model.layers import Experts
    from roofline.quant import DenseWeight

    gen = torch.Generator().manual_seed(3)
    experts = Experts(8, 64, 32)
    experts.gate_up, experts.down = DenseWeight(64, 64, 8, dtype=dtype), DenseWeight(64, 32, 8, dtype=dtype)
    for w in (experts.gate_up.weight, experts.down.weight):
        w.copy_(torch.randn(w.shape, generator=gen))
    x = torch.randn(37, 64, generator=gen).to(dtype)
    top = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(37)])  # expert 0..7, not in order
    weights = torch.rand(37, 3, generator=gen).to(dtype)
    want = torch.zeros_like(x)
    for t in range(37):
        for slot in top[t].argsort().tolist():
            e = int(top[t, slot])
            gate, up = (x[t : t + 1] @ experts.gate_up.weight[e].t()).chunk(2, dim=-1)
            want[t] += ((F.silu(gate) * up) @ experts.down.weight[e].t())[0] * weights[t, slot]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(experts(x, top, weights), want, rtol=tol, atol=tol * want.abs().max().item())
