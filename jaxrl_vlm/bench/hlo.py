"""Collective traffic of a compiled XLA program, read from its optimized HLO text (`compiled.as_text()`).

Per collective instruction we take the bytes of its RESULT shape (per device, per execution; a tuple
result sums its elements) and multiply by how often it runs: an instruction inside a `while` body runs
`known_trip_count` times (XLA records it in the loop's backend_config; our micro-batch `lax.scan` and
the chunked log-prob `lax.map` are such loops), nested loops multiply. Async pairs (`all-gather-start`
/ `-done`) are counted once, at the `-done`, whose result is the collective's output.

Bytes by kind follow the result-shape convention: an all-gather counts the gathered (full) array, a
reduce-scatter the scattered block, an all-reduce the reduced array. Link traffic differs by
algorithm (a ring all-reduce sends ~2(n-1)/n of it); the convention keeps layouts comparable.

Mesh-axis attribution: the replica groups (explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` /
`[4,2]<=[2,4]T(1,0)`, or mesh-axes `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`) name logical device ids,
i.e. positions in the program's device assignment, which for a `jax.jit` over one `Mesh` is
`mesh.devices.flat` order. The axes of OUR mesh along which a group's members differ are the axes the
collective communicates over ("fsdp", "data+fsdp", ...). Groups we cannot parse give "?".

No jax import: this is text processing, unit-tested on handwritten HLO.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

COLLECTIVE_KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SYNC_OPCODES = {k: k for k in COLLECTIVE_KINDS} | {"ragged-all-to-all": "all-to-all"}
_DONE_OPCODES = {"all-gather-done": "all-gather", "all-reduce-done": "all-reduce", "collective-permute-done": "collective-permute"}
_START_OPCODES = {"all-gather-start", "all-reduce-start", "collective-permute-start"}
# Ops whose `calls=` would make a wrapped computation count twice (start already calls it).
_NO_CALL_EDGE = {"async-done", "async-update"}
UNKNOWN_AXES = "?"
NO_COMMUNICATION = "-"


class HloParseError(ValueError):
    """The HLO text does not have the structure `as_text()` prints (names the offending line)."""


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # result type text, e.g. "f32[8,64]{1,0}" or "(f32[8]{0}, s32[])"
    opcode: str
    operands: str  # text inside the opcode's parentheses
    attrs: str  # text after them (replica_groups=..., calls=..., backend_config=...)


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction] = field(default_factory=list)


@dataclass(frozen=True)
class Collective:
    """One collective instruction: bytes per execution (per device) and how often it executes."""

    kind: str
    name: str
    computation: str
    result_bytes: int
    executions: int
    axes: str  # "+"-joined mesh axes, NO_COMMUNICATION for singleton groups, UNKNOWN_AXES if unparsed
    group_size: int | None
    op_name: str = ""  # jax source op from the HLO metadata (where in the program it comes from)

    @property
    def total_bytes(self) -> int:
        return self.result_bytes * self.executions


@dataclass(frozen=True)
class CollectiveSummary:
    """Per-device bytes moved by collectives in one execution of the program."""

    bytes_by_kind: dict[str, int]  # every kind of COLLECTIVE_KINDS, 0 when absent
    bytes_by_axis: dict[str, int]
    bytes_by_kind_axis: dict[str, dict[str, int]]
    count_by_kind: dict[str, int]  # executions
    unknown_trip_counts: int  # while loops without known_trip_count (their bodies were counted once)
    top: tuple[Collective, ...] = ()  # the largest collectives by total bytes (where the traffic comes from)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


# ----------------------------------------------------------------------------- parsing

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[(]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")


def _balanced_end(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index just past the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise HloParseError(f"unbalanced {open_ch}{close_ch} in: {text[:200]}")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _balanced_end(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, tail = rest[:end], rest[end:]
    om = _OPCODE.match(tail)
    if not om:
        return None
    open_at = om.end() - 1
    close_at = _balanced_end(tail, open_at)
    return Instruction(name, shape.strip(), om.group(1), tail[open_at + 1 : close_at - 1], tail[close_at:])


def parse_hlo(text: str) -> dict[str, Computation]:
    """Computations by name (HLO text order: callees before callers; ENTRY marked)."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("HloModule", "//", "#")):
            continue
        if current is None:
            if not line[:1].isspace() and stripped.endswith("{"):
                m = _HEADER.match(stripped)
                if not m:
                    raise HloParseError(f"line {lineno}: cannot read the computation header {stripped[:120]!r}")
                current = Computation(m.group(2), bool(m.group(1)))
            continue
        if stripped == "}":
            comps[current.name] = current
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            current.instructions.append(instr)
    if current is not None:
        raise HloParseError(f"computation {current.name} is not closed")
    if not any(c.is_entry for c in comps.values()):
        raise HloParseError("no ENTRY computation in the HLO text")
    return comps


# ----------------------------------------------------------------------------- loop multipliers

_CALL_ONE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_MANY = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def execution_counts(comps: dict[str, Computation]) -> tuple[dict[str, int], int]:
    """(executions of each computation per program run, number of loops with unknown trip count).

    A computation called from several sites runs once per call of each; a while body runs
    trip-count times per execution of the while (1 when XLA did not record the count).
    """
    callers: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    unknown = 0
    for comp in comps.values():
        for ins in comp.instructions:
            if ins.opcode in _NO_CALL_EDGE:
                continue
            trip = 1
            if ins.opcode == "while":
                m = _TRIP.search(ins.attrs)
                if m:
                    trip = int(m.group(1))
                else:
                    unknown += 1
            targets: list[tuple[str, str]] = [(k, v) for k, v in _CALL_ONE.findall(ins.attrs)]
            for key, names in _CALL_MANY.findall(ins.attrs):
                targets += [(key, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
            for key, callee in targets:
                if callee in callers:
                    callers[callee].append((comp.name, trip if key in ("body", "condition") else 1))

    memo: dict[str, int] = {}

    def count(name: str, depth: int = 0) -> int:
        if name in memo:
            return memo[name]
        if depth > len(comps):
            raise HloParseError(f"call cycle through computation {name}")
        if comps[name].is_entry:
            memo[name] = 1
        else:
            memo[name] = sum(count(caller, depth + 1) * factor for caller, factor in callers[name])
        return memo[name]

    return {name: count(name) for name in comps}, unknown


# ----------------------------------------------------------------------------- shapes

_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([^\]]*)\]")


def _element_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    m = re.match(r"[a-z]+(\d+)", dtype)
    if not m:
        raise HloParseError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result type (arrays of a tuple summed; layouts, tokens and scalars handled)."""
    total_bits = 0
    for dtype, dims in _ARRAY.findall(shape):
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total_bits += math.prod(sizes) * _element_bits(dtype)
    return (total_bits + 7) // 8


# ----------------------------------------------------------------------------- replica groups

_RG_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\}\s*,?\s*)*)\}")
_RG_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_RG_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _op_name(attrs: str) -> str:
    m = _OP_NAME.search(attrs)
    return m.group(1) if m else ""


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


_IOTA_IDS = re.compile(r"^\s*(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*$")


def _device_order(device_ids: str | None, n: int) -> np.ndarray:
    """Flat device ids of a mesh: iota, an iota tile `[4,2]T(1,0)` (arange reshaped, transposed), or a list."""
    if not device_ids:
        return np.arange(n, dtype=np.int64)
    m = _IOTA_IDS.match(device_ids)
    if m:
        dims = _ints(m.group(1))
        perm = _ints(m.group(2)) if m.group(2) else list(range(len(dims)))
        ids = np.arange(math.prod(dims), dtype=np.int64).reshape(dims).transpose(perm).reshape(-1)
    else:
        ids = np.array(_ints(device_ids), np.int64)
    if ids.size != n:
        raise HloParseError(f"device_ids=({device_ids}) lists {ids.size} devices, the mesh has {n}")
    return ids


def _mesh_axes_groups(axes_text: str, device_ids: str | None, refs_text: str) -> list[list[int]]:
    """Groups of a mesh-axes replica list: members vary over the referenced (sub-)axes."""
    names: list[str] = []
    sizes: list[int] = []
    for item in axes_text.split(","):
        name, _, size = item.strip().partition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    devices = _device_order(device_ids, n)
    refs: list[tuple[int, int | None, int | None]] = []  # (axis, pre_size, size) ; None = whole axis
    for item in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", refs_text):
        axis_name, pre, size = item
        if axis_name not in names:
            raise HloParseError(f"replica group axis {axis_name!r} not in mesh {names}")
        refs.append((names.index(axis_name), int(pre) if pre else None, int(size) if size else None))
    # Refine each referenced mesh dimension into (padding, sub-axis, ...) factors, major to minor.
    dims: list[int] = []
    grouped: dict[tuple[int, int], int] = {}  # (axis, ref index) -> refined dim
    for axis, full in enumerate(sizes):
        axis_refs = [(i, r) for i, r in enumerate(refs) if r[0] == axis]
        if not axis_refs:
            dims.append(full)
            continue
        if any(r[1] is None for _, r in axis_refs):
            grouped[(axis, axis_refs[0][0])] = len(dims)
            dims.append(full)
            continue
        prefix = 1
        for i, (_, pre, size) in sorted(axis_refs, key=lambda x: x[1][1]):
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[(axis, i)] = len(dims)
            dims.append(size)
            prefix *= size
        if prefix != full:
            dims.append(full // prefix)
    group_dims = [grouped[(r[0], i)] for i, r in enumerate(refs)]
    other = [d for d in range(len(dims)) if d not in group_dims]
    arr = devices.reshape(dims).transpose(other + group_dims)
    group_size = math.prod(dims[d] for d in group_dims)
    return arr.reshape(-1, group_size).tolist()


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Device groups of a collective's attributes; None when the format is not recognised.

    `replica_groups={}` means one group of all `num_devices`; collective-permute's
    `source_target_pairs` give one 2-member group per pair.
    """
    m = _PAIRS.search(attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    m = _RG_MESH.search(attrs)
    if m:
        return _mesh_axes_groups(m.group(1), m.group(2), m.group(3))
    m = _RG_IOTA.search(attrs)
    if m:
        shape, reshape = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(reshape)))
        ids = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(shape)
        return ids.reshape(shape[0], -1).tolist()
    m = _RG_EXPLICIT.search(attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        groups = [g for g in groups if g]
        return groups or [list(range(num_devices))]
    return None


def group_axes(groups: Sequence[Sequence[int]] | None, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> str:
    """Mesh axes (in mesh order, "+"-joined) along which the members of some group differ."""
    if groups is None:
        return UNKNOWN_AXES
    n = math.prod(axis_sizes)
    ids = [i for g in groups for i in g]
    if any(i < 0 or i >= n for i in ids):
        return UNKNOWN_AXES
    varying: set[int] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.stack(np.unravel_index(np.asarray(g), tuple(axis_sizes)), axis=-1)  # [members, axes]
        varying.update(int(a) for a in np.flatnonzero((coords != coords[0]).any(axis=0)))
    if not varying:
        return NO_COMMUNICATION
    return "+".join(axis_names[a] for a in sorted(varying))


# ----------------------------------------------------------------------------- collectives


def find_collectives(text: str, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> tuple[list[Collective], int]:
    """(every collective of the program with bytes, executions and mesh axes; loops of unknown trip count)."""
    comps = parse_hlo(text)
    counts, unknown = execution_counts(comps)
    num_devices = math.prod(axis_sizes)
    starts: dict[str, Instruction] = {}
    for comp in comps.values():
        for ins in comp.instructions:
            if ins.opcode in _START_OPCODES:
                starts[ins.name] = ins
    out: list[Collective] = []
    for comp in comps.values():
        for ins in comp.instructions:
            if ins.opcode in _SYNC_OPCODES:
                kind, attrs = _SYNC_OPCODES[ins.opcode], ins.attrs
            elif ins.opcode in _DONE_OPCODES:
                kind = _DONE_OPCODES[ins.opcode]
                operand = ins.operands.strip().split(",")[0].strip().lstrip("%")
                start = starts.get(operand)
                attrs = start.attrs if start is not None else ""
            else:
                continue
            groups = replica_groups(attrs, num_devices)
            out.append(
                Collective(
                    kind=kind,
                    name=ins.name,
                    computation=comp.name,
                    result_bytes=shape_bytes(ins.shape),
                    executions=counts[comp.name],
                    axes=group_axes(groups, axis_names, axis_sizes),
                    group_size=None if groups is None else max((len(g) for g in groups), default=0),
                    op_name=_op_name(ins.attrs),
                )
            )
    return out, unknown


def summarize(collectives: Sequence[Collective], unknown_trip_counts: int = 0, top_n: int = 10) -> CollectiveSummary:
    """Totals by kind and by mesh axes; collectives over singleton groups move nothing and are left out."""
    by_kind = {k: 0 for k in COLLECTIVE_KINDS}
    count = {k: 0 for k in COLLECTIVE_KINDS}
    by_axis: dict[str, int] = {}
    by_kind_axis: dict[str, dict[str, int]] = {k: {} for k in COLLECTIVE_KINDS}
    for c in collectives:
        if c.axes == NO_COMMUNICATION or c.executions == 0:
            continue
        by_kind[c.kind] += c.total_bytes
        count[c.kind] += c.executions
        by_axis[c.axes] = by_axis.get(c.axes, 0) + c.total_bytes
        by_kind_axis[c.kind][c.axes] = by_kind_axis[c.kind].get(c.axes, 0) + c.total_bytes
    moving = [c for c in collectives if c.axes != NO_COMMUNICATION and c.executions]
    top = tuple(sorted(moving, key=lambda c: -c.total_bytes)[:top_n])
    return CollectiveSummary(by_kind, by_axis, by_kind_axis, count, unknown_trip_counts, top)


def collective_summary(text: str, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> CollectiveSummary:
    """`summarize(find_collectives(...))` of an optimized HLO text."""
    found, unknown = find_collectives(text, axis_names, axis_sizes)
    return summarize(found, unknown)
