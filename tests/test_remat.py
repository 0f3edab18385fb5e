"""`--remat`: a rematerialisation policy per layer kind (`models/remat.py`). On tiny models that hold every kind of
layer (Qwen3-VL-MoE: dense and routed decoder layers and vision blocks; Qwen3.5: linear- and full-attention layers
and vision blocks) each layer runs under the policy its kind was given, every policy computes the same loss and
gradients as no remat, and remat shrinks what the forward pass keeps for the backward pass."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.config import ConfigError, load_config
from jaxrl_vlm.models import build_vision_inputs, get_rope_index, model_class, token_logprobs
from jaxrl_vlm.models.remat import LAYER_KINDS, RematPlan
from jaxrl_vlm.tiny import tiny_model_config

# Each family's plan gives every policy to some kind of layer it has.
PLANS = {
    "qwen3_vl_moe": "full_attention=dots,moe=full,vision=offload",
    "qwen3_5": "offload,linear_attention=dots,full_attention=full",
}


def _policy_name(policy) -> str:
    """The `remat.POLICIES` name of a jax checkpoint policy."""
    if policy is None:
        return "full"
    if policy == jax.checkpoint_policies.dots_with_no_batch_dims_saveable:
        return "dots"
    assert policy.__qualname__.startswith("offload_dot_with_no_batch_dims."), policy
    return "offload"


def test_remat_spec_names_a_policy_per_layer_kind():
    assert RematPlan.parse("none") == RematPlan() and not RematPlan.parse("none")
    assert RematPlan.parse("full") == RematPlan(*["full"] * len(LAYER_KINDS)) == RematPlan.of(True)
    assert RematPlan.parse("full, vision=none") == RematPlan("full", "full", "full", "none")
    assert RematPlan.parse("moe=dots") == RematPlan(moe="dots")
    assert load_config(None, ["--remat", "dots,linear_attention=full"]).model.remat == "dots,linear_attention=full"
    for bad, why in [("ful", "policy 'ful'"), ("vison=full", "unknown layer kind 'vison'"),
                     ("full,dots", "more than one default"), ("moe=full,moe=none", "moe is given twice")]:
        with pytest.raises(ConfigError, match=f"--remat: .*{why}"):
            load_config(None, ["--remat", bad])


def _inputs(cfg):
    """One row of 24 tokens holding two images of grid (1, 2, 2) (one merged token each), and its vision inputs."""
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 100, size=(1, 24))
    ids[0, 3], ids[0, 12] = cfg.image_token_id, cfg.image_token_id
    grid = np.array([[1, 2, 2], [1, 2, 2]])
    pixels = rng.randn(8, cfg.vision.patch_dim).astype(np.float32)
    vis = build_vision_inputs(pixels, grid, ids, cfg, patch_bucket=12)
    positions, _ = get_rope_index(ids, grid, None, cfg)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.ones((1, 24), jnp.int32), vis


def _loss(model, tokens, positions, seg, vis):
    lp, _ = token_logprobs(model, model(tokens, positions, seg, vis), jnp.roll(tokens, -1, axis=1), chunk_size=8)
    return lp.sum()


def _loss_and_grad(model, *args):
    return nnx.value_and_grad(lambda m: _loss(m, *args))(model)


def _checkpoint_policies(jaxpr) -> list:
    """The policy of every checkpoint (remat) in the program, outermost first."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
            found.append(eqn.params["policy"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _checkpoint_policies(sub)
    return found


def _model_pair(arch: str):
    """(model without remat, the same weights under `PLANS[arch]`, its plan, the config)."""
    cfg = tiny_model_config(arch=arch)
    cls = model_class(cfg)
    plain = cls(cfg, rngs=nnx.Rngs(3))
    remat = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), remat=PLANS[arch]))),
                      nnx.state(plain))
    assert remat.remat == RematPlan.parse(PLANS[arch]) and not plain.remat
    return plain, remat, remat.remat, cfg


@pytest.mark.parametrize("arch", list(PLANS))
def test_each_layer_runs_under_its_kinds_policy(arch):
    """Traced only: one checkpoint per decoder layer and vision block whose kind has a policy, with that policy."""
    _, remat, plan, cfg = _model_pair(arch)
    if arch == "qwen3_5":
        kinds = list(cfg.text.layer_types)
    else:
        kinds = ["moe" if cfg.text.is_sparse(i) else "full_attention" for i in range(cfg.text.num_hidden_layers)]
    kinds += ["vision"] * cfg.vision.depth
    want = [plan.policy(k) for k in kinds if plan.policy(k) != "none"]
    assert len(set(want)) == 3, want  # every policy is in the program
    jaxpr = jax.make_jaxpr(lambda m: _loss(m, *_inputs(cfg)))(remat).jaxpr
    names = [_policy_name(p) for p in _checkpoint_policies(jaxpr)]
    assert sorted(names) == sorted(want + ["full"]), (names, want)  # + the log-prob chunk's own checkpoint


def test_every_policy_keeps_loss_and_gradients():
    """Qwen3-VL-MoE under `dots` (dense layer), `full` (routed layer) and `offload` (vision blocks) against no remat.
    Remat changes what is kept, never the math, so one family carries every policy (Qwen3.5's layers under `full`:
    test_qwen3_5.py)."""
    plain, remat, _, cfg = _model_pair("qwen3_vl_moe")
    args = _inputs(cfg)
    l0, g0 = nnx.jit(_loss_and_grad)(plain, *args)
    l1, g1 = nnx.jit(_loss_and_grad)(remat, *args)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    assert float(jnp.abs(g0["visual"]["blocks"][0]["q_kernel_dnh"][...]).max()) > 0  # vision is in the graph


def test_remat_shrinks_what_the_forward_pass_keeps_for_the_backward_pass():
    """The bytes of the residuals the forward pass of the tiny Qwen3-VL (one 256-token row) hands to its backward pass
    (jax.vjp's closure, traced only): full remat keeps each layer's input, dots also the projections' outputs, none
    everything (attention probabilities included).

    This is the measure and not XLA:CPU's compiled temporary memory: XLA:CPU merges the recomputed forward back into
    the saved one (a jax.checkpoint'ed toy MLP compiles to the same 47 dots and 109.05 MB of temporaries as without
    it), so on this backend remat cannot show there; GPU and TPU compilers keep the recomputation."""
    cfg = tiny_model_config()
    tokens = jnp.zeros((1, 256), jnp.int32)
    positions = jnp.zeros((3, 1, 256), jnp.int32)
    seg = jnp.ones((1, 256), jnp.int32)

    def residual_bytes(remat: str) -> int:
        graphdef, params = nnx.split(model_class(cfg)(cfg, rngs=nnx.Rngs(0), remat=remat))

        def loss(p):
            m = nnx.merge(graphdef, p)
            lp, _ = token_logprobs(m, m(tokens, positions, seg), tokens, chunk_size=64)
            return lp.sum()

        kept = jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params))
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in kept)

    none, dots, full = residual_bytes("none"), residual_bytes("dots"), residual_bytes("full")
    assert full < dots < none / 4 and full < none / 8, (none, dots, full)
