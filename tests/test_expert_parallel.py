"""Expert parallelism (`models.expert_parallel`): the routed MoE block under a mesh whose `expert` axis splits the
experts, with the all-to-all token dispatch, equals the same block on one device (outputs, routing and gradients
within 1e-5 fp32) on 2, 4 and 8 simulated devices (expert x fsdp x tensor), with the router's choice and with forced
ids (routing replay), and in the engine's arrangement (the same tokens on every device of the group: local experts,
then a psum); a capacity factor drops exactly the copies an independent numpy simulation of the slots drops, counts
them per token, and the output is then a float64 numpy sum over the kept copies only."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.models.activation_sharding import activation_sharding
from jaxrl_vlm.models.expert_parallel import capacity
from jaxrl_vlm.models.moe import SparseMoE
from jaxrl_vlm.sharding.activations import ActivationSharding
from jaxrl_vlm.sharding.layout import build_mesh, param_shardings
from jaxrl_vlm.sharding.rules import resolve_rules

E, K, D, F = 8, 2, 16, 24
B, T = 8, 6
TOL = 1e-5


def _text():
    return types.SimpleNamespace(hidden_size=D, hidden_act="silu", num_experts=E, num_experts_per_tok=K,
                                 moe_intermediate_size=F, norm_topk_prob=True)


@pytest.fixture(scope="module")
def block():
    moe = SparseMoE(_text(), rngs=nnx.Rngs(0), param_dtype=jnp.float32, compute_dtype=jnp.float32)
    state = nnx.state(moe, nnx.Param)
    rng = np.random.default_rng(1)
    # O(1) activations and a router far from uniform, so a wrong expert shows.
    values = {"router_kernel_de": rng.standard_normal((D, E)) / np.sqrt(D) * 3,
              "gate_experts_edf": rng.standard_normal((E, D, F)) / np.sqrt(D),
              "up_experts_edf": rng.standard_normal((E, D, F)) / np.sqrt(D),
              "down_experts_efd": rng.standard_normal((E, F, D)) / np.sqrt(F)}
    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(values[path[-1]], jnp.float32))
    nnx.update(moe, state)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    forced = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(B * T)]).reshape(B, T, K), jnp.int32)
    return moe, x, forced


def _run(moe, x, forced, mesh=None, capacity_factor=None, rules=None):
    """(y, Routing, grads of sum(y * c) w.r.t. params and x, compiled HLO text) of one jitted forward + backward."""
    graphdef, state = nnx.split(moe)
    coef = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
    rules = resolve_rules(rules)
    layout = None if mesh is None else ActivationSharding.create(mesh, rules, capacity_factor)

    def loss(state, x):
        with activation_sharding(layout):
            y, routing = nnx.merge(graphdef, state).forward(x, forced)
        return jnp.sum(y * coef), (y, routing)

    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if mesh is not None:
        state = jax.device_put(state, param_shardings(state, mesh, rules))
    compiled = jax.jit(fn).lower(state, x).compile()
    (_, (y, routing)), grads = compiled(state, x)
    return np.asarray(y), jax.tree.map(np.asarray, routing), jax.tree.map(np.asarray, grads), compiled.as_text()


def _mesh(devices, **sizes):
    cfg = types.SimpleNamespace(mesh_data=1, mesh_fsdp=sizes.get("fsdp", 1), mesh_expert=sizes["expert"],
                                mesh_context=1, mesh_tensor=sizes.get("tensor", 1))
    return build_mesh(cfg, jax.devices()[:devices])


MESHES = {"ep2": (2, dict(expert=2)), "ep4": (4, dict(expert=4)),
          "fsdp2_ep2_tp2": (8, dict(fsdp=2, expert=2, tensor=2)), "ep2_tp2_same_tokens": (4, dict(expert=2, tensor=2))}
# The engine's view: every device of the group holds the same tokens (rows not split over `expert`), the dense
# tensor-parallel names over expert x tensor (SGLang's ep within tp): local experts, then one psum.
SAME_TOKENS = {"batch": None, "mlp": ["expert", "tensor"], "heads": ["expert", "tensor"]}


@pytest.fixture(scope="module")
def one_device(block):
    """The one-device reference per routing mode (router's choice, forced ids)."""
    moe, x, forced = block
    return {replay: _run(moe, x, forced if replay else None) for replay in (False, True)}


CASES = [("ep2", False), ("ep2", True), ("ep4", True), ("fsdp2_ep2_tp2", False), ("ep2_tp2_same_tokens", True)]


@pytest.mark.parametrize(("name", "replay"), CASES, ids=[f"{m}-{'forced_ids' if r else 'router'}" for m, r in CASES])
def test_expert_parallel_block_equals_one_device(block, one_device, name, replay):
    moe, x, forced = block
    forced = forced if replay else None
    ref_y, ref_routing, ref_grads, _ = one_device[replay]
    n, sizes = MESHES[name]
    same_tokens = name.endswith("same_tokens")
    y, routing, grads, hlo = _run(moe, x, forced, _mesh(n, **sizes), rules=SAME_TOKENS if same_tokens else None)
    # the experts stayed split: tokens travelled to them, or (same tokens everywhere) partial outputs were summed
    assert ("all-to-all" in hlo) == (not same_tokens)
    np.testing.assert_allclose(y, ref_y, atol=TOL, rtol=0)
    np.testing.assert_array_equal(routing.topk_ids, ref_routing.topk_ids)
    if replay:
        np.testing.assert_array_equal(routing.topk_ids, np.asarray(forced))
    assert routing.dropped.shape == (B, T) and not routing.dropped.any()
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(want).max() > 1e-3
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def _simulated_kept(ids_btk: np.ndarray, shards: int, ep: int, factor: float) -> np.ndarray:
    """Independent reading of the capacity rule, bool [B, T, K]: per device (a block of B / shards rows), copies in
    token order; a copy is dropped once its destination device (expert // (E / ep)) already took
    ceil(factor n k / ep) of this device's copies."""
    kept = np.ones(ids_btk.shape, bool)
    rows = B // shards
    for s in range(shards):
        n = rows * T
        cap = min(n * min(K, E // ep), math.ceil(factor * n * K / ep))
        used = np.zeros(ep, int)
        for r in range(s * rows, (s + 1) * rows):
            for t in range(T):
                for j, e in enumerate(ids_btk[r, t]):
                    dest = e // (E // ep)
                    kept[r, t, j] = used[dest] < cap
                    used[dest] += 1
    return kept


def test_copies_over_capacity_are_dropped_counted_and_left_out(block):
    moe, x, _ = block
    # Each token sends one copy to each of the 2 devices (one of experts 0-3, then expert 4): n copies per
    # destination against a capacity of ceil(0.6 n), so 40% of each device's copies to each destination drop.
    rng = np.random.default_rng(5)
    ids = np.stack([np.concatenate([rng.choice(4, 1), [4]]) for _ in range(B * T)]).reshape(B, T, K).astype(np.int32)
    factor = 0.6
    y, routing, _, _ = _run(moe, x, jnp.asarray(ids), _mesh(2, expert=2), capacity_factor=factor)
    kept = _simulated_kept(ids, 2, 2, factor)
    assert 0 < (~kept).sum() < kept.size
    np.testing.assert_array_equal(routing.dropped, K - kept.sum(-1))
    # Output = the weighted sum over the kept copies only, in numpy from the parameters (a SwiGLU MLP per copy).
    ref_y, ref_routing, _, _ = _run(moe, x, jnp.asarray(ids))  # the same ids on one device, nothing dropped
    weights = ref_routing.topk_weights
    params = {str(p[-1]): np.asarray(v.get_value(), np.float64)
              for p, v in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
    xs = np.asarray(x, np.float64)
    kept_y = np.zeros_like(xs)
    for (r, t, j), keep in np.ndenumerate(kept):
        if keep:
            e = ids[r, t, j]
            h = xs[r, t] @ params["gate_experts_edf"][e]
            kept_y[r, t] += weights[r, t, j] * (((h / (1 + np.exp(-h))) * (xs[r, t] @ params["up_experts_edf"][e]))
                                                @ params["down_experts_efd"][e])
    np.testing.assert_allclose(y, kept_y, atol=1e-4, rtol=0)
    assert np.abs(y - ref_y).max() > 1e-2  # the dropped terms are really missing


def test_capacity_is_the_worst_case_by_default_and_a_multiple_of_the_balanced_share_otherwise():
    assert capacity(24, 2, 8, 2, None) == 48  # a token sends at most min(k, E/ep) = 2 copies to one device
    assert capacity(24, 2, 8, 8, None) == 24  # one expert per device: at most one copy each
    assert capacity(24, 2, 8, 2, 1.25) == 30  # ceil(1.25 * 24 * 2 / 2)
    assert capacity(24, 2, 8, 2, 10.0) == 48 and capacity(1, 2, 8, 8, 0.01) == 1  # clipped to [1, worst case]


def test_expert_parallel_options_and_slime_flag():
    from jaxrl_vlm.config import ConfigError, load_config

    cfg = load_config(None, ["--expert-model-parallel-size", "2", "--moe-capacity-factor", "1.25"])
    assert (cfg.mesh.mesh_expert, cfg.mesh.moe_capacity_factor) == (2, 1.25)
    layout = ActivationSharding.from_config(cfg.mesh, _mesh(2, expert=2), resolve_rules())
    assert layout.moe_capacity_factor == 1.25
    assert load_config(None, ["--tp-size", "4", "--ep-size", "2"]).engine.ep_size == 2
    with pytest.raises(ConfigError, match="--ep-size 3 must divide --tp-size 2"):
        load_config(None, ["--tp-size", "2", "--ep-size", "3"])
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        load_config(None, ["--moe-capacity-factor", "0"])
