"""Prefill and decode of the Flax Qwen3-VL against a slotted KV cache (pure functions, jit-able).

The cache is one fixed-shape array pair: every request owns one *slot* (a row of the cache) for its
whole life, so continuous batching only changes which rows are active, never the shapes. The
functions compose the model's public pieces (`embed`, `visual`, each layer's `input_norm`,
`attn.project` / `attn.output`, `post_attn_norm`, `mlp`, `final_norm`, `lm_head_kernel`) so that
the math is the training forward's, with the attention split into "write K/V, then attend".

Positions are M-RoPE ids computed on the host (`rope.get_rope_index`). A decoded token at sequence
index i has position i + rope_delta on all three axes (text tokens after the prompt).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.qwen3_vl import Qwen3VL, add_at_slots, attention, mrope_cos_sin
from jaxrl_vlm.models.vision import VisionInputs


class KVCache(NamedTuple):
    """Keys and values of every slot: k, v [layers, slots, max_len, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array


def init_cache(cfg: Qwen3VLConfig, slots: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    t = cfg.text
    shape = (t.num_hidden_layers, slots, max_len, t.num_key_value_heads, t.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def cache_bytes(cfg: Qwen3VLConfig, slots: int, max_len: int, dtype: jnp.dtype) -> int:
    """Device memory the cache takes, for sizing `slots` x `max_len` before allocating."""
    t = cfg.text
    return 2 * t.num_hidden_layers * slots * max_len * t.num_key_value_heads * t.head_dim * jnp.dtype(dtype).itemsize


def _logits(model: Qwen3VL, hidden_nd: jax.Array) -> jax.Array:
    kernel = model.lm_head_kernel().astype(model.compute_dtype)
    return jnp.einsum("nd,dv->nv", hidden_nd.astype(model.compute_dtype), kernel, preferred_element_type=jnp.float32)


def prefill(
    model: Qwen3VL,
    cache: KVCache,
    slot: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: VisionInputs | None,
) -> tuple[KVCache, jax.Array]:
    """Run one prompt, padded to a bucket of T tokens, and store its K/V in rows [0, T) of `slot`.

    tokens_1t int32 [1, T] (image pads expanded; padding after `length`), positions_31t int32
    [3, 1, T], length int32 scalar (real tokens), vision: the images of this prompt (its
    `image_token_index` indexes the flattened [1 * T] tokens) or None.
    Returns the updated cache and the fp32 logits [V] at the last real token.

    Padding rows write K/V beyond `length`; decode overwrites position `length` before it is ever
    attended to and masks everything after it, so that garbage is never read.
    """
    _, t = tokens_1t.shape
    x, deepstack, image_slots = model.embed_inputs(tokens_1t, vision)
    cos, sin = mrope_cos_sin(positions_31t, model.cfg, model.compute_dtype)
    idx = jnp.arange(t)
    causal = (idx[:, None] >= idx[None, :])[None]
    k_all, v_all = cache.k, cache.v
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.project(layer.input_norm(x), cos, sin)
        k_all = jax.lax.dynamic_update_slice(k_all, k.astype(k_all.dtype)[None], (i, slot, 0, 0, 0))
        v_all = jax.lax.dynamic_update_slice(v_all, v.astype(v_all.dtype)[None], (i, slot, 0, 0, 0))
        x = x + layer.attn.output(attention(q, k, v, causal, layer.attn.scale))
        x = x + layer.mlp(layer.post_attn_norm(x))
        if i < len(deepstack):
            x = add_at_slots(x, image_slots, deepstack[i])
    hidden = model.final_norm(x)[0]
    last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=0)
    return KVCache(k_all, v_all), _logits(model, last)[0]


def decode(
    model: Qwen3VL,
    cache: KVCache,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
    kv_len: int,
) -> tuple[KVCache, jax.Array]:
    """One decode step for slots [0, B): feed each slot's last token, append its K/V, return logits.

    tokens_b int32 [B]: the token at sequence index lengths_b (not yet in the cache); lengths_b int32
    [B]: tokens already cached per slot; rope_deltas_b int32 [B]. kv_len (static) bounds the attended
    cache prefix and must exceed every length. Free slots inside [0, B) compute garbage that is
    discarded (they write at their own position `lengths_b`, which a later prefill overwrites).
    Returns the updated cache and fp32 logits [B, V].
    """
    b = tokens_b.shape[0]
    x = model.embed(tokens_b[:, None])  # [B, 1, D]
    pos = (lengths_b + rope_deltas_b)[None, :, None]
    cos, sin = mrope_cos_sin(jnp.broadcast_to(pos, (3, b, 1)), model.cfg, model.compute_dtype)
    rows = jnp.arange(b)
    mask = (jnp.arange(kv_len)[None, :] <= lengths_b[:, None])[:, None, :]  # [B, 1, kv_len]
    k_all, v_all = cache.k, cache.v
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.project(layer.input_norm(x), cos, sin)
        k_all = k_all.at[i, rows, lengths_b].set(k[:, 0].astype(k_all.dtype))
        v_all = v_all.at[i, rows, lengths_b].set(v[:, 0].astype(v_all.dtype))
        keys = k_all[i, :b, :kv_len].astype(q.dtype)
        values = v_all[i, :b, :kv_len].astype(q.dtype)
        x = x + layer.attn.output(attention(q, keys, values, mask, layer.attn.scale))
        x = x + layer.mlp(layer.post_attn_norm(x))
    hidden = model.final_norm(x)[:, 0]
    return KVCache(k_all, v_all), _logits(model, hidden)
