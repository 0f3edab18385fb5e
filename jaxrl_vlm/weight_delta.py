"""Bit-exact weight deltas: what changed between the bytes an engine holds and the trainer's next version.

Pure numpy (plus safetensors for files, hashlib for checksums): no jax, no torch, so an engine's own process (a
vLLM worker extension with torch and safetensors only) can apply the same payload by reading this docstring.

How a delta is made (`encode_delta`)
- The trainer keeps a `WeightSnapshot` per engine: the bytes that engine last received, per tensor name, in the
  ENGINE's dtype and layout (bf16 weights as bf16, not the trainer's f32). Bytes, never numbers: a delta written
  from them makes the engine hold exactly the trainer's bytes, so nothing drifts and no periodic full resync is due.
- Each tensor is compared as unsigned integers of its element width (uint16 for bf16/f16, uint32 for f32, ...):
  no arithmetic, so -0.0 vs 0.0 and NaN payloads count as changes like any other bit.
- A tensor is `unchanged`, `sparse` (changed positions and their new elements) or `dense` (every element, when
  that is fewer bytes than sparse: past roughly itemsize/(itemsize+2) of it changed), or with `compact`, `planes`
  (below). A delta without a base (`base=None`: a full sync in the same format) is dense throughout.
- Its payload is cut into chunks grouped in buckets of at most `bucket_bytes` (gaps + values): a huge tensor
  spans several buckets, many small ones share one.

Wire format (version `FORMAT`), a directory (`save_delta` / `load_delta`):
- `manifest.json`, the `DeltaManifest` as JSON:
      {"format": "jaxrl-vlm.weight-delta.v1", "base_version": "3" | null, "target_version": "4",
       "checksum": "sha256", "features": [],
       "tensors": [{"name", "dtype": "BF16", "shape": [..], "encoding": "unchanged|sparse|dense|planes",
                    "changed": <changed elements>, "checksum": <hex of the FULL tensor after the apply>}, ...],
       "buckets": [{"file": "bucket-00000.safetensors", "nbytes": <gaps+values bytes>,
                    "chunks": [{"tensor", "start", "count", "index_dtype": "U16|U32|U64" | null,
                                ("plane": p)}, ...]}, ...]}
  `tensors` lists EVERY tensor of the model (the engine's complete set), in one fixed order. dtype names are
  safetensors'. A tensor's checksum is sha256 over its C-order little-endian bytes (a bf16 [2, 3] tensor: 12 bytes).
- `bucket-NNNNN.safetensors`: chunk k of the bucket is the arrays `"{k}.values"` and, for a sparse chunk,
  `"{k}.gaps"`; its `__metadata__` repeats `format` and `target_version` (a bucket of another delta is refused).
  * values: the chunk's new elements as raw bits, an unsigned integer array of the tensor's element width
    (U16 for BF16/F16/I16, U32 for F32/I32, U64 for F64/I64, U8 for 1-byte types); view it as the tensor's dtype.
  * sparse chunk: `gaps` (U16 where every gap fits, else U32, else U64: chosen per chunk, `index_dtype` says which)
    give the flat C-order positions `start + cumsum(gaps)`; `start` is 0 for a tensor's first chunk (so its first
    gap is the first position itself) and the previous chunk's last position after that (so every gap is >= 1).
    Element i of `values` goes to flat position i.
  * dense chunk (`index_dtype` null, no gaps): `values` are the elements of flat positions [start, start + count).
  The chunks of one tensor come in increasing position order; a dense tensor's chunks cover all of it.

Compact features (`encode_delta(..., compact=True)`; the manifest lists those it uses in `"features"`, and a reader
refuses a delta that needs one it lacks, so it falls back to a full sync rather than misread one):
- "u8-gaps": `index_dtype` may also be "U8", and a sparse stream may list unchanged positions (fillers: their value
  is the base's own, so writing it changes nothing): the encoder bridges a gap over 255 by fillers 255 apart, or
  gives a gap too wide to bridge cheaply a one-element chunk of a wider index dtype.
- "byte-planes": a tensor's `encoding` may be "planes": each byte of its elements (plane p: byte p of the
  little-endian element) is its own sparse stream. Its chunks carry `"plane": p`; their values are U8 (the new
  byte p of each listed element, whose other bytes are the base's); gaps, `start` and the increasing order hold per
  plane (the first chunk of each plane starts at 0). Chosen per tensor where it is the fewest bytes: between two RL
  steps a bf16 weight mostly moves by an ulp or so, a change confined to its low byte, so a changed element costs
  1 byte of value, not 2. Where `"plane"` is absent (or null) a chunk holds whole elements, as above.

Applying (`apply_delta`) needs the bytes of the base version (of the sparse and planes tensors only) and returns the
new bytes of every tensor the delta changes, each checked against its manifest checksum; it raises a `WeightDeltaError`
(`BaseMismatch`, `MalformedDelta`, `ChecksumMismatch`) before anything is returned, so the holder's bytes stay as
they were and the caller falls back to a full sync. The holder then answers `tensor_checksums` of what it holds,
and the trainer compares them with the manifest before it advances its snapshot (`WeightSnapshot.after`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.numpy

FORMAT = "jaxrl-vlm.weight-delta.v1"
CHECKSUM = "sha256"
MANIFEST_NAME = "manifest.json"
DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 16  # one element of the widest type with its widest gap

# safetensors' dtype names of the tensors a delta may carry.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
# The unsigned integer type of each element width: what is compared, and how values travel.
_UINT = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_INDEX_DTYPES = {"U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32),
                 "U64": np.dtype(np.uint64)}
_V1_INDEX = ("U16", "U32", "U64")  # the index dtypes of a delta without the "u8-gaps" feature
U8_GAPS = "u8-gaps"
BYTE_PLANES = "byte-planes"
FEATURES = (U8_GAPS, BYTE_PLANES)  # what this module reads and, with `compact`, writes
CHUNK_RECORD_BYTES = 100  # about what one chunk's entry adds to the manifest (JSON)


class WeightDeltaError(ValueError):
    """A delta that cannot be applied to these bytes. Nothing was changed: send a full sync instead."""


class BaseMismatch(WeightDeltaError):
    """The holder's bytes are not the delta's base: another version, or tensors of other names, dtypes or shapes."""


class MalformedDelta(WeightDeltaError):
    """The delta itself is inconsistent (a manifest that does not describe its arrays, positions out of range)."""


class ChecksumMismatch(WeightDeltaError):
    """The bytes after the apply are not the trainer's (a corrupt payload or a base that was not what it claimed)."""

    def __init__(self, message: str, tensors: tuple[str, ...]):
        super().__init__(message)
        self.tensors = tensors


class Encoding(str, Enum):
    UNCHANGED = "unchanged"
    SPARSE = "sparse"  # changed positions (gap-encoded) and their new elements
    DENSE = "dense"  # every element (cheaper than sparse, or no base)
    PLANES = "planes"  # per byte of the elements: changed positions and their new bytes ("byte-planes")


def dtype_name(dtype: np.dtype) -> str:
    """safetensors' name of a numpy dtype (ml_dtypes' bfloat16 is "BF16")."""
    try:
        return _DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no weight-delta encoding (supported: {sorted(DTYPES)})") from None


def tensor_checksum(array: np.ndarray) -> str:
    """sha256 (hex) of the array's C-order little-endian bytes: the manifest's per-tensor checksum."""
    data = np.ascontiguousarray(array)
    if data.dtype.byteorder == ">" or (data.dtype.byteorder == "=" and sys.byteorder != "little"):
        data = data.astype(data.dtype.newbyteorder("<"))
    return hashlib.sha256(memoryview(data.reshape(-1).view(np.uint8))).hexdigest()


def tensor_checksums(tensors: Mapping[str, np.ndarray]) -> dict[str, str]:
    return {name: tensor_checksum(array) for name, array in tensors.items()}


def _bits(array: np.ndarray) -> np.ndarray:
    """The flat C-order elements of `array` as unsigned integers of their width (a view where possible)."""
    data = np.ascontiguousarray(array).reshape(-1)
    return data.view(_UINT[data.dtype.itemsize])


# ---------------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str  # safetensors' name (DTYPES)
    shape: tuple[int, ...]
    encoding: Encoding
    changed: int  # elements whose bytes differ from the base (all of them without a base)
    checksum: str  # of the full tensor after the apply

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class ChunkRecord:
    tensor: str
    start: int  # sparse: positions are start + cumsum(gaps); dense: the first position
    count: int  # elements in the chunk
    index_dtype: str | None  # "U8" | "U16" | "U32" | "U64" for a sparse chunk, None for a dense one
    plane: int | None = None  # "byte-planes": the chunk holds byte `plane` of its elements (None: whole elements)


@dataclass(frozen=True)
class BucketRecord:
    file: str
    nbytes: int  # gaps + values
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class DeltaManifest:
    base_version: str | None  # None: a full sync (every tensor dense)
    target_version: str
    tensors: tuple[TensorRecord, ...]
    buckets: tuple[BucketRecord, ...]
    format: str = FORMAT
    checksum: str = CHECKSUM
    features: tuple[str, ...] = ()  # compact features the delta uses (a reader refuses one it lacks)

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        for bucket in raw["buckets"]:  # a v1 reader's chunks: no "plane" key unless the chunk is a plane's
            for chunk in bucket["chunks"]:
                if chunk["plane"] is None:
                    del chunk["plane"]
        return json.dumps(raw, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> DeltaManifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("checksum") != CHECKSUM:
                raise MalformedDelta(f"a {raw.get('format')!r} delta with {raw.get('checksum')!r} checksums; this "
                                     f"reader takes {FORMAT!r} with {CHECKSUM!r}")
            tensors = tuple(TensorRecord(name=t["name"], dtype=t["dtype"], shape=tuple(int(d) for d in t["shape"]),
                                         encoding=Encoding(t["encoding"]), changed=int(t["changed"]),
                                         checksum=str(t["checksum"])) for t in raw["tensors"])
            buckets = tuple(BucketRecord(file=str(b["file"]), nbytes=int(b["nbytes"]), chunks=tuple(
                ChunkRecord(tensor=c["tensor"], start=int(c["start"]), count=int(c["count"]),
                            index_dtype=c["index_dtype"], plane=None if c.get("plane") is None else int(c["plane"]))
                for c in b["chunks"])) for b in raw["buckets"])
            base = raw["base_version"]
            manifest = cls(base_version=None if base is None else str(base), target_version=str(raw["target_version"]),
                           tensors=tensors, buckets=buckets, features=tuple(str(f) for f in raw.get("features", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, WeightDeltaError):
                raise
            raise MalformedDelta(f"not a weight-delta manifest: {type(e).__name__}: {e}") from e
        manifest.check()
        return manifest

    def check(self) -> None:
        """Raise MalformedDelta unless the records agree with each other (names, dtypes, chunk coverage) and every
        feature they use is declared, and one this reader has."""
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            raise MalformedDelta(f"the delta needs features {unknown}, which this reader lacks (it has "
                                 f"{list(FEATURES)})")
        records = {t.name: t for t in self.tensors}
        if len(records) != len(self.tensors):
            raise MalformedDelta("a tensor is listed twice in the manifest")
        covered = dict.fromkeys(records, 0)
        for t in self.tensors:
            if t.dtype not in DTYPES:
                raise MalformedDelta(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
            if not 0 <= t.changed <= t.size:
                raise MalformedDelta(f"tensor {t.name!r}: {t.changed} changed elements of {t.size}")
            if self.base_version is None and t.encoding is not Encoding.DENSE:
                raise MalformedDelta(f"tensor {t.name!r} is {t.encoding.value} in a delta without a base")
            if t.encoding is Encoding.PLANES and BYTE_PLANES not in self.features:
                raise MalformedDelta(f"tensor {t.name!r} is planes, but the delta does not declare {BYTE_PLANES!r}")
        for bucket in self.buckets:
            for c in bucket.chunks:
                record = records.get(c.tensor)
                if record is None:
                    raise MalformedDelta(f"{bucket.file}: a chunk of {c.tensor!r}, which the manifest does not list")
                indexed = record.encoding in (Encoding.SPARSE, Encoding.PLANES)
                if record.encoding is Encoding.UNCHANGED or indexed != (c.index_dtype is not None):
                    raise MalformedDelta(f"{bucket.file}: a {'sparse' if c.index_dtype else 'dense'} chunk of "
                                         f"{c.tensor!r}, which is {record.encoding.value}")
                if c.index_dtype is not None and (c.index_dtype not in _INDEX_DTYPES or (
                        c.index_dtype not in _V1_INDEX and U8_GAPS not in self.features)):
                    raise MalformedDelta(f"{bucket.file}: chunk of {c.tensor!r} has index dtype {c.index_dtype!r}")
                planes = record.encoding is Encoding.PLANES
                if planes != (c.plane is not None) or (planes and not 0 <= c.plane < record.itemsize):
                    raise MalformedDelta(f"{bucket.file}: chunk of {c.tensor!r} ({record.encoding.value}) has plane "
                                         f"{c.plane}")
                if c.count <= 0 or c.start < 0:
                    raise MalformedDelta(f"{bucket.file}: chunk of {c.tensor!r} with start {c.start}, count {c.count}")
                covered[c.tensor] += c.count
        for t in self.tensors:
            if t.encoding is Encoding.PLANES:  # every changed element in at least one plane
                if not t.changed <= covered[t.name] <= t.size * t.itemsize:
                    raise MalformedDelta(f"tensor {t.name!r} (planes): its chunks hold {covered[t.name]} bytes for "
                                         f"{t.changed} changed elements")
                continue
            if t.encoding is Encoding.SPARSE and U8_GAPS in self.features:  # fillers: unchanged positions too
                if not t.changed <= covered[t.name] <= t.size:
                    raise MalformedDelta(f"tensor {t.name!r} (sparse): its chunks hold {covered[t.name]} elements for "
                                         f"{t.changed} changed ones of {t.size}")
                continue
            want = {Encoding.UNCHANGED: 0, Encoding.SPARSE: t.changed, Encoding.DENSE: t.size}[t.encoding]
            if covered[t.name] != want:
                raise MalformedDelta(f"tensor {t.name!r} ({t.encoding.value}): its chunks hold {covered[t.name]} "
                                     f"elements, the manifest says {want}")

    def changed_tensors(self) -> list[str]:
        """Names of the tensors the delta writes (sparse or dense), in manifest order."""
        return [t.name for t in self.tensors if t.encoding is not Encoding.UNCHANGED]

    def sparse_tensors(self) -> list[str]:
        """Names of the tensors whose base bytes an apply needs (sparse or planes)."""
        return [t.name for t in self.tensors if t.encoding in (Encoding.SPARSE, Encoding.PLANES)]

    def checksums(self) -> dict[str, str]:
        return {t.name: t.checksum for t in self.tensors}


# ---------------------------------------------------------------------------------------------------- in memory


@dataclass(frozen=True)
class Chunk:
    """One chunk's arrays: `values` [count] unsigned raw elements, `gaps` [count] (sparse) or None (dense)."""

    record: ChunkRecord
    values: np.ndarray  # [count], unsigned of the element width (U8 for a plane's chunk)
    gaps: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.gaps is None else self.gaps.nbytes)


@dataclass(frozen=True)
class WeightDelta:
    """A manifest and its payload, `buckets[i][k]` the k-th chunk of bucket i (`manifest.buckets[i].chunks[k]`)."""

    manifest: DeltaManifest
    buckets: tuple[tuple[Chunk, ...], ...]

    @property
    def payload_bytes(self) -> int:
        return sum(b.nbytes for b in self.manifest.buckets)


@dataclass(frozen=True)
class DeltaStats:
    """What one encode cost and saved. `bytes` is what crosses to the engine (payload + manifest); `full_bytes` what
    a full sync in the engine's dtype would have sent. Seconds: `diff_s` comparing bytes, `encode_s` building chunks
    and buckets, `checksum_s` hashing the new tensors (the caller adds write, apply and confirm)."""

    bytes: int
    full_bytes: int
    changed_elements: int
    total_elements: int
    diff_s: float
    encode_s: float
    checksum_s: float

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def metrics(self) -> dict[str, float]:
        return {"sync/bytes": float(self.bytes), "sync/full_bytes": float(self.full_bytes),
                "sync/changed_fraction": self.changed_fraction, "sync/diff_s": self.diff_s,
                "sync/encode_s": self.encode_s + self.checksum_s}


@dataclass
class WeightSnapshot:
    """The bytes one engine holds (as the trainer last sent them) under the engine's weight `version`: tensor name ->
    array in the engine's dtype. The arrays are owned by the snapshot: never write to them afterwards."""

    version: str
    tensors: dict[str, np.ndarray]
    _checksums: dict[str, str] = field(default_factory=dict, repr=False)

    def checksum(self, name: str) -> str:
        if name not in self._checksums:
            self._checksums[name] = tensor_checksum(self.tensors[name])
        return self._checksums[name]

    def after(self, delta: WeightDelta, new: Mapping[str, np.ndarray]) -> WeightSnapshot:
        """The snapshot once an engine confirmed `delta` (encoded from this snapshot, or from none, to `new`)."""
        manifest = delta.manifest
        if manifest.base_version is not None and manifest.base_version != self.version:
            raise BaseMismatch(f"delta from version {manifest.base_version} cannot follow snapshot {self.version}")
        return WeightSnapshot(manifest.target_version, dict(new), manifest.checksums())


# ---------------------------------------------------------------------------------------------------- encode


def _chunk_cut(gaps: np.ndarray, begin: int, room: int, itemsize: int) -> tuple[int, np.dtype]:
    """How many sparse elements from `begin` make the next chunk, within `room` bytes, and their index dtype: the
    narrowest that fits them all, or a narrow chunk ending just before the first gap too wide for it when at least
    half of what the room holds comes before that gap (a rare wide gap widens one chunk, frequent ones make no
    run of tiny chunks)."""
    for dtype in (_INDEX_DTYPES[name] for name in _V1_INDEX):
        n = min(len(gaps) - begin, room // (dtype.itemsize + itemsize))
        if n <= 0 or dtype == np.uint64:
            return max(n, 0), dtype
        too_wide = np.flatnonzero(gaps[begin:begin + n] > np.iinfo(dtype).max)
        if too_wide.size == 0:
            return n, dtype
        if 2 * int(too_wide[0]) >= n:
            return int(too_wide[0]), dtype
    raise AssertionError("unreachable: uint64 holds every gap")


def _narrowest(gaps: np.ndarray) -> np.dtype:
    widest = int(gaps.max()) if gaps.size else 0
    return next(dt for dt in _INDEX_DTYPES.values() if widest <= np.iinfo(dt).max)


def _u8_plan(gaps: np.ndarray, value_bytes: int) -> tuple[list[tuple[int, int, np.dtype]], int]:
    """How a stream of `gaps` goes with "u8-gaps", and the bytes it costs: the cheaper of one index dtype for all
    (the narrowest that holds the widest gap) and U8 spans, where a gap over 255 is bridged by fillers (unchanged
    positions 255 apart, their base value sent again) unless that costs more than a chunk of its own (a one-element
    span in the narrowest dtype that holds it, its manifest entry counted as CHUNK_RECORD_BYTES)."""
    single = _narrowest(gaps)
    single_cost = len(gaps) * (single.itemsize + value_bytes)
    fillers = np.maximum(-(-gaps.astype(np.int64) // 255) - 1, 0)
    alone = np.flatnonzero(fillers * (1 + value_bytes) > CHUNK_RECORD_BYTES)
    bridged = np.ones(len(gaps), bool)
    bridged[alone] = False
    u8_cost = int(((1 + fillers[bridged]) * (1 + value_bytes)).sum())
    u8_cost += sum(_narrowest(gaps[i:i + 1]).itemsize + value_bytes + CHUNK_RECORD_BYTES for i in alone.tolist())
    if single_cost <= u8_cost:
        return [(0, len(gaps), single)], single_cost
    spans: list[tuple[int, int, np.dtype]] = []
    at = 0
    for i in alone.tolist():
        if i > at:
            spans.append((at, i, np.dtype(np.uint8)))
        spans.append((i, i + 1, _narrowest(gaps[i:i + 1])))
        at = i + 1
    if at < len(gaps):
        spans.append((at, len(gaps), np.dtype(np.uint8)))
    return spans, u8_cost


def _bridge(positions: np.ndarray, prev: int) -> tuple[np.ndarray, np.ndarray]:
    """`positions` (increasing, after `prev`) with fillers 255 apart wherever a gap exceeds 255, and a mask of the
    fillers: every gap of the result fits a byte."""
    gaps = np.diff(positions, prepend=prev)
    fillers = np.maximum(-(-gaps // 255) - 1, 0)
    if not fillers.any():
        return positions, np.zeros(len(positions), bool)
    counts = fillers + 1
    group = np.repeat(np.arange(len(positions)), counts)
    step = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. within a group
    is_filler = step < fillers[group]
    before = np.concatenate([[prev], positions[:-1]])[group]
    return np.where(is_filler, before + 255 * (step + 1), positions[group]), is_filler


class _Packer:
    """Chunks placed in buckets of at most `bucket_bytes` payload bytes, in order: a huge tensor spans several
    buckets, many small ones share one."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[Chunk]] = [[]]
        self.room = bucket_bytes

    def place(self, chunk: Chunk) -> None:
        self.buckets[-1].append(chunk)
        self.room -= chunk.nbytes

    def next_bucket(self) -> None:
        if self.buckets[-1]:
            self.buckets.append([])
        self.room = self.bucket_bytes

    def dense(self, name: str, bits: np.ndarray) -> None:
        begin, itemsize = 0, bits.dtype.itemsize
        while begin < bits.size:
            n = min(bits.size - begin, self.room // itemsize)
            if n <= 0:
                self.next_bucket()
                continue
            self.place(Chunk(ChunkRecord(name, begin, n, None), bits[begin:begin + n], None))
            begin += n

    def sparse(self, name: str, positions: np.ndarray, values: np.ndarray, spans: list | None = None,
               plane: int | None = None, base_bits: np.ndarray | None = None) -> None:
        """The stream of `positions` (increasing) and their `values`. `spans` (`_u8_plan`) fix each chunk's index
        dtype, a U8 span's fillers taking the base's own value (from `base_bits`, the base's elements: the byte
        `plane` of them for a plane); None: `_chunk_cut` picks the dtypes (the v1 encoding)."""
        if spans is None:
            gaps = np.diff(positions, prepend=0)
            segments = [(positions, values, gaps, None)]
        else:
            segments, prev = [], 0
            for lo, hi, dtype in spans:
                at, vals = positions[lo:hi], values[lo:hi]
                if dtype == np.uint8:
                    bridged, filler = _bridge(at, prev)
                    if filler.any():
                        old = base_bits[bridged[filler]]
                        if plane is not None:
                            old = (old >> old.dtype.type(8 * plane)) & old.dtype.type(0xFF)
                        full = np.empty(len(bridged), vals.dtype)
                        full[filler], full[~filler] = old.astype(vals.dtype), vals
                        at, vals = bridged, full
                segments.append((at, vals, np.diff(at, prepend=prev), dtype))
                prev = int(at[-1])
        itemsize = values.dtype.itemsize
        last = None  # the position the next chunk's gaps count from (None: the stream's first chunk, from 0)
        for at, vals, gaps, dtype in segments:
            begin = 0
            while begin < len(gaps):
                if dtype is None:
                    n, index_dtype = _chunk_cut(gaps, begin, self.room, itemsize)
                else:
                    index_dtype = dtype
                    n = min(len(gaps) - begin, self.room // (index_dtype.itemsize + itemsize))
                if n <= 0:
                    self.next_bucket()
                    continue
                start = 0 if last is None else last
                self.place(Chunk(ChunkRecord(name, start, n, _DTYPE_NAMES[index_dtype], plane),
                                 vals[begin:begin + n], gaps[begin:begin + n].astype(index_dtype)))
                last = int(at[begin + n - 1])
                begin += n

    def done(self) -> list[list[Chunk]]:
        return self.buckets if self.buckets[-1] else self.buckets[:-1]


def _plane_streams(bits: np.ndarray, old: np.ndarray,
                   positions: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(plane, positions, new bytes) of each byte of the elements that changed at `positions` (little-endian)."""
    xor = old[positions] ^ bits[positions]
    new = bits[positions]
    out = []
    for plane in range(bits.dtype.itemsize):
        shift = bits.dtype.type(8 * plane)
        moved = ((xor >> shift) & bits.dtype.type(0xFF)) != 0
        if moved.any():
            out.append((plane, positions[moved], ((new[moved] >> shift) & bits.dtype.type(0xFF)).astype(np.uint8)))
    return out


def encode_delta(base: WeightSnapshot | None, new: Mapping[str, np.ndarray], target_version: str, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, compact: bool = False) -> tuple[WeightDelta, DeltaStats]:
    """The delta that turns `base`'s bytes into `new`'s (None: a full sync, every tensor dense), in buckets of at
    most `bucket_bytes` payload bytes. `new` must have `base`'s tensor names, dtypes and shapes (else BaseMismatch:
    send a full sync); its order is the manifest's. `compact`: use the features "u8-gaps" and "byte-planes" where
    they save bytes (the reader must have them: the embedded engine's does); off, the delta is plain v1."""
    if bucket_bytes < MIN_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes}: a bucket must hold at least {MIN_BUCKET_BYTES} bytes")
    if base is not None and set(base.tensors) != set(new):
        missing, extra = sorted(set(base.tensors) - set(new)), sorted(set(new) - set(base.tensors))
        raise BaseMismatch(f"the new weights do not have the snapshot's tensors: missing {missing[:3]}, "
                           f"new {extra[:3]}")
    planes_ok = compact and sys.byteorder == "little"  # planes are bytes of the little-endian element
    diff_s = encode_s = checksum_s = 0.0
    records: list[TensorRecord] = []
    packer = _Packer(bucket_bytes)
    changed_total = elements = full_bytes = 0
    for name, array in new.items():
        array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d tensor 1-d)
        dname = dtype_name(array.dtype)
        size, itemsize = array.size, array.dtype.itemsize
        elements += size
        full_bytes += array.nbytes
        t0 = time.perf_counter()
        bits = _bits(array)
        old = None
        if base is None:
            positions = None
            changed = size
        else:
            old_array = base.tensors[name]
            if old_array.dtype != array.dtype or old_array.shape != array.shape:
                raise BaseMismatch(f"tensor {name!r} is {dtype_name(old_array.dtype)} {list(old_array.shape)} in the "
                                   f"snapshot, {dname} {list(array.shape)} now")
            old = _bits(old_array)
            positions = np.flatnonzero(old != bits)
            changed = int(positions.size)
        t1 = time.perf_counter()
        diff_s += t1 - t0
        changed_total += changed
        if changed == 0:
            encoding = Encoding.UNCHANGED
        elif positions is None:
            encoding = Encoding.DENSE
        elif not compact:
            encoding = Encoding.DENSE if changed * (2 + itemsize) >= size * itemsize else Encoding.SPARSE
        else:  # the fewest bytes of dense, sparse and planes
            spans, sparse_cost = _u8_plan(np.diff(positions, prepend=0), itemsize)
            streams = _plane_streams(bits, old, positions) if planes_ok and itemsize > 1 else []
            plans = [_u8_plan(np.diff(at, prepend=0), 1) for _, at, _ in streams]
            costs = {Encoding.DENSE: size * itemsize, Encoding.SPARSE: sparse_cost}
            if streams:
                costs[Encoding.PLANES] = sum(cost for _, cost in plans)
            encoding = min(costs, key=costs.get)
        if encoding is Encoding.DENSE:
            packer.dense(name, bits)
        elif encoding is Encoding.SPARSE:
            packer.sparse(name, positions, bits[positions], spans if compact else None, base_bits=old)
        elif encoding is Encoding.PLANES:
            for (plane, at, values), (plane_spans, _) in zip(streams, plans):
                packer.sparse(name, at, values, plane_spans, plane, base_bits=old)
        t2 = time.perf_counter()
        encode_s += t2 - t1
        checksum = base.checksum(name) if encoding is Encoding.UNCHANGED else tensor_checksum(array)
        checksum_s += time.perf_counter() - t2
        records.append(TensorRecord(name, dname, tuple(array.shape), encoding, changed, checksum))
    buckets = packer.done()
    used = set()
    if any(r.encoding is Encoding.PLANES for r in records):
        used.add(BYTE_PLANES)
    if any(c.record.index_dtype == "U8" for chunks in buckets for c in chunks):
        used.add(U8_GAPS)
    manifest = DeltaManifest(
        base_version=None if base is None else base.version, target_version=str(target_version),
        tensors=tuple(records),
        buckets=tuple(BucketRecord(_bucket_file(i), sum(c.nbytes for c in chunks), tuple(c.record for c in chunks))
                      for i, chunks in enumerate(buckets)),
        features=tuple(f for f in FEATURES if f in used))
    delta = WeightDelta(manifest, tuple(tuple(chunks) for chunks in buckets))
    stats = DeltaStats(bytes=delta.payload_bytes + len(manifest.to_json().encode()), full_bytes=full_bytes,
                       changed_elements=changed_total, total_elements=elements, diff_s=diff_s, encode_s=encode_s,
                       checksum_s=checksum_s)
    return delta, stats


def _bucket_file(i: int) -> str:
    return f"bucket-{i:05d}.safetensors"


# ---------------------------------------------------------------------------------------------------- apply


def _chunks_by_tensor(delta: WeightDelta) -> dict[str, list[Chunk]]:
    if len(delta.buckets) != len(delta.manifest.buckets):
        raise MalformedDelta(f"{len(delta.buckets)} buckets of arrays, the manifest lists "
                             f"{len(delta.manifest.buckets)}")
    out: dict[str, list[Chunk]] = {}
    for record, chunks in zip(delta.manifest.buckets, delta.buckets):
        if tuple(c.record for c in chunks) != record.chunks:
            raise MalformedDelta(f"{record.file}: its arrays are not the chunks its manifest entry lists")
        for chunk in chunks:
            out.setdefault(chunk.record.tensor, []).append(chunk)
    return out


def _write_chunks(target: np.ndarray, record: TensorRecord, chunks: list[Chunk]) -> None:
    """Write the chunks' elements (or, for planes, bytes of elements) into `target` (a flat unsigned view of the
    tensor), checking every position."""
    last: dict[int | None, int] = {}  # per plane (None: whole elements), the last position written
    width = _UINT[record.itemsize]
    planes = None
    if record.encoding is Encoding.PLANES:
        if sys.byteorder != "little":
            raise MalformedDelta(f"tensor {record.name!r}: byte planes are read on little-endian hosts only")
        planes = target.view(np.uint8).reshape(-1, record.itemsize)  # column p: byte p of each element
    for chunk in chunks:
        c = chunk.record
        want = width if c.plane is None else np.dtype(np.uint8)
        if chunk.values.dtype != want or chunk.values.shape != (c.count,):
            raise MalformedDelta(f"tensor {record.name!r}: a chunk's values are {chunk.values.dtype} "
                                 f"{chunk.values.shape}, the manifest needs {want} ({c.count},)")
        prev = last.get(c.plane, -1)
        if c.index_dtype is None:
            if c.start != prev + 1 or c.start + c.count > record.size:
                raise MalformedDelta(f"tensor {record.name!r}: dense chunk [{c.start}, {c.start + c.count}) after "
                                     f"position {prev}, of {record.size} elements")
            target[c.start:c.start + c.count] = chunk.values
            last[c.plane] = c.start + c.count - 1
            continue
        gaps = chunk.gaps
        if gaps is None or gaps.dtype != _INDEX_DTYPES[c.index_dtype] or gaps.shape != (c.count,):
            raise MalformedDelta(f"tensor {record.name!r}: a chunk's gaps do not match its manifest entry "
                                 f"({c.index_dtype} x {c.count})")
        if c.start != max(prev, 0) or (prev >= 0 and gaps[0] == 0) or (c.count > 1 and gaps[1:].min() == 0):
            raise MalformedDelta(f"tensor {record.name!r}: positions are not increasing (chunk start {c.start})")
        positions = c.start + np.cumsum(gaps, dtype=np.uint64)
        if int(positions[-1]) >= record.size:
            raise MalformedDelta(f"tensor {record.name!r}: position {int(positions[-1])} past its {record.size} "
                                 "elements")
        if planes is None:
            target[positions.astype(np.intp)] = chunk.values
        else:
            planes[positions.astype(np.intp), c.plane] = chunk.values
        last[c.plane] = int(positions[-1])


def apply_delta(base: Mapping[str, np.ndarray], delta: WeightDelta, version: str | None) -> dict[str, np.ndarray]:
    """The new bytes of every tensor `delta` writes, as fresh arrays (`base` is not modified).

    `base`: the holder's tensors (in its dtype) under its weight `version`; only the sparse tensors' bytes are read
    (`manifest.sparse_tensors()`), so a holder may pass just those. Every returned tensor matches its manifest
    checksum; any failure raises a WeightDeltaError before anything is returned."""
    manifest = delta.manifest
    manifest.check()
    if manifest.base_version is not None and manifest.base_version != version:
        raise BaseMismatch(f"delta to version {manifest.target_version} applies to version {manifest.base_version}; "
                           f"this engine holds version {version}")
    chunks = _chunks_by_tensor(delta)
    out: dict[str, np.ndarray] = {}
    for record in manifest.tensors:
        if record.encoding is Encoding.UNCHANGED:
            continue
        dtype = DTYPES[record.dtype]
        if record.encoding is Encoding.DENSE:
            array = np.empty(record.shape, dtype)
        else:
            old = base.get(record.name)
            if old is None:
                raise BaseMismatch(f"tensor {record.name!r} of the delta is not in this engine's weights")
            if old.dtype != dtype or tuple(old.shape) != record.shape:
                raise BaseMismatch(f"tensor {record.name!r} is {old.dtype} {list(old.shape)} here, the delta's "
                                   f"base {record.dtype} {list(record.shape)}")
            array = np.array(old, dtype=dtype, order="C", copy=True)
        _write_chunks(array.reshape(-1).view(_UINT[dtype.itemsize]), record, chunks.get(record.name, []))
        out[record.name] = array
    want = manifest.checksums()
    wrong = tuple(name for name, array in out.items() if tensor_checksum(array) != want[name])
    if wrong:
        raise ChecksumMismatch(f"delta to version {manifest.target_version}: {len(wrong)} tensor(s) differ from the "
                               f"trainer's bytes after the apply, e.g. {list(wrong[:3])}", wrong)
    return out


def checksum_mismatches(manifest: DeltaManifest, held: Mapping[str, str]) -> list[str]:
    """Names of the manifest's tensors whose checksum `held` (an engine's answer) lacks or differs from."""
    return [t.name for t in manifest.tensors if held.get(t.name) != t.checksum]


# ---------------------------------------------------------------------------------------------------- files


def save_delta(delta: WeightDelta, directory: str | os.PathLike) -> Path:
    """Write `delta` as `directory/` (manifest.json + bucket files, the module docstring's format), atomically: a
    temporary sibling renamed when complete, so a reader never sees half a delta."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    metadata = {"format": FORMAT, "target_version": delta.manifest.target_version}
    for record, chunks in zip(delta.manifest.buckets, delta.buckets):
        arrays: dict[str, np.ndarray] = {}
        for k, chunk in enumerate(chunks):
            arrays[f"{k}.values"] = chunk.values
            if chunk.gaps is not None:
                arrays[f"{k}.gaps"] = chunk.gaps
        safetensors.numpy.save_file(arrays, str(tmp / record.file), metadata=metadata)
    (tmp / MANIFEST_NAME).write_text(delta.manifest.to_json())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load_delta(directory: str | os.PathLike) -> WeightDelta:
    """Read a delta written by `save_delta`; MalformedDelta if a file is missing or does not match the manifest."""
    root = Path(directory)
    try:
        manifest = DeltaManifest.from_json((root / MANIFEST_NAME).read_text())
    except OSError as e:
        raise MalformedDelta(f"{root}: no readable {MANIFEST_NAME} ({e})") from e
    buckets = []
    for record in manifest.buckets:
        path = root / record.file
        if Path(record.file).name != record.file or not path.is_file():
            raise MalformedDelta(f"{root}: bucket file {record.file!r} is missing or not inside the delta")
        try:
            with safetensors.safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                arrays = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a corrupt file
            raise MalformedDelta(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        if metadata.get("format") != FORMAT or metadata.get("target_version") != manifest.target_version:
            raise MalformedDelta(f"{path}: a bucket of another delta ({metadata})")
        chunks = []
        for k, c in enumerate(record.chunks):
            if f"{k}.values" not in arrays or (c.index_dtype is not None) != (f"{k}.gaps" in arrays):
                raise MalformedDelta(f"{path}: chunk {k} ({c.tensor!r}) lacks its arrays")
            chunks.append(Chunk(c, arrays.pop(f"{k}.values"), arrays.pop(f"{k}.gaps", None)))
        if arrays:
            raise MalformedDelta(f"{path}: arrays the manifest does not list: {sorted(arrays)[:3]}")
        buckets.append(tuple(chunks))
    return WeightDelta(manifest, tuple(buckets))

