"""quantize: round-to-nearest from BF16 into the published formats, per module class, streaming.

For users with BF16 or fine-tuned checkpoints. Everything that is not a layout class (norms,
router, embedding, MTP head...) is copied as stored; a class already stored in the requested
format is copied too, so an INT4 checkpoint can get an INT8 LM head without touching the rest.
Converting one quantised format into another (or back to BF16) is refused: it would compound
rounding errors, and the BF16 original is the better source.
"""

from __future__ import annotations

from ..config import ModelConfig
from .build import BuildPlan, Choice, PlanError, Source, plan_units, quantization_config, vision_steps, with_quantization
from .shapes import LAYOUT_CLASSES, model_units


def quantize_plan(src_spec: str, formats: dict[str, str], group_size: int = 128) -> BuildPlan:
    """Plan `src` re-stored with `formats` (layout class -> bf16|int4|fp8|int8)."""
    src = Source(src_spec, "source")
    unknown = set(formats) - set(LAYOUT_CLASSES)
    if unknown:
        raise PlanError(f"cannot choose a format for {', '.join(sorted(unknown))}")

    def choose(cls: str) -> Choice:
        return Choice(src, formats.get(cls, "keep") if cls in LAYOUT_CLASSES else "keep")

    has_mtp = src.cfg.mtp_num_hidden_layers > 0 and any(n.startswith("mtp.") for n in src.canonical)
    units = model_units(src.cfg, mtp=has_mtp)
    try:
        steps, used = plan_units(units, choose, nested=src.nested, group_size=group_size)
    except PlanError as exc:
        raise PlanError(f"{exc}\n  (to keep a class as the source stores it, ask for that format, e.g. --experts int4)") from None
    leftover = sorted(set(src.file_of) - set(used.get(src, ())) - set(src.vision))
    if leftover:
        raise PlanError(f"{len(leftover)} tensor(s) in the source are not part of a model with its config: {', '.join(leftover[:5])}")
    steps += vision_steps(src)
    steps.sort(key=lambda s: s.sort_key([src]))
    outputs = [o for s in steps for o in s.outputs]
    previous = src.raw_config.get("quantization_config") or (src.raw_config.get("text_config") or {}).get("quantization_config")
    block = tuple(src.cfg.quantization.weight_block_size or (128, 128))
    config = with_quantization(src.raw_config, quantization_config(outputs, previous, group_size, block))
    notes = [] if has_mtp or not src.cfg.mtp_num_hidden_layers else ["the source has no MTP head (no mtp.* tensors)"]
    return BuildPlan(config=config, cfg=ModelConfig.from_dict(config, source="output config"), steps=steps, sources=[src],
                     side_files_from=src.dir, expect_mtp=has_mtp, notes=notes,
                     provenance={"tool": "roofline checkpoint quantize", "source": {"spec": src.spec, "dir": str(src.dir)},
                                 "formats": formats, "group_size": group_size, "rounding": "nearest"})
