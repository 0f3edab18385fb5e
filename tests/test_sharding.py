"""Mesh layouts on 8 simulated CPU devices: same logits as one device, parameters split as the rules
say (checked on the placed arrays' shards), checkpoints loaded straight into their shards, batch rows
split, goldens that catch silent re-sharding, and the real 2B shape laid out without allocating.

To regenerate the goldens after an intended layout change:
    jaxrl-vlm dump-shardings $(for f in configs/mesh/*.yaml; do echo --mesh-config $f; done) --out-dir tests/goldens/sharding
    for a in qwen2_5_vl qwen3_5 qwen3_vl_moe qwen3_5_moe; do jaxrl-vlm dump-shardings $(for f in configs/mesh/*.yaml; do echo --mesh-config $f; done) \
        --arch $a --out-dir tests/goldens/sharding/$a; done
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxrl_vlm.config import load_config
from jaxrl_vlm.models import Qwen3VL, build_vision_inputs, from_hf, get_rope_index, qwen3_vl_2b_instruct
from jaxrl_vlm.models.hf_io import abstract_model, param_count
from jaxrl_vlm.sharding import goldens as SG
from jaxrl_vlm.sharding import layout as SL
from jaxrl_vlm.sharding import rules as SR

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = sorted((REPO / "configs" / "mesh").glob("*.yaml"))
GOLDENS = REPO / "tests" / "goldens" / "sharding"
REGENERATE = (
    "jaxrl-vlm dump-shardings $(for f in configs/mesh/*.yaml; do echo --mesh-config $f; done) "
    "--out-dir tests/goldens/sharding  (and with --arch A --out-dir tests/goldens/sharding/A for A in qwen2_5_vl, "
    "qwen3_5, qwen3_vl_moe, qwen3_5_moe)"
)
# Goldens per family of the tiny model: Qwen3-VL at the top level, the others in their own folders.
GOLDEN_DIRS = {"qwen3_vl": GOLDENS, "qwen2_5_vl": GOLDENS / "qwen2_5_vl", "qwen3_5": GOLDENS / "qwen3_5",
               "qwen3_vl_moe": GOLDENS / "qwen3_vl_moe", "qwen3_5_moe": GOLDENS / "qwen3_5_moe"}
B, T, PATCH_BUCKET = 8, 40, 64


def _mesh_cfg(layout: Path):
    return load_config(None, ["--mesh-config", str(layout)]).mesh


def _sizes(**kw):
    sizes = types.SimpleNamespace(mesh_data=kw.get("data", 1), mesh_fsdp=kw.get("fsdp", 1), mesh_tensor=kw.get("tensor", 1))
    if "context" in kw:
        sizes.mesh_context = kw["context"]
    if "expert" in kw:
        sizes.mesh_expert = kw["expert"]
    return sizes


# ----------------------------------------------------------------------------- mesh and rules


def test_eight_simulated_devices():
    assert jax.device_count() == 8, "conftest must set XLA_FLAGS before jax is imported"


def test_mesh_sizes_fill_and_errors():
    assert SL.mesh_shape(_sizes(data=-1), 8) == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert SL.mesh_shape(_sizes(fsdp=-1, tensor=2), 8) == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    assert SL.mesh_shape(_sizes(data=2, fsdp=2, tensor=2), 8) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert SL.mesh_shape(_sizes(fsdp=2, context=-1), 8) == {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert SL.mesh_shape(_sizes(fsdp=-1, expert=2), 8) == {"data": 1, "fsdp": 4, "expert": 2, "context": 1, "tensor": 1}
    with pytest.raises(SR.ShardingError, match="does not divide the 8 devices"):
        SL.mesh_shape(_sizes(data=-1, tensor=3), 8)
    with pytest.raises(SR.ShardingError, match="at most one"):
        SL.mesh_shape(_sizes(data=-1, fsdp=-1), 8)
    with pytest.raises(SR.ShardingError, match="multiply to 4 but there are 8 devices"):
        SL.mesh_shape(_sizes(data=2, fsdp=2), 8)
    with pytest.raises(SR.ShardingError, match="positive or -1"):
        SL.mesh_shape(_sizes(data=0, fsdp=-1), 8)


def test_build_mesh_has_named_auto_axes():
    mesh = SL.build_mesh(_sizes(fsdp=-1, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 5  # with_sharding_constraint raises under Explicit axes
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    small = SL.build_mesh(_sizes(data=-1), devices=jax.devices()[:2])
    assert dict(small.shape) == {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    # context sits between fsdp and tensor: a context group is made of neighbouring devices.
    cp = SL.build_mesh(_sizes(fsdp=2, context=2, tensor=2))
    assert [d.id for d in cp.devices[0, 0, 0, :, 0]] == [0, 2]
    assert SL.sequence_shards(cp, SR.DEFAULT_RULES) == 2 and SL.row_multiple(cp, SR.DEFAULT_RULES) == 2
    # expert sits between fsdp and context; by default it is one more batch axis (the dense layers' view of it).
    ep = SL.build_mesh(_sizes(fsdp=2, expert=2, tensor=2))
    assert [d.id for d in ep.devices[0, 0, :, 0, 0]] == [0, 2]
    assert SL.row_multiple(ep, SR.DEFAULT_RULES) == 4 and SL.sequence_shards(ep, SR.DEFAULT_RULES) == 1


def test_rules_overrides_are_validated():
    rules = SR.resolve_rules({"vocab": ["fsdp", "tensor"], "embed": None, "mlp": []})
    assert rules["vocab"] == ("fsdp", "tensor") and rules["embed"] is None and rules["mlp"] is None
    assert rules["heads"] == SR.DEFAULT_RULES["heads"]
    with pytest.raises(SR.ShardingError, match="unknown logical axis 'embedding'"):
        SR.resolve_rules({"embedding": "fsdp"})
    with pytest.raises(SR.ShardingError, match=r"unknown mesh axes \['model'\]"):
        SR.resolve_rules({"embed": "model"})
    with pytest.raises(SR.ShardingError, match="repeats"):
        SR.resolve_rules({"embed": ["fsdp", "fsdp"]})
    # a bad rule in a layout file is a config error naming the key
    with pytest.raises(SR.ShardingError, match="'heads'"):
        SR.resolve_rules({"heads": 3})


def test_spec_resolution_drops_unit_axes_clashes_and_non_divisors():
    rules = SR.resolve_rules({"vocab": ["fsdp", "tensor"]})
    sizes = {"data": 1, "fsdp": 4, "tensor": 2}
    # rules-table lookup only
    assert SR.logical_to_spec(("embed", "heads", "head_dim"), rules) == P("fsdp", "tensor")
    # vocab takes fsdp x tensor; embed's fsdp is already used by dim 0, so embed stays whole
    spec, notes = SR.spec_with_notes(("vocab", "embed"), (1024, 64), rules, sizes)
    assert spec == P(("fsdp", "tensor")) and len(notes) == 1 and "already shard" in notes[0]
    # 4 heads over 8-way tensor: replicated with a note; MLP 128 over 8 is fine
    spec, notes = SR.spec_with_notes(("embed", "heads", "head_dim"), (64, 4, 16), SR.DEFAULT_RULES, {"tensor": 8, "fsdp": 1})
    assert spec == P() and "not divisible by 8" in notes[0]
    assert SR.spec_with_notes(("embed", "mlp"), (64, 128), SR.DEFAULT_RULES, {"tensor": 8, "fsdp": 1}) == (P(None, "tensor"), [])
    # a size-1 axis is a no-op and does not appear
    assert SR.spec_with_notes(("embed", "mlp"), (64, 128), SR.DEFAULT_RULES, {"data": 8, "fsdp": 1, "tensor": 1})[0] == P()
    with pytest.raises(SR.ShardingError, match="do not match shape"):
        SR.spec_with_notes(("embed",), (3, 4), SR.DEFAULT_RULES, sizes)


# ----------------------------------------------------------------------------- the tiny model on every layout


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_sharding"), seed=3)


@pytest.fixture(scope="module")
def batch(tiny_dir, make_test_image):
    """An [8, 40] right-padded batch with two images of different sizes in rows 0 and 5."""
    from jaxrl_vlm.models.hf_io import load_hf_config
    from rollout.processing import load_image_processor, process_images

    cfg = load_hf_config(tiny_dir)
    proc = process_images(load_image_processor(tiny_dir), [make_test_image(1, 64), make_test_image(2, (96, 64))])
    grid = proc["image_grid_thw"]
    rng = np.random.default_rng(0)
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.int32)
    image_rows = {0: 0, 5: 1}
    for row in range(B):
        ids = list(rng.integers(0, cfg.text.vocab_size - 20, size=int(rng.integers(6, 14))))
        if row in image_rows:
            n = int(np.prod(grid[image_rows[row]])) // cfg.vision.merge_unit
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        ids += list(rng.integers(0, cfg.text.vocab_size - 20, size=int(rng.integers(3, 10))))
        tokens[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    positions, _ = get_rope_index(tokens, grid, mask, cfg)
    vision = build_vision_inputs(proc["pixel_values"], grid, tokens, cfg, patch_bucket=PATCH_BUCKET, token_valid=mask)
    return tokens, positions.astype(np.int32), mask, vision


def _forward(model: Qwen3VL, tokens, positions, segment_ids, vision, *, shardings=None):
    """Logits of a jitted forward; with `shardings` = (params, tokens, positions, vision) in_shardings."""
    graphdef, state = nnx.split(model)

    def fwd(state, tokens, positions, segment_ids, vision):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens, positions, segment_ids, vision))

    if shardings is None:
        return np.asarray(jax.jit(fwd)(state, tokens, positions, segment_ids, vision))
    params, rows, positions_sh, vision_sh = shardings
    jitted = jax.jit(fwd, in_shardings=(params, rows, positions_sh, rows, vision_sh))
    return np.asarray(jitted(state, tokens, positions, segment_ids, vision))


@pytest.fixture(scope="module")
def single_device_logits(tiny_dir, batch):
    with jax.default_device(jax.devices()[0]):
        model = from_hf(tiny_dir)
        return _forward(model, *batch)


def _expected_ways(layout: Path, names, shape, mesh_sizes) -> list[int]:
    """Independent reading of a layout file: per dim, into how many pieces its rule should cut it."""
    overrides = yaml.safe_load(layout.read_text())["mesh"].get("sharding_rules") or {}
    used: set[str] = set()
    ways = []
    for name, size in zip(names, shape):
        rule = overrides.get(name, SR.DEFAULT_RULES[name])
        axes = [] if rule is None else [rule] if isinstance(rule, str) else list(rule)
        axes = [a for a in axes if a not in used]
        n = math.prod(mesh_sizes[a] for a in axes)
        if size % n:
            n, axes = 1, []
        used.update(axes)
        ways.append(n)
    return ways


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_layout_matches_single_device_and_shards_as_rules_say(layout, tiny_dir, batch, single_device_logits, monkeypatch):
    mesh_cfg = _mesh_cfg(layout)
    mesh = SL.build_mesh(mesh_cfg)
    rules = SR.resolve_rules(mesh_cfg.sharding_rules)
    from jaxrl_vlm.models.hf_io import load_hf_config

    cfg = load_hf_config(tiny_dir)

    # Load straight into shards, recording every host block the loader is asked for.
    real = jax.make_array_from_callback
    blocks: dict[tuple, list[tuple]] = {}

    def spy(shape, sharding, callback, *a, **kw):
        def cb(index):
            block = callback(index)
            blocks.setdefault((tuple(shape), sharding.spec), []).append(block.shape)
            return block

        return real(shape, sharding, cb, *a, **kw)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    model = from_hf(tiny_dir, shardings_for=SL.shardings_for(mesh, rules, cfg))
    monkeypatch.undo()

    want_shardings = dict(nnx.to_flat_state(SL.param_shardings(model, mesh, rules)))
    sizes = dict(mesh.shape)
    per_device = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        arr = var.get_value()
        names, shape = var.get_metadata()["out_sharding"], arr.shape
        assert arr.sharding == want_shardings[path].get_value(), path  # loader agrees with param_shardings
        ways = _expected_ways(layout, names, shape, sizes)
        shard_shape = tuple(s // w for s, w in zip(shape, ways))
        assert all(sh.data.shape == shard_shape for sh in arr.addressable_shards), (path, ways)
        for dim, w in enumerate(ways):
            starts = {sh.index[dim].start or 0 for sh in arr.addressable_shards}
            assert len(starts) == w, (path, dim)
        # the loader read only shard-sized blocks from the checkpoint, never the whole sharded tensor
        assert set(blocks[(tuple(shape), arr.sharding.spec)]) == {shard_shape}, path
        per_device += math.prod(shard_shape) * arr.dtype.itemsize
    assert per_device == SL.param_bytes_per_device(model, mesh, rules)

    tokens, positions, mask, vision = batch
    row_sh = SL.batch_sharding(mesh, rules, ndim=2, row_axis=0)
    pos_sh = SL.batch_sharding(mesh, rules, ndim=3, row_axis=1)
    vis_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), vision)
    params_sh = SL.param_shardings(model, mesh, rules)  # the model holds only Params: this is its whole state
    logits = _forward(model, tokens, positions, mask, vision, shardings=(params_sh, row_sh, pos_sh, vis_sh))
    real_tokens = mask.astype(bool)
    assert np.abs(single_device_logits).max() > 1.0  # non-trivial logits, so 1e-5 means something
    np.testing.assert_allclose(logits[real_tokens], single_device_logits[real_tokens], atol=1e-5, rtol=0)
    shards = SL.row_multiple(mesh, rules)
    assert jax.device_put(tokens, row_sh).addressable_shards[0].data.shape == (B // shards, T)


def test_every_layout_shards_something_except_dp():
    """Guards against a preset silently degenerating to replication (e.g. a typo in an axis size)."""
    from jaxrl_vlm.tiny import tiny_model_config

    model = abstract_model(tiny_model_config())
    total = param_count(model.cfg) * 4
    per_device = {}
    for layout in LAYOUTS:
        mesh_cfg = _mesh_cfg(layout)
        per_device[layout.stem] = SL.param_bytes_per_device(model, SL.abstract_mesh(mesh_cfg, 8), SR.resolve_rules(mesh_cfg.sharding_rules))
    assert per_device["dp"] == total
    assert per_device["fsdp"] < total / 7
    assert per_device["fsdp_tp"] < total / 5
    assert per_device["tp"] < total / 2


def test_shard_model_places_a_fresh_init():
    from jaxrl_vlm.tiny import init_tiny_model, tiny_model_config

    model = init_tiny_model(tiny_model_config(), seed=1)
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    mesh = SL.build_mesh(_sizes(fsdp=-1, tensor=2))
    SL.shard_model(model, mesh, SR.DEFAULT_RULES)
    q = model.layers[0].attn.q_kernel_dnh.get_value()
    assert q.sharding.spec == P("fsdp", "tensor") and q.addressable_shards[0].data.shape == (16, 2, 16)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(var.get_value()), before[path])
    # the from_hf callback resolves exactly when given a shape, and by table lookup without one
    lookup = SL.shardings_for(SL.build_mesh(_sizes(tensor=-1)), SR.DEFAULT_RULES)
    assert lookup(("embed", "heads", "head_dim"), (64, 4, 16)).spec == P()  # 4 heads on 8-way tensor: whole
    assert lookup(("embed", "heads", "head_dim")).spec == P(None, "tensor")


def test_optimizer_state_shards_like_its_parameters():
    import optax

    from jaxrl_vlm.tiny import init_tiny_model, tiny_model_config

    model = init_tiny_model(tiny_model_config(), seed=1)
    names = {n for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) for n in v.get_metadata()["out_sharding"]}
    activation_only = {SR.BATCH_AXIS, SR.SEQUENCE_AXIS, SR.PATCH_AXIS}
    assert names <= set(SR.PARAM_LOGICAL_AXES) and set(SR.DEFAULT_RULES) == set(SR.PARAM_LOGICAL_AXES) | activation_only
    mesh = SL.build_mesh(_sizes(fsdp=-1, tensor=2))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    state = nnx.state(optimizer)
    placed = jax.device_put(state, SL.state_shardings(state, mesh, SR.DEFAULT_RULES))
    flat = dict(nnx.to_flat_state(placed))
    for moment in ("mu", "nu"):
        arr = flat[("opt_state", 0, moment, "layers", 0, "mlp", "down_kernel_fd")].get_value()
        assert arr.sharding.spec == P("tensor", "fsdp") and arr.addressable_shards[0].data.shape == (64, 16)
    assert flat[("step",)].get_value().sharding.spec == P()  # unnamed counters are replicated


# ----------------------------------------------------------------------------- batches


def test_batch_tree_shardings_split_rows_only():
    mesh = SL.build_mesh(_sizes(data=2, fsdp=2, tensor=2))
    k, r, t, p = 2, 4, 16, 32
    tree = {
        "tokens": np.zeros((k, r, t), np.int32),
        "positions": np.zeros((k, 3, r, t), np.int32),
        "advantages": np.zeros((k, r, t), np.float32),
        "vision": {"pixel_values": np.zeros((k, p, 1536), np.float32), "image_token_index": np.zeros((k, p // 4), np.int32)},
        "num_tokens": np.zeros((), np.int32),
    }
    sh = SL.batch_shardings(tree, mesh)
    assert sh["tokens"].spec == P(None, ("data", "fsdp"))
    assert sh["positions"].spec == P(None, None, ("data", "fsdp"))
    assert sh["vision"]["pixel_values"].spec == P() and sh["num_tokens"].spec == P()
    placed = SL.put_batch(tree, mesh)
    assert placed["tokens"].addressable_shards[0].data.shape == (k, r // 4, t)
    assert placed["positions"].addressable_shards[0].data.shape == (k, 3, r // 4, t)
    assert SL.row_multiple(mesh) == 4
    with pytest.raises(SR.ShardingError, match=r"tokens has 6 rows .* not a multiple of the 4 batch shards"):
        SL.batch_shardings({"tokens": np.zeros((k, 6, t), np.int32)}, mesh)
    # a layout may move rows to other axes
    rows_on_data = SR.resolve_rules({"batch": "data"})
    assert SL.row_multiple(mesh, rows_on_data) == 2
    assert SL.batch_sharding(mesh, rows_on_data).spec == P(None, "data")


def test_activation_constraints_apply_only_inside_their_context():
    from jaxrl_vlm.models.activation_sharding import ROWS_MLP, activation_sharding, constrain
    from jaxrl_vlm.sharding.activations import ActivationSharding

    mesh = SL.build_mesh(_sizes(data=2, fsdp=2, tensor=2))
    spec = ActivationSharding.create(mesh, SR.resolve_rules())
    x = jax.device_put(np.ones((8, 4, 6), np.float32), NamedSharding(mesh, P()))
    assert constrain(x, ROWS_MLP) is x  # no context: the engine and eager code are untouched

    def f(a):
        with activation_sharding(spec):
            return constrain(a * 2.0, ROWS_MLP)

    out = jax.jit(f)(x)
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")
    assert out.addressable_shards[0].data.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.asarray(out), 2.0)
    # a dimension the mesh does not divide falls back to replicated, as for parameters
    odd = jax.jit(f)(jax.device_put(np.ones((6, 4, 5), np.float32), NamedSharding(mesh, P())))
    assert odd.sharding.spec == P()
    with activation_sharding(spec), pytest.raises(ValueError, match="do not match shape"):
        constrain(x, ("batch", None))
    off = load_config(None, ["--mesh-config", str(REPO / "configs/mesh/fsdp.yaml"), "--activation-constraints", "false"])
    assert ActivationSharding.from_config(off.mesh, mesh, SR.resolve_rules()) is None


# ----------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("arch", sorted(GOLDEN_DIRS))
def test_every_layout_has_a_golden(arch):
    assert LAYOUTS, "configs/mesh/ has no layouts"
    assert {p.stem for p in LAYOUTS} == {p.stem for p in GOLDEN_DIRS[arch].glob("*.json")}, f"regenerate with: {REGENERATE}"
    assert {"dp", "fsdp", "tp", "fsdp_tp"} <= {p.stem for p in LAYOUTS}


@pytest.mark.parametrize("arch", sorted(GOLDEN_DIRS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_layout_matches_its_golden(layout, arch):
    from jaxrl_vlm.tiny import tiny_model_config

    golden = json.loads((GOLDEN_DIRS[arch] / f"{layout.stem}.json").read_text())
    current = json.loads(SG.format_dump(SG.dump_shardings(tiny_model_config(arch=arch), _mesh_cfg(layout), 8)))
    diff = SG.diff_shardings(golden, current)
    assert not diff, (
        f"{layout.name} re-shards the tiny model ({len(diff)} changes):\n  " + "\n  ".join(diff[:40])
        + f"\nIf intended, regenerate the goldens: {REGENERATE}"
    )


def test_golden_diff_names_the_resharded_tensor():
    from jaxrl_vlm.tiny import tiny_model_config

    cfg = _mesh_cfg(REPO / "configs" / "mesh" / "fsdp_tp.yaml")
    golden = SG.dump_shardings(tiny_model_config(), cfg, 8)
    cfg.sharding_rules = dict(cfg.sharding_rules, mlp=None)
    diff = SG.diff_shardings(golden, SG.dump_shardings(tiny_model_config(), cfg, 8))
    assert "params.layers.0.mlp.gate_kernel_df.spec: golden ['fsdp', 'tensor'] != now ['fsdp', None]" in diff
    assert any(line.startswith("rules.mlp:") for line in diff)


def test_cli_dump_shardings_writes_the_golden(tmp_path, capsys):
    from jaxrl_vlm.cli import main

    layout = REPO / "configs" / "mesh" / "fsdp.yaml"
    assert main(["dump-shardings", "--mesh-config", str(layout), "--out", str(tmp_path / "fsdp.json")]) == 0
    assert (tmp_path / "fsdp.json").read_text() == (GOLDENS / "fsdp.json").read_text()
    assert main(["dump-shardings", "--mesh-config", str(layout), "--num-devices", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == {"data": 1, "fsdp": 6, "expert": 1, "context": 1, "tensor": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh:\n  mesh_data: 1\n  mesh_fsdp: -1\n  sharding_rules: {embeding: fsdp}\n")
    assert main(["dump-shardings", "--mesh-config", str(bad)]) == 2
    assert "unknown logical axis 'embeding'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real 2B shape


@pytest.fixture(scope="module")
def abstract_2b():
    return abstract_model(qwen3_vl_2b_instruct())


@pytest.mark.slow
def test_2b_fsdp_bytes_per_device_without_allocating():
    live_before = sum(a.nbytes for a in jax.live_arrays())
    cfg = qwen3_vl_2b_instruct()
    model = abstract_model(cfg)
    n = param_count(cfg)
    assert 2.10e9 < n < 2.15e9
    mesh_cfg = _mesh_cfg(REPO / "configs" / "mesh" / "fsdp.yaml")
    mesh = SL.build_mesh(mesh_cfg)
    rules = SR.resolve_rules(mesh_cfg.sharding_rules)
    ours = SL.param_bytes_per_device(model, mesh, rules)
    # JAX's own shard shapes for the same shardings, summed
    shardings = dict(nnx.to_flat_state(SL.param_shardings(model, mesh, rules)))
    by_jax = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        by_jax += math.prod(shardings[path].get_value().shard_shape(shape)) * 4
    assert ours == by_jax
    # 1/8 of the fp32 model per device, plus the vectors that stay whole (norms, biases): < 0.1% of the model
    assert 0 < ours - n * 4 / 8 < 0.001 * n * 4
    assert sum(a.nbytes for a in jax.live_arrays()) - live_before < 1e6  # nothing of the 8.5 GB was allocated


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_2b_needs_no_fallback_on_8_devices(layout, abstract_2b):
    """The presets divide every dimension of the real model they mean to split (fallbacks are for tiny models)."""
    mesh_cfg = _mesh_cfg(layout)
    layouts = SL.param_layouts(abstract_2b, SL.abstract_mesh(mesh_cfg, 8), SR.resolve_rules(mesh_cfg.sharding_rules))
    assert [(p.path, p.notes) for p in layouts if p.notes] == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: p.stem)
def test_qwen25_3b_falls_back_only_where_its_shape_cannot_split(layout):
    """Qwen2.5-VL-3B has 2 kv heads and a vision MLP of 3420 (= 4 * 855): an 8-way tensor axis cannot split
    those, and only those are replicated (with a note); every other layout splits it without a fallback."""
    from jaxrl_vlm.models import qwen2_5_vl_3b_instruct

    mesh_cfg = _mesh_cfg(layout)
    mesh = SL.abstract_mesh(mesh_cfg, 8)
    layouts = SL.param_layouts(abstract_model(qwen2_5_vl_3b_instruct()), mesh, SR.resolve_rules(mesh_cfg.sharding_rules))
    noted = {name for p in layouts if p.notes for note in p.notes for name in ("kv_heads", "vision_mlp") if f"({name})" in note}
    all_notes = [note for p in layouts for note in p.notes]
    if dict(mesh.shape)["tensor"] == 8:
        assert noted == {"kv_heads", "vision_mlp"}
        assert all("(kv_heads) of size 2" in n or "(vision_mlp) of size 3420" in n for n in all_notes)
    else:
        assert all_notes == []
