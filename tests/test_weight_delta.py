"""Delta weight sync, bit-exact (issue 52, items 1-2 for the embedded engine).

- `jaxrl_vlm.weight_delta` (pure numpy): a delta applied to its base gives the new bytes exactly, for bf16, f32 and
  f16 tensors of odd shapes, none / some / all changed, with narrow and wide gaps, in buckets never above the cap,
  in memory and through files; a wrong base, a corrupt payload or a diverged base raises a typed error and leaves
  the base as it was.
- The embedded engine (tp 2 x dp 2, bf16 weights): after a full sync and 20 delta syncs of a trainer whose weights
  move a little each step, it holds bit for bit what an engine loaded fresh from the trainer's full HF export holds,
  and its checksums equal each manifest's after every sync.
- The syncer's fallbacks: a delta refused at the swap (another version swapped in since it was staged) goes again in
  full, a retry after a failed swap stages the version again (memory and delta modes), and a killed-and-restarted
  engine gets a full sync, then deltas again.
- The in-process update: the client's weight-update calls go to the engine object (no HTTP), and the trainer's
  arrays reach the engine in one cast-and-copy program, in fresh buffers, with the bytes of the transfer path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_vlm import weight_delta as wd
from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.engine.core import Engine
from jaxrl_vlm.engine.weights import host_tensors, serving_tensors
from jaxrl_vlm.models.hf_io import from_hf, to_hf
from jaxrl_vlm.sharding.layout import build_mesh, shard_model
from jaxrl_vlm.sharding.rules import DEFAULT_RULES
from rollout.client import SGLangClient
from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT

BF16 = np.dtype(ml_dtypes.bfloat16)


def _random(shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0, 0.02, shape).astype(dtype)


def _as_uint(array: np.ndarray) -> np.ndarray:
    """The flat elements as unsigned integers of their width: the reference for "changed"."""
    return np.ascontiguousarray(array).reshape(-1).view(f"u{array.dtype.itemsize}")


def _changed(array: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """`array` with about `fraction` of its elements moved by ~1% (always a new bf16 value) and, where possible,
    a -0.0 and a NaN with a payload: bits, not numbers, are compared."""
    out = array.copy().reshape(-1)
    n = int(round(fraction * out.size))
    idx = rng.choice(out.size, n, replace=False)
    out[idx] = (out[idx].astype(np.float32) * 1.01 + 1e-3).astype(array.dtype)
    if n >= 2:
        out[idx[0]] = -0.0
        bits = _as_uint(out)
        bits[idx[1]] = np.iinfo(bits.dtype).max >> 1  # a NaN, with every payload bit set
    return out.reshape(array.shape)


def _same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def _roundtrip(base: dict[str, np.ndarray], new: dict[str, np.ndarray], **kw) -> wd.WeightDelta:
    delta, stats = wd.encode_delta(wd.WeightSnapshot("3", base), new, "4", **kw)
    applied = {**base, **wd.apply_delta(base, delta, "3")}
    _same_bytes(applied, new)
    assert wd.tensor_checksums(applied) == delta.manifest.checksums()
    assert stats.changed_elements == sum(int((_as_uint(base[k]) != _as_uint(new[k])).sum()) for k in new)
    assert stats.full_bytes == sum(a.nbytes for a in new.values())
    return delta


@pytest.mark.parametrize("compact", [False, True], ids=["v1", "compact"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32), np.dtype(np.float16)], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_round_trip_is_bit_exact(dtype, fraction, compact):
    rng = np.random.default_rng(0)
    base = {"a": _random((3, 5, 7), dtype, rng), "b": _random((1,), dtype, rng), "c": _random((129, 31), dtype, rng),
            "empty": _random((0, 4), dtype, rng)}
    new = {k: _changed(v, fraction, rng) for k, v in base.items()}
    delta = _roundtrip(base, new, compact=compact)
    encodings = {t.name: t.encoding for t in delta.manifest.tensors}
    assert encodings["empty"] is wd.Encoding.UNCHANGED
    if not compact:  # plain v1: what a reader of the format's first version reads
        assert delta.manifest.features == () and wd.Encoding.PLANES not in encodings.values()
        assert all(c.record.index_dtype in (None, "U16", "U32", "U64") for b in delta.buckets for c in b)
    if fraction == 0.0:
        assert set(encodings.values()) == {wd.Encoding.UNCHANGED} and not delta.buckets
    if fraction == 0.01:
        assert encodings["c"] in (wd.Encoding.SPARSE, wd.Encoding.PLANES)
    if fraction == 1.0:  # sending every element beats positions + values
        assert encodings["c"] is wd.Encoding.DENSE
        assert delta.payload_bytes == sum(a.nbytes for a in new.values())


def test_a_gap_too_wide_for_uint16_takes_a_wide_index_in_its_own_chunk_only():
    base = {"w": np.zeros((300_000,), BF16)}
    new = {"w": base["w"].copy()}
    new["w"][[3, 5, 70_005, 70_010, 250_000, 250_001]] = 1.0  # gap 70_000 > 65_535
    single = _roundtrip(base, new)
    (chunk,) = single.buckets[0]
    assert chunk.record.index_dtype == "U32" and chunk.gaps.dtype == np.uint32
    # Buckets of 16 bytes (4 elements with 16-bit gaps): a narrow chunk ends before the wide gap, and only the
    # chunks holding a wide gap pay for it.
    split = _roundtrip(base, new, bucket_bytes=16)
    chunks = [(c.record.index_dtype, c.record.start, c.gaps.tolist()) for bucket in split.buckets for c in bucket]
    assert chunks == [("U16", 0, [3, 2]), ("U32", 5, [70_000]), ("U32", 70_005, [5, 179_990]), ("U16", 250_000, [1])]
    assert [b.nbytes for b in split.manifest.buckets] == [8 + 6, 12 + 4]
    # A few changes: one index dtype for all is the fewest bytes, compact or not.
    assert _roundtrip(base, new, compact=True).payload_bytes == single.payload_bytes


def test_compact_gaps_are_bytes_with_fillers_and_a_gap_too_wide_to_bridge_in_a_chunk_of_its_own():
    base = {"w": np.zeros((400_000,), BF16)}
    new = {"w": base["w"].copy()}
    near = np.arange(10, 20_000, 40)  # 500 changes 40 apart: byte gaps
    far = np.array([20_300, 20_900, 350_000, 350_040])  # gaps of 340 and 600 (bridged), then 329_100 (alone)
    new["w"][np.concatenate([near, far])] = 1.0
    compact = _roundtrip(base, new, compact=True)
    chunks = [c for bucket in compact.buckets for c in bucket]
    assert [c.record.index_dtype for c in chunks] == ["U8", "U32", "U8"]
    assert chunks[1].record.count == 1 and chunks[1].gaps.tolist() == [329_100]
    fillers = chunks[0].record.count - len(near) - 2
    assert fillers == 1 + 2  # 340 = 255 + 85, 600 = 255 + 255 + 90
    (record,) = compact.manifest.tensors
    assert record.encoding is wd.Encoding.SPARSE and record.changed == len(near) + len(far)
    # bf16 1.0 moves its high byte: whole elements (2 bytes) with byte gaps, where v1 pays 16-bit gaps.
    assert compact.payload_bytes == 3 * (len(near) + len(far) + fillers - 1) + 4 + 2
    assert compact.payload_bytes < _roundtrip(base, new).payload_bytes


@pytest.mark.parametrize("cap", [64, 1000, 1 << 20])
def test_buckets_never_exceed_the_cap_and_small_tensors_share_one(cap, tmp_path):
    rng = np.random.default_rng(1)
    base = {"big": _random((100, 300), BF16, rng), "dense": _random((50, 7), np.dtype(np.float32), rng),
            **{f"small{i}": _random((4,), BF16, rng) for i in range(20)}}
    new = {"big": _changed(base["big"], 0.05, rng), "dense": _changed(base["dense"], 1.0, rng),
           **{f"small{i}": _changed(base[f"small{i}"], 0.5, rng) for i in range(20)}}
    delta = _roundtrip(base, new, bucket_bytes=cap)
    assert all(0 < b.nbytes <= cap for b in delta.manifest.buckets)
    assert [sum(c.nbytes for c in chunks) for chunks in delta.buckets] == [b.nbytes for b in delta.manifest.buckets]
    if cap == 1 << 20:
        assert len(delta.buckets) == 1
    else:
        assert len(delta.buckets) > 1
        # A huge tensor's delta is split, and consecutive small tensors share buckets.
        assert sum(1 for chunks in delta.buckets for c in chunks if c.record.tensor == "big") > 1
        assert any(len({c.record.tensor for c in chunks}) > 1 for chunks in delta.buckets)
    loaded = wd.load_delta(wd.save_delta(delta, tmp_path / "delta"))
    assert loaded.manifest == delta.manifest
    _same_bytes({**base, **wd.apply_delta(base, loaded, "3")}, new)
    assert sorted(p.name for p in (tmp_path / "delta").iterdir()) == sorted(
        [wd.MANIFEST_NAME, *(b.file for b in delta.manifest.buckets)])


def test_a_full_sync_needs_no_base_and_a_snapshot_follows_confirmed_deltas():
    rng = np.random.default_rng(2)
    v1 = {"a": _random((170, 30), BF16, rng), "b": _random((5,), np.dtype(np.float32), rng)}
    full, stats = wd.encode_delta(None, v1, "1", bucket_bytes=4000)
    assert full.manifest.base_version is None and stats.changed_fraction == 1.0
    _same_bytes(wd.apply_delta({}, full, "whatever the engine held"), v1)
    snapshot = wd.WeightSnapshot("0", {}).after(full, v1)
    v2 = {"a": _changed(v1["a"], 0.1, rng), "b": v1["b"]}
    delta, stats = wd.encode_delta(snapshot, v2, "2")
    assert stats.bytes < stats.full_bytes and 0 < stats.changed_fraction < 0.2
    assert {t.name: t.encoding for t in delta.manifest.tensors} == {"a": wd.Encoding.SPARSE, "b": wd.Encoding.UNCHANGED}
    assert set(stats.metrics()) == {"sync/bytes", "sync/full_bytes", "sync/changed_fraction", "sync/diff_s",
                                    "sync/encode_s"}
    snapshot = snapshot.after(delta, v2)
    assert snapshot.version == "2" and snapshot.checksum("a") == wd.tensor_checksum(v2["a"])
    with pytest.raises(wd.BaseMismatch):
        snapshot.after(delta, v2)  # a delta from version 1 cannot follow version 2
    with pytest.raises(wd.BaseMismatch, match="missing"):
        wd.encode_delta(snapshot, {"a": v2["a"]}, "3")
    with pytest.raises(wd.BaseMismatch, match="'b'"):
        wd.encode_delta(snapshot, {"a": v2["a"], "b": v2["b"].astype(BF16)}, "3")


def test_a_wrong_base_or_a_corrupt_delta_raises_and_changes_nothing(tmp_path):
    rng = np.random.default_rng(3)
    base = {"a": _random((40, 40), BF16, rng), "b": _random((9,), np.dtype(np.float32), rng)}
    new = {"a": _changed(base["a"], 0.05, rng), "b": _changed(base["b"], 0.3, rng)}
    delta, _ = wd.encode_delta(wd.WeightSnapshot("7", base), new, "8", bucket_bytes=128)
    before = {k: v.copy() for k, v in base.items()}

    with pytest.raises(wd.BaseMismatch, match="applies to version 7; this engine holds version 6"):
        wd.apply_delta(base, delta, "6")
    diverged = {**base, "a": _changed(base["a"], 0.01, rng)}  # the engine does not hold what the trainer thinks
    with pytest.raises(wd.ChecksumMismatch) as err:
        wd.apply_delta(diverged, delta, "7")
    assert err.value.tensors == ("a",)
    (chunk, *_), *_ = delta.buckets
    flipped = chunk.values.copy()
    flipped[0] ^= 1
    corrupt = wd.WeightDelta(delta.manifest, ((wd.Chunk(chunk.record, flipped, chunk.gaps), *delta.buckets[0][1:]),
                                              *delta.buckets[1:]))
    with pytest.raises(wd.ChecksumMismatch):
        wd.apply_delta(base, corrupt, "7")
    far = chunk.gaps.copy()
    far[-1] = np.iinfo(far.dtype).max
    with pytest.raises(wd.MalformedDelta, match="past its 1600 elements|not increasing"):
        wd.apply_delta(base, wd.WeightDelta(delta.manifest, ((wd.Chunk(chunk.record, chunk.values, far),
                                                              *delta.buckets[0][1:]), *delta.buckets[1:])), "7")
    with pytest.raises(wd.BaseMismatch, match="'a'"):
        wd.apply_delta({"b": base["b"]}, delta, "7")
    _same_bytes(base, before)

    # Files: a bucket of another delta, a missing file, a manifest of another format.
    saved = wd.save_delta(delta, tmp_path / "d8")
    other, _ = wd.encode_delta(wd.WeightSnapshot("7", base), new, "9", bucket_bytes=128)
    other_dir = wd.save_delta(other, tmp_path / "d9")
    (saved / delta.manifest.buckets[0].file).write_bytes((other_dir / other.manifest.buckets[0].file).read_bytes())
    with pytest.raises(wd.MalformedDelta, match="another delta"):
        wd.load_delta(saved)
    (saved / delta.manifest.buckets[0].file).unlink()
    with pytest.raises(wd.MalformedDelta, match="missing"):
        wd.load_delta(saved)
    (saved / wd.MANIFEST_NAME).write_text(delta.manifest.to_json().replace(wd.FORMAT, "something.v0"))
    with pytest.raises(wd.MalformedDelta, match="something.v0"):
        wd.load_delta(saved)
    assert all(issubclass(e, wd.WeightDeltaError) and issubclass(e, ValueError)
               for e in (wd.BaseMismatch, wd.ChecksumMismatch, wd.MalformedDelta))


_DTYPES = [BF16, np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32), np.dtype(np.bool_)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_change_pattern_round_trips_in_any_bucket_size(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    base, new = {}, {}
    for i in range(data.draw(st.integers(1, 4))):
        dtype = data.draw(st.sampled_from(_DTYPES))
        shape = tuple(data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
        bits = rng.integers(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=np.uint8)
        old = bits.view(dtype).reshape(shape) if dtype != np.bool_ else (bits % 2).astype(bool).reshape(shape)
        mask = rng.random(shape) < data.draw(st.sampled_from([0.0, 0.02, 0.5, 1.0]))
        noise = rng.integers(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=np.uint8)
        other = noise.view(dtype).reshape(shape) if dtype != np.bool_ else (noise % 2).astype(bool).reshape(shape)
        base[f"t{i}"], new[f"t{i}"] = old, np.where(mask, other, old)
    _roundtrip(base, new, bucket_bytes=data.draw(st.sampled_from([16, 50, 333, 1 << 16])),
               compact=data.draw(st.booleans()))


def test_compact_deltas_send_an_ulp_move_as_one_byte_and_a_one_byte_gap():
    """Between two RL steps a bf16 weight moves by about an ulp: its low byte changes, its high byte stays."""
    rng = np.random.default_rng(11)
    w = rng.normal(0, 0.02, (512, 1024)).astype(BF16)
    moved = w.copy().reshape(-1)
    idx = np.sort(rng.choice(moved.size, moved.size // 50, replace=False))  # 2% of the elements
    moved.view(np.uint16)[idx] ^= 1  # one ulp
    moved[idx[::100]] *= -1  # a few sign flips: those bytes go as the high plane
    base, new = {"w": w}, {"w": moved.reshape(w.shape)}
    v1 = _roundtrip(base, new)
    compact = _roundtrip(base, new, compact=True)
    (record,) = compact.manifest.tensors
    assert record.encoding is wd.Encoding.PLANES and set(compact.manifest.features) == {wd.BYTE_PLANES, wd.U8_GAPS}
    planes = {c.record.plane for b in compact.buckets for c in b}
    assert planes == {0, 1}
    changed = len(idx)
    assert v1.payload_bytes == changed * 4  # 2-byte values, 16-bit gaps
    assert compact.payload_bytes < changed * 2.1  # 1-byte values, 1-byte gaps (the high plane's are few)
    loaded = wd.load_delta(wd.save_delta(compact, Path(tempfile.mkdtemp()) / "d"))
    assert loaded.manifest == compact.manifest
    _same_bytes({**base, **wd.apply_delta(base, loaded, "3")}, new)


def test_a_reader_refuses_a_feature_it_lacks_or_one_the_manifest_does_not_declare():
    rng = np.random.default_rng(12)
    base = {"w": rng.normal(0, 0.02, (300,)).astype(BF16)}
    new = {"w": base["w"].copy()}
    new["w"].view(np.uint16)[::7] ^= 1
    delta, _ = wd.encode_delta(wd.WeightSnapshot("3", base), new, "4", compact=True)
    assert delta.manifest.features
    future = dataclasses.replace(delta.manifest, features=(*delta.manifest.features, "zstd"))
    with pytest.raises(wd.MalformedDelta, match="features \\['zstd'\\], which this reader lacks"):
        wd.DeltaManifest.from_json(future.to_json())
    undeclared = dataclasses.replace(delta.manifest, features=())
    with pytest.raises(wd.MalformedDelta, match="planes|U8"):
        undeclared.check()
    # A plain v1 manifest has no "plane" keys (a v1 reader sees nothing new).
    plain, _ = wd.encode_delta(wd.WeightSnapshot("3", base), new, "4")
    assert '"plane"' not in plain.manifest.to_json() and '"plane"' in delta.manifest.to_json()


# ---------------------------------------------------------------------------------------------------- the engine

ENGINE = dict(max_batch=4, max_seq_len=64, min_kv_bucket=64, decode_batch_sizes=(4,), param_dtype="bfloat16",
              tp_size=2, dp_size=2, device_ids=(0, 1, 2, 3))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("weight_delta") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with EmbeddedEngine(str(tiny_dir), config=EngineOptions(**ENGINE)) as embedded:
        yield embedded


def _trainer(tiny_dir: Path):
    """The tiny model in float32, laid out like a trainer's (fsdp over devices 4-7, apart from the engine's)."""
    model = from_hf(str(tiny_dir))

    class Sizes:
        mesh_data, mesh_fsdp, mesh_tensor = 1, 4, 1

    shard_model(model, build_mesh(Sizes, jax.local_devices()[4:8]), DEFAULT_RULES)
    return model


def _rl_step(model, rng: np.random.Generator) -> None:
    """Move the weights as an RL step at a small learning rate does: every weight by ~1e-6, 1% of them by ~1%."""
    state = nnx.state(model, nnx.Param)

    def step(x):
        host = np.asarray(jax.device_get(x))
        moved = host + rng.normal(0, 1e-6, host.shape).astype(host.dtype)
        pick = rng.random(host.shape) < 0.01
        moved = np.where(pick, moved * (1 + rng.uniform(-0.02, 0.02, host.shape)).astype(host.dtype), moved)
        return jax.device_put(moved, x.sharding)

    nnx.update(model, jax.tree.map(step, state))


async def _swap_in(url: str, name: str, version: str) -> None:
    client = SGLangClient(url)
    try:
        await client.sync_weights_from_disk(name, version, load_format=IN_MEMORY_LOAD_FORMAT, flush_poll_s=0.05)
    finally:
        await client.close()


def test_twenty_delta_syncs_leave_the_engine_equal_to_one_loaded_from_the_full_export(tiny_dir, engine, tmp_path):
    core = engine.engine
    trainer = _trainer(tiny_dir)
    rng = np.random.default_rng(4)
    like = core.runner.params

    def sync(snapshot: wd.WeightSnapshot | None, version: int, via_disk: bool):
        new = serving_tensors(nnx.state(trainer, nnx.Param), like, via_dtype=jnp.bfloat16)
        delta, stats = wd.encode_delta(snapshot, new, str(version), bucket_bytes=64 << 10)
        if via_disk:  # as an external engine would receive it
            delta = wd.load_delta(wd.save_delta(delta, tmp_path / f"delta_v{version}"))
        core.stage_delta(f"delta_v{version}", delta)
        asyncio.run(_swap_in(engine.url, f"delta_v{version}", str(version)))
        for replica in range(len(core.runners)):  # each replica answers what it holds
            assert wd.checksum_mismatches(delta.manifest, core.weight_checksums(replica)) == []
        return (snapshot or wd.WeightSnapshot("", {})).after(delta, new), stats

    snapshot, full = sync(None, 1, via_disk=False)  # the first sync is full
    assert full.changed_fraction == 1.0
    fractions = []
    for version in range(2, 22):
        _rl_step(trainer, rng)
        snapshot, stats = sync(snapshot, version, via_disk=version % 5 == 0)
        fractions.append(stats.changed_fraction)
        assert stats.bytes < 0.2 * stats.full_bytes
    assert all(0.005 < f < 0.05 for f in fractions), fractions
    assert core.scheduler.weight_version == "21"

    export = to_hf(trainer, tmp_path / "full_export", dtype=jnp.bfloat16, copy_from=str(tiny_dir))
    fresh = Engine(export, EngineOptions(**ENGINE))
    for synced, loaded in zip(core.runners, fresh.runners, strict=True):
        _same_bytes(host_tensors(synced.params), host_tensors(loaded.params))
        _same_bytes(host_tensors(synced.params), snapshot.tensors)


def test_the_engine_refuses_a_delta_on_another_base_and_keeps_its_weights(tiny_dir, engine):
    core = engine.engine
    new = serving_tensors(nnx.state(from_hf(str(tiny_dir)), nnx.Param), core.runner.params, via_dtype=jnp.bfloat16)
    full, _ = wd.encode_delta(None, new, "100")
    core.stage_delta("full_v100", full)
    asyncio.run(_swap_in(engine.url, "full_v100", "100"))
    snapshot = wd.WeightSnapshot("", {}).after(full, new)
    moved = {**new, "embed_vd": _changed(new["embed_vd"], 0.01, np.random.default_rng(5))}
    delta, _ = wd.encode_delta(snapshot, moved, "101")
    stale, _ = wd.encode_delta(wd.WeightSnapshot("99", new), moved, "101")
    with pytest.raises(wd.BaseMismatch, match="applies to version 99; this engine holds version 100"):
        core.stage_delta("stale", stale)
    # Staged on version 100, but version 102 is swapped in first: the update refuses the delta.
    core.stage_delta("delta_v101", delta)
    core.stage_delta("full_v102", full)
    asyncio.run(_swap_in(engine.url, "full_v102", "102"))
    with pytest.raises(Exception, match="a delta on version 100, but this replica serves version 102"):
        asyncio.run(_swap_in(engine.url, "delta_v101", "101"))
    assert core.scheduler.weight_version == "102"
    assert wd.checksum_mismatches(full.manifest, core.weight_checksums(0)) == []


def _bump(model, name: str, factor: float) -> None:
    """Scale the first row of the trainer's parameter `name` (one tensor changes, the others keep their bytes)."""
    state = nnx.state(model, nnx.Param)
    var = dict(nnx.to_flat_state(state))[tuple(int(p) if p.isdigit() else p for p in name.split("/"))]
    value = var.get_value()
    host = np.array(jax.device_get(value))
    host[0] *= factor
    var.set_value(jax.device_put(host, value.sharding))
    nnx.update(model, state)


def test_the_syncer_sends_deltas_and_resends_in_full_when_the_engine_holds_other_bytes(tiny_dir, engine, tmp_path):
    from jaxrl_vlm.weight_sync import WeightSyncer

    core = engine.engine
    trainer = _trainer(tiny_dir)
    rng = np.random.default_rng(6)

    async def tamper(syncer: WeightSyncer, name: str) -> None:
        """The engine's `name` changes behind the trainer's back; the engine still reports the same version."""
        snapshot = syncer.snapshot
        moved = {**snapshot.tensors, name: _changed(snapshot.tensors[name], 0.05, rng)}
        core.stage_delta("tamper", wd.encode_delta(snapshot, moved, snapshot.version)[0])
        await syncer.client.sync_weights_from_disk("tamper", snapshot.version, load_format=IN_MEMORY_LOAD_FORMAT)

    async def scenario():
        client = SGLangClient(engine.url)
        client.local_engine = core
        syncer = WeightSyncer(client, tmp_path / "sync", mode="delta", dtype=jnp.bfloat16, flush_poll_s=0.05,
                              delta_bucket_bytes=64 << 10)
        try:
            reports = [await syncer.push(trainer, 300)]
            for version in (301, 302):
                _rl_step(trainer, rng)
                reports.append(await syncer.push(trainer, version))
            # A tensor the next delta leaves alone differs in the engine: the checksums catch it after the update.
            await tamper(syncer, "final_norm/scale")
            _bump(trainer, "embed_vd", 1.05)
            reports.append(await syncer.push(trainer, 303))
            # A tensor the next delta changes differs in the engine: the apply refuses it, nothing is swapped in.
            await tamper(syncer, "embed_vd")
            _bump(trainer, "embed_vd", 1.05)
            reports.append(await syncer.push(trainer, 304))
            return syncer, reports
        finally:
            await client.close()

    syncer, reports = asyncio.run(scenario())
    metrics = [r.metrics() for r in reports]
    assert [m["sync/delta"] for m in metrics] == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert [m["sync/checksum_mismatches"] for m in metrics] == [0, 0, 0, 1, 2]
    assert all(m["sync/bytes"] < 0.2 * m["sync/full_bytes"] for m in metrics[1:3])
    assert all(m["sync/in_memory"] == 1.0 and m["sync/gbytes"] * 1e9 >= m["sync/bytes"] for m in metrics)
    assert syncer.snapshot.version == "304" and core.scheduler.weight_version == "304"
    assert all(r.delta.delta is None and r.delta.tensors is None for r in syncer.history)  # the snapshot holds them
    want = serving_tensors(nnx.state(trainer, nnx.Param), core.runner.params, via_dtype=jnp.bfloat16)
    _same_bytes(syncer.snapshot.tensors, want)
    for runner in core.runners:
        _same_bytes(host_tensors(runner.params), want)


# ---------------------------------------------------------------------------------------------------- fallbacks


async def _syncer(url: str, core, tmp_path: Path, mode: str = "delta", **kw):
    from jaxrl_vlm.weight_sync import WeightSyncer

    client = SGLangClient(url)
    client.local_engine = core
    # retry_wait_s: a retry in process restages at once; a wait would show as a slow test.
    return WeightSyncer(client, tmp_path / "sync", mode=mode, dtype=jnp.bfloat16, flush_poll_s=0.05,
                        delta_bucket_bytes=64 << 10, retry_wait_s=60.0, **kw)


def test_a_delta_refused_at_the_swap_goes_again_in_full(tiny_dir, engine, tmp_path):
    core = engine.engine
    trainer = _trainer(tiny_dir)
    rng = np.random.default_rng(7)

    async def scenario():
        syncer = await _syncer(engine.url, core, tmp_path)
        try:
            await syncer.push(trainer, 400)
            _rl_step(trainer, rng)
            staged = syncer.export(trainer, 401)  # a delta on version 400, staged
            assert staged.delta is not None and not staged.delta.full
            # Another version is swapped in before the delta's turn: the swap refuses it.
            other = serving_tensors(nnx.state(from_hf(str(tiny_dir)), nnx.Param), core.runner.params,
                                    via_dtype=jnp.bfloat16)
            core.stage_delta("other", wd.encode_delta(None, other, "999")[0])
            await _swap_in(engine.url, "other", "999")
            report = await asyncio.wait_for(syncer.load(staged), 30)  # no 60 s retry wait
            return syncer, report
        finally:
            await syncer.client.close()

    syncer, report = asyncio.run(scenario())
    m = report.metrics()
    assert report.attempts == 2 and "a delta on version 400" in report.errors[0]
    assert (m["sync/delta"], m["sync/full_resyncs"], m["sync/checksum_mismatches"]) == (0.0, 1.0, 0.0)
    assert m["sync/bytes"] > m["sync/full_bytes"]  # the refused delta and the full sync both crossed
    assert core.scheduler.weight_version == "401" and syncer.snapshot.version == "401"
    want = serving_tensors(nnx.state(trainer, nnx.Param), core.runner.params, via_dtype=jnp.bfloat16)
    for runner in core.runners:
        _same_bytes(host_tensors(runner.params), want)


@pytest.mark.parametrize("mode", ["memory", "delta"])
def test_a_retry_after_a_failed_swap_stages_the_version_again(tiny_dir, engine, tmp_path, monkeypatch, mode):
    """The swap takes the staged weights before it fails: the retry must send them again, not swap in nothing."""
    core = engine.engine
    trainer = _trainer(tiny_dir)
    failures = []
    set_params = type(core.runners[1]).set_params

    def fails_once(self, staged):
        if not failures:
            failures.append(self)
            raise RuntimeError("device lost mid-swap")
        set_params(self, staged)

    async def scenario():
        syncer = await _syncer(engine.url, core, tmp_path, mode=mode)
        try:
            await syncer.push(trainer, 500)
            _rl_step(trainer, np.random.default_rng(8))
            monkeypatch.setattr(type(core.runners[1]), "set_params", fails_once)
            return await asyncio.wait_for(syncer.push(trainer, 501), 30), syncer
        finally:
            await syncer.client.close()

    report, syncer = asyncio.run(scenario())
    assert report.attempts == 2 and "device lost mid-swap" in report.errors[0]
    assert core.scheduler.weight_version == "501"  # every replica, the one that failed included
    if mode == "delta":
        assert report.delta.full and syncer.full_resyncs == 1
    want = serving_tensors(nnx.state(trainer, nnx.Param), core.runner.params, via_dtype=jnp.bfloat16)
    for runner in core.runners:
        _same_bytes(host_tensors(runner.params), want)


def test_a_killed_and_restarted_engine_gets_a_full_sync_then_deltas_again(tiny_dir, tmp_path):
    from jaxrl_vlm.weight_sync import WeightSyncer

    options = EngineOptions(max_batch=2, max_seq_len=64, min_kv_bucket=64, param_dtype="bfloat16")
    trainer = from_hf(str(tiny_dir))
    rng = np.random.default_rng(9)
    syncer = WeightSyncer(None, tmp_path / "sync", mode="delta", dtype=jnp.bfloat16, flush_poll_s=0.05,
                          delta_bucket_bytes=64 << 10)

    async def push_versions(embedded: EmbeddedEngine, versions: range) -> list[dict[str, float]]:
        # As the job does after a relaunch: a new client for the engine's new address.
        syncer.client = SGLangClient(embedded.url)
        syncer.client.local_engine = embedded.engine
        try:
            metrics = []
            for version in versions:
                _rl_step(trainer, rng)
                metrics.append((await syncer.push(trainer, version)).metrics())
            return metrics
        finally:
            await syncer.client.close()

    with EmbeddedEngine(str(tiny_dir), config=options) as first:
        before = asyncio.run(push_versions(first, range(1, 4)))
    # Killed; a new engine starts from the checkpoint, at its startup version.
    with EmbeddedEngine(str(tiny_dir), config=options) as restarted:
        assert restarted.engine.weight_version == "default"
        after = asyncio.run(push_versions(restarted, range(4, 7)))
        held = host_tensors(restarted.engine.runner.params)
    assert [m["sync/delta"] for m in before + after] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert [m["sync/full_resyncs"] for m in before + after] == [0, 0, 0, 1, 1, 1]
    assert all(m["sync/checksum_mismatches"] == 0 for m in before + after)
    _same_bytes(held, serving_tensors(nnx.state(trainer, nnx.Param), restarted.engine.runner.params,
                                      via_dtype=jnp.bfloat16))


# ---------------------------------------------------------------------------------------------------- in process


def test_the_weight_update_calls_reach_the_engine_in_process_without_http(tiny_dir, engine, monkeypatch):
    core = engine.engine
    sent = []
    request = SGLangClient._request

    async def recording(self, method, url, path, **kw):
        sent.append(path)
        return await request(self, method, url, path, **kw)

    monkeypatch.setattr(SGLangClient, "_request", recording)
    core.stage_weights("in_process", from_hf(str(tiny_dir)), via_dtype=jnp.bfloat16)

    async def scenario():
        client = SGLangClient(engine.url)
        client.local_engine = core
        try:
            await client.sync_weights_from_disk("in_process", "600", load_format=IN_MEMORY_LOAD_FORMAT)
            return await client.get_weight_versions()
        finally:
            await client.close()

    assert asyncio.run(scenario()) == {engine.url: "600"}
    assert sent == []  # pause, flush, update, continue and the version check: none went over HTTP


def test_in_memory_staging_copies_once_into_fresh_buffers_with_the_transfer_paths_bytes():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxrl_vlm.engine.weights import place_weights

    devices = jax.local_devices()[:4]
    rng = np.random.default_rng(10)
    host = [rng.normal(0, 1, (8, 12)).astype(np.float32) for _ in range(3)]
    rows = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P("x", None))
    cols = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P(None, "x"))
    elsewhere = NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()[4:8]), ("x",)), P("x", None))
    sources = [jax.device_put(h, rows) for h in host]  # the trainer's arrays
    for via, target_dtype in [(None, jnp.float32), (None, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]:
        want = [np.asarray(h.astype(via or np.float32).astype(target_dtype)) for h in host]  # numpy's casts
        for sharding in (cols, elsewhere):  # one device set (one program, resharded), another (a transfer)
            targets = [jax.ShapeDtypeStruct(h.shape, target_dtype, sharding=sharding) for h in host]
            placed = place_weights(sources, targets, via)
            for got, src, w in zip(placed, sources, want):
                assert got.sharding == sharding and got.dtype == target_dtype
                assert np.asarray(got).tobytes() == w.tobytes()
                # Fresh buffers: donating the trainer's (its next train step) leaves the engine's alive.
                assert {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}.isdisjoint(
                    {s.data.unsafe_buffer_pointer() for s in src.addressable_shards})
    donate = jax.jit(lambda xs: [x * 2 for x in xs], donate_argnums=0)
    placed = place_weights(sources, [jax.ShapeDtypeStruct(h.shape, jnp.float32, sharding=rows) for h in host])
    donate(sources)
    assert all(s.is_deleted() for s in sources) and not any(p.is_deleted() for p in placed)
    assert np.asarray(placed[0]).tobytes() == host[0].tobytes()


def test_weight_sync_mode_delta_is_an_option_and_auto_stays_the_default():
    from jaxrl_vlm.config import load_config

    assert load_config(None, []).engine.weight_sync_mode == "auto"
    assert load_config(None, ["--weight-sync-mode", "delta"]).engine.weight_sync_mode == "delta"



def test_shared_staging_hands_over_the_arrays_that_fit_and_copies_the_others():
    """`may_alias` (a trainer that keeps its parameters): an array already in its target's dtype and layout is served
    as it is, the others are placed as before (a cast, a rounding through the sync dtype, another layout)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxrl_vlm.engine.weights import place_weights

    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("x",))
    rows, cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))
    host = np.random.default_rng(11).normal(0, 1, (8, 12)).astype(np.float32)
    source = jax.device_put(host, rows)
    same_layout = NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("engine_tp",)), P("engine_tp"))
    cases = [  # (target dtype, target sharding, via dtype) -> handed over?
        (jnp.float32, rows, None, True), (jnp.float32, same_layout, jnp.float32, True),
        (jnp.bfloat16, rows, None, False), (jnp.float32, rows, jnp.bfloat16, False), (jnp.float32, cols, None, False)]
    for dtype, sharding, via, shared in cases:
        got = place_weights([source], [jax.ShapeDtypeStruct(host.shape, dtype, sharding=sharding)], via, may_alias=True)[0]
        assert (got is source) == shared, (dtype, sharding, via)
        want = host.astype(via or np.float32).astype(dtype)
        assert got.dtype == dtype and np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_a_step_that_keeps_its_parameters_leaves_them_alive_and_still_donates_the_rest(monkeypatch, sharded):
    """`compile_train_step(donate_params=False)`: the engine may serve the old parameters while the step runs and after
    it (they are not deleted), the optimizer state is still donated, and the step computes what the donating one does."""
    from jaxrl_vlm.rl import train_step as ts

    def fake_step(graphdef, tx, cfg, state, batch, old_logprobs=None, ref_logprobs=None, frozen=None, teacher=None, *,
                  teacher_graphdef=None):
        moved = jax.tree.map(lambda p: p + batch, state.params)
        return state._replace(params=moved, opt_state=jax.tree.map(lambda m: m * 2, state.opt_state),
                              step=state.step + 1), {"train/loss": batch}

    monkeypatch.setattr(ts, "train_step", fake_step)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def fresh():
        return ts.TrainState(params={"w": jnp.arange(4.0)}, opt_state={"m": jnp.ones(4)}, step=jnp.zeros((), jnp.int32),
                             rng=jnp.zeros(2, jnp.uint32))

    kw = dict(state_shardings=jax.tree.map(lambda _: one, fresh()), batch_shardings=lambda tree: one) if sharded else {}
    results = {}
    for donate in (True, False):
        state = fresh()
        new, metrics = ts.compile_train_step(None, None, None, donate_params=donate, **kw)(state, jnp.float32(0.5))
        assert state.params["w"].is_deleted() == donate and state.opt_state["m"].is_deleted()
        results[donate] = (np.asarray(new.params["w"]), np.asarray(new.opt_state["m"]), int(new.step))
    assert all(np.array_equal(a, b) for a, b in zip(results[True], results[False]))


def test_the_engine_serves_the_arrays_of_a_trainer_that_shares_them(tiny_dir, engine, tmp_path):
    """`WeightSyncer.can_share`: the trainer's parameters already in the engine's dtype and its first replica's
    layout are served as they are after a memory sync with `share_trainer_arrays` (no copy); the other replica, on
    other devices, gets copies. A trainer in another dtype (the run's float32 against bf16 engine weights) cannot
    share, and its step keeps donating."""
    from jaxrl_vlm.engine.weights import param_arrays
    from jaxrl_vlm.weight_sync import WeightSyncer

    core = engine.engine
    trainer = from_hf(str(tiny_dir))
    served = param_arrays(core.runners[0].params)
    as_loaded = jax.tree.map(lambda x: x, nnx.state(trainer, nnx.Param))  # float32, on one device
    fits = jax.tree.map(lambda x: x, nnx.state(trainer, nnx.Param))
    for path, var in nnx.to_flat_state(fits):
        var.set_value(jax.device_put(var.get_value().astype(served[path].dtype), served[path].sharding))
    nnx.update(trainer, fits)

    async def scenario():
        client = SGLangClient(engine.url)
        client.local_engine = core
        syncer = WeightSyncer(client, tmp_path / "sync", mode="memory", dtype=jnp.bfloat16, flush_poll_s=0.05)
        try:
            assert not syncer.can_share(as_loaded)  # float32 for bf16 weights: a cast is needed
            assert not WeightSyncer(client, tmp_path / "d", mode="delta").can_share(nnx.state(trainer, nnx.Param))
            assert syncer.can_share(nnx.state(trainer, nnx.Param))
            syncer.share_trainer_arrays = True
            await syncer.push(trainer, 700)
        finally:
            await client.close()

    asyncio.run(scenario())
    given = param_arrays(trainer)
    assert core.scheduler.weight_version == "700"
    assert all(x is given[p] for p, x in param_arrays(core.runners[0].params).items())
    other = param_arrays(core.runners[1].params)
    assert not any(x is given[p] for p, x in other.items())
    _same_bytes(host_tensors(core.runners[1].params), host_tensors(nnx.state(trainer, nnx.Param)))
