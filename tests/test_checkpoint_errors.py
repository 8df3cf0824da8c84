"""Each bad checkpoint gives an error naming the tensor and/or file; odd-but-valid formats load."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from roofline.checkpoint import CheckpointError, load_model
from roofline.checkpoint.convert import publish_names
from roofline.checkpoint.writer import write_checkpoint
from roofline.config import ConfigError
from tiny_checkpoints import INT4_PLAN, reference_model, text_config, write_variant


@pytest.fixture(scope="module")
def tiny():
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=21)
    return cfg, hf, mtp


def make(tmp_path, tiny, **kw):
    cfg, hf, mtp = tiny
    write_variant(hf, mtp, tmp_path / "m", cfg=cfg, max_shard_bytes=300_000, **kw)
    return tmp_path / "m"


def edit_shard_holding(folder, name, edit):
    """Apply `edit(tensors)` to the shard that holds `name`."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    path = folder / index[name]
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


def expect_error(folder, *fragments, error=CheckpointError):
    with pytest.raises(error) as info:
        load_model(folder, "cpu", torch.float32)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


NAME = "model.layers.0.linear_attn.in_proj_qkv.weight"


def test_missing_tensor(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    edit_shard_holding(folder, NAME, lambda t: t.pop(NAME))
    expect_error(folder, "missing", "model.layers.0.linear_attn.in_proj_qkv")


def test_unexpected_tensor(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    path = edit_shard_holding(folder, NAME, lambda t: t.update({"model.layers.0.linear_attn.surprise": torch.zeros(2)}))
    expect_error(folder, "unexpected", "model.layers.0.linear_attn.surprise", path.name)


def test_misshapen_tensor(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    path = edit_shard_holding(folder, NAME, lambda t: t.update({NAME: t[NAME][:-8].clone()}))
    expect_error(folder, NAME, path.name, "shape")


def test_truncated_file(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    path = folder / index[NAME]
    path.write_bytes(path.read_bytes()[:-100])
    expect_error(folder, path.name, "truncated")


def test_shard_listed_in_index_but_absent(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    (folder / index[NAME]).unlink()
    expect_error(folder, index[NAME], "not on disk")


def test_unsupported_weight_format(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    base = NAME[: -len(".weight")]

    def to_packed(t):
        t[base + ".weight_packed"] = t.pop(NAME).to(torch.int8)

    edit_shard_holding(folder, NAME, to_packed)
    expect_error(folder, "unsupported weight format", base + ".weight_packed")


def test_non_trivial_g_idx(tmp_path, tiny):
    folder = make(tmp_path, tiny, plan=INT4_PLAN)
    base = "model.layers.0.linear_attn.in_proj_qkv"
    k = tiny[0]["hidden_size"]
    edit_shard_holding(folder, base + ".qweight", lambda t: t.update({base + ".g_idx": torch.arange(k).to(torch.int32) // 64}))  # act-order-like: not k // 128
    expect_error(folder, base, "g_idx")


def test_trivial_g_idx_accepted(tmp_path, tiny):
    folder = make(tmp_path, tiny, plan=INT4_PLAN)
    base = "model.layers.0.linear_attn.in_proj_qkv"
    k = tiny[0]["hidden_size"]
    edit_shard_holding(folder, base + ".qweight", lambda t: t.update({base + ".g_idx": torch.arange(k).to(torch.int32) // 128}))
    load_model(folder, "cpu", torch.float32)


def test_unsupported_model_type(tmp_path, tiny):
    folder = make(tmp_path, tiny)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(folder, "llama", "qwen3_5_moe", error=ConfigError)


def test_int4_asymmetric_with_group_64_matches_its_dequantised_weights(tmp_path, tiny):
    """Any group size dividing K, and asymmetric zeros, load exactly."""
    cfg, hf, mtp = tiny
    from roofline.quant import quantize_int4

    tensors = dict(publish_names(((n, t.bfloat16()) for n, t in {**hf.state_dict(), **mtp}.items())))
    name = NAME
    packed = quantize_int4(tensors.pop(name).float(), group_size=64, sym=False)
    base = name[: -len(".weight")]
    tensors.update({f"{base}.{s}": v for s, v in packed.items()})
    write_checkpoint(tmp_path / "asym", tensors.items(), cfg)
    model, report = load_model(tmp_path / "asym", "cpu", torch.float32)
    weight = model.model.layers[0].linear_attn.in_proj_qkv
    assert weight.FORMAT == "int4" and weight.group_size == 64
    original = hf.state_dict()[name]
    err = (weight.dequantize() - original).abs().max() / original.abs().max()
    assert 0 < err < 0.08  # quantised (not a silent dense copy) and within 4-bit error
