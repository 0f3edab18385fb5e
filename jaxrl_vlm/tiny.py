"""`jaxrl-vlm make-tiny`: a tiny random Qwen-VL checkpoint built with our init and our exporter.

The output directory is a complete `--model-path`: `model.safetensors` written by `to_hf`, the
transformers-5 `config.json` of `tiny_assets.TINY_HF_CONFIGS[arch]` (`qwen3_vl`, the default, or
`qwen2_5_vl`), `generation_config.json` (eos = [<|im_end|>, <|endoftext|>] like the Instruct models),
tokenizer, the architecture's chat template and image processor files. transformers'
`...ForConditionalGeneration.from_pretrained` and our `from_hf` both load it. No torch: the weights
never leave JAX/numpy.

Init ("scaled", the default): HF's std-0.02 normal suits hidden sizes in the thousands; at hidden 64
it makes every logit ~0.16 and the residual stream ~0.02, so a tiny model barely moves in a few dozen
RL steps. We use fan-in scaling instead: kernels ~ N(0, 1/fan_in), residual-branch outputs
(attention out, MLP down, vision block out/fc2) further divided by sqrt(2 * layers), embeddings
N(0, 1/hidden) so tied logits have std ~1; norms are ones and biases zeros. "hf" keeps std 0.02.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.models.config import FAMILY_PARSERS, ModelConfig, from_hf_dict
from jaxrl_vlm.models.families import PolicyModel, family_model
from jaxrl_vlm.models.hf_io import load_hf_config, model_class, param_count, to_hf

INITS = ("scaled", "hf")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


TINY_ARCHS = tuple(FAMILY_PARSERS)  # make-tiny builds every family (config.json model_type)


def tiny_hf_config(vocab_size: int = 1024, tokenizer_seed: int = 0, arch: str = "qwen3_vl") -> tuple[dict[str, Any], Any]:
    """(transformers-5 config dict, tokenizer with `arch`'s chat template and pre-tokenizer) of the tiny model;
    token ids come from the tokenizer."""
    from jaxrl_vlm.tiny_assets import (  # transformers: ~8 s, only here
        QWEN2_PRETOKENIZE_REGEX,
        TINY_CHAT_TEMPLATES,
        TINY_HF_CONFIGS,
        TINY_PRETOKENIZE_REGEX,
        build_tiny_tokenizer,
    )

    if arch not in TINY_ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {TINY_ARCHS}")
    tokenizer = build_tiny_tokenizer(vocab_size, tokenizer_seed, chat_template=TINY_CHAT_TEMPLATES[arch],
                                     pretokenize_regex=TINY_PRETOKENIZE_REGEX.get(arch, QWEN2_PRETOKENIZE_REGEX))
    return TINY_HF_CONFIGS[arch](tokenizer), tokenizer


def with_head_dim(hf_config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`hf_config` with the text head size `head_dim`; an M-RoPE section is rescaled to keep its proportions and sum
    to head_dim // 2 (transformers does not check that sum, our parser does)."""
    text = dict(hf_config["text_config"])
    if "head_dim" not in text:
        raise ValueError(f"head_dim: the tiny {hf_config.get('model_type')} derives its head size from hidden_size / "
                         "num_attention_heads; only configs with an explicit head_dim take this option")
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"head_dim={head_dim}: must be a multiple of 8 (M-RoPE splits the rotary half in three)")
    text["head_dim"] = head_dim
    rope = dict(text.get("rope_parameters") or {})
    section = rope.get("mrope_section")
    if section:
        half = head_dim // 2
        scaled = [max(1, round(s * half / sum(section))) for s in section]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled
        text["rope_parameters"] = rope
    return {**hf_config, "text_config": text}


@functools.lru_cache(maxsize=8)
def tiny_model_config(vocab_size: int = 1024, tokenizer_seed: int = 0, arch: str = "qwen3_vl") -> ModelConfig:
    """Our (frozen) config of the tiny model of `arch`: the fixed shape sharding goldens are dumped for.
    Cached: it trains the tiny BPE to learn the special-token ids."""
    return from_hf_dict(tiny_hf_config(vocab_size, tokenizer_seed, arch)[0])


def _init_std(path: tuple[str | int, ...], shape: tuple[int, ...], cfg: ModelConfig) -> float | None:
    """Std of the scaled init for the parameter at `path`; None keeps the constructor's value. A parameter that
    the generic names below do not cover is the family's to answer (`FamilyModel.init_std`)."""
    leaf = str(path[-1])
    if leaf in ("scale", "bias") or "_bias_" in leaf:
        return None  # norm scales (ones), norm and linear biases (zeros)
    if leaf == "embed_vd":
        return cfg.text.hidden_size**-0.5
    if leaf == "lm_head_dv":
        return cfg.text.hidden_size**-0.5
    if leaf == "pos_embed_sd":
        return cfg.vision.hidden_size**-0.5
    if "_kernel_" not in leaf:
        own = family_model(cfg).init_std
        if own is not None:
            return own(path, shape, cfg)
        raise ValueError(f"no init rule for parameter {'.'.join(map(str, path))} {shape}")
    # Einsum-named kernels: o_kernel_nhd contracts (n, h); every other kernel its first axis.
    fan_in = math.prod(shape[:2]) if leaf.startswith("o_kernel") else shape[0]
    std = fan_in**-0.5
    if path[0] == "layers" and leaf in ("o_kernel_nhd", "down_kernel_fd"):
        std /= math.sqrt(2 * cfg.text.num_hidden_layers)
    if "blocks" in path and leaf in ("o_kernel_nhd", "fc2_kernel_fd", "down_kernel_fd"):
        std /= math.sqrt(2 * cfg.vision.depth)
    return std


def init_tiny_model(
    cfg: ModelConfig, seed: int = 0, *, init: str = "scaled", param_dtype: Any = jnp.float32, **model_kwargs: Any
) -> PolicyModel:
    """The model of `cfg`'s family with our init (see the module docstring); deterministic in `seed`.

    `model_kwargs` (compute_dtype, remat, attention_impl) go to the model class.
    """
    if init not in INITS:
        raise ValueError(f"init={init!r}: choose one of {INITS}")
    model = model_class(cfg)(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype, **model_kwargs)
    if init == "hf":
        return model
    key = jax.random.key(seed)
    state = nnx.state(model, nnx.Param)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        shape = tuple(var.get_value().shape)
        std = _init_std(path, shape, cfg)
        if std is not None:
            value = std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
            var.set_value(value.astype(param_dtype))
    nnx.update(model, state)
    return model


def make_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    tokenizer_seed: int = 0,
    init: str = "scaled",
    dtype: str = "float32",
    min_pixels: int = 64 * 64,
    max_pixels: int = 128 * 128,
    arch: str = "qwen3_vl",
    head_dim: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a tiny random checkpoint directory of `arch` (`TINY_ARCHS`: weights, config, generation config,
    processing files).

    vocab_size: tokenizer and embedding size (>= 270: 256 bytes + merges + 13 added tokens).
    dtype: of the safetensors (float32 keeps exact parity with transformers; bfloat16 like releases).
    min/max_pixels: the image processor's pixel range (64x64..128x128 -> 4..16 image tokens).
    head_dim: the text attention's head size (None: the tiny config's 16). vLLM's CPU attention kernels need one of
    32, 64, 80, ...: a tiny checkpoint that a real vLLM server serves is made with `head_dim=32`.
    overwrite: replace a model already in `out_dir` (its config.json or safetensors); without it that is an error,
    so a typo in the path cannot destroy a checkpoint.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"make-tiny: {out} exists and is not a directory")
    held = sorted(p.name for p in out.glob("*") if p.name == "config.json" or p.suffix == ".safetensors")
    if held and not overwrite:
        raise FileExistsError(f"make-tiny: {out} already holds a model ({', '.join(held)}); pass --overwrite "
                              "(overwrite=True) to replace it")
    from jaxrl_vlm.tiny_assets import EOS_TOKEN, PAD_TOKEN, save_tiny_processing  # transformers: ~8 s, only here
    hf_config, tokenizer = tiny_hf_config(vocab_size, tokenizer_seed, arch)
    if head_dim is not None:
        hf_config = with_head_dim(hf_config, head_dim)
    cfg = from_hf_dict(hf_config)
    model = init_tiny_model(cfg, seed, init=init)
    to_hf(model, out, dtype=DTYPES[dtype])
    hf_config = dict(hf_config, dtype=dtype)
    hf_config["text_config"] = dict(hf_config["text_config"], dtype=dtype)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if load_hf_config(out) != cfg:  # the written config must describe the weights we exported
        raise RuntimeError(f"{out / 'config.json'} does not parse back to the exported model's config")
    save_tiny_processing(out, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels, arch=arch)
    im_end, endoftext = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def summarize(out: Path) -> str:
    """One line for the CLI: where, how many parameters, file size."""
    cfg = load_hf_config(out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return f"wrote tiny {type(cfg).__name__.removesuffix('Config')} to {out}: {param_count(cfg):,} parameters, vocab {cfg.text.vocab_size}, {size / 1e6:.2f} MB of weights"


__all__ = ["INITS", "TINY_ARCHS", "init_tiny_model", "make_tiny", "summarize", "tiny_hf_config", "tiny_model_config"]
