"""`attention_impl: ring`: ring attention over the context axis (`models/ring_attention.py`) against the dense masked
XLA attention — the function alone on packed rows at cp 1, 2 and 4 (outputs and gradients), a whole model's RL loss
and gradients at cp 2 against the XLA attention on one device, and the shape it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_vlm.models.activation_sharding import activation_sharding
from jaxrl_vlm.models.block_flash import MASK_VALUE
from jaxrl_vlm.models.layers import attention
from jaxrl_vlm.models.ring_attention import block_attention, ring_attention
from jaxrl_vlm.sharding import layout as SL
from jaxrl_vlm.sharding import rules as SR
from jaxrl_vlm.sharding.activations import ActivationSharding

B, T, N, KV, H = 2, 128, 4, 2, 8
BLOCK = 8  # several key blocks per zig-zag chunk at every cp (chunks of 64 / 32 / 16 tokens), so blocks are skipped
SCALE = H**-0.5
RTOL = 1e-5


def _packed_rows():
    """q [B, T, N, H], k/v [B, T, KV, H] and segment ids: row 0 packs three sequences then padding, with segment 2
    crossing the cp 2 shard boundary (64) and the cp 4 chunk boundaries (32, 48); row 1 packs two."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, KV, KV))
    seg = np.zeros((B, T), np.int32)
    seg[0, :20], seg[0, 20:77], seg[0, 77:120] = 1, 2, 3
    seg[1, :100], seg[1, 100:] = 1, 2
    return q, k, v, jnp.asarray(seg)


def _context_spec(cp: int) -> ActivationSharding:
    """Rows over `data` (2), positions over `context` (cp): 2 * cp of the 8 simulated devices."""
    mesh = SL.build_mesh(SimpleNamespace(mesh_data=2, mesh_fsdp=1, mesh_tensor=1, mesh_context=cp),
                         jax.devices()[: 2 * cp])
    return ActivationSharding.create(mesh, SR.resolve_rules())


def _relative(got, want) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@pytest.fixture(scope="module")
def dense_reference():
    """The dense masked attention's output and gradients of a weighted sum (padding rows included: both attend
    them among the padding)."""
    q, k, v, seg = _packed_rows()
    idx = jnp.arange(T)
    mask = (seg[:, :, None] == seg[:, None, :]) & (idx[:, None] >= idx[None, :])[None]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    dense = lambda q, k, v: attention(q, k, v, mask, SCALE)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(dense(q, k, v) * weights)  # noqa: E731
    return (q, k, v, seg, weights), dense(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("cp", [None, 1, 2, 4], ids=["no_mesh", "cp1", "cp2", "cp4"])
def test_ring_attention_equals_dense_attention_with_gradients(dense_reference, cp):
    (q, k, v, seg, weights), want, want_grads = dense_reference
    spec = None if cp is None else _context_spec(cp)

    def ring(q, k, v):
        with activation_sharding(spec):
            return ring_attention(q, k, v, seg, scale=SCALE, block=BLOCK)

    loss = lambda q, k, v: jnp.sum(ring(q, k, v) * weights)  # noqa: E731
    step = jax.jit(lambda *a: (ring(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))
    out, grads = step(q, k, v)
    assert _relative(out, want) <= RTOL
    for name, got, ref in zip("qkv", grads, want_grads):
        assert _relative(got, ref) <= RTOL, f"d{name} at cp {cp}"
    if cp and cp > 1:
        assert out.sharding.spec[1] == "context" and out.addressable_shards[0].data.shape[1] == T // cp
        hlo = step.lower(q, k, v).compile().as_text()
        # Keys and values travel the ring (collective-permutes); nothing gathers the row.
        assert "collective-permute" in hlo and "all-gather" not in hlo


def test_keys_wholly_after_the_queries_contribute_nothing():
    """A key set entirely in the queries' future: output 0 and log-sum-exp MASK_VALUE, so merging it changes
    nothing (the ring's hops rely on this for the chunks a device must not see)."""
    q, k, v, seg = _packed_rows()
    pos = jnp.arange(16)
    out, lse = block_attention(q[:, :16], k[:, :16], v[:, :16], pos, pos + 16, seg[:, :16], seg[:, :16],
                               scale=SCALE, block=BLOCK)
    assert float(jnp.max(jnp.abs(out))) == 0.0 and bool(jnp.all(lse == MASK_VALUE))


def test_context_parallel_rows_must_split_into_zigzag_chunks():
    spec = _context_spec(4)
    q = jnp.zeros((2, 36, N, H))  # 9 positions per device: not two equal chunks

    def run(q):
        with activation_sharding(spec):
            return ring_attention(q, q[:, :, :KV], q[:, :, :KV], jnp.ones((2, 36), jnp.int32), scale=1.0)

    with pytest.raises(ValueError, match=r"attention_impl=ring cuts each row into 2 x 4 zig-zag chunks .* rows have "
                                         r"36 tokens; use seq buckets that are multiples of 8"):
        jax.eval_shape(run, q)


@pytest.fixture(scope="module")
def qwen3_vl_dir(tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ring_qwen3_vl") / "model", seed=5, arch="qwen3_vl")


def test_model_loss_and_gradients_with_ring_at_cp2_equal_xla_on_one_device(qwen3_vl_dir, make_test_image):
    """The RL loss (entropy and KL terms) of three multi-turn episodes with images packed in one 512-token row (an
    image across the cp 2 shard boundary): ring attention over 2 context devices against the dense XLA attention
    on one device, loss <= 1e-5 relative and gradients' global norm of difference <= 1e-5 relative."""
    from test_context_parallel import _loss_and_grads, _packed_episodes, _trainer

    samples = _packed_episodes(qwen3_vl_dir, make_test_image)
    _, ref_value, ref_grads = _loss_and_grads(_trainer(qwen3_vl_dir, ["--mesh-data", "1"], jax.devices()[:1]), samples)
    trainer = _trainer(qwen3_vl_dir, ["--mesh-data", "1", "--mesh-context", "2", "--attention-impl", "ring"],
                       jax.devices()[:2])
    assert dict(trainer.mesh.shape)["context"] == 2 and trainer.cfg.model.attention_impl == "ring"
    _, value, grads = _loss_and_grads(trainer, samples)
    assert value == pytest.approx(ref_value, rel=RTOL, abs=1e-7)
    diff = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))))
    norm = np.sqrt(sum(float(np.sum(b**2)) for b in jax.tree.leaves(ref_grads)))
    assert norm > 0 and diff <= RTOL * norm, diff / norm
