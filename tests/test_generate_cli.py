"""`roofline generate --json` reproduces transformers' greedy tokens and logprobs (the real CLI, in a subprocess)."""

import json
import subprocess
import sys

import pytest
import torch

from tiny_checkpoints import FP8_PLAN, INT4_PLAN, reference_model, text_config, write_variant

PROMPT = [5, 17, 99, 3, 250, 42, 7]


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roofline.cli", *args], capture_output=True, text=True, timeout=300)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=1, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


VARIANTS = {  # name: (moe, write_variant options)
    "bf16-nested-fused": (True, dict(nested=True, per_expert=False)),
    "int4-flat-extra-mtp": (True, dict(plan=INT4_PLAN, mtp_in_extra_file=True)),
    "fp8-nested": (True, dict(plan=FP8_PLAN, nested=True)),
    "dense-bf16-sharded": (False, dict(max_shard_bytes=200_000)),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_json_matches_transformers_greedy(tmp_path, variant, device):
    moe, options = VARIANTS[variant]
    cfg = text_config(moe=moe)
    hf, mtp = reference_model(cfg, seed=11)
    reference, _ = write_variant(hf, mtp, tmp_path / "m", cfg=cfg, **options)
    want_tokens, want_logprobs = hf_greedy(reference, PROMPT, 12)
    result = run_cli("generate", str(tmp_path / "m"), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--temperature", "0", "--json", "--device", device, "--dtype", "float32", "--max-tokens", "12",
                     "--no-int8-lm-head")  # exact comparison: the LM head as stored (CUDA would quantise it)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == want_tokens
    assert out["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
    assert out["finish_reason"] == ("stop" if want_tokens[-1] == 1 else "length")


def test_generate_reports_bad_input_without_traceback(tmp_path):
    result = run_cli("generate", str(tmp_path / "nope"), "--prompt-ids", "1,2")
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.gpu
def test_generate_runs_in_bfloat16_on_cuda(tmp_path):
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=12)
    write_variant(hf, mtp, tmp_path / "m", plan=INT4_PLAN, cfg=cfg)
    result = run_cli("generate", str(tmp_path / "m"), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--temperature", "0", "--json", "--device", "cuda", "--dtype", "bfloat16", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) >= 1


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_engine_flags_reach_the_engine(command):
    """--enforce-eager, --no-int8-lm-head, --no-async-scheduling and --max-num-batched-tokens become
    Engine.from_pretrained's keywords."""
    from roofline.cli import build_parser
    from roofline.commands.flags import engine_options

    extra = ["--prompt-ids", "1"] if command == "generate" else []
    defaults = engine_options(build_parser().parse_args([command, *extra]))
    assert defaults == {"int8_lm_head": None, "cuda_graphs": None, "async_scheduling": True, "max_num_batched_tokens": 8192}
    off = engine_options(build_parser().parse_args(
        [command, *extra, "--enforce-eager", "--no-int8-lm-head", "--no-async-scheduling", "--max-num-batched-tokens", "512"]))
    assert off == {"int8_lm_head": False, "cuda_graphs": False, "async_scheduling": False, "max_num_batched_tokens": 512}
