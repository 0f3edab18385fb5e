"""vLLM worker extension: applies the trainer's weight deltas inside vLLM's workers, bit-exactly.

vLLM loads it itself, in its own interpreter: `--worker-extension-cls jaxrl_vlm_worker.WeightDeltaExtension`, with
this file's directory on the server's PYTHONPATH (`jaxrl_vlm.vllm_launcher` passes both). So it imports numpy,
safetensors, torch and vLLM only, never the project: the delta format (`jaxrl-vlm.weight-delta.v1`, specified in
`jaxrl_vlm/weight_delta.py`'s docstring) is read here a second time, compact features included ("u8-gaps",
"byte-planes"; a delta that needs any other is refused), and a test applies deltas written by `weight_delta.py` with
both readers and compares the bytes (tests/test_vllm_delta_worker.py).

vLLM mixes the class into its worker class; the trainer calls its methods by name through the dev-mode route
`POST /collective_rpc {"method": M, "kwargs": {...}}`, which answers `{"results": [one answer per worker]}`:
- `jaxrl_vlm_delta_state()` -> `{"format", "version", "tensors"}`; `version` is null until a delta was applied, so a
  restarted server (or one whose last load failed) is told apart from one that holds the delta's base.
- `jaxrl_vlm_apply_delta(path)` -> `{"ok": true, "version", "loaded", "changed", "completed", "seconds"}`, or
  `{"ok": false, "error": "BaseMismatch" | "MalformedDelta" | "ChecksumMismatch", "message"}` with nothing changed.
- `jaxrl_vlm_checksums(recompute=False)` -> `{"version", "checksums": {HF name: sha256 hex of its full bytes}}`.

Each worker keeps a host copy of every HF-named tensor it last received, as raw bits in the sync dtype (not read
back from the model: vLLM's CPU linear layers keep only a repacked copy of their weight). A delta is applied to that
copy off to the side and every changed tensor is checked against its manifest checksum before the model is touched.
The changed tensors then go through the model's own `load_weights` under vLLM's in-place (layerwise) reload, in HF
names: vLLM fuses q/k/v and gate/up itself. That reload re-creates a layer empty before loading it, so every HF tensor
of a layer goes with any changed one (grouped by the model's `packed_modules_mapping`), and a layer the grouping left
incomplete is completed from the host copy before the reload is finalised.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

FORMAT = "jaxrl-vlm.weight-delta.v1"
CHECKSUM = "sha256"
MANIFEST_NAME = "manifest.json"
# The RPC method names (rollout/vllm_wire.py names the same; a test checks they agree).
STATE_METHOD = "jaxrl_vlm_delta_state"
APPLY_METHOD = "jaxrl_vlm_apply_delta"
CHECKSUMS_METHOD = "jaxrl_vlm_checksums"

# Element width in bytes of each safetensors dtype name a delta may carry; the raw bits travel as unsigned integers
# of that width.
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
            "U16": 2, "U8": 1, "BOOL": 1}
_UINT = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_INT = {1: np.dtype(np.int8), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
_INDEX = {"U8": np.dtype(np.uint8), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8")}
# The compact features of the format this reader applies: 8-bit gaps (with filler positions, whose value is the
# base's own) and per-byte planes.
FEATURES = frozenset({"u8-gaps", "byte-planes"})

logger = logging.getLogger("jaxrl_vlm_worker")


class DeltaError(ValueError):
    """A delta that cannot be applied to the bytes held (`kind` is weight_delta's exception name)."""

    kind = "MalformedDelta"


class BaseMismatch(DeltaError):
    kind = "BaseMismatch"


class MalformedDelta(DeltaError):
    kind = "MalformedDelta"


class ChecksumMismatch(DeltaError):
    kind = "ChecksumMismatch"


def checksum(bits: np.ndarray) -> str:
    """sha256 of a tensor's C-order little-endian bytes (its raw bits, `_UINT` arrays)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(bits).view(np.uint8))).hexdigest()


def read_manifest(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, MANIFEST_NAME)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise MalformedDelta(f"{directory}: no readable {MANIFEST_NAME} ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("checksum") != CHECKSUM:
        raise MalformedDelta(f"{directory}: not a {FORMAT} delta with {CHECKSUM} checksums")
    unknown = sorted(set(manifest.get("features") or ()) - FEATURES)
    if unknown:  # a feature this reader lacks: refused, so the trainer sends a full sync
        raise MalformedDelta(f"{directory}: needs the features {unknown}, which this reader lacks")
    encodings = ("unchanged", "sparse", "dense", *(("planes",) if "byte-planes" in manifest.get("features", ()) else ()))
    for t in manifest.get("tensors", ()):
        if t.get("dtype") not in ITEMSIZE or t.get("encoding") not in encodings:
            raise MalformedDelta(f"{directory}: tensor {t.get('name')!r} has dtype {t.get('dtype')!r}, encoding "
                                 f"{t.get('encoding')!r}")
    return manifest


def decode_delta(directory: str, held: dict[str, np.ndarray], meta: dict[str, tuple[str, tuple[int, ...]]],
                 version: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The delta at `directory` applied to `held` (name -> flat raw bits; `meta`: name -> (dtype, shape)) at weight
    `version`: (its manifest, name -> new flat raw bits of every tensor it writes). `held` is not modified; every
    returned tensor matches its manifest checksum, else a DeltaError is raised before anything is returned."""
    manifest = read_manifest(directory)
    base = manifest.get("base_version")
    records = {t["name"]: t for t in manifest["tensors"]}
    if base is not None:
        if str(base) != version:
            raise BaseMismatch(f"delta to version {manifest['target_version']} applies to version {base}; this "
                               f"worker holds version {version}")
        if set(records) != set(held):
            missing, extra = sorted(set(held) - set(records)), sorted(set(records) - set(held))
            raise BaseMismatch(f"the delta's tensors are not this worker's: missing {missing[:3]}, new {extra[:3]}")
        for name, t in records.items():
            if (t["dtype"], tuple(t["shape"])) != meta[name]:
                raise BaseMismatch(f"tensor {name!r} is {meta[name]} here, {t['dtype']} {t['shape']} in the delta")
    u8_gaps = "u8-gaps" in manifest.get("features", ())
    new: dict[str, np.ndarray] = {}
    last: dict[tuple[str, int | None], int] = {}  # last written position per (tensor, byte plane): chunks increase
    for bucket in manifest["buckets"]:
        path = os.path.join(directory, bucket["file"])
        if os.path.basename(bucket["file"]) != bucket["file"]:
            raise MalformedDelta(f"{directory}: bucket file {bucket['file']!r} is not inside the delta")
        try:
            with safetensors.safe_open(path, framework="numpy") as f:
                if (f.metadata() or {}).get("target_version") != str(manifest["target_version"]):
                    raise MalformedDelta(f"{path}: a bucket of another delta")
                arrays = {key: f.get_tensor(key) for key in f.keys()}
        except DeltaError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a missing or corrupt file
            raise MalformedDelta(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        for k, chunk in enumerate(bucket["chunks"]):
            name, start, count, index = chunk["tensor"], int(chunk["start"]), int(chunk["count"]), chunk["index_dtype"]
            t = records.get(name)
            if t is None or t["encoding"] == "unchanged":
                raise MalformedDelta(f"{path}: chunk {k} of {name!r}, which the delta does not change")
            size = int(np.prod(t["shape"], dtype=np.int64))
            width = _UINT[ITEMSIZE[t["dtype"]]]
            if name not in new:
                if t["encoding"] == "dense":
                    new[name] = np.empty(size, width)
                else:
                    if name not in held:
                        raise BaseMismatch(f"tensor {name!r} of the delta is not held by this worker")
                    new[name] = held[name].copy()
            plane = chunk.get("plane")
            if (plane is None) == (t["encoding"] == "planes") or (plane is not None and plane not in range(width.itemsize)):
                raise MalformedDelta(f"{path}: chunk {k} of {name!r} ({t['encoding']}) has byte plane {plane!r}")
            values = arrays.get(f"{k}.values")
            value_dtype = width if plane is None else np.dtype(np.uint8)
            if values is None or values.dtype != value_dtype or values.shape != (count,):
                raise MalformedDelta(f"{path}: chunk {k} of {name!r} lacks {count} {value_dtype} values")
            # A byte plane writes byte `plane` of each listed element (little-endian), the others stay the base's.
            target = new[name] if plane is None else new[name].view(np.uint8).reshape(size, width.itemsize)[:, plane]
            prev = last.get((name, plane), -1)
            if index is None:
                if t["encoding"] != "dense" or start != prev + 1 or start + count > size:
                    raise MalformedDelta(f"{path}: dense chunk [{start}, {start + count}) of {name!r} after {prev}")
                target[start:start + count] = values
                last[(name, plane)] = start + count - 1
                continue
            gaps = arrays.get(f"{k}.gaps")
            if t["encoding"] not in ("sparse", "planes") or index not in _INDEX or (index == "U8" and not u8_gaps) \
                    or gaps is None or gaps.dtype != _INDEX[index] or gaps.shape != (count,):
                raise MalformedDelta(f"{path}: sparse chunk {k} of {name!r} lacks its {index} gaps")
            if start != max(prev, 0) or (prev >= 0 and gaps[0] == 0) or (count > 1 and gaps[1:].min() == 0):
                raise MalformedDelta(f"{path}: positions of {name!r} are not increasing (chunk start {start})")
            positions = np.uint64(start) + np.cumsum(gaps, dtype=np.uint64)
            if int(positions[-1]) >= size:
                raise MalformedDelta(f"{path}: position {int(positions[-1])} of {name!r} past its {size} elements")
            target[positions.astype(np.intp)] = values
            last[(name, plane)] = int(positions[-1])
    for name, t in records.items():
        written = name in new
        if written != (t["encoding"] != "unchanged"):
            raise MalformedDelta(f"tensor {name!r} ({t['encoding']}) has {'' if written else 'no '}chunks")
        if t["encoding"] == "dense" and last[(name, None)] != int(np.prod(t["shape"], dtype=np.int64)) - 1:
            raise MalformedDelta(f"dense tensor {name!r}: its chunks stop at position {last[name]}")
    wrong = [name for name, bits in new.items() if checksum(bits) != records[name]["checksum"]]
    if wrong:
        raise ChecksumMismatch(f"delta to version {manifest['target_version']}: {len(wrong)} tensor(s) differ from "
                               f"the trainer's bytes after the apply, e.g. {wrong[:3]}")
    return manifest, new


def layer_groups(names: list[str], packed: dict[str, list[str]]) -> dict[str, list[str]]:
    """HF tensor names grouped by the vLLM layer that loads them: a module's weight and bias together, q/k/v and
    gate/up under their fused module (`packed`: the model's `packed_modules_mapping`, e.g. {"qkv_proj": ["q_proj",
    "k_proj", "v_proj"]}), and all experts of an MoE block (one fused layer holds them all)."""
    fused = {member: name for name, members in packed.items() for member in members}
    groups: dict[str, list[str]] = {}
    for name in names:
        module = name.rpartition(".")[0]
        head, _, last = module.rpartition(".")
        key = f"{head}.{fused[last]}" if last in fused else module
        if ".experts." in key:
            key = key.split(".experts.")[0] + ".experts"
        groups.setdefault(key, []).append(name)
    return groups


def as_torch(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    """The torch tensor of raw bits (a view, no copy): through the signed integer of the same width, since torch's
    unsigned 16/32/64-bit support is limited, then viewed as the tensor's dtype."""
    import torch  # vLLM's interpreter always has it; the project's tests load this module without needing it

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
    if dtype not in dtypes:
        raise MalformedDelta(f"dtype {dtype} cannot be loaded into a torch model")
    signed = bits.view(_INT[ITEMSIZE[dtype]]) if dtype not in ("U8", "BOOL") else bits
    return torch.from_numpy(signed).view(dtypes[dtype]).reshape(shape)


class _State:
    """One worker's host copy of the HF tensors it last loaded (flat raw bits), their checksums, and its version."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.tensors: dict[str, np.ndarray] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.checksums: dict[str, str] = {}


class WeightDeltaExtension:
    """Mixed into vLLM's worker class (no `__init__`: the worker's runs); state lives on `_jaxrl_vlm_state`."""

    def _jaxrl_vlm(self) -> _State:
        state = self.__dict__.get("_jaxrl_vlm_state")
        if state is None:
            state = self.__dict__["_jaxrl_vlm_state"] = _State()
        return state

    def jaxrl_vlm_delta_state(self) -> dict[str, Any]:
        state = self._jaxrl_vlm()
        return {"format": FORMAT, "version": state.version, "tensors": len(state.tensors)}

    def jaxrl_vlm_checksums(self, recompute: Any = False) -> dict[str, Any]:
        """The checksum of every tensor held; `recompute` hashes the bytes again instead of answering the checksums
        verified when they were applied."""
        state = self._jaxrl_vlm()
        if recompute not in (False, None, "", "0", "false", "False"):
            state.checksums = {name: checksum(bits) for name, bits in state.tensors.items()}
        return {"version": state.version, "checksums": dict(state.checksums)}

    def jaxrl_vlm_apply_delta(self, path: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        state = self._jaxrl_vlm()
        try:
            manifest, new = decode_delta(str(path), state.tensors, state.meta, state.version)
        except DeltaError as e:
            return {"ok": False, "error": e.kind, "message": str(e)}
        records = manifest["tensors"]
        full = manifest.get("base_version") is None
        tensors = dict(new) if full else {**state.tensors, **new}
        meta = {t["name"]: (t["dtype"], tuple(t["shape"])) for t in records}
        model = self.model_runner.get_model()
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        order = [t["name"] for t in records]
        if full:
            load = order
        else:
            groups = layer_groups(order, packed)
            touched = {key for key, names in groups.items() if any(n in new for n in names)}
            load = [n for key, names in groups.items() if key in touched for n in names]
        # Until the model holds the new bytes, this worker holds no known version (a failed load leaves a mix).
        state.version = None
        completed = self._jaxrl_vlm_load(model, tensors, meta, load, [n for n in order if n not in set(load)])
        state.tensors, state.meta = tensors, meta
        checksums = {t["name"]: t["checksum"] for t in records}
        state.checksums = checksums if full else {**state.checksums, **{n: checksums[n] for n in new}}
        state.version = str(manifest["target_version"])
        return {"ok": True, "version": state.version, "loaded": len(load) + completed, "changed": len(new),
                "completed": completed, "seconds": time.perf_counter() - t0}

    def _jaxrl_vlm_load(self, model: Any, tensors: dict[str, np.ndarray], meta: dict[str, tuple[str, tuple[int, ...]]],
                        load: list[str], rest: list[str]) -> int:
        """Load `load` into the model under vLLM's in-place reload (the steps of `reload_weights`, vLLM 0.32), then
        `rest` too if a layer is still incomplete. Returns how many tensors of `rest` that took."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        def weights(names: list[str]):
            return ((name, as_torch(tensors[name], *meta[name])) for name in names)

        if not load:
            return 0
        completed = 0
        # The reload warns "Failed to load weights" for every layer given no tensor: here, every unchanged layer,
        # which keeps what it holds (vLLM puts its tensors back), as intended.
        layerwise_log = logging.getLogger(finalize_layerwise_reload.__module__)
        level = layerwise_log.level
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(weights(load))
            partial = [type(layer).__name__ for layer in model.modules()
                       if (info := LAYERWISE_INFO.get(layer)) is not None and info.load_numel_total is not None
                       and 0 < info.load_numel < info.load_numel_total]
            if partial and rest:
                logger.warning("jaxrl_vlm delta: %d layer(s) (%s) have tensors outside the changed groups; loading "
                               "the %d unchanged tensors too", len(partial), sorted(set(partial))[:3], len(rest))
                model.load_weights(weights(rest))
                completed = len(rest)
            layerwise_log.setLevel(logging.ERROR)
            try:
                finalize_layerwise_reload(model, self.vllm_config.model_config)
            finally:
                layerwise_log.setLevel(level)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return completed
