"""`--freeze-vision-tower` / `--freeze-vision-merger` (issue 52, item 6): the frozen part of the vision tower keeps the
checkpoint's bytes through training, has no optimizer state, is not in the train state's checkpoint (a resume reloads
it), and leaves every weight sync after the first (in memory the engine keeps its arrays; on disk the version lists
it as kept, and a restarted engine gets it back from the copy of the first version); the forward and the gradients
of what trains are the unfrozen run's; the final export still has the tower; LoRA adapters on a frozen part are
refused; a sharded layout trains with the tower frozen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_samples import train_samples
from flax import nnx

from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like
from jaxrl_vlm.config import load_config
from jaxrl_vlm.engine import EngineOptions
from jaxrl_vlm.engine.core import Engine
from jaxrl_vlm.engine.weights import load_params_state
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.models import families
from jaxrl_vlm.models.freezing import VISION_TOWER, frozen_parts, vision_parts
from jaxrl_vlm.models.hf_io import SafetensorsReader, abstract_model, from_hf, kept_tensors, to_hf
from jaxrl_vlm.tiny import make_tiny, tiny_model_config
from jaxrl_vlm.weight_sync import FROZEN_DIR, WeightSyncer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("freeze") / "model", seed=9)


@pytest.fixture(scope="module")
def samples(tiny_dir, make_test_image):
    return train_samples(tiny_dir, make_test_image)


def _argv(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    # Adam's first step with no clipping, no decay and eps >> |g| moves each weight by -lr * g / (|g| + eps) ~ -g:
    # the step's gradient, readable in the weights.
    return ["--hf-checkpoint", str(tiny_dir), "--lr", "1e8", "--adam-eps", "1e8", "--clip-grad", "0",
            "--weight-decay", "0", "--seq-buckets", "256", "--row-buckets", "16", "--patch-buckets", "128",
            "--logprob-chunk-size", "64", "--output-dir", str(out), *extra]


def _trainer(tiny_dir: Path, out: Path, *extra: str, devices: int = 1) -> Trainer:
    t = Trainer(load_config(None, _argv(tiny_dir, out, *extra)), devices=jax.devices()[:devices])
    t.build_policy(tiny_dir)
    return t


def _flat(state) -> dict[tuple, np.ndarray]:
    return {tuple(p): np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(state)}


def _opt_paths(opt_state) -> set[tuple]:
    """The parameter paths the optimizer state tracks (its moments are states shaped like the parameters)."""
    out = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        keys = tuple(k for k in (getattr(k, "key", getattr(k, "idx", None)) for k in path) if k is not None)
        if VISION_TOWER in keys and jnp.issubdtype(leaf.dtype, jnp.floating):
            out.add(keys[keys.index(VISION_TOWER):])
    return out


def test_every_family_has_a_vision_tower_and_mergers_found_by_structure():
    for name in families.FAMILIES:
        model = abstract_model(tiny_model_config(arch=name))
        tower, mergers = vision_parts(model)
        params = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[0] == VISION_TOWER}
        assert tower and mergers and tower | mergers == params and not tower & mergers, name
        assert all("merger" in "/".join(map(str, p)) for p in mergers), name
        parts = frozen_parts(model, vision_tower=True)
        assert parts.hf_keys and all(".visual." in k or k.startswith("visual.") for k in parts.hf_keys), name
        assert not any("merger" in k for k in parts.hf_keys), name


def test_five_steps_leave_the_frozen_tower_bit_identical_with_no_optimizer_state(tiny_dir, samples, tmp_path):
    frozen = _trainer(tiny_dir, tmp_path / "frozen", "--freeze-vision-tower")
    full = _trainer(tiny_dir, tmp_path / "full")
    tower, mergers = vision_parts(nnx.merge(frozen.graphdef, frozen.policy_params()))
    assert frozen.frozen_parts.paths == tower
    start = _flat(frozen.policy_params())
    trained = _flat(frozen.state.params)
    assert not tower & set(trained) and mergers <= set(trained)
    # No optimizer state for the tower: Adam's moments track exactly the trained parameters.
    assert _opt_paths(frozen.state.opt_state) == mergers
    moments = [x for x in jax.tree.leaves(frozen.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in trained.values())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(frozen.frozen))  # kept in --param-dtype

    # The first step: the same forward (losses) and, for every trained parameter, the same gradient.
    a, b = frozen.train_on(samples), full.train_on(samples)
    for key in ("train/loss_total", "train/pg_loss", "train/entropy_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    after_frozen, after_full = _flat(frozen.policy_params()), _flat(full.policy_params())
    moved = []
    for path, value in after_frozen.items():
        if path in tower:
            assert not np.array_equal(after_full[path], start[path]), path  # the unfrozen run trains it
            continue
        np.testing.assert_allclose(value - start[path], after_full[path] - start[path], rtol=1e-4, atol=1e-9,
                                   err_msg=str(path))
        moved.append(not np.array_equal(value, start[path]))
    assert np.mean(moved) > 0.8

    for _ in range(4):
        assert frozen.train_on(samples)["train/skipped_nonfinite"] == 0.0
    end = _flat(frozen.policy_params())
    assert all(np.array_equal(end[p], start[p]) for p in tower), "a frozen tower parameter changed"
    assert np.mean([not np.array_equal(end[p], start[p]) for p in trained]) > 0.8, "the rest did not train"
    assert any(not np.array_equal(end[p], start[p]) for p in mergers)

    # The final export has the tower, with the checkpoint's bytes.
    export = to_hf(frozen.policy_model(), tmp_path / "final_model", dtype=jnp.float32, copy_from=str(tiny_dir))
    original, exported = SafetensorsReader(tiny_dir), SafetensorsReader(export)
    assert frozen.frozen_parts.hf_keys <= set(exported.keys())
    for key in frozen.frozen_parts.hf_keys:
        np.testing.assert_array_equal(exported.get(key), original.get(key).astype(np.float32), err_msg=key)

    # A checkpoint holds the trained state only; a resumed run reloads the tower from --hf-checkpoint.
    store = CheckpointStore(tmp_path / "ckpt", keep=1)
    store.save(5, frozen.state, {"weight_version": 5})
    store.close()
    resumed = _trainer(tiny_dir, tmp_path / "resumed", "--freeze-vision-tower")
    reader = CheckpointStore(tmp_path / "ckpt", read_only=True)
    _, resumed.state, _ = reader.restore(abstract_like(resumed.state))
    reader.close()
    again = _flat(resumed.policy_params())
    assert all(np.array_equal(again[p], end[p]) for p in end)


def test_the_merger_freezes_on_its_own_and_both_flags_freeze_the_whole_tower(tiny_dir, tmp_path):
    t = _trainer(tiny_dir, tmp_path / "run", "--freeze-vision-merger")
    tower, mergers = vision_parts(nnx.merge(t.graphdef, t.policy_params()))
    assert t.frozen_parts.paths == mergers and _opt_paths(t.state.opt_state) == tower
    assert set(_flat(t.frozen)) == mergers
    both = _trainer(tiny_dir, tmp_path / "both", "--freeze-vision-merger", "--freeze-vision-tower")
    assert both.frozen_parts.paths == tower | mergers and not _opt_paths(both.state.opt_state)


def test_lora_adapters_on_a_frozen_part_are_refused_naming_both_flags(tiny_dir, tmp_path):
    lora = ("--lora-rank", "2", "--lora-vision")
    with pytest.raises(ConfigError, match=r"--freeze-vision-tower.*--lora-vision"):
        _trainer(tiny_dir, tmp_path / "a", "--freeze-vision-tower", *lora)
    with pytest.raises(ConfigError, match=r"model\.visual\.merger"):
        _trainer(tiny_dir, tmp_path / "b", "--freeze-vision-merger", "--lora-rank", "2",
                 "--lora-modules-to-save", "model.visual.merger.norm")
    # LoRA that adapts only the text decoder (the default) leaves the frozen tower as it is.
    t = _trainer(tiny_dir, tmp_path / "c", "--freeze-vision-tower", "--lora-rank", "2")
    assert not any(s.vision for s in t.lora.sites)


def test_a_sharded_layout_trains_with_the_tower_frozen(tiny_dir, samples, tmp_path):
    t = _trainer(tiny_dir, tmp_path / "run", "--freeze-vision-tower", "--mesh-config",
                 str(REPO / "configs" / "mesh" / "fsdp_tp.yaml"), devices=8)
    assert dict(t.mesh.shape)["fsdp"] * dict(t.mesh.shape)["tensor"] == 8
    sharded = [x for x in jax.tree.leaves(t.frozen) if len(x.sharding.device_set) > 1]
    assert sharded, "the frozen tower is not laid out on the mesh"
    start = _flat(t.frozen)
    assert t.train_on(samples)["train/skipped_nonfinite"] == 0.0
    assert all(np.array_equal(v, start[p]) for p, v in _flat(t.frozen).items())


class _LocalClient:
    """What `WeightSyncer` reads of the embedded engine's client (in-memory staging only)."""

    def __init__(self, engine: Engine):
        self.local_engine = engine


class _DiskEngines:
    """An engine over HTTP as `WeightSyncer` sees it: it loads directories (recorded) and reports versions."""

    link = None

    def __init__(self):
        self.loaded: list[Path] = []
        self.version = "0"

    async def sync_weights_from_disk(self, path, version, **_):
        self.loaded.append(Path(path))
        self.version = version

    async def get_weight_versions(self):
        return {"http://engine": self.version}


def test_syncs_after_the_first_leave_the_frozen_tower_out(tiny_dir, tmp_path):
    model = from_hf(str(tiny_dir))
    parts = frozen_parts(model, vision_tower=True)
    params = nnx.state(model, nnx.Param)

    # Disk: the first version carries the tower; once the engines loaded it, versions list it as kept instead.
    engines = _DiskEngines()
    syncer = WeightSyncer(engines, tmp_path / "sync", copy_from=str(tiny_dir), dtype=jnp.bfloat16, frozen=parts,
                          retries=0)
    first = asyncio.run(syncer.push(model, 1))
    assert first.frozen_left_out == 0 and parts.hf_keys <= set(SafetensorsReader(first.path).keys())
    copy = tmp_path / "sync" / FROZEN_DIR  # the tower, copied byte for byte out of version 1 (deleted later)
    full, tower_copy = SafetensorsReader(first.path), SafetensorsReader(copy)
    assert set(tower_copy.keys()) == parts.hf_keys
    assert all(np.array_equal(tower_copy.get(k), full.get(k)) for k in parts.hf_keys)
    second = asyncio.run(syncer.push(model, 2))
    names = set(SafetensorsReader(second.path).keys())
    assert not names & parts.hf_keys and kept_tensors(second.path) == parts.hf_keys
    assert kept_tensors(copy) == names
    left_out = second.frozen_left_out
    assert left_out == sum(v.size * 2 for p, v in _flat(params).items() if p in parts.paths)  # bf16
    assert second.metrics()["sync/frozen_gbytes_left_out"] == left_out / 1e9
    # A restarted engine (another version reported) gets the tower's copy first, then the version.
    engines.version, engines.loaded = "0", []
    assert asyncio.run(syncer.restore())
    assert engines.loaded == [copy, second.path] and engines.version == "2"
    # Our engine: the partial version keeps the tower it holds; after a restart the copy and then the version give
    # every tensor the trainer's bytes.
    zeros = jax.tree.map(jnp.zeros_like, params)
    kept = _flat(load_params_state(second.path, model.cfg, zeros))
    restored = _flat(load_params_state(second.path, model.cfg, load_params_state(copy, model.cfg, zeros)))
    for path, value in _flat(params).items():
        want = value.astype(jnp.bfloat16).astype(value.dtype)
        np.testing.assert_array_equal(kept[path], np.zeros_like(value) if path in parts.paths else want, str(path))
        np.testing.assert_array_equal(restored[path], want, err_msg=str(path))

    # In memory: the engine keeps its own tower arrays (shared, nothing crosses), the rest is the trainer's.
    engine = Engine(str(tiny_dir), EngineOptions(max_batch=2, max_seq_len=64, min_kv_bucket=64,
                                                 decode_batch_sizes=(2,), device_ids=(0,)))
    memory = WeightSyncer(_LocalClient(engine), tmp_path / "mem", dtype=jnp.float32, mode="memory", frozen=parts)
    memory.frozen_held = True
    report = memory.export(model, 3)
    assert report.in_memory and report.frozen_left_out > 0
    staged = dict(nnx.to_flat_state(engine._take_staged(report.path.name, 0)))
    served = dict(nnx.to_flat_state(engine.runners[0].params))
    for path in parts.paths:
        assert staged[path].get_value() is served[path].get_value(), path
    assert report.bytes_written + report.frozen_left_out == sum(v.nbytes for v in _flat(params).values())
