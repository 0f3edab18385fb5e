"""The paged decode kernels (`attention_impl: pallas_gpu | pallas_tpu`) read the KV pages in place and give the
gather path's attention (`xla`) within 1e-5 in fp32, run in Pallas' interpreter on the CPU: the op alone on a
stacked cache with GQA, partly filled pages, tables padded with `num_pages` and a padding row; and the engine's
decode (`engine.forward.decode`) of one family of each kind (full attention, hybrid, MoE) over greedy steps of
several requests of different lengths spanning several pages (`-m ci_step`: CI's long-test step). Both kernels
also lower for their hardware (Mosaic, Triton) at a real model's shapes, and a cache they cannot tile is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_vlm.engine import forward
from jaxrl_vlm.models.config import from_hf_dict
from jaxrl_vlm.models.layers import attention
from jaxrl_vlm.models.paged_attention_kernel import IMPLS, kernel_constraint_error, paged_decode_attention
from jaxrl_vlm.models.paged_kv import gather_pages
from jaxrl_vlm.tiny import init_tiny_model
from jaxrl_vlm.tiny_assets import TINY_HF_CONFIGS

TOL = 1e-5
PAGE = 4


def _gather_reference(q, k_all, v_all, layer, tables, lengths, scale):
    span = tables.shape[1] * k_all.shape[2]
    mask = (jnp.arange(span)[None, :] <= lengths[:, None])[:, None, :]
    keys, values = gather_pages(k_all, layer, tables), gather_pages(v_all, layer, tables)
    return attention(q[:, None], keys, values, mask, scale)[:, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_equals_the_gather_on_a_stacked_cache_with_gqa_partial_pages_and_a_padding_row(impl):
    layers, num_pages, kv_heads, head_dim, heads = 2, 12, 2, 8, 6
    rng = np.random.default_rng(0)
    k_all, v_all = (jnp.asarray(rng.normal(size=(layers, num_pages, PAGE, kv_heads, head_dim)), jnp.float32)
                    for _ in range(2))
    q = jnp.asarray(rng.normal(size=(4, heads, head_dim)), jnp.float32)
    pad = num_pages
    # Rows attend to 10, 3 and 15 positions: pages partly filled, scattered, tables padded; the last row is padding.
    tables = jnp.array([[3, 7, 1, pad], [5, pad, pad, pad], [0, 2, 4, 6], [pad, pad, pad, pad]], jnp.int32)
    lengths = jnp.array([9, 2, 14, 0], jnp.int32)
    layer = 1  # not the first: the kernel must address its layer inside the stacked cache
    want = _gather_reference(q, k_all, v_all, layer, tables, lengths, head_dim**-0.5)
    got = jax.jit(lambda *a: paged_decode_attention(*a, layer, tables, lengths, scale=head_dim**-0.5,
                                                    impl=impl))(q, k_all, v_all)
    np.testing.assert_allclose(np.asarray(got[:3]), np.asarray(want[:3]), atol=TOL, rtol=0)
    assert np.isfinite(np.asarray(got[3])).all()  # the padding row: discarded, but no NaN to leak


@pytest.mark.parametrize("impl,platform,marker", [("pallas_tpu", "tpu", "tpu_custom_call"),
                                                   ("pallas_gpu", "cuda", "xla.gpu.triton")])
def test_kernels_lower_to_their_hardware_at_a_real_models_shapes(impl, platform, marker):
    """Without the hardware: the Pallas -> Mosaic (TPU) and Pallas -> Triton (GPU) lowering of a bf16 cache with pages
    of 16, head_dim 128 and 4 query heads per kv head (the later Mosaic / Triton compilation needs the device)."""
    layers, num_pages, kv_heads, head_dim, heads, rows, width = 2, 64, 2, 128, 8, 4, 8
    args = (jax.ShapeDtypeStruct((rows, heads, head_dim), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((layers, num_pages, 16, kv_heads, head_dim), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32))
    step = jax.jit(lambda q, k, v, t, n: paged_decode_attention(q, k, v, 1, t, n, scale=head_dim**-0.5, impl=impl,
                                                                interpret=False))
    # Mosaic reads the chip's tiling from the device kind; an abstract TPU stands in for one.
    tpu = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu"))
    with jax.sharding.use_abstract_mesh(tpu):
        text = step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text


def test_a_cache_the_compiled_kernel_cannot_tile_is_refused_naming_the_constraint():
    shapes = dict(head_dim=16, num_heads=4, kv_heads=2, interpret=False)
    assert kernel_constraint_error("pallas_gpu", page_size=16, **shapes) is None
    assert "page_size" in kernel_constraint_error("pallas_gpu", page_size=12, **shapes)
    assert "page_size a multiple of 8" in kernel_constraint_error("pallas_tpu", page_size=4, **shapes)
    assert kernel_constraint_error("pallas_tpu", page_size=4, **{**shapes, "interpret": True}) is None
    assert "num_key_value_heads" in kernel_constraint_error("pallas_gpu", page_size=16, head_dim=16, num_heads=6,
                                                            kv_heads=4, interpret=True)
    with pytest.raises(ValueError, match="head_dim.*attention_impl: xla"):
        cache = jnp.zeros((1, 4, 16, 1, 12))
        paged_decode_attention(jnp.zeros((1, 2, 12)), cache, cache, 0, jnp.zeros((1, 1), jnp.int32),
                               jnp.zeros((1,), jnp.int32), scale=1.0, impl="pallas_gpu", interpret=False)


def test_a_runs_attention_impl_reaches_its_embedded_engine_and_tensor_parallel_kernels_are_refused():
    from jaxrl_vlm.config import load_config
    from jaxrl_vlm.engine.options import EngineOptions

    cfg = load_config(None, ["--attention-impl", "pallas_tpu"])
    assert EngineOptions.from_run_config(cfg).attention_impl == "pallas_tpu"  # one option, both models
    assert EngineOptions.from_run_config(load_config(None, [])).attention_impl == "xla"
    with pytest.raises(ValueError, match="tp_size 2: the paged decode kernel is not split"):
        EngineOptions(attention_impl="pallas_gpu", tp_size=2)
    assert EngineOptions(attention_impl="xla", tp_size=2).tp_size == 2


class _SpecialTokens:
    """Just what the tiny configs read of a tokenizer: one id per special token, and the vocabulary size."""

    def __init__(self, vocab: int = 96):
        self.ids: dict[str, int] = {}
        self.vocab = vocab

    def encode(self, token: str, add_special_tokens: bool = False) -> list[int]:
        return [self.ids.setdefault(token, self.vocab - 1 - len(self.ids))]

    def __len__(self) -> int:
        return self.vocab


def _greedy_decode(model, cache, tables, lengths, tokens, steps):
    """`steps` decode steps through the engine's decode; returns the fp32 logits [steps, B, V] and the tokens fed
    (each step's greedy choice)."""
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda p, c, s, t, tok, n, d: forward.decode(nnx.merge(graphdef, p), c, s, t, tok, n, d))
    slots = jnp.arange(tables.shape[0], dtype=jnp.int32)
    deltas = jnp.zeros_like(lengths)
    out, fed = [], []
    for _ in range(steps):
        cache, logits = step(params, cache, slots, tables, tokens, lengths, deltas)
        out.append(np.asarray(logits))
        fed.append(np.asarray(tokens))
        tokens, lengths = jnp.argmax(logits, axis=-1).astype(jnp.int32), lengths + 1
    return np.stack(out), np.stack(fed)


# One family of each kind: full attention, hybrid (Gated DeltaNet + full attention; only its full layers are
# paged), and both MoE families (full-attention MoE, hybrid MoE). Interpreting the kernels inside whole decode steps
# takes ~10 s a family on 2 cores with a warm compilation cache (~25 s cold): CI's long-test step runs them, the
# suite runs the op checks above.
@pytest.mark.ci_step
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def test_engine_decode_with_the_kernel_equals_the_gather_path_over_greedy_steps(arch):
    cfg = from_hf_dict(TINY_HF_CONFIGS[arch](_SpecialTokens()))
    models = {impl: init_tiny_model(cfg, seed=3, attention_impl=impl) for impl in ("xla", *IMPLS)}
    num_pages, steps = 12, 3
    pad = num_pages
    prompts = [3, 6, 9]  # + 3 decoded: 1..3 pages each, the last partly filled
    tables = jnp.array([[5, 2, pad, pad], [7, 0, 9, pad], [1, 11, 4, pad], [pad] * 4], jnp.int32)
    rng = np.random.default_rng(1)
    cache = forward.init_cache(cfg, num_pages, PAGE, 4, jnp.float32)
    graphdef, params = nnx.split(models["xla"])
    prefill = jax.jit(lambda p, c, *a: forward.prefill(nnx.merge(graphdef, p), c, *a, None))
    first = []
    for slot, n in enumerate(prompts):
        ids = np.zeros((1, 12), np.int32)
        ids[0, :n] = rng.integers(0, 64, n)
        positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (3, 1, 12))
        cache, logits = prefill(params, cache, jnp.int32(slot), tables[slot], jnp.int32(0), jnp.asarray(ids),
                                positions, jnp.int32(n))
        first.append(int(jnp.argmax(logits)))
    tokens = jnp.array([*first, 0], jnp.int32)
    lengths = jnp.array([*prompts, 0], jnp.int32)
    want, fed = _greedy_decode(models["xla"], cache, tables, lengths, tokens, steps)
    for impl in IMPLS:
        got, got_fed = _greedy_decode(models[impl], cache, tables, lengths, tokens, steps)
        diff = float(np.abs(got[:, :3] - want[:, :3]).max())
        assert diff <= TOL, f"{arch} {impl}: max |kernel - gather| = {diff:.3g}"
        np.testing.assert_array_equal(got_fed[:, :3], fed[:, :3])
