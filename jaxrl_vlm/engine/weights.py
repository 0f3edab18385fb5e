"""Reload weights from an HF safetensors directory into the engine's existing model structure.

Like SGLang's `/update_weights_from_disk`, only the weight files are read: `config.json` is not read
again, the architecture is the one the engine was started with, and a checkpoint whose tensors do not
match it (missing, unexpected or mis-shaped keys) is refused before anything changes. The new
parameters are built completely off to the side, so a failed load leaves the serving weights intact.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.models import hf_io
from jaxrl_vlm.models.config import Qwen3VLConfig


def load_params_state(path: str | os.PathLike, cfg: Qwen3VLConfig, like: nnx.State) -> nnx.State:
    """Parameters of the checkpoint at `path` as a state with the structure, dtypes and devices of `like`.

    Raises `hf_io.CheckpointError` (or FileNotFoundError) naming the directory and the keys at fault.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (model_path of update_weights_from_disk)")
    reader = hf_io.SafetensorsReader(root)
    # hf_io keeps its HF-key mapping private; the engine needs it to load without a config.json.
    links = hf_io.weight_links(cfg)
    hf_io.check_checkpoint_keys(reader, links, cfg)
    flat = dict(nnx.to_flat_state(like))
    new_values: dict[tuple, jax.Array] = {}
    for link in links:
        parts = link.to_ours(reader.get(link.hf_key))
        for our_path, part in zip(link.ours, parts):
            if our_path not in flat:
                raise RuntimeError(f"engine model has no parameter {our_path} for {link.hf_key}")
            old = flat[our_path].get_value()
            if tuple(part.shape) != tuple(old.shape):
                raise hf_io.CheckpointError(
                    f"{root}: {link.hf_key} maps to shape {tuple(part.shape)}, the serving model has {tuple(old.shape)}"
                )
            host = np.ascontiguousarray(part).astype(np.dtype(old.dtype), copy=False)
            new_values[our_path] = jax.device_put(jnp.asarray(host), old.sharding)
    missing = sorted(str(p) for p in flat if p not in new_values)
    if missing:
        raise RuntimeError(f"parameters without a checkpoint source: {missing}")
    # New Variables throughout: the serving state is never mutated.
    return nnx.from_flat_state([(p, var.replace(new_values[p])) for p, var in nnx.to_flat_state(like)])
