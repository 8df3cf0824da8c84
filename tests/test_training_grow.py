"""training/grow.py: the bundled model grown by one full-attention layer computes exactly what it did."""

import json

import pytest
import torch

from roofline.engine.engine import Engine
from roofline.engine.sampling import SamplingParams
from roofline.hub import BUNDLED_MODEL
from training.evaluate import heldout, mtp_acceptance, prompt_ids

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    from training.grow import grow

    out = tmp_path_factory.mktemp("grown") / "tiny-grown"
    grow(BUNDLED_MODEL, out)
    return out


def test_grown_config_adds_one_attention_layer_within_the_size_limit(grown):
    before = json.loads((BUNDLED_MODEL / "config.json").read_text())
    after = json.loads((grown / "config.json").read_text())
    assert after["num_hidden_layers"] == before["num_hidden_layers"] + 1
    assert after["layer_types"] == before["layer_types"] + ["full_attention"]
    assert sum(f.stat().st_size for f in grown.iterdir()) <= 32 * 2**20, "issue 3: all shipped files <= 32 MB"


def test_grown_model_logits_equal_the_original(grown):
    from transformers import Qwen3_5MoeForCausalLM

    ids = torch.tensor([[2040, 872, 198, 3, 45, 99, 512, 7, 2041, 198, 2040, 77, 198, 2042]])
    logits = [Qwen3_5MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)(input_ids=ids).logits
              for path in (BUNDLED_MODEL, grown)]
    assert torch.equal(logits[0], logits[1])


def test_grown_model_answers_and_drafts_as_the_original_in_roofline(grown):
    convs = heldout("arithmetic", 2, seed=77, thinking=True)
    engines = [Engine.from_pretrained(str(path), device="cpu", dtype="float32") for path in (BUNDLED_MODEL, grown)]
    assert len(engines[1].model.model.layers) == len(engines[0].model.model.layers) + 1
    outputs = []
    for engine in engines:
        seq = engine.add(prompt_ids(engine, convs[0]), SamplingParams(temperature=0.0, max_tokens=24))
        while engine.sequences:
            engine.step()
        outputs.append(seq.output_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24
    assert mtp_acceptance(engines[0], convs, max_tokens=24) == mtp_acceptance(engines[1], convs, max_tokens=24)


def test_training_from_the_grown_model_keeps_its_config(grown, tmp_path):
    """train.py --init-from writes the checkpoint's own config (it once wrote the default 8-layer config, so the
    trained 9-layer weights of stage 7 did not load)."""
    import subprocess
    import sys

    out = tmp_path / "trained"
    cmd = [sys.executable, "-m", "training.train", "--out", str(out), "--init-from", str(grown), "--steps", "1",
           "--bench-steps", "0", "--batch", "1", "--row-len", "256", "--docs", "16", "--max-facts", "6",
           "--workers", "1", "--no-eval", "--device", "cpu"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    saved = json.loads((out / "config.json").read_text())
    assert saved == {k: v for k, v in json.loads((grown / "config.json").read_text()).items() if k in saved}
    assert saved["num_hidden_layers"] == json.loads((BUNDLED_MODEL / "config.json").read_text())["num_hidden_layers"] + 1
    Engine.from_pretrained(str(out), device="cpu", dtype="float32")  # every tensor has its place
