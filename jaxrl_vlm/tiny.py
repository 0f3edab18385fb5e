"""`jaxrl-vlm make-tiny`: a tiny random Qwen3-VL checkpoint built with our init and our exporter.

The output directory is a complete `--model-path`: `model.safetensors` written by `to_hf`, the
transformers-5 `config.json` of `tiny_assets.tiny_qwen3_vl_hf_config`, `generation_config.json`
(eos = [<|im_end|>, <|endoftext|>] like Qwen3-VL-Instruct), tokenizer, chat template and image
processor files. transformers' `Qwen3VLForConditionalGeneration.from_pretrained` and our `from_hf`
both load it. No torch: the weights never leave JAX/numpy.

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

from jaxrl_vlm.models.config import Qwen3VLConfig, from_hf_dict
from jaxrl_vlm.models.hf_io import load_hf_config, param_count, to_hf
from jaxrl_vlm.models.qwen3_vl import Qwen3VL

INITS = ("scaled", "hf")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def tiny_hf_config(vocab_size: int = 1024, tokenizer_seed: int = 0) -> tuple[dict[str, Any], Any]:
    """(transformers-5 config dict, tokenizer) of the tiny model; token ids come from the tokenizer."""
    from jaxrl_vlm.tiny_assets import build_tiny_tokenizer, tiny_qwen3_vl_hf_config  # transformers: ~8 s, only here

    tokenizer = build_tiny_tokenizer(vocab_size, tokenizer_seed)
    return tiny_qwen3_vl_hf_config(tokenizer), tokenizer


@functools.lru_cache(maxsize=8)
def tiny_model_config(vocab_size: int = 1024, tokenizer_seed: int = 0) -> Qwen3VLConfig:
    """Our (frozen) `Qwen3VLConfig` of the tiny model: the fixed shape sharding goldens are dumped for.
    Cached: it trains the tiny BPE to learn the special-token ids."""
    return from_hf_dict(tiny_hf_config(vocab_size, tokenizer_seed)[0])


def _init_std(path: tuple[str | int, ...], shape: tuple[int, ...], cfg: Qwen3VLConfig) -> float | None:
    """Std of the scaled init for the parameter at `path`; None keeps the constructor's value."""
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
        raise ValueError(f"no init rule for parameter {'.'.join(map(str, path))} {shape}")
    # Einsum-named kernels: o_kernel_nhd contracts (n, h); every other kernel its first axis.
    fan_in = math.prod(shape[:2]) if leaf.startswith("o_kernel") else shape[0]
    std = fan_in**-0.5
    if path[0] == "layers" and leaf in ("o_kernel_nhd", "down_kernel_fd"):
        std /= math.sqrt(2 * cfg.text.num_hidden_layers)
    if "blocks" in path and leaf in ("o_kernel_nhd", "fc2_kernel_fd"):
        std /= math.sqrt(2 * cfg.vision.depth)
    return std


def init_tiny_model(
    cfg: Qwen3VLConfig, seed: int = 0, *, init: str = "scaled", param_dtype: Any = jnp.float32, **model_kwargs: Any
) -> Qwen3VL:
    """A `Qwen3VL` with our init (see the module docstring); deterministic in `seed`.

    `model_kwargs` (compute_dtype, remat, attention_impl) go to `Qwen3VL`.
    """
    if init not in INITS:
        raise ValueError(f"init={init!r}: choose one of {INITS}")
    model = Qwen3VL(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype, **model_kwargs)
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
) -> Path:
    """Write a tiny random Qwen3-VL checkpoint directory (weights, config, generation config, processing files).

    vocab_size: tokenizer and embedding size (>= 270: 256 bytes + merges + 13 added tokens).
    dtype: of the safetensors (float32 keeps exact parity with transformers; bfloat16 like releases).
    min/max_pixels: the image processor's pixel range (64x64..128x128 -> 4..16 image tokens).
    """
    from jaxrl_vlm.tiny_assets import EOS_TOKEN, PAD_TOKEN, save_tiny_processing  # transformers: ~8 s, only here

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"make-tiny: {out} exists and is not a directory")
    hf_config, tokenizer = tiny_hf_config(vocab_size, tokenizer_seed)
    cfg = from_hf_dict(hf_config)
    model = init_tiny_model(cfg, seed, init=init)
    to_hf(model, out, dtype=DTYPES[dtype])
    hf_config = dict(hf_config, dtype=dtype)
    hf_config["text_config"] = dict(hf_config["text_config"], dtype=dtype)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if load_hf_config(out) != cfg:  # the written config must describe the weights we exported
        raise RuntimeError(f"{out / 'config.json'} does not parse back to the exported model's config")
    save_tiny_processing(out, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels)
    im_end, endoftext = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def summarize(out: Path) -> str:
    """One line for the CLI: where, how many parameters, file size."""
    cfg = load_hf_config(out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return f"wrote tiny Qwen3-VL to {out}: {param_count(cfg):,} parameters, vocab {cfg.text.vocab_size}, {size / 1e6:.2f} MB of weights"


__all__ = ["INITS", "init_tiny_model", "make_tiny", "summarize", "tiny_hf_config", "tiny_model_config"]
