"""Typed Qwen3-VL architecture config, read from / written to HF `config.json` dicts.

Released Qwen3-VL checkpoints store RoPE as `rope_theta` + `rope_scaling`; transformers 5 writes
`rope_parameters`. `from_hf_dict` accepts both; `to_hf_dict` writes the transformers-5 form.
Constraints that transformers does not check (M-RoPE sections, square position grid, ...) are
validated here so a bad config fails at load time with a message naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_SUPPORTED_TEXT_ACTS = ("silu",)
_SUPPORTED_VISION_ACTS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


class ConfigError(ValueError):
    """A Qwen3-VL config violates a constraint of the architecture."""


@dataclass(frozen=True)
class TextConfig:
    """Text decoder hyper-parameters (HF `text_config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"
    attention_bias: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"text_config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups)"
            )
        if len(self.mrope_section) != 3:
            raise ConfigError(f"text_config mrope_section must have 3 entries (t, h, w), got {self.mrope_section}")
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ConfigError(
                f"sum(mrope_section)={sum(self.mrope_section)} (mrope_section={list(self.mrope_section)}) must equal "
                f"head_dim // 2 = {self.head_dim // 2}"
            )
        if not self.mrope_interleaved:
            raise ConfigError("text_config mrope_interleaved=false is not Qwen3-VL's layout; only interleaved M-RoPE is supported")
        if self.hidden_act not in _SUPPORTED_TEXT_ACTS:
            raise ConfigError(f"text_config.hidden_act={self.hidden_act!r} unsupported; expected one of {_SUPPORTED_TEXT_ACTS}")
        if self.attention_bias:
            raise ConfigError("text_config.attention_bias=true is not supported (Qwen3-VL checkpoints have no q/k/v bias)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"text_config.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class VisionConfig:
    """Vision tower hyper-parameters (HF `vision_config`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * T * p * p (processor `pixel_values` row length)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per merged LLM token (spatial_merge_size ** 2)."""
        return self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim={self.head_dim} must be divisible by 4 (2-D rotary over h and w)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision_config.num_position_embeddings={self.num_position_embeddings} must be a perfect square "
                "(a learned side x side grid that is bilinearly resampled)"
            )
        if any(i < 0 or i >= self.depth for i in self.deepstack_visual_indexes):
            raise ConfigError(
                f"vision_config.deepstack_visual_indexes={list(self.deepstack_visual_indexes)} must lie in [0, depth={self.depth})"
            )
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ConfigError(f"vision_config.deepstack_visual_indexes has duplicates: {list(self.deepstack_visual_indexes)}")
        if self.hidden_act not in _SUPPORTED_VISION_ACTS:
            raise ConfigError(f"vision_config.hidden_act={self.hidden_act!r} unsupported; expected one of {_SUPPORTED_VISION_ACTS}")


@dataclass(frozen=True)
class Qwen3VLConfig:
    """Whole-model config: text decoder, vision tower, special token ids, embedding tying."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.text.validate()
        self.vision.validate()
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ConfigError(
                f"vision_config.out_hidden_size={self.vision.out_hidden_size} must equal "
                f"text_config.hidden_size={self.text.hidden_size} (merged image tokens replace text embeddings)"
            )
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ConfigError(
                f"len(deepstack_visual_indexes)={len(self.vision.deepstack_visual_indexes)} must be <= "
                f"text_config.num_hidden_layers={self.text.num_hidden_layers} (deepstack k is added after decoder layer k)"
            )
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            tok = getattr(self, name)
            if not 0 <= tok < self.text.vocab_size:
                raise ConfigError(f"{name}={tok} is outside the vocabulary [0, {self.text.vocab_size})")

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content (`rope_parameters`), loadable by `Qwen3VLConfig`."""
        t, v = self.text, self.vision
        text = {
            "model_type": "qwen3_vl_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim,
            "hidden_act": t.hidden_act,
            "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings,
            "attention_bias": t.attention_bias,
            "attention_dropout": 0.0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t.rope_theta,
                "mrope_section": list(t.mrope_section),
                "mrope_interleaved": t.mrope_interleaved,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.bos_token_id is not None:
            text["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            text["eos_token_id"] = self.eos_token_id
        vision = {
            "model_type": "qwen3_vl_vision",
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "in_channels": v.in_channels,
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "out_hidden_size": v.out_hidden_size,
            "num_position_embeddings": v.num_position_embeddings,
            "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
            "hidden_act": v.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        }
        return {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            "vision_config": vision,
        }


def _rope_from_text_dict(t: dict[str, Any]) -> tuple[float, tuple[int, ...], bool]:
    """(rope_theta, mrope_section, interleaved) from either `rope_parameters` or `rope_scaling`+`rope_theta`."""
    params = t.get("rope_parameters")
    if params is None:
        params = dict(t.get("rope_scaling") or {})
        if "rope_theta" in t:
            params.setdefault("rope_theta", t["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"text_config rope_type={rope_type!r} is not supported (only default M-RoPE)")
    if "rope_theta" not in params:
        raise ConfigError("text_config has no rope_theta (looked in rope_parameters, rope_scaling and rope_theta)")
    if "mrope_section" not in params:
        raise ConfigError("text_config has no mrope_section (looked in rope_parameters and rope_scaling)")
    return float(params["rope_theta"]), tuple(int(s) for s in params["mrope_section"]), bool(params.get("mrope_interleaved", True))


def from_hf_dict(d: dict[str, Any]) -> Qwen3VLConfig:
    """Parse an HF Qwen3-VL `config.json` dict (released or transformers-5 layout)."""
    if d.get("model_type", "qwen3_vl") != "qwen3_vl":
        raise ConfigError(f"config model_type={d.get('model_type')!r}, expected 'qwen3_vl'")
    for key in ("text_config", "vision_config"):
        if not isinstance(d.get(key), dict):
            raise ConfigError(f"config has no {key!r} object")
    t, v = d["text_config"], d["vision_config"]

    def need(sub: dict[str, Any], name: str, key: str) -> Any:
        if key not in sub:
            raise ConfigError(f"config {name}.{key} is missing")
        return sub[key]

    theta, section, interleaved = _rope_from_text_dict(t)
    heads = int(need(t, "text_config", "num_attention_heads"))
    hidden = int(need(t, "text_config", "hidden_size"))
    text = TextConfig(
        vocab_size=int(need(t, "text_config", "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need(t, "text_config", "intermediate_size")),
        num_hidden_layers=int(need(t, "text_config", "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or hidden // heads),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=interleaved,
        max_position_embeddings=int(t.get("max_position_embeddings", 262144)),
        hidden_act=str(t.get("hidden_act", "silu")),
        attention_bias=bool(t.get("attention_bias", False)),
    )
    vrope = v.get("rope_parameters") or {}
    vision = VisionConfig(
        depth=int(need(v, "vision_config", "depth")),
        hidden_size=int(need(v, "vision_config", "hidden_size")),
        intermediate_size=int(need(v, "vision_config", "intermediate_size")),
        num_heads=int(need(v, "vision_config", "num_heads")),
        out_hidden_size=int(need(v, "vision_config", "out_hidden_size")),
        num_position_embeddings=int(need(v, "vision_config", "num_position_embeddings")),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
    )
    # transformers reads the top-level flag; released 2B also repeats it inside text_config.
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    known = {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "tie_word_embeddings"}
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=int(d.get("image_token_id", 151655)),
        video_token_id=int(d.get("video_token_id", 151656)),
        vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
        tie_word_embeddings=bool(tie),
        bos_token_id=t.get("bos_token_id", d.get("bos_token_id")),
        eos_token_id=t.get("eos_token_id", d.get("eos_token_id")),
        extra={k: val for k, val in d.items() if k not in known},
    )


def qwen3_vl_2b_instruct() -> Qwen3VLConfig:
    """Qwen3-VL-2B-Instruct architecture (HF config revision 89644892; tied embeddings)."""
    return Qwen3VLConfig(
        text=TextConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=5_000_000.0,
            mrope_section=(24, 20, 20),
            mrope_interleaved=True,
            max_position_embeddings=262144,
        ),
        vision=VisionConfig(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=(5, 11, 17),
            hidden_act="gelu_pytorch_tanh",
        ),
        tie_word_embeddings=True,
    )


def small_model_config() -> Qwen3VLConfig:
    """A few layers at hidden 256 (4 heads of 64, GQA 2): compiles in seconds, shards over 8 devices."""
    vocab = 8192
    return Qwen3VLConfig(
        text=TextConfig(
            vocab_size=vocab,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            mrope_section=(12, 10, 10),  # Qwen3-VL's 24:20:20 split of the rotary half (32)
        ),
        vision=VisionConfig(
            depth=2,
            hidden_size=128,
            intermediate_size=512,
            num_heads=2,
            out_hidden_size=256,
            num_position_embeddings=256,
            deepstack_visual_indexes=(0, 1),
        ),
        image_token_id=vocab - 4,
        video_token_id=vocab - 3,
        vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1,
        bos_token_id=None,
        eos_token_id=None,
    )


# The one table of named architectures (the benchmark's `--model`, tests). The `tiny` test model is not
# here: its special-token ids come from the tiny tokenizer that `jaxrl_vlm.tiny` trains.
MODEL_PRESETS: dict[str, Callable[[], Qwen3VLConfig]] = {
    "small": small_model_config,
    "qwen3_vl_2b": qwen3_vl_2b_instruct,
}


def preset_config(name: str) -> Qwen3VLConfig:
    """The config of the architecture preset `name` (a key of `MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {tuple(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]()
