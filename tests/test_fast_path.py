"""The CUDA fast path (Triton decode kernels installed on the weights) against the reference path."""

import subprocess
import sys

import pytest
import torch

from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
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
    from roofline.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(k) if k else None
    reference = greedy(Engine.from_pretrained(str(hybrid), device="cuda", dtype="float32", fast_path=False, speculative=spec))
    fast = greedy(Engine.from_pretrained(str(hybrid), device="cuda", dtype="float32", speculative=spec))
    assert fast == reference


def test_fast_path_logits_close_in_bfloat16(hybrid):
    from roofline.engine.cache import SequenceCache

    ref = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16", fast_path=False).model
    fast = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16").model
    ids = torch.tensor([3, 17, 99, 5], device="cuda")
    c1, c2 = SequenceCache(), SequenceCache()
    ref(ids, [4], [c1])
    fast(ids, [4], [c2])  # prefill on the reference path in both
    step = torch.tensor([42], device="cuda")
    a, b = ref.logits(ref(step, [1], [c1])), fast.logits(fast(step, [1], [c2]))
    assert (a - b).abs().max() / a.abs().max() < 3e-2


def test_block_repacked_int4_gives_the_same_tokens(hybrid, monkeypatch):
    """ROOFLINE_INT4_QBLK=1 (qweights block-repacked at load): the same kernels' math on another weight order, so the
    same greedy tokens in bfloat16 as the GPTQ order."""
    plain = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16")
    monkeypatch.setenv("ROOFLINE_INT4_QBLK", "1")
    blocked = Engine.from_pretrained(str(hybrid), device="cuda", dtype="bfloat16")
    assert any(getattr(m, "blocked", False) for m in blocked.model.modules()), "nothing was block-repacked"
    assert greedy(blocked) == greedy(plain)
