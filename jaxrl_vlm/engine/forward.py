"""Prefill and decode of the Flax Qwen3-VL against a slotted KV cache (pure functions, jit-able).

The cache is one fixed-shape array pair: every request owns one *slot* (a row of the cache) for its
whole life, so continuous batching only changes which rows are active, never the shapes. The
functions compose the model's public pieces (`embed_inputs`, `embed`, each layer's `input_norm`,
`attn.project` / `attn.output`, `post_attn_norm`, `mlp`, `final_norm`, `lm_head_kernel`) so that
the math is the training forward's, with the attention split into "write K/V, then attend to the
cache". Prefill can start after a prefix already in the slot (prefix caching): it then computes
only the suffix, attending to the cached keys.

Positions are M-RoPE ids computed on the host (`rope.get_rope_index`). A decoded token at sequence
index i has position i + rope_delta on all three axes (text tokens after the prompt).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.qwen3_vl import Qwen3VL, add_at_slots, attention, mrope_cos_sin
from jaxrl_vlm.models.vision import VisionInputs


class KVCache(NamedTuple):
    """Keys and values of every slot: k, v [layers, slots, max_len, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array


def cache_shape(cfg: Qwen3VLConfig, slots: int, max_len: int) -> tuple[int, ...]:
    """Shape of k (and v): [layers, slots, max_len, kv_heads, head_dim]."""
    t = cfg.text
    return (t.num_hidden_layers, slots, max_len, t.num_key_value_heads, t.head_dim)


def init_cache(cfg: Qwen3VLConfig, slots: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    shape = cache_shape(cfg, slots, max_len)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def copy_rows(cache: KVCache, src: jax.Array, dst: jax.Array, rows: int) -> KVCache:
    """Rows [0, rows) of slot `src` copied into slot `dst` in every layer (`rows` static): a prefix
    shared with a warm slot, moved instead of recomputed."""

    def one(part: jax.Array) -> jax.Array:
        block = jax.lax.dynamic_slice(part, (0, src, 0, 0, 0), (part.shape[0], 1, rows, *part.shape[3:]))
        return jax.lax.dynamic_update_slice(part, block, (0, dst, 0, 0, 0))

    return KVCache(one(cache.k), one(cache.v))


def _logits(model: Qwen3VL, hidden_nd: jax.Array) -> jax.Array:
    kernel = model.lm_head_kernel().astype(model.compute_dtype)
    return jnp.einsum("nd,dv->nv", hidden_nd.astype(model.compute_dtype), kernel, preferred_element_type=jnp.float32)


def _decoder(
    model: Qwen3VL,
    cache: KVCache,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    write: Callable[[jax.Array, int, jax.Array], jax.Array],
    read: Callable[[jax.Array, int], jax.Array],
    deepstack: Sequence[jax.Array] = (),
    image_slots: jax.Array | None = None,
) -> tuple[KVCache, jax.Array]:
    """The decoder layers against the cache, shared by prefill and decode: per layer, project,
    `write(cache_part, layer, new)` the new K (and V), attend to `read(cache_part, layer)` under
    `mask`, MLP, and add deepstack features after the first layers. Returns the cache and the
    final-normed hidden states."""
    k_all, v_all = cache.k, cache.v
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.project(layer.input_norm(x), cos, sin)
        k_all, v_all = write(k_all, i, k.astype(k_all.dtype)), write(v_all, i, v.astype(v_all.dtype))
        keys, values = read(k_all, i).astype(q.dtype), read(v_all, i).astype(q.dtype)
        x = x + layer.attn.output(attention(q, keys, values, mask, layer.attn.scale))
        x = x + layer.mlp(layer.post_attn_norm(x))
        if i < len(deepstack):
            x = add_at_slots(x, image_slots, deepstack[i])
    return KVCache(k_all, v_all), model.final_norm(x)


def prefill(
    model: Qwen3VL,
    cache: KVCache,
    slot: jax.Array,
    start: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: VisionInputs | None,
    kv_len: int,
) -> tuple[KVCache, jax.Array]:
    """Run prompt tokens [start, start + T) of `slot` (padded to a bucket of T) and store their K/V
    at those rows; they attend to the slot's cached K/V [0, start) and causally to each other.

    start = 0 is a plain prefill; start > 0 extends a reused prefix (the prefix cache), so only the
    new suffix is computed. tokens_1t int32 [1, T] (image pads expanded; padding after `length`),
    positions_31t int32 [3, 1, T] (the full prompt's M-RoPE ids, sliced), length int32 scalar (real
    tokens in tokens_1t), vision: the images inside these T tokens only (its `image_token_index`
    indexes the flattened [1 * T] tokens) or None. kv_len (static) bounds the attended cache
    prefix: start + length <= kv_len. The caller guarantees start + T <= max_len (a dynamic update
    slice would otherwise be clamped and shift the write).
    Returns the updated cache and the fp32 logits [V] at the last real token.

    Padding rows write K/V beyond start + length; decode overwrites position start + length before
    it is ever attended to and masks everything after it, so that garbage is never read.
    """
    _, t = tokens_1t.shape
    x, deepstack, image_slots = model.embed_inputs(tokens_1t, vision)
    cos, sin = mrope_cos_sin(positions_31t, model.cfg, model.compute_dtype)
    mask = (jnp.arange(kv_len)[None, :] <= (start + jnp.arange(t))[:, None])[None]  # [1, T, kv_len]

    def write(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(part, new[None], (i, slot, start, 0, 0))

    def read(part: jax.Array, i: int) -> jax.Array:
        return jax.lax.dynamic_slice(part, (i, slot, 0, 0, 0), (1, 1, kv_len, *part.shape[3:]))[0]

    cache, hidden = _decoder(model, cache, x, cos, sin, mask, write, read, deepstack, image_slots)
    last = jax.lax.dynamic_slice_in_dim(hidden[0], length - 1, 1, axis=0)
    return cache, _logits(model, last)[0]


def decode(
    model: Qwen3VL,
    cache: KVCache,
    slots_b: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
    kv_len: int,
) -> tuple[KVCache, jax.Array]:
    """One decode step for the slots `slots_b`: feed each its last token, append its K/V, return logits.

    slots_b int32 [B]: cache slot of each row (any order; the batch holds only running requests, so
    its width never depends on where they sit); tokens_b int32 [B]: the token at sequence index
    lengths_b (not yet in the cache); lengths_b int32 [B]: tokens already cached per row;
    rope_deltas_b int32 [B]. kv_len (static) bounds the attended cache prefix and must exceed every
    real length. Padding rows carry length >= max_len: their K/V writes fall outside the cache and
    are dropped, so no slot but the rows' own is ever written (warm slots stay intact), and their
    logits are discarded.
    Returns the updated cache and fp32 logits [B, V].
    """
    b = tokens_b.shape[0]
    x = model.embed(tokens_b[:, None])  # [B, 1, D]
    pos = (lengths_b + rope_deltas_b)[None, :, None]
    cos, sin = mrope_cos_sin(jnp.broadcast_to(pos, (3, b, 1)), model.cfg, model.compute_dtype)
    mask = (jnp.arange(kv_len)[None, :] <= lengths_b[:, None])[:, None, :]  # [B, 1, kv_len]

    def write(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return part.at[i, slots_b, lengths_b].set(new[:, 0], mode="drop")

    def read(part: jax.Array, i: int) -> jax.Array:
        return part[i, slots_b, :kv_len]

    cache, hidden = _decoder(model, cache, x, cos, sin, mask, write, read)
    return cache, _logits(model, hidden[:, 0])
