"""Multi-host (multi-process) training: `jax.distributed` setup and the few cross-process operations the
trainer needs.

The model is the multi-controller one JAX uses on GPU and TPU clusters: every process runs the same
program on its own local devices, and a global `Mesh` spans the devices of all processes. What differs
between processes is only the work that cannot be split:

* the rollout (engine, environments, HTTP) runs on process 0 only; `broadcast_samples` sends its
  `list[Sample]` to every process, so all of them build the same host batch;
* each process turns the host batch into global arrays by contributing the rows its own devices hold
  (`global_batch`, via `jax.make_array_from_process_local_data`); no process ever uploads rows that
  live on another process's devices;
* weight export gathers every tensor across processes (`gather_for_export`, a collective all processes
  call in the same order) and process 0 writes the files (`export_hf`); `barrier` keeps the others
  from running ahead (e.g. telling the engine to load files that do not exist yet);
* orbax checkpoints need nothing extra: every process calls save/restore and writes its own shards.

Configuration (`initialize_from_env_or_config`), highest precedence first:

1. explicit settings from the config (`coordinator_address`, `num_processes`, `process_id`,
   `local_device_ids`);
2. environment variables ``JAXRL_COORDINATOR`` (``host:port`` of process 0's coordinator),
   ``JAXRL_NUM_PROCESSES``, ``JAXRL_PROCESS_ID`` and optionally ``JAXRL_LOCAL_DEVICE_IDS``
   (comma-separated, e.g. ``0,1,2,3``);
3. ``JAXRL_DISTRIBUTED=auto`` (or ``auto=True``): `jax.distributed.initialize()` with no arguments, which
   detects Cloud TPU pods, SLURM (``SLURM_*``), Open MPI (``OMPI_*``) and JAX's own
   ``JAX_COORDINATOR_ADDRESS`` / ``JAX_LOCAL_DEVICE_IDS``. Opt-in, because a single-process run inside
   a SLURM allocation must not try to join a cluster;
4. nothing set: a single process; nothing is initialized.

On CPU, cross-process collectives use gloo over TCP (jax 0.10's default
``jax_cpu_collectives_implementation``), which is what `tests/test_multihost.py` runs on loopback.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.models.hf_io import to_hf
from jaxrl_vlm.sharding.layout import batch_shardings
from rollout.sample import Sample

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXRL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXRL_LOCAL_DEVICE_IDS"
ENV_MODE = "JAXRL_DISTRIBUTED"  # "auto": let jax detect the cluster; "off": never initialize

# Broadcast payloads travel in power-of-two chunks of at most this many bytes: one compiled psum per
# chunk size (a bounded set), and device memory per broadcast bounded by the chunk, not the payload.
MAX_CHUNK_BYTES = 64 * 1024 * 1024
_HEADER = struct.Struct("<4sQI")  # magic, payload bytes, crc32
_MAGIC = b"JXRL"


class DistributedConfigError(ConfigError):
    """The multi-process settings are incomplete or inconsistent; the message names the setting."""


@dataclass(frozen=True)
class DistributedSettings:
    """Resolved settings; `mode` is "explicit" (all of address/count/id known), "auto" or "single"."""

    mode: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    source: str = ""  # where the settings came from, for messages


@dataclass(frozen=True)
class ProcessInfo:
    """What this process is in the job (after initialization)."""

    process_id: int
    num_processes: int
    local_device_count: int
    global_device_count: int

    @property
    def is_main(self) -> bool:
        return self.process_id == 0


# ----------------------------------------------------------------------------- settings


def _get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _parse_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool):
        raise DistributedConfigError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        return int(str(value).strip())
    except ValueError:
        raise DistributedConfigError(f"{where}: {name} must be an integer, got {value!r}") from None


def _parse_device_ids(value: Any, name: str, where: str) -> tuple[int, ...] | None:
    if value is None or value == "" or value == []:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    ids = tuple(_parse_int(v, name, where) for v in items)
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise DistributedConfigError(f"{where}: {name} must be distinct non-negative device ids, got {value!r}")
    return ids


def _check_address(address: str, name: str, where: str) -> str:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(f"{where}: {name} must be host:port (e.g. 10.0.0.1:1234), got {address!r}")
    return str(address)


def resolve_settings(config: Any = None, environ: Mapping[str, str] | None = None) -> DistributedSettings:
    """Settings from `config` (an object or mapping with `coordinator_address`, `num_processes`,
    `process_id`, `local_device_ids`, `auto` or `distributed_auto`) over the JAXRL_* environment (see the module docstring).

    Pure: reads only its arguments (`environ` defaults to `os.environ`). A partial explicit setting
    (e.g. an address without a process id) is an error naming what is missing.
    """
    env = os.environ if environ is None else environ
    explicit = {
        "coordinator_address": _get(config, "coordinator_address"),
        "num_processes": _get(config, "num_processes"),
        "process_id": _get(config, "process_id"),
    }
    if any(v is not None for v in explicit.values()):
        where, names = "distributed config", {k: k for k in explicit}
        local_ids = _get(config, "local_device_ids")
        ids_name = "local_device_ids"
    else:
        explicit = {
            "coordinator_address": env.get(ENV_COORDINATOR) or None,
            "num_processes": env.get(ENV_NUM_PROCESSES) or None,
            "process_id": env.get(ENV_PROCESS_ID) or None,
        }
        where = "environment"
        names = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES, "process_id": ENV_PROCESS_ID}
        local_ids = env.get(ENV_LOCAL_DEVICE_IDS)
        ids_name = ENV_LOCAL_DEVICE_IDS

    if any(v is not None for v in explicit.values()):
        missing = [names[k] for k, v in explicit.items() if v is None]
        if missing:
            given = ", ".join(f"{names[k]}={v!r}" for k, v in explicit.items() if v is not None)
            raise DistributedConfigError(f"{where}: {given} given but {', '.join(missing)} missing; "
                                         "a multi-process run needs the coordinator address, the process count and this process's id")
        address = _check_address(explicit["coordinator_address"], names["coordinator_address"], where)
        num = _parse_int(explicit["num_processes"], names["num_processes"], where)
        pid = _parse_int(explicit["process_id"], names["process_id"], where)
        if num < 1:
            raise DistributedConfigError(f"{where}: {names['num_processes']} must be >= 1, got {num}")
        if not 0 <= pid < num:
            raise DistributedConfigError(f"{where}: {names['process_id']}={pid} is outside 0..{num - 1} "
                                         f"({names['num_processes']}={num})")
        return DistributedSettings("explicit", address, num, pid, _parse_device_ids(local_ids, ids_name, where), where)

    mode = str(env.get(ENV_MODE, "")).strip().lower()
    if _get(config, "auto") or _get(config, "distributed_auto") or mode == "auto":
        return DistributedSettings("auto", source=f"{ENV_MODE}=auto" if mode == "auto" else "distributed config: auto")
    if mode not in ("", "off"):
        raise DistributedConfigError(f"environment: {ENV_MODE}={env.get(ENV_MODE)!r}; use 'auto' or 'off'")
    return DistributedSettings("single", source="no multi-process settings")


# ----------------------------------------------------------------------------- initialization


def _backend_started() -> bool:
    # jax.distributed.initialize must run before the XLA backend exists; jax raises otherwise, but only
    # after it has half-configured its global state, so we check first to give an actionable message.
    # Private API; if a jax version drops it we skip the early check and jax's own RuntimeError is raised.
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def process_info() -> ProcessInfo:
    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def initialize_from_env_or_config(
    config: Any = None,
    *,
    environ: Mapping[str, str] | None = None,
    initialization_timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
) -> ProcessInfo:
    """Join the multi-process job described by `config` / the environment (module docstring), once.

    Call it first thing in the program, before any JAX computation (`jax.devices()`, `device_put`,
    `jit`): JAX fixes the device set when its backend starts. Idempotent: a second call with the
    same settings returns the current `ProcessInfo`; with different settings it raises. A single
    process (nothing configured, or `num_processes` 1) initializes nothing.

    initialization_timeout_s: how long to wait for every process to connect to the coordinator.
    heartbeat_timeout_s: after this long without a heartbeat a peer counts as dead and the job stops
    (so a crashed process does not leave the others hanging in a collective forever).
    """
    settings = resolve_settings(config, environ)
    if jax.distributed.is_initialized():
        info = process_info()
        if settings.mode == "explicit" and (settings.process_id, settings.num_processes) != (info.process_id, info.num_processes):
            raise DistributedConfigError(
                f"{settings.source}: asks for process {settings.process_id} of {settings.num_processes}, but jax.distributed "
                f"is already initialized as process {info.process_id} of {info.num_processes}"
            )
        return info
    if settings.mode == "single" or (settings.mode == "explicit" and settings.num_processes == 1):
        return process_info()
    if _backend_started():
        raise DistributedConfigError(
            f"{settings.source}: multi-process settings found, but JAX's backend has already started in this process "
            "(something called jax.devices(), device_put or a jitted function first); call "
            "jaxrl_vlm.distributed.initialize_from_env_or_config() at the very start of the program"
        )
    if settings.mode == "auto":
        logger.info("jax.distributed.initialize(): auto-detecting the cluster (%s)", settings.source)
        jax.distributed.initialize(initialization_timeout=initialization_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
    else:
        logger.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d) from %s", settings.coordinator_address,
                    settings.num_processes, settings.process_id, settings.source)
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
            initialization_timeout=initialization_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    info = process_info()
    logger.info("process %d of %d: %d local / %d global devices", info.process_id, info.num_processes,
                info.local_device_count, info.global_device_count)
    return info


def is_main_process() -> bool:
    """True on process 0: the one that runs the rollout, writes exports and logs."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Block until every process reached the barrier `name` (no-op with one process).

    All processes must pass the same name at the same point; a mismatch raises instead of hanging.
    A dead peer ends the job through the distributed runtime's heartbeat timeout.
    """
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- broadcast


def _chunk_bytes(n: int, max_chunk: int) -> int:
    return max(8, min(max_chunk, 1 << max(0, n - 1).bit_length()))


def broadcast_bytes(payload: bytes | None, *, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> bytes:
    """Process 0's `payload` on every process (others pass None). A collective: all processes call it.

    The bytes travel as uint8 arrays through `multihost_utils.broadcast_one_to_all` (a psum in which
    only process 0 contributes non-zeros, so the sum is exact). A fixed-size header (length + crc32)
    goes first so the others know how many chunks follow; the crc is checked on arrival.
    """
    if jax.process_count() == 1:
        if payload is None:
            raise ValueError("broadcast_bytes: the single process is the source and must pass a payload")
        return payload
    source = jax.process_index() == 0
    if source and payload is None:
        raise ValueError("broadcast_bytes: process 0 is the source and must pass a payload")
    if not source and payload is not None:
        raise ValueError(f"broadcast_bytes: process {jax.process_index()} must pass None (only process 0 sends)")
    header = _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) if source else bytes(_HEADER.size)
    got = bytes(np.asarray(multihost_utils.broadcast_one_to_all(np.frombuffer(header, np.uint8))))
    magic, size, crc = _HEADER.unpack(got)
    if magic != _MAGIC:
        raise RuntimeError(f"broadcast_bytes: bad header {got!r} on process {jax.process_index()}; "
                           "processes called cross-process operations in different orders")
    chunk = _chunk_bytes(size, max_chunk_bytes)
    out = bytearray()
    for start in range(0, size, chunk):
        piece = np.zeros(chunk, np.uint8)
        if source:
            part = np.frombuffer(payload, np.uint8, count=min(chunk, size - start), offset=start)
            piece[: part.size] = part
        received = np.asarray(multihost_utils.broadcast_one_to_all(piece))
        out += received[: min(chunk, size - start)].tobytes()
    if len(out) != size or zlib.crc32(out) != crc:
        raise RuntimeError(f"broadcast_bytes: process {jax.process_index()} received {len(out)} bytes with a bad "
                           f"checksum (expected {size} bytes, crc {crc:#010x})")
    return bytes(out)


def broadcast_stop(reason: str | None) -> str | None:
    """Process 0's decision to stop the run (a reason, or None to go on) on every process, so that no process is
    left waiting in the next collective. A collective: all processes call it; only process 0's argument counts."""
    main = jax.process_index() == 0
    payload = (reason or "").encode() if main else None
    got = broadcast_bytes(payload).decode()
    return got or None


def _pickle_samples(samples: list[Any]) -> bytes:
    try:
        return pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        for i, s in enumerate(samples):
            for f in fields(s):
                try:
                    pickle.dumps(getattr(s, f.name), protocol=pickle.HIGHEST_PROTOCOL)
                except (pickle.PicklingError, TypeError, AttributeError) as inner:
                    raise TypeError(f"sample {i} (group {s.group_index}, index {s.index}): field {f.name!r} cannot be "
                                    f"serialized for the cross-process broadcast: {inner}") from e
        raise TypeError(f"samples cannot be serialized for the cross-process broadcast: {e}") from e


def broadcast_samples(samples: list[Any] | None) -> list[Any]:
    """Process 0's rollout result (`list[Sample]`) on every process; the others pass None.

    Serialized with pickle, as `torch.distributed.broadcast_object_list` does: the payload goes from one
    process of this job to its peers, which run the same code, so it crosses no trust boundary (never
    use it to read data from elsewhere). Images travel as the samples hold them (pixel arrays in
    `multimodal_train_inputs` plus PNG data URLs).
    """
    if samples is not None:
        bad = [i for i, s in enumerate(samples) if not isinstance(s, Sample)]
        if bad:
            raise TypeError(f"broadcast_samples: items {bad[:5]} are not rollout.sample.Sample")
    if jax.process_count() == 1:
        if samples is None:
            raise ValueError("broadcast_samples: the single process is the source and must pass its samples")
        return list(samples)
    payload = _pickle_samples(list(samples)) if samples is not None else None
    received = pickle.loads(broadcast_bytes(payload))  # noqa: S301 - from process 0 of this job (see docstring)
    if not isinstance(received, list) or not all(isinstance(s, Sample) for s in received):
        raise RuntimeError("broadcast_samples: the payload from process 0 is not a list[Sample]")
    return received


# ----------------------------------------------------------------------------- global arrays


def process_local_index(sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> tuple[np.ndarray | slice, ...]:
    """Per dimension, the global indices of the elements this process's devices hold, in the order
    `jax.make_array_from_process_local_data` expects them (its shards' blocks by increasing start).

    `slice(None)` where the process holds the whole dimension; an index array otherwise (several
    blocks when the process's devices are not neighbours along that dimension).
    """
    shape = tuple(int(d) for d in global_shape)
    starts: list[set[int]] = [set() for _ in shape]
    block = [d for d in shape]
    for index in sharding.addressable_devices_indices_map(shape).values():
        for d, sl in enumerate(index):
            start, stop, _ = sl.indices(shape[d])
            starts[d].add(start)
            block[d] = stop - start
    out: list[np.ndarray | slice] = []
    for d, size in enumerate(shape):
        ordered = sorted(starts[d])
        if len(ordered) * block[d] == size:
            out.append(slice(None))
        else:
            out.append(np.concatenate([np.arange(s, s + block[d]) for s in ordered]))
    return tuple(out)


def process_local_data(x: np.ndarray, sharding: jax.sharding.Sharding) -> np.ndarray:
    """The part of the host array `x` (the full global value) that this process's devices hold."""
    x = np.asarray(x)
    for d, idx in enumerate(process_local_index(sharding, x.shape)):
        if not isinstance(idx, slice):
            x = np.take(x, idx, axis=d)
    return x


def global_batch(train_arrays: Any, mesh: Mesh, shardings: Any = None, rules: Any = None) -> Any:
    """Global `jax.Array`s of a host batch pytree (`batching.TrainArrays`) on a mesh spanning all processes.

    Every process holds the same host batch (built from the broadcast samples) and contributes only the
    rows its own devices hold, through `jax.make_array_from_process_local_data`; replicated leaves
    (vision patches, micro-batch-level arrays) are contributed whole. `shardings` defaults to
    `sharding.layout.batch_shardings(train_arrays, mesh, rules)` (rows over the batch axes). With one process
    this is a plain `device_put`.
    """
    if shardings is None:
        shardings = batch_shardings(train_arrays, mesh, rules)

    def one(sharding: NamedSharding, x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, process_local_data(x, sharding), x.shape)

    return jax.tree.map(one, shardings, train_arrays)


# ----------------------------------------------------------------------------- export


def gather_for_export(x: Any) -> np.ndarray:
    """The full value of `x` as a host numpy array, on every process.

    For an array spread over several processes this is a collective (`process_allgather`): every
    process must call it for the same arrays in the same order. Arrays this process holds entirely
    (one process, or replicated) are read locally without communication.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def gather_tree(tree: Any) -> Any:
    """`gather_for_export` of every leaf (all processes call it; leaves in pytree order)."""
    return jax.tree.map(gather_for_export, tree)


def export_hf(model: Any, out_dir: str | os.PathLike, **to_hf_kwargs: Any) -> Path:
    """`models.hf_io.to_hf` for a model sharded over several processes. A collective: all processes call it.

    Every parameter is gathered (tensor by tensor, all processes in the same order); process 0 writes
    the HF directory and the others wait at a barrier until it is complete. Process 0 holds one full
    host copy of the parameters while writing (params bytes of host RAM). With one process this is
    `to_hf`.
    """
    if jax.process_count() == 1:
        return to_hf(model, out_dir, **to_hf_kwargs)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    host = gather_tree(params)
    out = Path(out_dir)
    if is_main_process():
        to_hf(nnx.merge(graphdef, host, rest), out, **to_hf_kwargs)
    barrier(f"jaxrl_vlm.export_hf:{out}")
    return out
