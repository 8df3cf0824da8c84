"""The bundled model: it answers, and it is the yardstick later optimisations are held to.

Bars from issue 3: held-out arithmetic and ~1K-token recall >= 95% (greedy), MTP draft
acceptance at position 1 >= 70%, and the project's own quantised build (INT4 experts,
attention and GDN, FP8 shared experts, INT8 LM head) within 2 points of BF16.
"""

import json
import subprocess
import sys

import pytest
import torch

from roofline.engine.engine import Engine
from roofline.hub import BUNDLED_MODEL
from training.evaluate import accuracy, heldout, mtp_acceptance, prompt_ids

N_ARITHMETIC, N_RECALL, RECALL_FACTS, N_MTP = 200, 40, 100, 12


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(None, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def quantized_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "tiny-hybrid-int8head"
    result = subprocess.run(
        [sys.executable, "-m", "roofline.cli", "checkpoint", "quantize", str(BUNDLED_MODEL), "--out", str(out),
         "--layout", "hybrid", "--lm-head", "int8", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    engine = Engine.from_pretrained(str(out), device="cpu", dtype="float32")
    formats = {name: type(m).__name__ for name, m in engine.model.named_modules()}
    assert formats["model.layers.0.mlp.experts.gate_up"] == "Int4Weight"
    assert formats["model.layers.3.self_attn.q_proj"] == "Int4Weight"
    assert formats["model.layers.0.linear_attn.in_proj_qkv"] == "Int4Weight"
    assert formats["model.layers.0.mlp.shared_expert.up_proj"] == "Fp8BlockWeight"
    assert formats["lm_head"] == "Int8RowWeight"
    return engine


@pytest.fixture(scope="module")
def tasks():
    return {"arithmetic": heldout("arithmetic", N_ARITHMETIC), "recall": heldout("recall", N_RECALL, n_facts=RECALL_FACTS)}


@pytest.fixture(scope="module")
def bf16_scores(engine, tasks):
    return {"arithmetic": accuracy(engine, tasks["arithmetic"]), "recall": accuracy(engine, tasks["recall"], max_tokens=64)}


def test_main_command_answers_without_model_argument():
    result = subprocess.run(
        [sys.executable, "-m", "roofline.cli", "generate", "--chat", "--prompt", "What is 38 + 45?", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)["text"].split("</think>")[-1]
    assert "83" in answer, answer


def test_transformers_loads_it_and_agrees(engine):
    from transformers import Qwen3_5MoeForCausalLM

    hf = Qwen3_5MoeForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(engine.tokenizer.encode("<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n"))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    from roofline.engine.cache import SequenceCache

    got = engine.model.logits(engine.model(ids, [len(ids)], [SequenceCache()]))
    assert (got - want).abs().max() / want.abs().max() < 1e-4


# Arithmetic with thinking on and off as the generator draws them (a quarter off). 200 problems, not 100: at
# stage 9 the first 100 scored 0.95 and the next 100 0.85, so 100 could not tell.
def test_heldout_arithmetic_accuracy(bf16_scores):
    assert bf16_scores["arithmetic"] >= 0.95, bf16_scores


def test_heldout_recall_accuracy_at_1k_tokens(engine, tasks, bf16_scores):
    assert bf16_scores["recall"] >= 0.95, bf16_scores


def test_recall_prompts_are_about_1k_tokens(engine, tasks):
    mean_tokens = sum(len(prompt_ids(engine, c)) for c in tasks["recall"]) / len(tasks["recall"])
    assert mean_tokens >= 900, f"recall prompts average {mean_tokens:.0f} tokens, not ~1K"


def test_mtp_acceptance(engine):
    first, second = mtp_acceptance(engine, heldout("arithmetic", N_MTP, seed=99))
    print(f"MTP greedy acceptance: position 1 {first:.3f}, position 2 {second:.3f}")
    assert first >= 0.70
    assert 0 < second <= 1


def test_quantized_build_within_two_points_on_arithmetic(quantized_engine, tasks, bf16_scores):
    score = accuracy(quantized_engine, tasks["arithmetic"])
    print(f"arithmetic: BF16 {bf16_scores['arithmetic']}, quantised {score}")
    assert bf16_scores["arithmetic"] > 0.5, "the comparison needs a model that answers"
    assert score >= bf16_scores["arithmetic"] - 0.02, (score, bf16_scores)


def test_quantized_build_within_two_points_on_recall(quantized_engine, tasks, bf16_scores):
    score = accuracy(quantized_engine, tasks["recall"], max_tokens=64)
    print(f"recall at ~1K tokens: BF16 {bf16_scores['recall']}, quantised {score}")
    assert bf16_scores["recall"] > 0.2, "the comparison needs a model that recalls"
    assert score >= bf16_scores["recall"] - 0.02, (score, bf16_scores)


def test_int8_lm_head_at_load_keeps_answers(engine):
    """The load-time INT8 LM head (the CUDA default) against the stored head: logits close, the same greedy
    answers, and the same top token wherever the stored head's top-2 margin exceeds the quantisation error
    (at positions no training loss covers the margin can be ~0.04, where either token is an honest argmax)."""
    from roofline.engine.cache import SequenceCache
    from roofline.engine.sampling import SamplingParams
    from roofline.quant.int8 import Int8RowWeight

    int8 = Engine.from_pretrained(None, device="cpu", dtype="float32", int8_lm_head=True)
    assert isinstance(int8.model.lm_head, Int8RowWeight)
    ids = torch.tensor(engine.tokenizer.encode("<|im_start|>user\nWhat is 38 + 45?<|im_end|>\n<|im_start|>assistant\n"))
    want = engine.model.logits(engine.model(ids, [len(ids)], [SequenceCache()]))
    got = int8.model.logits(int8.model(ids, [len(ids)], [SequenceCache()]))
    error = (got - want).abs().max()
    assert error / want.abs().max() < 2e-2
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error
    assert clear.sum() >= len(ids) // 2, "most positions should have a clear top token"
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    prompt = ids.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=48)
    assert [e.token_id for e in int8.generate(prompt, params)] == [e.token_id for e in engine.generate(prompt, params)]


def test_speculation_keeps_greedy_answers(engine):
    """MTP-k (k = 1..4) on the bundled model, four questions decoding together: token for token the output
    without speculation, while the head's drafts are mostly accepted (stage 10: position 1 accepted in every
    round at k = 1..4; 0.89-0.94 while the head's cache lost its history each step, test_speculative)."""
    from roofline.engine.sampling import SamplingParams
    from roofline.engine.speculative import SpeculativeConfig

    prompts = [prompt_ids(engine, c) for c in heldout("arithmetic", 4, seed=5)]

    def answers(e):
        seqs = [e.add(p, SamplingParams(temperature=0.0, max_tokens=64)) for p in prompts]
        while e.sequences:
            e.step()
        return [s.output_ids for s in seqs]

    want = answers(engine)
    for k in range(1, 5):
        spec = Engine(engine.model, engine.tokenizer, engine.model_dir, speculative=SpeculativeConfig(k))
        assert answers(spec) == want, k
        assert spec.speculator.acceptance_rates()[0] > 0.95, spec.speculator.acceptance_rates()
