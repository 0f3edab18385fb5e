"""Context parallelism of Qwen3.5's Gated DeltaNet layers (`jaxrl_vlm.models.linear_context`), on 8 simulated CPU
devices (conftest): a row's positions split into contiguous blocks over a `context` mesh axis, rows over `data`.

The reference is the unsplit function on one device: `chunk_gated_delta_rule` (outputs, final state, gradients)
and `causal_depthwise_conv`, each within 1e-5 relative, on packed rows whose segment boundaries fall exactly on a
block boundary, inside a block, and one position after a block boundary (the conv halo is half masked), with a
segment that spans three blocks, from a non-zero initial state. Then the tiny Qwen3.5's forward and gradients
under an activation layout that splits the sequence against the same model without a layout.

Shapes are tiny and each check compiles once (the split and the unsplit programs, value and gradients together).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxrl_vlm.models.activation_sharding import activation_sharding
from jaxrl_vlm.models.linear_context import ContextSplit, context_causal_conv, context_chunk_gated_delta_rule
from jaxrl_vlm.models.qwen3_5 import (
    Qwen3_5,
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
    segment_runs,
)
from jaxrl_vlm.tiny import tiny_model_config

REL = 1e-5
B, T, H, DK, DV, CHUNK = 2, 32, 2, 4, 3, 5  # chunks of 5 straddle every block boundary and pad each block
# Row 0: boundaries at 8 (a block boundary for cp 4, inside a block for cp 2) and 13; its last segment spans
# positions 13..31, blocks 1-3 at cp 4. Row 1: boundaries at 16 (a block boundary for both), 25 (one after cp 4's
# block boundary 24) and 30 (padding, segment id 0).
SEGMENTS = np.array([[1] * 8 + [2] * 5 + [3] * 19, [1] * 16 + [2] * 9 + [3] * 5 + [0] * 2], np.int32)
RUNS = segment_runs(jnp.asarray(SEGMENTS))


def _mesh(cp: int, tensor: int = 1) -> Mesh:
    """("data", "context"[, "tensor"]) = (2, cp[, tensor]) on the first 2 * cp * tensor devices."""
    shape, names = ((2, cp), ("data", "context")) if tensor == 1 else ((2, cp, tensor), ("data", "context", "tensor"))
    devices = jax.devices()[: 2 * cp * tensor]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def _split(cp: int, heads_over_tensor: bool = False) -> ContextSplit:
    if heads_over_tensor:
        return ContextSplit(_mesh(cp, tensor=2), rows="data", sequence=("context",), heads="tensor")
    return ContextSplit(_mesh(cp), rows="data", sequence=("context",), heads=None)


def _assert_close(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= REL, f"{what}: max error {err:.2e} of the largest reference value"


def _rule_inputs():
    rng = np.random.RandomState(0)
    q = l2_normalize(jnp.asarray(rng.randn(B, T, H, DK), jnp.float32)) * DK**-0.5
    k = l2_normalize(jnp.asarray(rng.randn(B, T, H, DK), jnp.float32))
    v = jnp.asarray(rng.randn(B, T, H, DV), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 0.3, (B, T, H)), jnp.float32)  # slow decay: the state carries over blocks
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, T, H)), jnp.float32)
    state = jnp.asarray(rng.randn(B, H, DK, DV), jnp.float32)
    weights = (jnp.asarray(rng.randn(B, T, H, DV), jnp.float32), jnp.asarray(rng.randn(B, H, DK, DV), jnp.float32))
    return (q, k, v, g, beta, state), weights


def _value_and_grads(fn, args, weights):
    """(fn's outputs, gradients of a weighted sum of them with respect to every input), in one program."""

    def loss(*a):
        outs = fn(*a)
        return sum(jnp.sum(o * w) for o, w in zip(outs, weights)), outs

    (_, outs), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return outs, grads


_rule = partial(chunk_gated_delta_rule, chunk_size=CHUNK)


@jax.jit
def _unsplit_rule(args, weights):
    return _value_and_grads(lambda *a: _rule(*a, RUNS), args, weights)


@partial(jax.jit, static_argnums=(0, 1))
def _split_rule(cp, heads_over_tensor, args, weights):
    split = _split(cp, heads_over_tensor)
    return _value_and_grads(lambda *a: context_chunk_gated_delta_rule(_rule, *a, RUNS, split), args, weights)


@pytest.mark.parametrize("cp, heads_over_tensor", [(2, True), (4, False)], ids=["cp2-heads-over-tensor", "cp4"])
def test_split_delta_rule_equals_the_unsplit_rule_with_its_gradients(cp, heads_over_tensor):
    """Outputs, final state and the gradients of q, k, v, g, beta and the initial state, on packed rows (at cp 2
    the heads are split over a third mesh axis too, as tensor parallelism splits the linear value heads)."""
    args, weights = _rule_inputs()
    (o_ref, s_ref), g_ref = _unsplit_rule(args, weights)
    (o, s), grads = _split_rule(cp, heads_over_tensor, args, weights)
    _assert_close(o, o_ref, "outputs")
    _assert_close(s, s_ref, "final state")
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial state"), grads, g_ref):
        _assert_close(got, want, f"gradient of {name}")


def test_split_conv_reads_the_previous_block_as_its_window_within_the_segment():
    """cp 4, K 4: each block's first 3 outputs read the previous block's last inputs unless a segment starts in
    between (row 1 at 25: one tap of position 25's window would cross); block 0 reads the given window (run 0)."""
    rng = np.random.RandomState(1)
    kk, c = 4, 5
    args = tuple(jnp.asarray(rng.randn(*shape), jnp.float32) for shape in ((B, T, c), (kk, c), (B, kk - 1, c)))
    weights = (jnp.asarray(rng.randn(B, T, c), jnp.float32),)
    split = _split(4)
    conv = jax.jit(lambda a, w: _value_and_grads(lambda *x: (causal_depthwise_conv(*x, RUNS),), a, w))
    split_conv = jax.jit(lambda a, w: _value_and_grads(
        lambda *x: (context_causal_conv(causal_depthwise_conv, *x, RUNS, split),), a, w))
    (want,), g_ref = conv(args, weights)
    (got,), grads = split_conv(args, weights)
    _assert_close(got, want, "conv outputs")
    for name, g, r in zip(("inputs", "taps", "window"), grads, g_ref):
        _assert_close(g, r, f"gradient of the conv {name}")


def _recurrent_float64(q, k, v, g, beta, s):
    """The gated delta rule step by step in numpy float64 (one run): o [B, T, H, Dv] and the final state."""
    s, out = np.array(s, np.float64), []
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t][..., None]
        s = s + k[:, t][..., :, None] * delta[..., None, :]
        out.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return np.stack(out, 1), s


def test_chunked_rule_is_as_accurate_as_the_recurrent_rule_where_decay_is_slow_and_keys_alike():
    """The split above is exact only if the chunked rule is accurate itself. Chunks of 64 (the default), two heads:
    decay ~0.99 per step with beta ~1 and keys within 0.3 of one direction (a trained model's slow heads: the
    powers of the chunk's key matrix reach 1e17, and a Neumann-series inverse gave outputs 1e16 off), and decay of
    e^-3..e^-4.6 per step (a chunk's summed log-decay reaches -300). Outputs and final state within 1e-5 of a
    float64 step-by-step reference (measured <= 1e-6), gradients within 1e-5 of the fp32 recurrent rule's
    (measured <= 9e-7)."""
    rng = np.random.RandomState(4)
    t, dk, dv = 128, 16, 4
    k = rng.randn(1, 1, 2, dk) + np.array([0.3, 1.0])[:, None] * rng.randn(1, t, 2, dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.randn(1, t, 2, dk)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    v = rng.randn(1, t, 2, dv)
    g = np.stack([-rng.uniform(0, 0.02, (1, t)), -rng.uniform(3.0, 4.6, (1, t))], -1)
    beta = np.stack([rng.uniform(0.9, 1.0, (1, t)), rng.uniform(0.0, 1.0, (1, t))], -1)
    state = rng.randn(1, 2, dk, dv)
    o_ref, s_ref = _recurrent_float64(q, k, v, g, beta, state)
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state))
    weights = (jnp.asarray(rng.randn(*o_ref.shape), jnp.float32), jnp.asarray(rng.randn(*s_ref.shape), jnp.float32))
    (o, s), grads = jax.jit(lambda a, w: _value_and_grads(chunk_gated_delta_rule, a, w))(args, weights)
    _, g_rec = jax.jit(lambda a, w: _value_and_grads(recurrent_gated_delta_rule, a, w))(args, weights)
    for h in range(2):
        _assert_close(np.asarray(o)[:, :, h], o_ref[:, :, h], f"outputs of head {h}")
        _assert_close(np.asarray(s)[:, h], s_ref[:, h], f"final state of head {h}")
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial state"), grads, g_rec):
        _assert_close(got, want, f"gradient of {name}")


# ----------------------------------------------------------------------------- the model under a layout


@dataclass(frozen=True)
class _SequenceLayout:
    """An `ActivationLayout` that splits rows over `data` and positions over `context`; every other name whole."""

    mesh: Mesh

    def sharding(self, names, shape) -> NamedSharding:
        axes = {"batch": "data", "sequence": "context"}
        return NamedSharding(self.mesh, PartitionSpec(*(axes.get(n) for n in names)))


def _tiny_qwen3_5():
    """(graphdef, parameters) of the tiny Qwen3.5 (3 linear layers, 1 full-attention layer), linear chunks of 8.

    Drawn in numpy from the abstract model: jax's random init compiles one program per parameter shape, longer
    than everything else here. Kernels ~ N(0, 1/fan_in), norm weights near their neutral value, and A = e^-3
    (a decay of ~0.94 per step, so the state entering a block matters: A = 1 forgets within a few steps and
    would hide a wrong hand-over)."""
    cfg = tiny_model_config(arch="qwen3_5")
    model = nnx.eval_shape(lambda: Qwen3_5(cfg, rngs=nnx.Rngs(0)))
    for layer in model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.chunk_size = 8
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(0)
    for path, var in nnx.to_flat_state(state):
        shape, leaf = var.get_value().shape, str(path[-1])
        if leaf == "scale":  # the linear layers' gated norm multiplies by w, the others by 1 + w
            value = float(path[-2:] == ("norm", "scale") and "linear_attn" in path) + 0.1 * rng.randn(*shape)
        elif leaf == "a_log_h":
            value = -3.0 + 0.3 * rng.randn(*shape)
        elif len(shape) == 1:
            value = 0.1 * rng.randn(*shape)
        else:
            fan_in = shape[1] if leaf == "embed_vd" else np.prod(shape[:2]) if leaf.startswith("o_kernel") else shape[0]
            value = rng.randn(*shape) / np.sqrt(fan_in)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    return graphdef, state


def test_tiny_qwen3_5_under_a_sequence_split_layout_equals_its_forward_without():
    """The train step's forward on packed rows with the linear layers' context-parallel path (the traced program
    holds their shard_maps) equals the forward without a layout (which holds none), within 1e-5 relative (measured
    2.5e-6, as much as rows split over `data` alone give; zeroing the state handed to a block, or the conv halo,
    gives errors of order 1). Gradients are checked on the split functions above."""
    graphdef, params = _tiny_qwen3_5()
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 200, (B, T)), jnp.int32)
    seg = jnp.asarray(SEGMENTS)
    starts = np.maximum.accumulate(np.where(np.diff(SEGMENTS, prepend=-1, axis=1) != 0, np.arange(T), 0), axis=1)
    positions = jnp.asarray(np.broadcast_to(np.arange(T) - starts, (3, B, T)), jnp.int32)  # text: t = h = w
    layout = _SequenceLayout(_mesh(4))

    def forward(p, layout):
        with activation_sharding(layout):
            return nnx.merge(graphdef, p)(tokens, positions, seg)

    assert "shard_map" in str(jax.make_jaxpr(lambda p: forward(p, layout))(params))
    assert "shard_map" not in str(jax.make_jaxpr(lambda p: forward(p, None))(params))
    want = jax.jit(lambda p: forward(p, None))(params)
    got = jax.jit(lambda p: forward(p, layout))(params)
    _assert_close(got, want, "hidden states")
