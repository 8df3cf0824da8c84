"""The CUDA fast path (Triton decode kernels installed on the weights) against the reference path."""

import subprocess
import sys

import pytest
import torch

from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
from roofline.engine.speculative import SpeculativeConfig
from roofline.hub import BUNDLED_MODEL

pytestmark = pytest.mark.gpu
PROMPTS = ["What is 38 + 45?", "Compute 71 - 29.", "How much is 12 times 7?"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The bundled model as INT4 experts/attention/GDN + FP8 shared experts + INT8 LM head."""
    out = tmp_path_factory.mktemp("fast") / "tiny-hybrid"
    cmd = [sys.executable, "-m", "roofline.cli", "checkpoint", "quantize", str(BUNDLED_MODEL), "--out", str(out),
           "--layout", "hybrid", "--lm-head", "int8", "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out


def greedy(engine, n=40):
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    seqs = [engine.add(p, SamplingParams(temperature=0.0, max_tokens=n)) for p in prompts]
    while engine.sequences:
        engine.step()
    return [s.output_ids for s in seqs]


def test_fast_path_installs_every_packed_format(hybrid):
    engine = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16")
    from roofline.model.layers import Experts
    from roofline.quant import Int4Weight

    packed = [m for m in engine.model.modules()
              if (isinstance(m, Int4Weight) and not m.num_experts) or hasattr(m, "weight_scale")
              or (isinstance(m, Experts) and isinstance(m.gate_up, Int4Weight))]  # the MTP head stays BF16
    assert packed and {type(m.forward).__name__ for m in packed} == {"partial"}, "every packed weight needs its kernel"


@pytest.mark.parametrize("k", [0, 2])
def test_fast_path_greedy_tokens_equal_reference_path(hybrid, k):
    spec = SpeculativeConfig(k) if k else None
    reference = greedy(Engine.from_pretrained(str(hybrid), device="cuda", dtype="float32", fast_path=False, speculative=spec))
    fast = greedy(Engine.from_pretrained(str(hybrid), device="cuda", dtype="float32", speculative=spec))
    assert fast == reference


def test_fast_path_logits_close_in_bfloat16(hybrid):
    """The fast path in bfloat16 against the fp32 reference, one decode step after each test prompt.

    Real prompts, not arbitrary ids: on ids the model never saw (3, 17, 99, 5, 42) a router of the stage-10
    weights has two experts within bf16 rounding of each other, so any two bf16 computations may route that
    token differently (the reference path's own bf16 logits were 8.8% off its fp32 ones there, 0.4-0.6% on
    these prompts; checked on the CPU)."""
    from roofline.engine.cache import SequenceCache

    ref = Engine.from_pretrained(str(hybrid), device="cuda", dtype="float32", fast_path=False)
    fast = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16").model
    for prompt in PROMPTS:
        ids = torch.tensor(ref.tokenizer.encode(ref.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])),
                           device="cuda")
        c1, c2 = SequenceCache(), SequenceCache()
        ref.model(ids[:-1], [len(ids) - 1], [c1])
        fast(ids[:-1], [len(ids) - 1], [c2])  # prefill (> 4 rows): the model's own code (GDN through fla when installed)
        a = ref.model.logits(ref.model(ids[-1:], [1], [c1])).float()
        b = fast.logits(fast(ids[-1:], [1], [c2])).float()
        assert (a - b).abs().max() / a.abs().max() < 3e-2, prompt


@pytest.mark.parametrize("k", [0, 2])
def test_block_repacked_int4_gives_the_same_tokens(hybrid, monkeypatch, k):
    """Qweights block-repacked at load (the default, MTP verify steps included): the same kernels' math on another
    weight order, so the same greedy tokens in bfloat16 as the GPTQ order (ROOFLINE_INT4_QBLK=0)."""
    spec = SpeculativeConfig(k) if k else None
    monkeypatch.setenv("ROOFLINE_INT4_QBLK", "0")
    plain = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16", speculative=spec)
    assert not any(getattr(m, "blocked", False) for m in plain.model.modules())
    monkeypatch.delenv("ROOFLINE_INT4_QBLK")
    blocked = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16", speculative=spec)
    assert any(getattr(m, "blocked", False) for m in blocked.model.modules()), "nothing was block-repacked"
    assert greedy(blocked) == greedy(plain)
    if k:
        assert sum(blocked.speculator.drafted) > 0, "no verify step ran"
