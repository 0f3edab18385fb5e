"""Reload weights from an HF safetensors directory into the engine's existing model structure.

Like SGLang's `/update_weights_from_disk`, only the weight files are read: `config.json` is not read
again, the architecture is the one the engine was started with, and a checkpoint whose tensors do not
match it (missing, unexpected or mis-shaped keys) is refused before anything changes. The new
parameters are built completely off to the side, so a failed load leaves the serving weights intact.

Before any tensor is read, `check_checkpoint_files` checks the files themselves: the index is an object whose
`weight_map` maps names to shard files inside the directory, and every safetensors header has a sane length
and is an object of well-formed entries whose byte ranges lie inside the file. A corrupt or hostile
checkpoint is then refused with a `CheckpointError` naming the file, never read past its end or into memory
it claims to need.

`merge_adapters` serves LoRA in memory: the engine keeps the base it loaded and merges each version's adapters into
it on its own devices, so a weight sync moves only the adapters.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_vlm.lora.adapters import Adapters, LoraSetup, merged_params
from jaxrl_vlm.models import hf_io
from jaxrl_vlm.models.config import ModelConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on a header
MAX_INDEX_BYTES = 64 << 20
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _bad(where: Path | str, why: str) -> hf_io.CheckpointError:
    return hf_io.CheckpointError(f"{where}: {why}")


def _load_json(raw: bytes, where: Path) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise _bad(where, "JSON nests too deeply") from None
    except ValueError as e:
        raise _bad(where, f"not valid JSON ({e})") from e


def _shard_files(root: Path) -> list[Path]:
    """The weight files of the checkpoint at `root` (index or single file), each checked to lie inside it."""
    index = root / INDEX_NAME
    if not index.exists():
        if not (root / SINGLE_NAME).exists():
            raise _bad(root, f"no {SINGLE_NAME} or {INDEX_NAME}")
        return [root / SINGLE_NAME]
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise _bad(index, f"{index.stat().st_size} bytes, more than an index can need ({MAX_INDEX_BYTES})")
    data = _load_json(index.read_bytes(), index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise _bad(index, f"not a safetensors index: 'weight_map' must be an object of tensor name -> file, "
                          f"got {type(weight_map).__name__}")
    files: dict[str, Path] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name.endswith(".safetensors"):
            raise _bad(index, f"weight_map[{key!r}] = {name!r} is not a .safetensors file name")
        # Names, not real paths, are checked: an HF cache snapshot's shards are symlinks into its blob store.
        if os.path.isabs(name) or ".." in Path(name).parts or "\\" in name:
            raise _bad(index, f"weight_map[{key!r}] = {name!r} is not a file of the checkpoint directory {root}")
        files.setdefault(name, root / name)
    return [files[name] for name in sorted(files)]


def check_safetensors_file(file: Path) -> None:
    """Raise CheckpointError unless `file` has a sane safetensors header (length, JSON object, entries whose
    dtype, shape and byte range agree and lie inside the file)."""
    if not file.is_file():
        raise _bad(file, "listed in the checkpoint but missing (or not a regular file)")
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise _bad(file, "too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw_len)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _bad(file, f"corrupt safetensors header: header length {n} but the file has {size} bytes "
                             f"(and a header may have at most {MAX_HEADER_BYTES})")
        header = _load_json(f.read(n), file)
    if not isinstance(header, dict):
        raise _bad(file, f"corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    data_bytes = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict):
                raise _bad(file, "corrupt safetensors header: __metadata__ is not an object")
            continue
        if not isinstance(entry, dict):
            raise _bad(file, f"corrupt safetensors header: entry {key!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _ITEM_BYTES:
            raise _bad(file, f"tensor {key!r} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _bad(file, f"tensor {key!r} has a malformed shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise _bad(file, f"tensor {key!r} has data_offsets {offsets!r} outside the file's {data_bytes} data bytes")
        if offsets[1] - offsets[0] != math.prod(shape) * _ITEM_BYTES[dtype]:
            raise _bad(file, f"tensor {key!r}: data_offsets span {offsets[1] - offsets[0]} bytes but shape {shape} "
                             f"of {dtype} needs {math.prod(shape) * _ITEM_BYTES[dtype]}")


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """Raise FileNotFoundError or CheckpointError unless every weight file of the checkpoint at `path` is
    well formed (see the module docstring). Reads only the index and the headers."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (model_path of update_weights_from_disk)")
    for file in _shard_files(root):
        check_safetensors_file(file)


def load_params_state(path: str | os.PathLike, cfg: ModelConfig, like: nnx.State) -> nnx.State:
    """Parameters of the checkpoint at `path` as a state with the structure, dtypes and devices of `like`.

    Raises `hf_io.CheckpointError` (or FileNotFoundError) naming the directory and the keys at fault.
    """
    root = Path(path)
    check_checkpoint_files(root)
    reader = hf_io.SafetensorsReader(root)
    # The family's HF names (the serving config's family): the engine loads without reading config.json again.
    links = hf_io.weight_links(cfg)
    hf_io.check_checkpoint_keys(reader, links, cfg)
    flat = dict(nnx.to_flat_state(like))
    new_values: dict[tuple, jax.Array] = {}
    for link in links:
        parts = link.to_ours(hf_io.read_link(reader, link))  # any stored layout (transposed, per-expert)
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


@functools.lru_cache(maxsize=8)
def _merge_program(setup: LoraSetup):
    return jax.jit(lambda base, adapters: merged_params(base, adapters, setup))


def merge_adapters(base: nnx.State, adapters: Adapters, setup: LoraSetup, via_dtype: Any = None) -> nnx.State:
    """The serving state `base` (a replica's parameters, kept as they were loaded) with LoRA adapters merged in, on
    the base's devices and in its dtypes: the adapters are all that crosses from the trainer. `via_dtype`: round
    the adapters through this dtype first (the weight-sync dtype), as a disk export would."""
    leaf = jax.tree.leaves(base)[0]
    here = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec()) \
        if isinstance(leaf.sharding, jax.sharding.NamedSharding) else leaf.sharding
    if via_dtype is not None:
        adapters = jax.tree.map(lambda x: x.astype(via_dtype), adapters)
    return _merge_program(setup)(base, jax.device_put(adapters, here))
