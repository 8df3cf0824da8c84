"""Bytes per decoded token and the bandwidth ceiling, from tensor headers, against qwen35.md's table."""

from __future__ import annotations

import json

import pytest

from roofline.bench.ceiling import (MACHINES, TokenBytes, machines, model_token_bytes, parse_acceptance, parse_bandwidth,
                                    token_bytes)
from roofline.checkpoint.shapes import layout_tensors, resolve_layout, shape_config
from roofline.cli import main
from roofline.config import ModelConfig
from roofline.errors import UserError

GB = 1e9


def shape_bytes(name: str, layout: str = "int4", **overrides) -> TokenBytes:
    cfg = ModelConfig.from_dict(shape_config(name))
    return token_bytes(cfg, layout_tensors(cfg, resolve_layout(layout, overrides)))


# qwen35.md, "Bytes per decoded token, 122B, batch 1": weights GB/token, + state, ceiling at 273 GB/s and 4.2 TB/s
TABLE_122B = [
    (("bf16", {}), 18.0, 18.3, 15, 230),
    (("int4", {}), 6.53, 6.83, 40, 615),
    (("int4", {"lm_head": "int8"}), 5.77, 6.07, 45, 690),
    (("hybrid", {"lm_head": "int8"}), 5.32, 5.62, 49, 750),
]


@pytest.mark.parametrize("layout,weights,with_state,spark,h200_copy", TABLE_122B, ids=["bf16", "int4", "int8-head", "fp8-shared"])
def test_122b_matches_the_table(layout, weights, with_state, spark, h200_copy):
    tb = shape_bytes("qwen3.5-122b-a10b", layout[0], **layout[1])
    # INT4 here counts qzeros too (the table's 0.516 B/weight leaves them out): +0.5%
    assert tb.weights / GB == pytest.approx(weights, rel=0.01)
    assert tb.decode(0) / GB == pytest.approx(with_state, rel=0.01)
    assert tb.ceiling(273e9) == pytest.approx(spark, rel=0.02)
    assert tb.ceiling(4.2e12) == pytest.approx(h200_copy, rel=0.02)


def test_122b_components():
    cfg = ModelConfig.from_dict(shape_config("122b-a10b"))
    tb = shape_bytes("122b-a10b", "bf16")
    params = {r.cls: r.read / 2 for r in tb.rows if r.fmt == "bf16"}
    assert params["experts"] / 1e9 == pytest.approx(3.62, abs=0.01)  # 8 x 48 x 9.44M
    assert params["attention"] / 1e9 == pytest.approx(0.94, abs=0.01)
    assert (params["gdn"] + params["gdn_small"]) / 1e9 == pytest.approx(3.19, abs=0.02)
    assert params["shared"] / 1e9 == pytest.approx(0.45, abs=0.01)
    assert params["lm_head"] / 1e9 == pytest.approx(0.76, abs=0.01)
    assert tb.embed_row == 3072 * 2  # one row of the embedding
    assert tb.gdn_state == 36 * 64 * 128 * 128 * 4 * 2 == 301_989_888  # ~302 MB read + written
    assert tb.kv_per_token == 24_576  # 12 layers x 2 kv heads x 256 x K,V x 2 B
    assert tb.decode(32768) == tb.decode(0) + 32768 * 24_576
    assert cfg.layer_types.count("full_attention") == 12


@pytest.mark.parametrize("name,total,active", [("qwen3.5-35b-a3b", 35, 3), ("qwen3.5-122b-a10b", 122, 9.0),
                                               ("qwen3.5-397b-a17b", 397, 16.3), ("qwen3.5-27b", 27, 25.6)])
def test_every_shape_has_its_published_size(name, total, active):
    tb = shape_bytes(name, "bf16")
    stored = sum(r.stored for r in tb.rows if r.cls != "mtp") / 2  # bf16: 2 bytes per parameter
    assert stored / 1e9 == pytest.approx(total, rel=0.03)
    assert tb.weights / 2 / 1e9 == pytest.approx(active, rel=0.05)


def test_mtp_verify_reads_the_union_of_the_experts():
    tb = shape_bytes("122b-a10b", "hybrid", lm_head="int8")
    frac = 8 / 256
    assert tb.union_fraction(1) == pytest.approx(frac)
    assert tb.union_fraction(3) == pytest.approx(1 - (1 - frac) ** 3)  # E(1-(1-k/E)^(k+1)) / E for 2 drafts
    assert tb.verify(0) == pytest.approx(tb.decode(0))  # no drafts: a plain decode step
    # k drafts: verify reads more experts (but the dense weights once), drafts add MTP layer + lm_head
    extra_experts = tb.experts_stored * (tb.union_fraction(3) - frac)
    assert tb.verify(2) - tb.decode(0) == pytest.approx(extra_experts + 2 * tb.embed_row)
    assert tb.draft() == pytest.approx(tb.mtp_dense + tb.mtp_experts_stored * frac + tb.lm_head + tb.embed_row)
    assert TokenBytes.tokens_per_step(2, (0.95, 0.80)) == pytest.approx(2.75)
    plain, mtp1, mtp2 = (tb.ceiling(273e9, k) for k in (0, 1, 2))
    assert plain < mtp1 < mtp2  # on the 122B, both drafts pay off at the reported acceptance
    assert tb.ceiling(273e9, 2, acceptance=(0.3, 0.1)) < plain  # and speculation that is rarely accepted costs
    with pytest.raises(UserError, match="MTP-3 needs 3 acceptance rates"):
        tb.per_token(3, 0, (0.95, 0.8))


def test_dense_27b_has_no_experts_and_mtp_still_helps():
    tb = shape_bytes("27b", "int4")
    assert tb.experts_stored == 0 and tb.num_experts == 0
    assert tb.verify(2) == pytest.approx(tb.decode(0) + 2 * tb.embed_row)
    assert tb.ceiling(273e9, 1) > tb.ceiling(273e9)


def test_parsing():
    assert parse_bandwidth("273") == 273e9
    assert parse_bandwidth("4.2T") == parse_bandwidth("4.2TB/s") == 4.2e12
    assert parse_bandwidth("820GB/s") == 820e9
    for bad in ("fast", "-3", "0"):
        with pytest.raises(UserError, match="bandwidth"):
            parse_bandwidth(bad)
    assert parse_acceptance(None) == (0.95, 0.80)
    assert parse_acceptance("0.9, 0.7,0.5") == (0.9, 0.7, 0.5)
    with pytest.raises(UserError, match="between 0 and 1"):
        parse_acceptance("95,80")
    assert [m.name for m in machines()] == list(MACHINES)
    assert [m.bandwidth for m in machines(["h200"], "1T")] == [4.8e12, 1e12]
    with pytest.raises(UserError, match="unknown machine"):
        machines(["gb300"])


def test_ceiling_command(capsys):
    assert main(["ceiling", "--model", "qwen3.5-122b-a10b", "--layout", "int4", "--machine", "dgx-spark"]) == 0
    out = capsys.readouterr().out
    assert "qwen3.5-122b-a10b, layout: experts int4, attention int4, gdn int4" in out
    spark = next(line for line in out.splitlines() if line.startswith("dgx-spark"))
    assert spark.split()[3] == "39.8"  # plain decoding at context 0 (the table: 40)
    assert "GDN state     301.99 MB" in out and "KV cache       24.58 KB" in out
    assert main(["ceiling", "--model", "122B-A10B", "--lm-head", "int8", "--shared", "fp8", "--bandwidth", "4.2T",
                 "--context", "0", "--mtp", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["ceilings"]
    assert row["machine"] == "custom" and row["tok_s"] == pytest.approx(750, rel=0.02)
    assert main(["ceiling", "--model", "qwen3.5-9t"]) == 2
    assert "not a known shape" in capsys.readouterr().err


def test_ceiling_from_shape_equals_ceiling_from_a_checkpoint_of_that_shape(tmp_path, capsys):
    """The shape model and the header count agree: a random checkpoint's tensors give the same bytes."""
    assert main(["checkpoint", "random", "--shape", "tiny", "--layout", "hybrid", "--lm-head", "int8", str(tmp_path / "c"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    _, _, from_dir = model_token_bytes(str(tmp_path / "c"))
    _, _, from_shape = model_token_bytes("tiny", resolve_layout("hybrid", {"lm_head": "int8"}))
    assert from_dir.rows == from_shape.rows
    assert from_dir.decode(4096) == from_shape.decode(4096) and from_dir.draft() == from_shape.draft()
    with pytest.raises(UserError, match="--layers applies to named shapes"):
        model_token_bytes(str(tmp_path / "c"), layers=2)
