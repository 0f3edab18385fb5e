"""Hugging Face checkpoint import/export for the Flax Qwen-VL families (Qwen3-VL, Qwen2.5-VL).

The family comes from `config.json`'s model_type (`config.from_hf_dict`); its model class, HF tensor names
(`hf_links.Link`s) and export names come from the family registry (`families.family_model`), so nothing here
names a family. Tensor names are transformers 5's (`model.language_model.*`, `model.visual.*`); checkpoints
that use the older names (`model.layers.*`, `visual.*`: released Qwen2.5-VL, and what transformers 5 itself
saves for Qwen2.5-VL) are read through the same renaming transformers applies, and a family exports under the
names its `stored_tensor_name` gives (the older ones for Qwen2.5-VL).

Import reads `model.safetensors` or shards listed in `model.safetensors.index.json` through our own
memory-mapped safetensors reader (bf16 included, via ml_dtypes), converts torch layouts to ours with
numpy *views*, and fills an `nnx.eval_shape` model, so neither a random init nor a whole checkpoint
is ever materialised. With `shardings_for`, each tensor goes straight into its sharding through
`jax.make_array_from_callback`, which reads only the slice each device needs. A tensor may be stored in another
layout (`Link.stored_layouts`: released Qwen3-VL-MoE's transposed experts) or split into several tensors
(`Link.stored_splits`: Qwen3.5-MoE's experts one by one, as transformers saves them; joined into one host copy of
that tensor). Tensors that the family's transformers class ignores on load (`FamilyModel.ignored_checkpoint_keys`:
Qwen3.5's multi-token-prediction head `mtp.*`) are skipped and counted in the log; any other unread tensor is an
error.

Export writes HF key names and torch layouts, bf16 by default, safetensors metadata
`{"format": "pt"}`, shard by shard and tensor by tensor: a shard's header is computed from shapes
first, then each tensor is fetched, converted and appended. Peak host memory is about one HF tensor
(plus its parts, e.g. q/k/v for a fused vision qkv), not one shard.
"""


from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Container, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxrl_vlm.errors import CheckpointError
from jaxrl_vlm.models.config import ModelConfig, from_hf_dict
from jaxrl_vlm.models.families import PolicyModel, family_model
from jaxrl_vlm.models.hf_links import Link, ParamPath, SplitLayout, current_tensor_name

logger = logging.getLogger(__name__)

ShardingsFor = Callable[[tuple[str | None, ...]], jax.sharding.Sharding]

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
# Keys that transformers may leave in a checkpoint and that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")
# A directory that leaves tensors out (`to_hf(leave_out=...)`: a weight sync of a run that freezes them) lists them
# here, {"kept": [HF names]}: an engine keeps what it holds for them. SGLang's and vLLM's reloads read the tensors the
# files have and ignore this file; our engine (`engine.weights.load_params_state`) refuses any other missing tensor.
KEPT_TENSORS_FILE = "kept_tensors.json"


# ----------------------------------------------------------------------------- safetensors reading


class SafetensorsReader:
    """Lazy, memory-mapped access to the tensors of one HF checkpoint directory (single or sharded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = [single.name]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._entries: dict[str, tuple[str, dict[str, Any], int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index but missing")
            header, data_start = read_safetensors_header(file)
            for stored, entry in header.items():
                if stored == "__metadata__":
                    continue
                key = current_tensor_name(stored)
                if key in self._entries:
                    raise CheckpointError(f"{file}: tensor {key!r} also appears in {self._entries[key][0]}")
                self._entries[key] = (name, entry, data_start)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key][1]["shape"])

    def get(self, key: str) -> np.ndarray:
        """Read-only numpy view of tensor `key` (memory-mapped; nothing is read until sliced)."""
        name, entry, data_start = self._entries[key]
        if entry["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} has unsupported dtype {entry['dtype']}")
        if name not in self._maps:
            self._maps[name] = np.memmap(self.path / name, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._maps[name][data_start + begin : data_start + end]
        return raw.view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])




def kept_tensors(path: str | os.PathLike) -> frozenset[str]:
    """The HF tensors the checkpoint at `path` leaves to the engine that loads it (`KEPT_TENSORS_FILE`; none when
    it has no such file)."""
    file = Path(path) / KEPT_TENSORS_FILE
    if not file.is_file():
        return frozenset()
    try:
        kept = json.loads(file.read_text()).get("kept")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{file}: not a JSON object with a 'kept' list of tensor names ({e})") from e
    if not isinstance(kept, list) or not all(isinstance(k, str) for k in kept):
        raise CheckpointError(f"{file}: 'kept' must be a list of tensor names, got {kept!r}")
    return frozenset(kept)


def read_safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """(header dict, byte offset where tensor data starts) of a .safetensors file."""
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{file}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from e
    return header, 8 + n


# ----------------------------------------------------------------------------- the family's names


def model_class(cfg: ModelConfig) -> Callable[..., PolicyModel]:
    """The Flax model class of `cfg`'s family."""
    return family_model(cfg).model_class


def weight_links(cfg: ModelConfig) -> list[Link]:
    """Every HF tensor of the family's `...ForConditionalGeneration` and where it lives in our model."""
    return family_model(cfg).weight_links(cfg)


# ----------------------------------------------------------------------------- import


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Parse `<path>/config.json` (released `rope_scaling` or transformers-5 `rope_parameters`)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(f"{file}: missing")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from e
    try:
        return from_hf_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from e


def abstract_model(cfg: ModelConfig, **model_kwargs: Any) -> PolicyModel:
    """The model of `cfg`'s family with `ShapeDtypeStruct` leaves: shapes, dtypes and axis names, no memory."""
    cls = model_class(cfg)
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **model_kwargs))


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, from abstract shapes (nothing is allocated)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return int(sum(int(np.prod(var.get_value().shape)) for _, var in nnx.to_flat_state(state)))


def ignored_checkpoint_keys(keys: Iterable[str], cfg: ModelConfig) -> list[str]:
    """The keys among `keys` that `cfg`'s family ignores on load, as its transformers class does
    (`FamilyModel.ignored_checkpoint_keys`: e.g. Qwen3.5's multi-token-prediction head `mtp.*`)."""
    patterns = [re.compile(p) for p in family_model(cfg).ignored_checkpoint_keys]
    return sorted(k for k in keys if any(p.search(k) for p in patterns))


def _stored_split(present: Container[str], link: Link) -> SplitLayout | None:
    """The split form of `link` that the checkpoint holds (any of its tensors present), when `hf_key` is absent."""
    if link.hf_key in present:
        return None
    return next((split for split in link.stored_splits if any(k in present for k in split.keys)), None)


def read_link(reader: SafetensorsReader, link: Link) -> np.ndarray:
    """`link`'s tensor in its `hf_shape` layout, from whichever form the checkpoint stores (fused, another
    layout of the same tensor, or split into several tensors); checked by `check_checkpoint_keys` first."""
    split = _stored_split(reader, link)
    if split is None:
        return link.canonical(reader.get(link.hf_key))
    return split.join([reader.get(k) for k in split.keys])


def check_checkpoint_keys(reader: SafetensorsReader, links: list[Link], cfg: ModelConfig) -> list[str]:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped tensor; return the keys the family
    ignores (`ignored_checkpoint_keys`), which are present but not read."""
    present = set(reader.keys())
    expected: dict[str, tuple[int, ...]] = {}
    accepted: dict[str, set[tuple[int, ...]]] = {}
    for link in links:
        split = _stored_split(present, link)
        if split is None:
            expected[link.hf_key] = link.hf_shape
            accepted[link.hf_key] = {link.hf_shape, *(shape for shape, _ in link.stored_layouts)}
        else:
            for key, shape in zip(split.keys, split.shapes):
                expected[key], accepted[key] = shape, {shape}
    tolerated = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    ignored = ignored_checkpoint_keys(present - expected.keys(), cfg)
    missing = sorted(k for k in expected if k not in present)
    unexpected = sorted(
        k for k in present - set(ignored)
        if k not in expected and k not in tolerated and not k.endswith(_IGNORED_SUFFIXES)
    )
    bad_shape = sorted(
        f"{k}: checkpoint {reader.shape(k)} != expected {expected[k]}"
        for k in expected
        if k in present and reader.shape(k) not in accepted[k]
    )
    if "lm_head.weight" in present and cfg.tie_word_embeddings:
        vshape = (cfg.text.vocab_size, cfg.text.hidden_size)
        if reader.shape("lm_head.weight") != vshape:
            bad_shape.append(f"lm_head.weight: checkpoint {reader.shape('lm_head.weight')} != expected {vshape}")
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {missing}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
        if bad_shape:
            parts.append(f"mis-shaped keys ({len(bad_shape)}): {bad_shape}")
        raise CheckpointError(f"{reader.path}: checkpoint does not match its config.json; " + "; ".join(parts))
    return ignored


def from_hf(
    path: str | os.PathLike,
    *,
    param_dtype: jnp.dtype = jnp.float32,
    shardings_for: ShardingsFor | None = None,
    **model_kwargs: Any,
) -> PolicyModel:
    """Load an HF checkpoint directory into the model of its family (`families.py`: `Qwen3VL`, `Qwen25VL`, ...).

    shardings_for(logical_axis_names) -> Sharding places each parameter directly into its shards;
    without it parameters go to the default device. `model_kwargs` (compute_dtype, remat,
    attention_impl) are passed to the model class.
    """
    cfg = load_hf_config(path)
    reader = SafetensorsReader(path)
    links = weight_links(cfg)
    ignored = check_checkpoint_keys(reader, links, cfg)
    if ignored:
        logger.info("%s: ignored %d tensors that %s does not use, as transformers does (e.g. %s)", path,
                    len(ignored), type(cfg).model_type, ignored[0])
    abstract = abstract_model(cfg, param_dtype=param_dtype, **model_kwargs)
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    filled: set[ParamPath] = set()
    for link in links:
        parts = link.to_ours(read_link(reader, link))
        for our_path, part in zip(link.ours, parts):
            var = variables[our_path]
            want = tuple(var.get_value().shape)
            if tuple(part.shape) != want:
                raise CheckpointError(f"{path}: {link.hf_key} maps to shape {part.shape}, model needs {want} at {our_path}")
            var.set_value(_place(part, np_dtype, var.get_metadata().get("out_sharding"), shardings_for))
            filled.add(our_path)
    unfilled = sorted(str(p) for p in variables if p not in filled)
    if unfilled:  # a mapping bug, not a user error
        raise RuntimeError(f"parameters without an HF source: {unfilled}")
    return nnx.merge(graphdef, state)


def _place(
    part: np.ndarray,
    dtype: np.dtype,
    names: tuple[str | None, ...] | None,
    shardings_for: ShardingsFor | None,
) -> jax.Array:
    if shardings_for is None:
        return jnp.asarray(np.ascontiguousarray(part).astype(dtype, copy=False))
    sharding = shardings_for(tuple(names) if names else (None,) * part.ndim)
    return jax.make_array_from_callback(
        tuple(part.shape), sharding, lambda index: np.ascontiguousarray(part[index]).astype(dtype, copy=False)
    )


# ----------------------------------------------------------------------------- export


def _tensor_nbytes(shape: Iterable[int], dtype: np.dtype) -> int:
    return int(np.prod(tuple(shape), dtype=np.int64)) * dtype.itemsize


def _plan_shards(links: list[Link], dtype: np.dtype, max_shard_bytes: int) -> list[list[Link]]:
    shards: list[list[Link]] = [[]]
    size = 0
    for link in links:
        nbytes = _tensor_nbytes(link.hf_shape, dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(link)
        size += nbytes
    return shards


def _write_shard(
    file: Path, links: list[Link], dtype: np.dtype, fetch: Callable[[Link], np.ndarray], stored: Callable[[str], str]
) -> None:
    """Header from shapes first, then each tensor appended in order (peak memory ~ one tensor); `stored` gives
    the name a tensor has on disk."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for link in links:
        nbytes = _tensor_nbytes(link.hf_shape, dtype)
        header[stored(link.hf_key)] = {"dtype": _ST_NAMES[dtype], "shape": list(link.hf_shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as the safetensors writer does
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for link in links:
            arr = np.ascontiguousarray(fetch(link).astype(dtype, copy=False))
            if arr.shape != link.hf_shape:
                raise RuntimeError(f"{link.hf_key}: produced shape {arr.shape}, header says {link.hf_shape}")
            f.write(arr.tobytes(order="C"))
    os.replace(tmp, file)


def to_hf(
    model: PolicyModel,
    out_dir: str | os.PathLike,
    *,
    dtype: jnp.dtype = jnp.bfloat16,
    max_shard_bytes: int = 5 * 1024**3,
    copy_from: str | os.PathLike | None = None,
    untie_embeddings: bool = False,
    leave_out: Container[str] = (),
) -> Path:
    """Write `model` as an HF checkpoint directory of its family (HF names, torch layouts).

    `leave_out`: HF tensor names not written (a frozen vision tower, which the engine already holds), listed in
    `KEPT_TENSORS_FILE` so the directory says it is partial.

    `untie_embeddings`: a model with tied word embeddings is written with an explicit `lm_head.weight` (a copy of
    the embedding) and `tie_word_embeddings: false`; the same function, for an engine that cannot reload a tied
    head in place (vLLM 0.32, `rollout/vllm_client.py`).

    Shards above `max_shard_bytes` get `model-0000i-of-0000n.safetensors` + index. config.json is
    copied unchanged from `copy_from` (with its tokenizer / processor / chat-template files and
    generation_config.json) or generated (transformers-5 style). Each parameter is pulled to host
    with `np.asarray` (gathered from its shards; single-controller).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    np_dtype = np.dtype(jnp.dtype(dtype))
    if np_dtype not in _ST_NAMES:
        raise ValueError(f"cannot export dtype {np_dtype}; use one of {sorted(_ST_NAMES.values(), key=str)}")
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    links = weight_links(cfg)
    kept = sorted(link.hf_key for link in links if link.hf_key in leave_out)
    links = [link for link in links if link.hf_key not in leave_out]
    untie = untie_embeddings and cfg.tie_word_embeddings
    if untie:
        (embed,) = [link for link in links if link.hf_key.endswith("language_model.embed_tokens.weight")]
        links = [*links, dataclasses.replace(embed, hf_key="lm_head.weight")]

    def fetch(link: Link) -> np.ndarray:
        parts = [np.asarray(jax.device_get(params[p].get_value())) for p in link.ours]
        return link.to_hf(parts)

    stored = family_model(cfg).stored_tensor_name
    shards = _plan_shards(links, np_dtype, max_shard_bytes)
    if len(shards) == 1:
        _write_shard(out / "model.safetensors", shards[0], np_dtype, fetch, stored)
        stale = out / "model.safetensors.index.json"
        if stale.exists():
            stale.unlink()
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(out / name, shard, np_dtype, fetch, stored)
            for link in shard:
                weight_map[stored(link.hf_key)] = name
                total += _tensor_nbytes(link.hf_shape, np_dtype)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if kept:
        (out / KEPT_TENSORS_FILE).write_text(json.dumps({"kept": kept}, indent=1))
    elif (out / KEPT_TENSORS_FILE).exists():
        (out / KEPT_TENSORS_FILE).unlink()

    src = Path(copy_from) if copy_from is not None else None
    if src is not None:
        if not (src / "config.json").exists():
            raise CheckpointError(f"copy_from={src}: no config.json to copy")
        for item in sorted(src.iterdir()):
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and \
                    item.name not in ("model.safetensors.index.json", KEPT_TENSORS_FILE):
                shutil.copyfile(item, out / item.name)
        if untie:
            (out / "config.json").write_text(json.dumps(_untied(json.loads((src / "config.json").read_text())), indent=2))
    else:
        conf = cfg.to_hf_dict()
        conf["dtype"] = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(np_dtype, "float32")
        (out / "config.json").write_text(json.dumps(_untied(conf) if untie else conf, indent=2))
        gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)) if v is not None}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def write_tensor_subset(src: str | os.PathLike, out_dir: str | os.PathLike, keys: Container[str]) -> Path:
    """Copy the tensors `keys` (HF names) of the checkpoint at `src` (e.g. a weight-sync version) byte for byte, under
    the names they are stored by, into a partial checkpoint at `out_dir` (one shard, no config) whose
    `KEPT_TENSORS_FILE` lists every other tensor: loaded after an engine restart, it puts back what later partial
    versions leave out."""
    reader = SafetensorsReader(src)
    chosen, kept = [], []
    for file in sorted({reader._entries[k][0] for k in reader.keys()}):
        header, data_start = read_safetensors_header(reader.path / file)
        for stored, entry in header.items():
            if stored == "__metadata__":
                continue
            (chosen if current_tensor_name(stored) in keys else kept).append((stored, entry, file, data_start))
    if not chosen:
        raise ValueError(f"write_tensor_subset: none of the tensors asked for is in {src}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header_out: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for stored, entry, _, _ in chosen:
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        header_out[stored] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header_out, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for stored, entry, file, data_start in chosen:
            begin, end = entry["data_offsets"]
            with open(reader.path / file, "rb") as source:
                source.seek(data_start + begin)
                f.write(source.read(end - begin))
    (out / KEPT_TENSORS_FILE).write_text(json.dumps({"kept": sorted(current_tensor_name(k) for k, *_ in kept)},
                                                    indent=1))
    return out


def _untied(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (an HF config dict) with `tie_word_embeddings: false` at the top and in its text config."""
    out = dict(config, tie_word_embeddings=False)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = dict(out["text_config"], tie_word_embeddings=False)
    return out
