"""Checkpoint tools end to end on tiny checkpoints in the published formats (build-hybrid, graft-mtp,
quantize, random, inspect): outputs load and give the logits of the expected dequantised model; every
bad input gives one clear error and leaves no output behind."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from roofline.checkpoint import load_model
from roofline.checkpoint.reader import CheckpointReader
from roofline.checkpoint.stream import StreamWriter
from roofline.cli import main
from roofline.engine.cache import SequenceCache
from tiny_checkpoints import FP8_PLAN, INT4_PLAN, reference_model, text_config, write_variant

PROMPT = torch.tensor([5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 1, 200])
SHARD = 400_000  # several shards per tiny checkpoint, so shard handling is exercised


# --- fixtures: one tiny model in the three published formats ---------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    cfg = text_config()
    hf, mtp = reference_model(cfg, seed=11)
    ref4, _ = write_variant(hf, mtp, root / "int4", cfg=cfg, plan=INT4_PLAN, nested=True, mtp_in_extra_file=True, max_shard_bytes=SHARD)
    ref8, _ = write_variant(hf, mtp, root / "fp8", cfg=cfg, plan=FP8_PLAN, nested=True, max_shard_bytes=SHARD)
    write_variant(hf, mtp, root / "bf16", cfg=cfg, nested=True, per_expert=False, max_shard_bytes=SHARD)
    for name in ("tokenizer.json", "generation_config.json"):  # side files the output must carry over
        (root / "int4" / name).write_text("{}")
    return {"root": root, "cfg": cfg, "hf": hf, "mtp": mtp, "ref4": ref4, "ref8": ref8,
            "int4": root / "int4", "fp8": root / "fp8", "bf16": root / "bf16"}


def copy_source(sources, name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(sources[name], dst)
    return dst


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def engine_logits(model, ids=PROMPT):
    return model.logits(model(ids, [len(ids)], [SequenceCache()]))


def hf_logits(model, ids=PROMPT):
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def assert_close(ours, ref, tol=2e-4):
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"relative max error {err:.2e}"


def expected_hybrid(sources):
    """The dequantised hybrid: the INT4 reference with the shared experts of the FP8 reference."""
    ref = copy.deepcopy(sources["ref4"])
    fp8 = dict(sources["ref8"].named_parameters())
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if ".shared_expert." in name:
                param.copy_(fp8[name])
    return ref


def assert_no_output(out: Path):
    assert not out.exists(), f"{out} was left behind"
    assert not out.with_name(f".{out.name}.incomplete").exists(), "temporary output was left behind"


def index_of(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def greedy_engine(model, ids, steps):
    cache = SequenceCache()
    logits = model.logits(model(ids, [len(ids)], [cache]))
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = model.logits(model(torch.tensor(tokens[-1:]), [1], [cache]))
    return tokens


def greedy_hf(model, ids, steps):
    seq = ids.tolist()
    for _ in range(steps):
        seq.append(int(hf_logits(model, torch.tensor(seq))[-1].argmax()))
    return seq[len(ids):]


# --- build-hybrid ------------------------------------------------------------------------------------


def test_build_hybrid_default_plan(sources, tmp_path, capsys):
    out = tmp_path / "hybrid"
    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"],
                             "--out", out, "--max-shard-size", "500KB")
    assert rc == 0, stderr
    # one summary table, no per-tensor warnings
    assert "shared     FP8 source    fp8       copy" in stdout
    assert "experts    INT4 source   int4      copy" in stdout
    assert "mtp        INT4 source   bf16      copy" in stdout
    assert "warning" not in (stdout + stderr).lower()

    model, report = load_model(out, "cpu", torch.float32)
    assert report.has_mtp and report.skipped_vision == 1
    assert report.formats["fp8-block"] == 3 * 4  # the shared experts' three linears in 4 layers
    assert report.formats["int4"] > 0
    expected = expected_hybrid(sources)
    ours = engine_logits(model)
    assert_close(ours, hf_logits(expected))
    assert (ours - hf_logits(sources["ref4"])).abs().max() > 1e-4, "the FP8 shared experts changed nothing?"
    # generates the tokens of the dequantised hybrid
    assert greedy_engine(model, PROMPT, 6) == greedy_hf(expected, PROMPT, 6)

    # MTP head kept (from the INT4 source's unindexed extra file), bit for bit, and listed in the index
    index = index_of(out)
    written = tensors_of(out)
    src_mtp = load_file(sources["int4"] / "model_extra_tensors.safetensors")
    assert src_mtp and all(name in index for name in src_mtp)
    assert all(torch.equal(written[n], t) for n, t in src_mtp.items())
    assert set(index) == set(written), "the index must list every tensor of every file"
    assert len(list(out.glob("model-*.safetensors"))) > 1
    # side files and the config: the INT4 source's, with the FP8 block size recorded
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["weight_block_size"] == [128, 128]

    # refuses to overwrite without --force, and leaves the existing output untouched
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"], "--out", out)
    assert rc == 2 and "already exists" in stderr and "--force" in stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"], "--out", out, "--force")
    assert rc == 0, stderr
    assert load_model(out, "cpu", torch.float32)[1].has_mtp


def test_build_hybrid_plan_file(sources, tmp_path, capsys):
    """A plan file: attention from the FP8 source as stored, LM head quantised to INT8 from the INT4 source's BF16."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"attention": "fp8:keep", "lm_head": {"source": "int4", "format": "int8"}}))
    out = tmp_path / "hybrid"
    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"],
                             "--out", out, "--plan", plan, "--no-progress")
    assert rc == 0, stderr
    assert "attention  FP8 source    fp8       copy" in stdout
    assert "lm_head    INT4 source   int8      quantize" in stdout
    model, report = load_model(out, "cpu", torch.float32)
    assert report.formats["fp8-block"] == 3 * 4 + 4 * 1  # shared experts + q/k/v/o of the one attention layer
    assert report.formats["int8-row"] == 1
    expected = expected_hybrid(sources)
    fp8 = dict(sources["ref8"].named_parameters())
    with torch.no_grad():
        for name, param in expected.named_parameters():
            if ".self_attn." in name and name.endswith("proj.weight"):
                param.copy_(fp8[name])
        w = expected.lm_head.weight
        scale = w.abs().amax(-1, keepdim=True) / 127
        w.copy_((w / scale).round().clamp(-127, 127) * scale)
    assert_close(engine_logits(model), hf_logits(expected))


def test_build_hybrid_dry_run_writes_nothing(sources, tmp_path, capsys):
    out = tmp_path / "hybrid"
    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"],
                             "--out", out, "--dry-run", "--machine", "h200")
    assert rc == 0, stderr
    for text in ("plan:", "shared           fp8    from the FP8 source", "everything else", "output:", "MTP head kept",
                 "bytes read per decoded token", "GDN state", "ceiling in tok/s", "h200"):
        assert text in stdout, text
    assert_no_output(out)


def test_build_hybrid_resolves_hf_ids_in_a_cache_with_two_snapshots(sources, tmp_path, capsys, monkeypatch):
    """HF ids resolve to refs/main's snapshot; the FP8 snapshot holds only the shards the plan needs."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    int4_repo = hub / "models--org--tiny-int4"
    shutil.copytree(sources["int4"], int4_repo / "snapshots" / "bbbb")
    (int4_repo / "snapshots" / "aaaa").mkdir(parents=True)  # an older, broken snapshot
    (int4_repo / "snapshots" / "aaaa" / "config.json").write_text("{not json")
    (int4_repo / "refs").mkdir()
    (int4_repo / "refs" / "main").write_text("bbbb")
    fp8_snap = hub / "models--org--tiny-fp8" / "snapshots" / "cccc"
    shutil.copytree(sources["fp8"], fp8_snap)
    index = index_of(fp8_snap)
    needed = {f for n, f in index.items() if ".shared_expert." in n and not n.startswith("mtp.")}
    unneeded = set(index.values()) - needed
    assert unneeded, "the test needs an FP8 shard without shared experts"
    for f in unneeded:
        (fp8_snap / f).unlink()  # never downloaded: not needed

    out = tmp_path / "hybrid"
    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", "org/tiny-int4", "--fp8", "org/tiny-fp8", "--out", out)
    assert rc == 0, stderr
    assert f"from {len(needed)} of {len(set(index.values()))} shard(s)" in stdout
    assert_close(engine_logits(load_model(out, "cpu", torch.float32)[0]), hf_logits(expected_hybrid(sources)))

    # a needed shard missing with downloads off: a clear error naming the shard, no output
    (fp8_snap / sorted(needed)[0]).unlink()
    out2 = tmp_path / "hybrid2"
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", "org/tiny-int4", "--fp8", "org/tiny-fp8", "--out", out2)
    assert rc == 2 and sorted(needed)[0] in stderr and "downloads are off" in stderr
    assert_no_output(out2)
    # an id in neither the cache nor reachable
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", "org/absent", "--fp8", "org/tiny-fp8", "--out", out2)
    assert rc == 2 and "org/absent" in stderr and "not in the local Hugging Face cache" in stderr
    assert_no_output(out2)


class FakeHub:
    """Stands in for huggingface_hub with a network: serves a "remote" folder, records what was downloaded."""

    def __init__(self, remote: Path, cache: Path):
        self.remote, self.cache, self.downloaded, self.headers_fetched = remote, cache, [], []

    def hf_hub_download(self, repo_id, filename, revision=None):
        self.downloaded.append(filename)
        dst = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / (revision or "rev1") / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.remote / filename, dst)
        return str(dst)

    def HfApi(self):
        hub = self

        class Api:
            def parse_safetensors_file_metadata(self, repo_id, filename, revision=None):
                from types import SimpleNamespace

                from roofline.checkpoint.reader import read_header
                from roofline.checkpoint.stream import DTYPE_NAMES

                hub.headers_fetched.append(filename)
                infos = read_header(hub.remote / filename)
                return SimpleNamespace(tensors={n: SimpleNamespace(dtype=DTYPE_NAMES[i.dtype], shape=list(i.shape)) for n, i in infos.items()})

        return Api()


def test_build_hybrid_downloads_only_the_fp8_shards_it_needs(sources, tmp_path, capsys, monkeypatch):
    import roofline.checkpoint.build as build

    hub = FakeHub(sources["fp8"], tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(build, "_hub", lambda: hub)
    index = index_of(sources["fp8"])
    needed = {f for n, f in index.items() if ".shared_expert." in n and not n.startswith("mtp.")}

    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", "org/remote-fp8",
                             "--out", tmp_path / "dry", "--dry-run")
    assert rc == 0, stderr
    assert f"({len(needed)} to download)" in stdout
    assert hub.downloaded == ["config.json", "model.safetensors.index.json"]  # headers came without the shards
    assert set(hub.headers_fetched) == needed

    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", "org/remote-fp8",
                             "--out", tmp_path / "hybrid")
    assert rc == 0, stderr
    assert set(hub.downloaded[2:]) == needed and len(needed) < len(set(index.values()))
    assert_close(engine_logits(load_model(tmp_path / "hybrid", "cpu", torch.float32)[0]), hf_logits(expected_hybrid(sources)))


def _drop_tensor(folder: Path, name: str) -> None:
    """Remove one tensor from a checkpoint (its shard rewritten, the index updated)."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"].pop(name)
    tensors = load_file(folder / file)
    del tensors[name]
    save_file(tensors, folder / file, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def _bad_fp8_source(kind, sources, tmp_path):
    if kind == "models do not match":
        assert main(["checkpoint", "random", "--shape", "tiny", "--layout", "fp8", str(tmp_path / "other"), "--no-progress"]) == 0
        return sources["int4"], tmp_path / "other"
    fp8 = copy_source(sources, "fp8", tmp_path)
    int4 = sources["int4"]
    index = index_of(fp8)
    if kind == "missing shard":
        int4 = copy_source(sources, "int4", tmp_path)
        (int4 / "model-00002-of-00003.safetensors").unlink()
    elif kind == "corrupt file":
        shard = fp8 / index["model.language_model.layers.1.mlp.shared_expert.up_proj.weight"]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "corrupt header":
        int4 = copy_source(sources, "int4", tmp_path)
        (int4 / "model_extra_tensors.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
    elif kind == "source lacks a tensor":
        _drop_tensor(fp8, "model.language_model.layers.2.mlp.shared_expert.down_proj.weight")
    elif kind == "source lacks a scale":
        _drop_tensor(fp8, "model.language_model.layers.3.mlp.shared_expert.gate_proj.weight_scale_inv")
    return int4, fp8


BAD_INPUTS = {
    "models do not match": ["do not match", "vocab_size 256 vs 512"],
    "missing shard": ["model-00002-of-00003.safetensors", "missing"],
    "corrupt file": ["truncated"],
    "corrupt header": ["model_extra_tensors.safetensors", "not a readable safetensors file"],
    "source lacks a tensor": ["shared", "FP8 source lacks model.layers.2.mlp.shared_expert.down_proj"],
    "source lacks a scale": ["FP8 source lacks model.layers.3.mlp.shared_expert.gate_proj.weight_scale_inv", "float8_e4m3fn"],
}


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_build_hybrid_bad_inputs_give_clear_errors_and_no_output(kind, sources, tmp_path, capsys):
    int4, fp8 = _bad_fp8_source(kind, sources, tmp_path)
    out = tmp_path / "hybrid"
    rc, stdout, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", int4, "--fp8", fp8, "--out", out)
    assert rc == 2, stdout + stderr
    assert stderr.startswith("roofline checkpoint: error: ") and "Traceback" not in stderr
    for text in BAD_INPUTS[kind]:
        assert text in stderr, f"{text!r} not in {stderr!r}"
    assert_no_output(out)


def test_build_hybrid_bad_plan_file(sources, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    for content, message in [("{", "not valid JSON"), ('{"experts": "int8:int4"}', "unknown source 'int8'"),
                             ('{"expert": "int4:int4"}', "unknown module class 'expert'"),
                             ('{"experts": "int4:nf4"}', "unknown format 'nf4'"),
                             ('{"shared": "fp8:int4"}', "converting fp8 to int4")]:
        plan.write_text(content)
        rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"],
                            "--out", tmp_path / "o", "--plan", plan)
        assert rc == 2 and message in stderr, (content, stderr)
        assert_no_output(tmp_path / "o")


def test_interrupted_build_leaves_nothing_complete_and_reruns_cleanly(sources, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hybrid"
    real_write, calls = StreamWriter.write, []

    def interrupted(self, name, tensor):
        calls.append(name)
        if len(calls) == 40:
            raise KeyboardInterrupt
        return real_write(self, name, tensor)

    monkeypatch.setattr(StreamWriter, "write", interrupted)
    rc, _, _ = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"], "--out", out)
    assert rc == 130 and len(calls) == 40
    assert_no_output(out)
    monkeypatch.setattr(StreamWriter, "write", real_write)
    # a run killed hard leaves its hidden temporary folder: the next run removes it and starts again
    stale = out.with_name(f".{out.name}.incomplete")
    stale.mkdir()
    (stale / "model-00001-of-00009.safetensors").write_bytes(b"partial")
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"], "--out", out)
    assert rc == 0, stderr
    assert not stale.exists() and not (out / "model-00001-of-00009.safetensors").exists()
    assert load_model(out, "cpu", torch.float32)[1].has_mtp


def test_force_refuses_to_replace_a_folder_that_is_not_a_checkpoint(sources, tmp_path, capsys):
    out = tmp_path / "documents"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    rc, _, stderr = run(capsys, "checkpoint", "build-hybrid", "--int4", sources["int4"], "--fp8", sources["fp8"], "--out", out, "--force")
    assert rc == 2 and "not a checkpoint folder" in stderr
    assert (out / "thesis.txt").read_text() == "precious"


# --- graft-mtp --------------------------------------------------------------------------------------


def test_graft_mtp_adds_the_head_and_is_idempotent(sources, tmp_path, capsys):
    target = tmp_path / "no-mtp"
    write_variant(sources["hf"], None, target, cfg=sources["cfg"], plan=INT4_PLAN, nested=True, max_shard_bytes=SHARD)
    assert not load_model(target, "cpu", torch.float32)[1].has_mtp
    rc, stdout, stderr = run(capsys, "checkpoint", "graft-mtp", "--from", sources["int4"], "--into", target)
    assert rc == 0, stderr
    assert "grafted the MTP head" in stdout
    model, report = load_model(target, "cpu", torch.float32)
    assert report.has_mtp
    src_mtp = load_file(sources["int4"] / "model_extra_tensors.safetensors")
    index = index_of(target)
    assert all(index[n] == "model_extra_tensors.safetensors" for n in src_mtp)
    grafted = load_file(target / "model_extra_tensors.safetensors")
    assert set(grafted) == set(src_mtp) and all(torch.equal(grafted[n], t) for n, t in src_mtp.items())

    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in target.iterdir()}
    rc, stdout, stderr = run(capsys, "checkpoint", "graft-mtp", "--from", sources["int4"], "--into", target)
    assert rc == 0 and "nothing to do" in stdout, stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in target.iterdir()} == before


def test_graft_mtp_indexes_a_head_the_index_does_not_list(sources, tmp_path, capsys):
    target = copy_source(sources, "int4", tmp_path)  # public INT4 layout: MTP in an unindexed extra file
    assert not any(n.startswith("mtp.") for n in index_of(target))
    rc, stdout, stderr = run(capsys, "checkpoint", "graft-mtp", "--from", sources["bf16"], "--into", target)
    assert rc == 0 and "listed its" in stdout, stderr
    assert sum(n.startswith("mtp.") for n in index_of(target)) == len(load_file(target / "model_extra_tensors.safetensors"))
    rc, stdout, _ = run(capsys, "checkpoint", "graft-mtp", "--from", sources["bf16"], "--into", target)
    assert rc == 0 and "nothing to do" in stdout


def test_graft_mtp_errors(sources, tmp_path, capsys):
    no_mtp = tmp_path / "no-mtp"
    write_variant(sources["hf"], None, no_mtp, cfg=sources["cfg"], nested=True)
    rc, _, stderr = run(capsys, "checkpoint", "graft-mtp", "--from", no_mtp, "--into", copy_source(sources, "fp8", tmp_path))
    assert rc == 2 and "has no mtp.* tensors" in stderr
    cfg = json.loads((no_mtp / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(cfg))
    rc, _, stderr = run(capsys, "checkpoint", "graft-mtp", "--from", sources["int4"], "--into", no_mtp)
    assert rc == 2 and "declares no MTP layer" in stderr
    assert not (no_mtp / "model_extra_tensors.safetensors").exists()


# --- quantize -----------------------------------------------------------------------------------------


def test_quantize_bf16_to_int4_equals_the_published_int4_format(sources, tmp_path, capsys):
    out = tmp_path / "q"
    rc, stdout, stderr = run(capsys, "checkpoint", "quantize", sources["bf16"], "--out", out, "--layout", "int4")
    assert rc == 0, stderr
    assert "experts    source        int4      quantize" in stdout
    # the MTP head is copied as stored (fused BF16 experts here); everything else is bit-identical to the
    # INT4 checkpoint the test helpers' round-to-nearest wrote
    ours = {n: t for n, t in tensors_of(out).items() if not n.startswith("mtp.")}
    published = {n: t for n, t in tensors_of(sources["int4"]).items() if not n.startswith("mtp.")}
    assert set(ours) == set(published)
    assert all(torch.equal(ours[n], published[n]) for n in published)
    model, report = load_model(out, "cpu", torch.float32)
    assert report.has_mtp
    assert_close(engine_logits(model), hf_logits(sources["ref4"]))


def test_quantize_round_trips_within_each_formats_error(sources, tmp_path, capsys):
    out = tmp_path / "q"
    rc, _, stderr = run(capsys, "checkpoint", "quantize", sources["bf16"], "--out", out, "--experts", "fp8", "--attention",
                        "int4", "--gdn", "int4", "--shared", "fp8", "--lm-head", "int8")
    assert rc == 0, stderr
    model, report = load_model(out, "cpu", torch.float32)
    assert report.formats["int8-row"] == 1 and report.formats["fp8-block"] > 0 and report.formats["int4"] > 0
    hf = dict(sources["hf"].named_parameters())
    # half a step of the group/block/row absmax (INT4: absmax/7.5 steps; e4m3: 3 mantissa bits; INT8: absmax/127),
    # plus the rounding of INT4's fp16 scales
    bound = {"int4": 1 / 15 * 1.01, "fp8-block": 1 / 16, "int8-row": 1 / 254 * 1.001}
    checked = set()
    for path, weight in model.named_modules():
        fmt = getattr(weight, "FORMAT", None)
        if fmt not in bound:
            continue
        if weight.num_experts:  # compare each expert with transformers' fused [E, 2I, H] / [E, H, I]
            name = path.replace("experts.gate_up", "experts.gate_up_proj").replace("experts.down", "experts.down_proj")
            original, deq = hf[name], weight.dequantize()
        else:
            original, deq = hf[path + ".weight"], weight.dequantize()
        err = float((deq - original.detach()).abs().max() / original.detach().abs().max())
        assert 0 < err <= bound[fmt], (path, fmt, err)
        checked.add(fmt)
    assert checked == set(bound)


def test_quantize_refuses_to_convert_between_quantised_formats(sources, tmp_path, capsys):
    out = tmp_path / "q"
    rc, _, stderr = run(capsys, "checkpoint", "quantize", sources["fp8"], "--out", out)  # default: experts int4
    assert rc == 2 and "is fp8 in source and int4 was asked for; converting fp8 to int4" in stderr
    assert_no_output(out)
    # a class already in the requested format is copied: the INT4 checkpoint gets an INT8 LM head
    rc, stdout, stderr = run(capsys, "checkpoint", "quantize", sources["int4"], "--out", out, "--layout", "int4", "--lm-head", "int8")
    assert rc == 0, stderr
    assert "experts    source        int4      copy" in stdout and "lm_head    source        int8      quantize" in stdout
    assert load_model(out, "cpu", torch.float32)[1].formats["int8-row"] == 1


# --- random and inspect -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bf16", "int4", "fp8", "hybrid"])
def test_random_checkpoints_load_in_every_layout(layout, tmp_path, capsys):
    out = tmp_path / layout
    rc, _, stderr = run(capsys, "checkpoint", "random", "--shape", "tiny", "--layout", layout, out, "--max-shard-size", "300KB")
    assert rc == 0, stderr
    model, report = load_model(out, "cpu", torch.float32)
    assert report.has_mtp
    expected = {"bf16": "dense", "int4": "int4", "fp8": "fp8-block", "hybrid": "int4"}[layout]
    assert report.formats[expected] >= 4 * 4  # at least the routed experts
    logits = engine_logits(model, torch.tensor([1, 2, 3, 4, 5]))
    assert logits.isfinite().all() and logits.std() > 0.1
    reader = CheckpointReader(out)
    if layout in ("int4", "hybrid"):  # as published: the MTP head in an unindexed extra file
        mtp = [n for n, i in reader.tensors.items() if n.startswith("mtp.")]
        assert {reader.tensors[n].file.name for n in mtp} == {"model_extra_tensors.safetensors"}
        assert not any(n.startswith("mtp.") for n in index_of(out))
    else:
        assert set(index_of(out)) == set(reader.tensors)
    if layout == "bf16":  # the official BF16 layout stores experts fused
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in reader.tensors


def test_random_is_deterministic_and_streams(tmp_path, capsys):
    for name in ("a", "b"):
        assert run(capsys, "checkpoint", "random", "--shape", "tiny", "--layers", "2", "--seed", "7", tmp_path / name)[0] == 0
    a, b = tensors_of(tmp_path / "a"), tensors_of(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    rc, _, stderr = run(capsys, "checkpoint", "random", "--shape", "qwen3.5-1t", tmp_path / "c")
    assert rc == 2 and "unknown model shape 'qwen3.5-1t'" in stderr and "qwen3.5-122b-a10b" in stderr


def test_random_shapes_match_the_published_tensor_names_and_shapes(sources):
    """The shapes the tools generate are those the transformers reference (and the loader) use."""
    from roofline.checkpoint.shapes import layout_tensors, resolve_layout
    from roofline.config import load_config

    cfg = load_config(sources["int4"])
    planned = layout_tensors(cfg, resolve_layout("int4"))
    stored = {}
    for path in sources["int4"].glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                canon = name.replace("model.language_model.", "model.")
                if not canon.startswith("model.visual."):
                    stored[canon] = (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
    assert set(planned) == set(stored)
    assert all(tuple(planned[n].shape) == stored[n][0] for n in planned)


def test_inspect(sources, tmp_path, capsys):
    rc, stdout, stderr = run(capsys, "checkpoint", "inspect", sources["int4"], "--machine", "dgx-spark", "--machine", "h200",
                             "--bandwidth", "1T", "--context", "0,4K")
    assert rc == 0, stderr
    for text in ("loads: yes", "MTP head: yes, in model_extra_tensors.safetensors (not in the index",
                 "not in the index: model_extra_tensors.safetensors", "experts    int4", "vision     bf16",
                 "bytes read per decoded token", "context 4K", "dgx-spark", "h200", "custom", "MTP-2"):
        assert text in stdout, text
    rc, stdout, _ = run(capsys, "checkpoint", "inspect", sources["int4"], "--json", "--machine", "h200", "--mtp", "1")
    data = json.loads(stdout)
    assert data["loads"] and {c["mtp"] for c in data["ceilings"]} == {0, 1}
    # a checkpoint that does not load is still inspected, with the reason
    broken = copy_source(sources, "fp8", tmp_path)
    _drop_tensor(broken, "model.language_model.norm.weight")
    rc, stdout, _ = run(capsys, "checkpoint", "inspect", broken)
    assert rc == 0 and "loads: NO: tensor model.norm.weight is missing" in stdout

