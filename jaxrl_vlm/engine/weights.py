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

Weight deltas (`jaxrl_vlm.weight_delta`): the engine's parameters are named by their state path (`tensor_name`,
"layers/0/mlp/up_kernel_df") in the engine's own dtypes and layouts. `serving_tensors` is what a trainer's state
becomes in an engine after a full sync (the trainer's snapshot), `delta_tensors` the new bytes of the tensors a
delta changes (applied to the engine's current bytes on the host), `with_tensors` a state holding them in the
engine's shardings, and `state_checksums` the checksums of what a state holds, which the trainer compares with
the delta's manifest.
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

from jaxrl_vlm import weight_delta
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
    """Parameters of the checkpoint at `path` as a state with the structure, dtypes and devices of `like`; the
    tensors the directory lists as kept (`hf_io.KEPT_TENSORS_FILE`: a sync that leaves a frozen vision tower out) are
    `like`'s own arrays.

    Raises `hf_io.CheckpointError` (or FileNotFoundError) naming the directory and the keys at fault.
    """
    root = Path(path)
    check_checkpoint_files(root)
    reader = hf_io.SafetensorsReader(root)
    # The family's HF names (the serving config's family): the engine loads without reading config.json again.
    kept = hf_io.kept_tensors(root)
    links = [link for link in hf_io.weight_links(cfg) if link.hf_key not in kept]
    hf_io.check_checkpoint_keys(reader, links, cfg)
    flat = dict(nnx.to_flat_state(like))
    kept_paths = {p for link in hf_io.weight_links(cfg) if link.hf_key in kept for p in link.ours}
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
    missing = sorted(str(p) for p in flat if p not in new_values and p not in kept_paths)
    if missing:
        raise RuntimeError(f"parameters without a checkpoint source: {missing}")
    # New Variables throughout: the serving state is never mutated.
    return nnx.from_flat_state([(p, var.replace(new_values.get(p, var.get_value())))
                                for p, var in nnx.to_flat_state(like)])


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


# ---------------------------------------------------------------------------------------------------- in memory


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _key_name(key: Any) -> Any:
    """One step of a pytree key path as `nnx.to_flat_state` names it (an attribute or dict key, a list index)."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    raise TypeError(f"unexpected pytree key {key!r} in a parameter path")


def variable_paths(tree: Any) -> list[tuple | None]:
    """For each leaf of `tree` (a model or a state; `jax.tree.leaves` order): the path of its nnx.Param, as
    `nnx.to_flat_state` writes it, or None for a leaf of another kind of variable."""
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
    paths: list[tuple | None] = []
    for path, var in pairs:
        name = tuple(_key_name(k) for k in path) if isinstance(var, nnx.Param) else None
        paths.extend([name] * (len(jax.tree.leaves(var)) if _is_variable(var) else 1))
    return paths


_PATHS_BY_STRUCTURE: dict[Any, list[tuple | None]] = {}  # `variable_paths`, by tree structure (a few models a run)


def leaf_paths(tree: Any) -> tuple[list[Any], Any, list[tuple | None]]:
    """`tree`'s leaves, its structure and `variable_paths`, the paths read once per structure: a weight sync reads
    the same model's parameters every version, and the flatten costs a tenth of `nnx.state`'s graph walk."""
    leaves, structure = jax.tree.flatten(tree)
    paths = _PATHS_BY_STRUCTURE.get(structure)
    if paths is None:
        if len(_PATHS_BY_STRUCTURE) >= 16:
            _PATHS_BY_STRUCTURE.clear()
        paths = _PATHS_BY_STRUCTURE[structure] = variable_paths(tree)
    return leaves, structure, paths


def param_arrays(tree: Any) -> dict[tuple, Any]:
    """path -> array of the parameters (nnx.Param) of a model or a state (flax's Module and State are pytrees)."""
    leaves, _, paths = leaf_paths(tree)
    return {path: leaf for path, leaf in zip(paths, leaves) if path is not None}


def _device_set(sharding: Any) -> frozenset:
    return frozenset(sharding.device_set)


@functools.lru_cache(maxsize=32)
def _cast_copy_program(dtypes: tuple[Any, ...], shardings: tuple[Any, ...]) -> Any:
    """One program casting each array to its dtype into its sharding (resharding within one device set)."""

    def cast_copy(arrays: list[jax.Array]) -> list[jax.Array]:
        # copy=True: a new buffer even where the dtype is kept; jit would otherwise hand back the input itself.
        return [jnp.array(x, dtype=d, copy=True) for x, d in zip(arrays, dtypes)]

    return jax.jit(cast_copy, out_shardings=list(shardings))


@functools.lru_cache(maxsize=256)
def _same_layout(source: Any, target: Any, ndim: int) -> bool:
    return source == target or source.is_equivalent_to(target, ndim)


def aliasable(source: Any, target: Any, via_dtype: Any = None) -> bool:
    """Whether `source` can be served as it is in `target`'s place: a live device array of the target's dtype and
    layout (same devices, same shards), which rounding through `via_dtype` would not change."""
    if not isinstance(source, jax.Array) or source.is_deleted() or source.dtype != target.dtype:
        return False
    via = None if via_dtype is None else jnp.dtype(via_dtype)
    if via is not None and via != source.dtype and jnp.issubdtype(source.dtype, jnp.floating):
        return False
    return _same_layout(source.sharding, target.sharding, source.ndim)


def place_weights(sources: list[Any], targets: list[Any], via_dtype: Any = None,
                  may_alias: bool = False) -> list[jax.Array]:
    """Each source array rounded through `via_dtype` (floating arrays only; None: not), cast to its target's dtype and
    placed in its target's sharding (targets: arrays or ShapeDtypeStructs). Fresh buffers, never a source's, unless
    `may_alias`: the trainer's train step donates its own, which would delete what the engine serves. So the one copy
    made is the cast, or at equal dtypes the copy that donation needs; no host round trip.

    `may_alias` (the caller's promise that nothing donates or mutates the sources: a trainer whose step keeps its
    parameters, `Trainer.share_params`): a source already in its target's dtype and layout (`aliasable`) is handed
    over as it is, with no copy and no dispatch; the others are placed as below.

    Sources on the targets' devices (one device set throughout: an engine replica on the trainer's devices) go
    through one compiled program, cast and copy in one pass and one dispatch for the whole model; others are cast
    where they are, then moved in one batched transfer."""
    if may_alias:
        out: list[Any] = [x if aliasable(x, t, via_dtype) else None for x, t in zip(sources, targets)]
        rest = [i for i, x in enumerate(out) if x is None]
        if rest:
            for i, placed in zip(rest, place_weights([sources[i] for i in rest], [targets[i] for i in rest], via_dtype)):
                out[i] = placed
        return out
    via = None if via_dtype is None else jnp.dtype(via_dtype)
    # Rounding through a third dtype is its own step: inside one program a compiler may drop a
    # narrowing-then-widening pair of converts (XLA's excess-precision rewrites), which a disk export never does.
    sources = [x.astype(via) if via is not None and jnp.issubdtype(x.dtype, jnp.floating) and via not in
               (x.dtype, t.dtype) else x for x, t in zip(sources, targets)]
    shardings = [t.sharding for t in targets]
    if not sources:
        return []
    devices = {_device_set(s) for s in shardings}
    devices |= {_device_set(x.sharding) for x in sources if isinstance(x, jax.Array)}
    if len(devices) == 1 and all(isinstance(x, jax.Array) for x in sources):
        return _cast_copy_program(tuple(jnp.dtype(t.dtype) for t in targets), tuple(shardings))(sources)
    cast = [x if x.dtype == t.dtype else jnp.asarray(x, t.dtype) for x, t in zip(sources, targets)]
    placed = jax.device_put(cast, shardings, may_alias=False)
    # jax 0.10.2 hands back the source's own per-device buffers when every target device already holds a whole copy
    # (an array replicated over the trainer's 8 devices, put on an engine's 2), even with may_alias=False: the next
    # train step then donates them under the engine, which crashes on deleted buffers (issue 49;
    # tests/test_one_process_devices.py). The caller's own arrays get a real copy on the target devices.
    kept = [i for i, (c, x) in enumerate(zip(cast, sources)) if c is x and isinstance(x, jax.Array)]
    if kept:
        copies = _cast_copy_program(tuple(jnp.dtype(targets[i].dtype) for i in kept),
                                    tuple(shardings[i] for i in kept))([placed[i] for i in kept])
        for i, copy in zip(kept, copies):
            placed[i] = copy
    return placed


# ---------------------------------------------------------------------------------------------------- weight deltas


def tensor_name(path: tuple) -> str:
    """A parameter's name in weight deltas and checksums: its state path joined by "/"."""
    return "/".join(str(part) for part in path)


def _named_params(state: nnx.State) -> dict[str, tuple[tuple, Any]]:
    """name -> (path, variable) of the parameters (nnx.Param) of `state`, in state order."""
    return {tensor_name(path): (path, var) for path, var in nnx.to_flat_state(state) if isinstance(var, nnx.Param)}


def serving_tensors(params: Any, like: nnx.State, via_dtype: Any = None) -> dict[str, np.ndarray]:
    """The bytes an engine serving `like` holds after a full sync of the trainer's parameter state `params` (same
    model; any devices) through `via_dtype` (the sync dtype; None: none): host arrays in the engine's dtypes, by
    `tensor_name`. The casts are numpy's, in the order of a disk export and reload (`hf_io.to_hf` then
    `load_params_state`), so these bytes equal those of an engine loaded fresh from that export."""
    want = _named_params(like)
    given = _named_params(params)
    if set(given) != set(want):
        extra, missing = sorted(set(given) - set(want)), sorted(set(want) - set(given))
        raise ValueError(f"weights do not fit the serving model: missing {missing[:3]}, unexpected {extra[:3]}")
    via = None if via_dtype is None else np.dtype(jnp.dtype(via_dtype))
    out: dict[str, np.ndarray] = {}
    for name, (_, var) in want.items():
        old = var.get_value()
        host = np.asarray(jax.device_get(given[name][1].get_value()))
        if tuple(host.shape) != tuple(old.shape):
            raise ValueError(f"weights do not fit the serving model: {name} has shape {tuple(host.shape)}, the "
                             f"serving model {tuple(old.shape)}")
        if via is not None and jnp.issubdtype(host.dtype, jnp.floating):
            host = host.astype(via, copy=False)
        out[name] = np.asarray(host.astype(np.dtype(old.dtype), copy=False), order="C")
    return out


def host_tensors(state: nnx.State, names: Any = None) -> dict[str, np.ndarray]:
    """The parameters of `state` (all, or those in `names`) gathered to host arrays, by `tensor_name`."""
    params = _named_params(state)
    keep = [n for n in params if names is None or n in names]
    values = jax.device_get([params[n][1].get_value() for n in keep])
    return {n: np.asarray(v) for n, v in zip(keep, values)}


def delta_tensors(state: nnx.State, delta: weight_delta.WeightDelta, version: str) -> dict[str, np.ndarray]:
    """The new host bytes of every tensor `delta` changes, applied to the bytes `state` holds under `version` and
    checked against the manifest's checksums. Raises a `weight_delta.WeightDeltaError` (the caller sends a full
    sync) when `state` is not the delta's base: another version, or other tensors."""
    params = _named_params(state)
    listed = {t.name for t in delta.manifest.tensors}
    if listed != set(params):
        extra, missing = sorted(listed - set(params)), sorted(set(params) - listed)
        raise weight_delta.BaseMismatch(f"the delta's tensors are not the engine's: unknown {extra[:3]}, "
                                        f"absent {missing[:3]}")
    if delta.manifest.base_version is not None and delta.manifest.base_version != version:
        raise weight_delta.BaseMismatch(f"delta to version {delta.manifest.target_version} applies to version "
                                        f"{delta.manifest.base_version}; this engine holds version {version}")
    return weight_delta.apply_delta(host_tensors(state, set(delta.manifest.sparse_tensors())), delta, version)


def with_tensors(state: nnx.State, tensors: dict[str, np.ndarray]) -> nnx.State:
    """`state` with the named parameters replaced by `tensors` (host arrays of their dtypes and shapes), placed in
    the shardings of the ones they replace; the other arrays are shared, not copied (new Variables throughout, as
    `load_params_state`: the serving state is never mutated)."""
    params = _named_params(state)
    paths = [params[name][0] for name in tensors]
    shardings = [params[name][1].get_value().sharding for name in tensors]
    placed = dict(zip(paths, jax.device_put(list(tensors.values()), shardings)))
    return nnx.from_flat_state([(p, var.replace(placed.get(p, var.get_value())))
                                for p, var in nnx.to_flat_state(state)])


def state_checksums(state: nnx.State) -> dict[str, str]:
    """`weight_delta.tensor_checksum` of every parameter `state` holds, by `tensor_name`."""
    return weight_delta.tensor_checksums(host_tensors(state))
