"""ModelConfig: the text-model facts the engine needs, read from a checkpoint's config.json.

Published Qwen3.5 checkpoints are multimodal (`...ForConditionalGeneration`, text under
`text_config`); `...ForCausalLM.save_pretrained` writes a flat config. Both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError, read_json_file

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")


class ConfigError(UserError):
    """config.json is missing, unreadable or describes a model the engine does not support."""


@dataclass
class QuantizationConfig:
    """The checkpoint's `quantization_config`; per-tensor formats are still detected from tensor names."""

    method: str | None = None
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    weight_block_size: tuple[int, int] | None = None


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # MoE (zero experts means a dense MLP of `intermediate_size`)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    eos_token_id: list[int] = field(default_factory=list)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    nested: bool = False  # True when read from a multimodal config with `text_config`

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        nested = "text_config" in raw
        text = dict(raw["text_config"]) if nested else dict(raw)
        if nested and text.get("model_type", model_type + "_text") not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: text_config.model_type {text.get('model_type')!r} is not supported")

        def need(key):
            if key not in text:
                where = "text_config." if nested else ""
                raise ConfigError(f"{source}: required field {where}{key} is missing")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "linear_attention"}:
            raise ConfigError(f"{source}: layer_types must list {n_layers} of 'full_attention'/'linear_attention'")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        is_moe = model_type.startswith("qwen3_5_moe")
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        cfg = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=list(layer_types),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads")),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            num_experts=int(need("num_experts")) if is_moe else 0,
            num_experts_per_tok=int(need("num_experts_per_tok")) if is_moe else 0,
            moe_intermediate_size=int(need("moe_intermediate_size")) if is_moe else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if is_moe else 0,
            intermediate_size=0 if is_moe else int(need("intermediate_size")),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0))),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            quantization=_quantization(raw.get("quantization_config") or text.get("quantization_config")),
            nested=nested,
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok must be in 1..num_experts")
        if self.rotary_dim % 2:
            raise ConfigError(f"{source}: head_dim * partial_rotary_factor must be even")


def _quantization(raw: dict | None) -> QuantizationConfig:
    if not raw:
        return QuantizationConfig()
    block = raw.get("weight_block_size")
    return QuantizationConfig(
        method=raw.get("quant_method"),
        bits=raw.get("bits"),
        group_size=raw.get("group_size"),
        sym=raw.get("sym"),
        weight_block_size=tuple(block) if block else None,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    raw = read_json_file(path, "model config (is the folder a Qwen3.5 checkpoint?)", ConfigError)
    return ModelConfig.from_dict(raw, source=str(path))
