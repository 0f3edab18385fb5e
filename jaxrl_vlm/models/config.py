"""Typed architecture configs of the Qwen-VL families, read from / written to HF `config.json` dicts.

Two families share the text decoder config (`TextConfig`) and differ in the vision tower:
`Qwen3VLConfig` (learned position grid, deepstack, interleaved M-RoPE) and `Qwen25VLConfig` (window
attention, RMSNorm + SwiGLU blocks, contiguous M-RoPE, q/k/v bias, no q/k norm); `Qwen3VLMoeConfig` is
Qwen3-VL's with routed-expert fields in its text config (`Qwen3VLMoeTextConfig`), `Qwen3_5MoeConfig` Qwen3.5's
with routed and shared experts (`Qwen35MoeTextConfig`). Each family is registered
here (`families.register`: model_type, config class, parser, the file of its model); `from_hf_dict` is the
one place that reads `config.json`'s `model_type`, and everything downstream finds the family from the
config's type (`families.family_of`). This module never imports jax.

Released checkpoints store RoPE as `rope_theta` + `rope_scaling` (Qwen2.5-VL also keeps the text fields
at the top level); transformers 5 writes `rope_parameters` inside `text_config`. The parsers accept
both; `to_hf_dict` writes the transformers-5 form. Constraints that transformers does not check
(M-RoPE sections, square position grid, ...) are validated here so a bad config fails at load time
with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.models.families import FAMILIES, Family, register

#: The attention implementations a model can be built with (`--attention-impl`; models/layers.py says what each
#: does). Here, in a module without jax, so that option checks never import jax (an env host, `jaxrl-vlm config`).
ATTENTION_IMPLS = ("xla", "pallas_gpu", "pallas_tpu", "ring")

_SUPPORTED_TEXT_ACTS = ("silu",)
_SUPPORTED_VISION_ACTS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


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
    attention_bias: bool = False  # q/k/v projection biases (Qwen2 / Qwen2.5-VL); o_proj never has one
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3)

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
        if self.hidden_act not in _SUPPORTED_TEXT_ACTS:
            raise ConfigError(f"text_config.hidden_act={self.hidden_act!r} unsupported; expected one of {_SUPPORTED_TEXT_ACTS}")
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

    @property
    def gated_mlp(self) -> bool:
        """Block MLP is fc2(act(fc1 x)), two matrices (Qwen2.5-VL's is gated: three)."""
        return False

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
class _VLConfig:
    """What every Qwen-VL family's config holds: text decoder, vision tower, special token ids, tying."""

    text: TextConfig
    vision: Any
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
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            tok = getattr(self, name)
            if not 0 <= tok < self.text.vocab_size:
                raise ConfigError(f"{name}={tok} is outside the vocabulary [0, {self.text.vocab_size})")

    model_type: ClassVar[str]  # config.json's name of the family

    def _hf_top(self, architecture: str, text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
        if self.bos_token_id is not None:
            text["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            text["eos_token_id"] = self.eos_token_id
        return {
            "architectures": [architecture],
            "model_type": self.model_type,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            "vision_config": vision,
        }

    def _hf_text(self, model_type: str) -> dict[str, Any]:
        t = self.text
        return {
            "model_type": model_type,
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
            "attention_dropout": 0.0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t.rope_theta,
                "mrope_section": list(t.mrope_section),
                "mrope_interleaved": t.mrope_interleaved,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
        }


@dataclass(frozen=True)
class Qwen3VLConfig(_VLConfig):
    """Qwen3-VL: text decoder, vision tower with deepstack, special token ids, embedding tying."""

    model_type: ClassVar[str] = "qwen3_vl"
    vision: VisionConfig

    def validate(self) -> None:
        super().validate()
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ConfigError(
                f"len(deepstack_visual_indexes)={len(self.vision.deepstack_visual_indexes)} must be <= "
                f"text_config.num_hidden_layers={self.text.num_hidden_layers} (deepstack k is added after decoder layer k)"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content (`rope_parameters`), loadable by `Qwen3VLConfig`."""
        v = self.vision
        text = dict(self._hf_text("qwen3_vl_text"), attention_bias=self.text.attention_bias)
        vision = dict(_learned_position_vision_hf(v, "qwen3_vl_vision"),
                      deepstack_visual_indexes=list(v.deepstack_visual_indexes),
                      rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
        return self._hf_top("Qwen3VLForConditionalGeneration", text, vision)


def _rope_from_text_dict(t: dict[str, Any], interleaved_default: bool) -> tuple[float, tuple[int, ...], bool]:
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
    return float(params["rope_theta"]), tuple(int(s) for s in params["mrope_section"]), bool(params.get("mrope_interleaved", interleaved_default))


def _need(sub: dict[str, Any], name: str, key: str) -> Any:
    if key not in sub:
        raise ConfigError(f"config {name}.{key} is missing")
    return sub[key]


def _text_from_dict(t: dict[str, Any], *, interleaved_default: bool, attention_bias: bool | None, qk_norm: bool,
                    max_positions_default: int) -> TextConfig:
    """The text decoder of either family; `attention_bias=None` reads it from the dict."""
    theta, section, interleaved = _rope_from_text_dict(t, interleaved_default)
    heads = int(_need(t, "text_config", "num_attention_heads"))
    hidden = int(_need(t, "text_config", "hidden_size"))
    return TextConfig(
        vocab_size=int(_need(t, "text_config", "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_need(t, "text_config", "intermediate_size")),
        num_hidden_layers=int(_need(t, "text_config", "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or hidden // heads),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=interleaved,
        max_position_embeddings=int(t.get("max_position_embeddings", max_positions_default)),
        hidden_act=str(t.get("hidden_act", "silu")),
        attention_bias=bool(t.get("attention_bias", False)) if attention_bias is None else attention_bias,
        qk_norm=qk_norm,
    )


def qwen3_vl_from_hf_dict(d: dict[str, Any]) -> Qwen3VLConfig:
    """Parse an HF Qwen3-VL `config.json` dict (released or transformers-5 layout)."""
    for key in ("text_config", "vision_config"):
        if not isinstance(d.get(key), dict):
            raise ConfigError(f"config has no {key!r} object")
    t, v = d["text_config"], d["vision_config"]
    need = _need
    text = _text_from_dict(t, interleaved_default=True, attention_bias=None, qk_norm=True, max_positions_default=262144)
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
    return Qwen3VLConfig(text=text, vision=vision, **_top_level_fields(d, t, known=set()))


def _top_level_fields(d: dict[str, Any], t: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """Special token ids, tying, bos/eos and the keys we do not model (`extra`); `known`: more keys we read."""
    # transformers reads the top-level flag; released checkpoints also repeat it inside text_config.
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    known = known | {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id", "tie_word_embeddings"}
    return dict(
        image_token_id=int(d.get("image_token_id", 151655)),
        video_token_id=int(d.get("video_token_id", 151656)),
        vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
        tie_word_embeddings=bool(tie),
        bos_token_id=t.get("bos_token_id", d.get("bos_token_id")),
        eos_token_id=t.get("eos_token_id", d.get("eos_token_id")),
        extra={k: val for k, val in d.items() if k not in known},
    )


# ----------------------------------------------------------------------------- Qwen2.5-VL


@dataclass(frozen=True)
class Qwen25VisionConfig:
    """Qwen2.5-VL vision tower (HF `vision_config`): window attention except at `fullatt_block_indexes`,
    RMSNorm + gated (SwiGLU) block MLP, no learned position table, no deepstack."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    window_size: int = 112  # pixels per attention-window side
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "silu"
    tokens_per_second: int = 2
    rope_theta: float = 10000.0

    head_dim = VisionConfig.head_dim
    patch_dim = VisionConfig.patch_dim
    merge_unit = VisionConfig.merge_unit

    @property
    def deepstack_visual_indexes(self) -> tuple[int, ...]:
        return ()

    @property
    def gated_mlp(self) -> bool:
        return True

    @property
    def window_merged_side(self) -> int:
        """Merged tokens per attention-window side (window_size // merge // patch)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"vision head_dim={self.head_dim} must be divisible by 4 (2-D rotary over h and w)")
        if self.window_merged_side < 1:
            raise ConfigError(
                f"vision_config.window_size={self.window_size} must be at least spatial_merge_size * patch_size = "
                f"{self.spatial_merge_size * self.patch_size} pixels (one merged token)"
            )
        if any(i < 0 or i >= self.depth for i in self.fullatt_block_indexes):
            raise ConfigError(
                f"vision_config.fullatt_block_indexes={list(self.fullatt_block_indexes)} must lie in [0, depth={self.depth})"
            )
        if self.hidden_act not in _SUPPORTED_VISION_ACTS:
            raise ConfigError(f"vision_config.hidden_act={self.hidden_act!r} unsupported; expected one of {_SUPPORTED_VISION_ACTS}")


@dataclass(frozen=True)
class Qwen25VLConfig(_VLConfig):
    """Qwen2.5-VL: a Qwen2 text decoder (q/k/v bias, no q/k norm, contiguous M-RoPE) and a windowed ViT."""

    model_type: ClassVar[str] = "qwen2_5_vl"
    vision: Qwen25VisionConfig

    def validate(self) -> None:
        super().validate()
        if self.text.mrope_interleaved:
            raise ConfigError("Qwen2.5-VL's M-RoPE is contiguous (t, h, w sections in order); mrope_interleaved must be false")
        t = self.text
        if t.head_dim * t.num_attention_heads != t.hidden_size or t.qk_norm or not t.attention_bias:
            raise ConfigError(
                f"Qwen2.5-VL's text decoder is Qwen2's: head_dim ({t.head_dim}) * num_attention_heads "
                f"({t.num_attention_heads}) must equal hidden_size ({t.hidden_size}), with q/k/v bias and no q/k norm"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content, loadable by `Qwen2_5_VLConfig`."""
        v = self.vision
        text = self._hf_text("qwen2_5_vl_text")
        del text["head_dim"], text["rope_parameters"]["mrope_interleaved"]  # Qwen2 derives head_dim; sections are contiguous
        vision = dict(
            _vision_hf(v, "qwen2_5_vl_vision"),
            window_size=v.window_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes),
            tokens_per_second=v.tokens_per_second,
            rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
        )
        return self._hf_top("Qwen2_5_VLForConditionalGeneration", text, vision)


# Keys of a released (flat) Qwen2.5-VL config.json that describe the text decoder.
_FLAT_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                   "max_position_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "use_sliding_window")


def qwen2_5_vl_from_hf_dict(d: dict[str, Any]) -> Qwen25VLConfig:
    """Parse an HF Qwen2.5-VL `config.json` dict: released (text fields at the top level, `rope_scaling`) or
    transformers-5 (`text_config` with `rope_parameters`)."""
    if not isinstance(d.get("vision_config"), dict):
        raise ConfigError("config has no 'vision_config' object")
    t = d.get("text_config")
    flat = not isinstance(t, dict)
    if flat:
        t = {k: d[k] for k in _FLAT_TEXT_KEYS if k in d}
    if t.get("use_sliding_window"):
        raise ConfigError("text_config.use_sliding_window=true is not supported (released Qwen2.5-VL checkpoints set false)")
    text = _text_from_dict(t, interleaved_default=False, attention_bias=True, qk_norm=False, max_positions_default=128000)
    v = d["vision_config"]
    vrope = v.get("rope_parameters") or {}
    vision = Qwen25VisionConfig(
        depth=int(_need(v, "vision_config", "depth")),
        hidden_size=int(_need(v, "vision_config", "hidden_size")),
        intermediate_size=int(_need(v, "vision_config", "intermediate_size")),
        num_heads=int(_need(v, "vision_config", "num_heads")),
        out_hidden_size=int(_need(v, "vision_config", "out_hidden_size")),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=str(v.get("hidden_act", "silu")),
        tokens_per_second=int(v.get("tokens_per_second", 2)),
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
    )
    return Qwen25VLConfig(text=text, vision=vision, **_top_level_fields(d, t, known=set(_FLAT_TEXT_KEYS) if flat else set()))


# ----------------------------------------------------------------------------- Qwen3.5 (dense)

QWEN3_5_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35TextConfig:
    """Qwen3.5's hybrid text decoder (HF `text_config` of model_type `qwen3_5_text`): `layer_types` mixes Gated
    DeltaNet layers (`linear_*` fields) and gated full-attention layers (q/k norm, output gate, partial M-RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"
    attention_bias: bool = False

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each full-attention head that are rotated (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: q and k (key heads) then v (value heads), as HF's in_proj_qkv."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                     "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"text_config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"text_config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups)"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"text_config.linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads} (each key head serves a group of value heads)"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"text_config.layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        unknown = sorted({k for k in self.layer_types if k not in QWEN3_5_LAYER_TYPES})
        if unknown:
            raise ConfigError(f"text_config.layer_types has unknown layer types {unknown}; expected {QWEN3_5_LAYER_TYPES}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"text_config partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim}; it must "
                f"be even and in (0, head_dim={self.head_dim}]"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2:
            raise ConfigError(
                f"text_config mrope_section={list(self.mrope_section)} must have 3 entries summing to rotary_dim // 2 = "
                f"{self.rotary_dim // 2} (head_dim * partial_rotary_factor / 2)"
            )
        if self.hidden_act not in _SUPPORTED_TEXT_ACTS:
            raise ConfigError(f"text_config.hidden_act={self.hidden_act!r} unsupported; expected one of {_SUPPORTED_TEXT_ACTS}")
        if self.attention_bias:
            raise ConfigError("text_config.attention_bias=true is not supported for qwen3_5 (released checkpoints set false)")


def _vision_hf(v: VisionConfig, model_type: str) -> dict[str, Any]:
    """The `vision_config` keys every family's tower writes alike (shape, patching, merge, activation)."""
    return {
        "model_type": model_type,
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "out_hidden_size": v.out_hidden_size,
        "hidden_act": v.hidden_act,
    }


def _learned_position_vision_hf(v: VisionConfig, model_type: str) -> dict[str, Any]:
    """The `vision_config` keys that Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 write alike for their learned-position tower."""
    return dict(_vision_hf(v, model_type), num_position_embeddings=v.num_position_embeddings)


@dataclass(frozen=True)
class Qwen3_5Config(_VLConfig):
    """Qwen3.5 dense: the hybrid text decoder and Qwen3-VL's vision tower without deepstack."""

    model_type: ClassVar[str] = "qwen3_5"
    text: Qwen35TextConfig
    vision: VisionConfig
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.vision.deepstack_visual_indexes:
            raise ConfigError("qwen3_5's vision tower has no deepstack; vision deepstack_visual_indexes must be empty")

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content, loadable by transformers' `Qwen3_5Config`."""
        t, v = self.text, self.vision
        text = self._hf_text("qwen3_5_text")
        text["rope_parameters"]["partial_rotary_factor"] = t.partial_rotary_factor
        text.update(
            layer_types=list(t.layer_types),
            linear_conv_kernel_dim=t.linear_conv_kernel_dim,
            linear_key_head_dim=t.linear_key_head_dim,
            linear_value_head_dim=t.linear_value_head_dim,
            linear_num_key_heads=t.linear_num_key_heads,
            linear_num_value_heads=t.linear_num_value_heads,
            attention_bias=False,
        )
        vision = _learned_position_vision_hf(v, "qwen3_5_vision")
        return self._hf_top("Qwen3_5ForConditionalGeneration", text, vision)


def _qwen3_5_layer_types(t: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, or transformers' default from `full_attention_interval` (every n-th layer full)."""
    if t.get("layer_types") is not None:
        return tuple(str(k) for k in t["layer_types"])
    interval = int(t.get("full_attention_interval", 4))
    if interval <= 0:
        raise ConfigError(f"text_config.full_attention_interval must be positive, got {interval}")
    return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers))


def qwen3_5_from_hf_dict(d: dict[str, Any]) -> Qwen3_5Config:
    """Parse an HF Qwen3.5 (dense) `config.json` dict (`text_config` / `vision_config`)."""
    for key in ("text_config", "vision_config"):
        if not isinstance(d.get(key), dict):
            raise ConfigError(f"config has no {key!r} object")
    t, v = d["text_config"], d["vision_config"]
    params = t.get("rope_parameters")
    if params is None:
        params = dict(t.get("rope_scaling") or {})
        params.setdefault("rope_theta", t.get("rope_theta", 10_000_000.0))
    if params.get("rope_type", params.get("type", "default")) not in ("default", "mrope"):
        raise ConfigError(f"text_config rope_type={params.get('rope_type')!r} is not supported (only default M-RoPE)")
    section = tuple(int(s) for s in params.get("mrope_section", (11, 11, 10)))
    factor = float(params.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
    heads = int(_need(t, "text_config", "num_attention_heads"))
    layers = int(_need(t, "text_config", "num_hidden_layers"))
    text = Qwen35TextConfig(
        vocab_size=int(_need(t, "text_config", "vocab_size")),
        hidden_size=int(_need(t, "text_config", "hidden_size")),
        intermediate_size=int(_need(t, "text_config", "intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or 256),
        layer_types=_qwen3_5_layer_types(t, layers),
        linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(params["rope_theta"]),
        partial_rotary_factor=factor,
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=bool(params.get("mrope_interleaved", True)),
        max_position_embeddings=int(t.get("max_position_embeddings", 262144)),
        hidden_act=str(t.get("hidden_act", "silu")),
        attention_bias=bool(t.get("attention_bias", False)),
    )
    if v.get("deepstack_visual_indexes"):
        raise ConfigError("vision_config.deepstack_visual_indexes is set, but qwen3_5's vision tower has no deepstack")
    vision = VisionConfig(
        depth=int(_need(v, "vision_config", "depth")),
        hidden_size=int(_need(v, "vision_config", "hidden_size")),
        intermediate_size=int(_need(v, "vision_config", "intermediate_size")),
        num_heads=int(_need(v, "vision_config", "num_heads")),
        out_hidden_size=int(_need(v, "vision_config", "out_hidden_size")),
        num_position_embeddings=int(_need(v, "vision_config", "num_position_embeddings")),
        deepstack_visual_indexes=(),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    )
    top = _top_level_fields(d, t, known=set())
    for name, default in (("image_token_id", 248056), ("video_token_id", 248057), ("vision_start_token_id", 248053),
                          ("vision_end_token_id", 248054)):
        top[name] = int(d.get(name, default))
    return Qwen3_5Config(text=text, vision=vision, **top)


# ----------------------------------------------------------------------------- Qwen3-VL-MoE

# text_config keys of MoE variants whose architecture this family does not implement, with the values under which
# they change nothing (a released Qwen3-VL-MoE config has none of them, or these values).
_QWEN3_VL_MOE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "moe_shared_expert_intermediate_size": (None, 0),
    "routed_scaling_factor": (None, 1, 1.0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "router_jitter_noise": (None, 0, 0.0),
    "use_sliding_window": (None, False),
    "sliding_window": (None,),
}


@dataclass(frozen=True)
class Qwen3VLMoeTextConfig(TextConfig):
    """Qwen3-VL-MoE's text decoder (HF `text_config` of model_type `qwen3_vl_moe_text`): Qwen3-VL's decoder whose
    MLPs are routed sparse MoE blocks (`moe.SparseMoE`) except in the dense layers (`dense_layers`, transformers'
    rule: a layer is sparse iff it is not in `mlp_only_layers`, num_experts > 0 and (i + 1) % decoder_sparse_step
    == 0). `intermediate_size` is the dense layers' MLP width, `moe_intermediate_size` each expert's."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # transformers' Qwen3-VL-MoE router always renormalises the top-k probabilities
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Decoder layers whose MLP is the routed MoE block, in order (the index space of routing arrays)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_sparse(i))

    def validate(self) -> None:
        super().validate()
        if self.num_experts < 0:
            raise ConfigError(f"text_config.num_experts must be >= 0, got {self.num_experts}")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"text_config.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"text_config.mlp_only_layers={list(self.mlp_only_layers)} has layers {bad} outside "
                              f"[0, num_hidden_layers={self.num_hidden_layers})")
        if self.sparse_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"text_config.num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                  f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"text_config.moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if not self.norm_topk_prob:
            raise ConfigError("text_config.norm_topk_prob=false is not supported for qwen3_vl_moe: transformers' "
                              "Qwen3-VL-MoE router always renormalises the top-k probabilities")


@dataclass(frozen=True)
class Qwen3VLMoeConfig(_VLConfig):
    """Qwen3-VL-MoE: Qwen3-VL's vision tower (deepstack) and a text decoder with routed sparse MoE MLPs."""

    model_type: ClassVar[str] = "qwen3_vl_moe"
    text: Qwen3VLMoeTextConfig
    vision: VisionConfig
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        super().validate()
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ConfigError(
                f"len(deepstack_visual_indexes)={len(self.vision.deepstack_visual_indexes)} must be <= "
                f"text_config.num_hidden_layers={self.text.num_hidden_layers} (deepstack k is added after decoder layer k)"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content, loadable by transformers' `Qwen3VLMoeConfig`."""
        t, v = self.text, self.vision
        text = dict(self._hf_text("qwen3_vl_moe_text"), attention_bias=t.attention_bias, num_experts=t.num_experts,
                    num_experts_per_tok=t.num_experts_per_tok, moe_intermediate_size=t.moe_intermediate_size,
                    decoder_sparse_step=t.decoder_sparse_step, mlp_only_layers=list(t.mlp_only_layers),
                    router_aux_loss_coef=t.router_aux_loss_coef)
        vision = dict(_learned_position_vision_hf(v, "qwen3_vl_moe_vision"),
                      deepstack_visual_indexes=list(v.deepstack_visual_indexes),
                      rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
        return self._hf_top("Qwen3VLMoeForConditionalGeneration", text, vision)


def qwen3_vl_moe_from_hf_dict(d: dict[str, Any]) -> Qwen3VLMoeConfig:
    """Parse an HF Qwen3-VL-MoE `config.json` dict (released, or as transformers 5 saves it: the expert count as
    `num_local_experts`). Keys of MoE variants this family does not implement (shared experts, grouped or scaled
    routing, sliding windows) are errors unless they hold their neutral value."""
    base = qwen3_vl_from_hf_dict(d)  # Qwen3-VL's text fields, vision tower and top-level fields
    t = d["text_config"]
    for key, neutral in _QWEN3_VL_MOE_UNSUPPORTED.items():
        if key in t and t[key] not in neutral:
            raise ConfigError(f"text_config.{key}={t[key]!r} is not supported by qwen3_vl_moe (this family implements "
                              f"routed experts without it; expected one of {list(neutral)})")
    if "num_experts" in t and "num_local_experts" in t and t["num_experts"] != t["num_local_experts"]:
        raise ConfigError(f"text_config.num_experts={t['num_experts']} and num_local_experts={t['num_local_experts']} "
                          "disagree (transformers reads them as one field)")
    experts = t.get("num_experts", t.get("num_local_experts", 60))
    fields = {f.name: getattr(base.text, f.name) for f in dataclasses.fields(TextConfig)}
    fields["max_position_embeddings"] = int(t.get("max_position_embeddings", 128000))
    text = Qwen3VLMoeTextConfig(
        **fields,
        num_experts=int(experts),
        num_experts_per_tok=int(t.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 1408)),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in (t.get("mlp_only_layers") or ())),
        router_aux_loss_coef=float(t.get("router_aux_loss_coef", 0.001)),
    )
    top = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name not in ("text", "vision")}
    return Qwen3VLMoeConfig(text=text, vision=base.vision, **top)


# ----------------------------------------------------------------------------- Qwen3.5-MoE

# text_config keys that transformers' Qwen3.5-MoE does not have (it has a shared expert, routes every layer and
# always renormalises the top-k), with the values under which they change nothing.
_QWEN3_5_MOE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **{k: v for k, v in _QWEN3_VL_MOE_UNSUPPORTED.items() if k != "shared_expert_intermediate_size"},
    "norm_topk_prob": (None, True),
    "decoder_sparse_step": (None, 1),
    "mlp_only_layers": (None, [], ()),
}


@dataclass(frozen=True)
class Qwen35MoeTextConfig(Qwen35TextConfig):
    """Qwen3.5-MoE's hybrid text decoder (HF `text_config` of model_type `qwen3_5_moe_text`): Qwen3.5's linear and
    full-attention layers, each with an MoE MLP: `num_experts` routed SwiGLU experts of width
    `moe_intermediate_size` (top `num_experts_per_tok` of a softmax, renormalised) plus one shared SwiGLU expert that
    every token passes through, scaled by a per-token sigmoid gate. `intermediate_size` is that shared expert's width
    (HF's `shared_expert_intermediate_size`): the family has no other dense MLP."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    norm_topk_prob: ClassVar[bool] = True  # transformers' Qwen3.5-MoE router always renormalises the top-k

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Decoder layers with a routed MoE block, in order (the index space of routing arrays): all of them."""
        return tuple(range(self.num_hidden_layers))

    def validate(self) -> None:
        super().validate()
        if self.num_experts < 1:
            raise ConfigError(f"text_config.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"text_config.num_experts_per_tok={self.num_experts_per_tok} must lie in "
                              f"[1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size <= 0:
            raise ConfigError(f"text_config.moe_intermediate_size must be positive, got {self.moe_intermediate_size}")


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3.5-MoE: Qwen3.5's hybrid decoder with routed + shared-expert MLPs, and its vision tower."""

    model_type: ClassVar[str] = "qwen3_5_moe"
    text: Qwen35MoeTextConfig

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style `config.json` content, loadable by transformers' `Qwen3_5MoeConfig`."""
        t, dense = self.text, super().to_hf_dict()
        text = {k: v for k, v in dense["text_config"].items() if k != "intermediate_size"}
        text.update(model_type="qwen3_5_moe_text", num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                    moe_intermediate_size=t.moe_intermediate_size,
                    shared_expert_intermediate_size=t.shared_expert_intermediate_size,
                    router_aux_loss_coef=t.router_aux_loss_coef)
        vision = dict(dense["vision_config"], model_type="qwen3_5_moe_vision")
        return dict(dense, architectures=["Qwen3_5MoeForConditionalGeneration"], text_config=text, vision_config=vision)


def qwen3_5_moe_from_hf_dict(d: dict[str, Any]) -> Qwen3_5MoeConfig:
    """Parse an HF Qwen3.5-MoE `config.json` dict (released, or as transformers 5 saves it). Missing MoE fields take
    transformers' defaults; keys of MoE variants this family does not implement are errors unless neutral."""
    t = d.get("text_config")
    if not isinstance(t, dict):
        raise ConfigError("config has no 'text_config' object")
    for key, neutral in _QWEN3_5_MOE_UNSUPPORTED.items():
        if key in t and t[key] not in neutral:
            raise ConfigError(f"text_config.{key}={t[key]!r} is not supported by qwen3_5_moe (every layer routes over "
                              f"its experts and has a gated shared expert; expected one of {list(neutral)})")
    shared = int(t.get("shared_expert_intermediate_size", 512))
    if shared <= 0:
        raise ConfigError(f"text_config.shared_expert_intermediate_size={shared}: qwen3_5_moe's every layer has a "
                          "shared expert, whose width must be positive")
    # Qwen3.5's parser reads the hybrid stack; the shared expert's width stands in for the dense MLP's.
    base = qwen3_5_from_hf_dict(dict(d, text_config=dict(t, intermediate_size=shared)))
    fields = {f.name: getattr(base.text, f.name) for f in dataclasses.fields(Qwen35TextConfig)}
    text = Qwen35MoeTextConfig(
        **fields,
        num_experts=int(t.get("num_experts", 256)),
        num_experts_per_tok=int(t.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 512)),
        router_aux_loss_coef=float(t.get("router_aux_loss_coef", 0.001)),
    )
    top = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name not in ("text", "vision")}
    return Qwen3_5MoeConfig(text=text, vision=base.vision, **top)


# The families, keyed by `config.json`'s model_type: config class, parser and the file of the model (`families.py`).
register(Family(Qwen3VLConfig.model_type, Qwen3VLConfig, qwen3_vl_from_hf_dict, "jaxrl_vlm.models.qwen3_vl"))
register(Family(Qwen25VLConfig.model_type, Qwen25VLConfig, qwen2_5_vl_from_hf_dict, "jaxrl_vlm.models.qwen2_5_vl"))
register(Family(Qwen3_5Config.model_type, Qwen3_5Config, qwen3_5_from_hf_dict, "jaxrl_vlm.models.qwen3_5"))
register(Family(Qwen3VLMoeConfig.model_type, Qwen3VLMoeConfig, qwen3_vl_moe_from_hf_dict, "jaxrl_vlm.models.qwen3_vl_moe"))
register(Family(Qwen3_5MoeConfig.model_type, Qwen3_5MoeConfig, qwen3_5_moe_from_hf_dict, "jaxrl_vlm.models.qwen3_5_moe"))
# model_type -> parser, read from the registry (the config's choices of `--make-tiny-arch`, `make-tiny --arch`).
FAMILY_PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {name: f.from_hf_dict for name, f in FAMILIES.items()}
ModelConfig = Qwen3VLConfig | Qwen25VLConfig | Qwen3_5Config | Qwen3VLMoeConfig | Qwen3_5MoeConfig


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    """Parse an HF `config.json` dict of any registered family (its `model_type`; default qwen3_vl)."""
    model_type = d.get("model_type", "qwen3_vl")
    if model_type not in FAMILIES:
        raise ConfigError(f"config model_type={model_type!r} is not supported; expected one of {tuple(FAMILIES)}")
    return FAMILIES[model_type].from_hf_dict(d)


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


def qwen2_5_vl_3b_instruct() -> Qwen25VLConfig:
    """Qwen2.5-VL-3B-Instruct architecture (tied embeddings, 36 layers, GQA 16/2, windowed 32-block ViT)."""
    return Qwen25VLConfig(
        text=TextConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            mrope_section=(16, 24, 24),
            mrope_interleaved=False,
            max_position_embeddings=128000,
            attention_bias=True,
            qk_norm=False,
        ),
        vision=Qwen25VisionConfig(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            window_size=112,
            fullatt_block_indexes=(7, 15, 23, 31),
        ),
        tie_word_embeddings=True,
    )


def _qwen3_5_dense(*, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, linear_v_heads: int,
                   vision: tuple[int, int, int, int], tied: bool) -> Qwen3_5Config:
    """A released Qwen3.5 dense architecture. What every size shares (the model cards' 'Token Embedding 248320',
    'Head Dimension 256' / '128', 'Rotary Position Embedding Dimension: 64', 16 linear key heads, 3 linear : 1 full)
    is fixed here; `vision` is the tower's (depth, hidden_size, intermediate_size, num_heads)."""
    depth, v_hidden, v_mlp, v_heads = vision
    return Qwen3_5Config(
        text=Qwen35TextConfig(
            vocab_size=248320, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
            layer_types=_qwen3_5_layer_types({"full_attention_interval": 4}, layers),
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=linear_v_heads, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
            mrope_section=(11, 11, 10), max_position_embeddings=262144,
        ),
        vision=VisionConfig(depth=depth, hidden_size=v_hidden, intermediate_size=v_mlp, num_heads=v_heads,
                            out_hidden_size=hidden, num_position_embeddings=2304, deepstack_visual_indexes=()),
        tie_word_embeddings=tied,
    )


# Sources. Text: each model card's "Model Overview" (Qwen/Qwen3.5-<size> README: hidden, layers, heads, FFN, tying).
# Vision: a copy of the released config.json's vision_config, as named per size.
def qwen3_5_0_8b() -> Qwen3_5Config:
    """Qwen3.5-0.8B: card; vision from a test fixture mirroring Qwen/Qwen3.5-0.8B's config.json (12 x 768)."""
    return _qwen3_5_dense(hidden=1024, mlp=3584, layers=24, heads=8, kv_heads=2, linear_v_heads=16,
                          vision=(12, 768, 3072, 12), tied=True)


def qwen3_5_2b() -> Qwen3_5Config:
    """Qwen3.5-2B: card; vision from the config.json of a byte-identical-architecture fine-tune (24 x 1024)."""
    return _qwen3_5_dense(hidden=2048, mlp=6144, layers=24, heads=8, kv_heads=2, linear_v_heads=16,
                          vision=(24, 1024, 4096, 16), tied=True)


def qwen3_5_4b() -> Qwen3_5Config:
    """Qwen3.5-4B: card; vision from the config.json of a fine-tune with the card's text config (24 x 1024)."""
    return _qwen3_5_dense(hidden=2560, mlp=9216, layers=32, heads=16, kv_heads=4, linear_v_heads=32,
                          vision=(24, 1024, 4096, 16), tied=True)


def qwen3_5_9b() -> Qwen3_5Config:
    """Qwen3.5-9B: card, and a fixture copy of its config.json (revision c2022362; 27 x 1152 tower, untied)."""
    return _qwen3_5_dense(hidden=4096, mlp=12288, layers=32, heads=16, kv_heads=4, linear_v_heads=32,
                          vision=(27, 1152, 4304, 16), tied=False)


def qwen3_5_27b() -> Qwen3_5Config:
    """Qwen3.5-27B: card and slime scripts/models/qwen3.5-27B.sh (untied); 27 x 1152 tower as in its quant cards."""
    return _qwen3_5_dense(hidden=5120, mlp=17408, layers=64, heads=24, kv_heads=4, linear_v_heads=48,
                          vision=(27, 1152, 4304, 16), tied=False)


def qwen3_vl_30b_a3b() -> Qwen3VLMoeConfig:
    """Qwen3-VL-30B-A3B: slime scripts/models/qwen3-vl-30b-a3b.sh (text, experts) and the released GGUF's metadata
    (vision: 27 blocks of 1152, deepstack 8/16/24; the 1152-wide tower's MLP is 4304 as in Qwen3-VL-8B)."""
    return Qwen3VLMoeConfig(
        text=Qwen3VLMoeTextConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=5_000_000.0,
            mrope_section=(24, 20, 20), max_position_embeddings=262144,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        ),
        vision=VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                            num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
        tie_word_embeddings=False,
    )


# Qwen3.5-35B-A3B (the qwen3_5_moe family). Card: 40 layers = 10 x (3 linear + 1 full),
# hidden 2048, 248320 vocabulary (untied), gated attention 16 Q / 2 KV heads of 256 (rotary 64), Gated DeltaNet
# 16 QK / 32 V heads of 128; 256 experts, 8 routed + 1 shared, expert intermediate 512. slime
# scripts/models/qwen3.5-35B-A3B.sh agrees (--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 512
# --moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate, softmax router, every layer sparse).
# config.json copies of the same architecture (Qwen3.6-35B-A3B) add: num_experts_per_tok 8,
# shared_expert_intermediate_size 512, router_aux_loss_coef 0.001, no dense `intermediate_size`; vision tower
# 27 x 1152 (MLP 4304, 16 heads) -> 2048.
def qwen3_5_35b_a3b() -> Qwen3_5MoeConfig:
    """Qwen3.5-35B-A3B from the sources above; the hybrid stack's shared values (head 256, rotary 0.25, M-RoPE
    [11, 11, 10], theta 1e7, linear heads of 128) as the dense sizes'. `intermediate_size` is the shared expert's."""
    dense = _qwen3_5_dense(hidden=2048, mlp=512, layers=40, heads=16, kv_heads=2, linear_v_heads=32,
                           vision=(27, 1152, 4304, 16), tied=False)
    text = Qwen35MoeTextConfig(**{f.name: getattr(dense.text, f.name) for f in dataclasses.fields(Qwen35TextConfig)},
                               num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                               router_aux_loss_coef=0.001)
    return Qwen3_5MoeConfig(text=text, vision=dense.vision, tie_word_embeddings=False)


# The one table of named architectures (the benchmark's `--model`, tests). The `tiny` test model is not
# here: its special-token ids come from the tiny tokenizer that `jaxrl_vlm.tiny` trains.
MODEL_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "small": small_model_config,
    "qwen3_vl_2b": qwen3_vl_2b_instruct,
    "qwen2_5_vl_3b": qwen2_5_vl_3b_instruct,
    "qwen3_5_0_8b": qwen3_5_0_8b,
    "qwen3_5_2b": qwen3_5_2b,
    "qwen3_5_4b": qwen3_5_4b,
    "qwen3_5_9b": qwen3_5_9b,
    "qwen3_5_27b": qwen3_5_27b,
    "qwen3_vl_30b_a3b": qwen3_vl_30b_a3b,
    "qwen3_5_35b_a3b": qwen3_5_35b_a3b,
}


def preset_config(name: str) -> ModelConfig:
    """The config of the architecture preset `name` (a key of `MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {tuple(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]()
