"""Paged KV cache, and the prefill and decode of a full-attention `VisionLanguageDecoder` against it (pure
functions, jit-able): the engine functions of every family whose text decoder is `layers.DecoderLayer`.

The cache is one fixed-shape array pair of *pages* of `page_size` tokens. A request's K/V lives in
the pages its *page table* lists: sequence position p is row p % page_size of page table[p //
page_size]. Page tables are padded with `num_pages` (one past the last page): a write there is
dropped and a read there is masked, so tables of any length fit a fixed-width bucket. Pages may be
shared by several requests (a common prompt prefix), which is safe because a request only ever
writes positions past its shared pages. The functions compose the model's public pieces
(`embed_inputs`, `embed`, each layer's `input_norm`, `attn.project` / `attn.output`,
`post_attn_norm`, `mlp`, `final_norm`, `lm_head_kernel`) so that the math is the training forward's,
with the attention split into "write K/V, then attend to the cache". Prefill can start after a
prefix already in the cache (prefix sharing): it then computes only the suffix, attending to the
cached keys.

Positions are M-RoPE ids computed on the host (`rope.get_rope_index`). A decoded token at sequence
index i has position i + rope_delta on all three axes (text tokens after the prompt).

Decode attention (`decode_attention`) follows the model's `attention_impl`: `xla` (and `ring`) gather each row's
pages into a dense array and attend with XLA; `pallas_gpu` / `pallas_tpu` read the pages in place with a paged
kernel (`paged_attention_kernel`; Pallas' interpreter on a CPU backend). Prefill always gathers: it attends many
queries at once, where the gather's extra copy is small next to the attention itself.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl_vlm.models import paged_attention_kernel
from jaxrl_vlm.models.config import ModelConfig
from jaxrl_vlm.models.layers import VisionLanguageDecoder, add_at_slots, attention, mrope_cos_sin

# Attends to the cache after this step's K/V write: (q [B, T, N, H], k_all, v_all [L, pages, page_size, K, H],
# layer, scale) -> [B, T, N, H].
CacheAttention = Callable[[jax.Array, jax.Array, jax.Array, int, float], jax.Array]


class KVCache(NamedTuple):
    """Keys and values of every page: k, v [layers, num_pages, page_size, kv_heads, head_dim] (a
    `families.DecodeCache`)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def copy_page(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Page `src` copied into page `dst` in every layer: a partly shared page that the copy's owner
        goes on to write (copy-on-write)."""
        return KVCache(self.k.at[:, dst].set(self.k[:, src]), self.v.at[:, dst].set(self.v[:, src]))

    @property
    def state_rows(self) -> int:
        return 0  # full attention keeps everything in pages

    def copy_state(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        return self

    def logical_axes(self) -> "KVCache":
        """Pages split by kv heads, as the attention projections are (no communication in attention)."""
        return KVCache(KV_LOGICAL_AXES, KV_LOGICAL_AXES)


# k and v [layers, pages, page_size, kv_heads, head_dim]: heads follow the attention projections' split.
KV_LOGICAL_AXES: tuple[str | None, ...] = (None, None, None, "kv_heads", "head_dim")


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """Shape of k (and v): [layers, num_pages, page_size, kv_heads, head_dim]."""
    t = cfg.text
    return (t.num_hidden_layers, num_pages, page_size, t.num_key_value_heads, t.head_dim)


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, max_slots: int, dtype: jnp.dtype) -> KVCache:
    """The engine's whole KV memory: `num_pages` pages of `page_size` tokens (the one device allocation);
    full attention keeps nothing per slot, so `max_slots` is unused."""
    shape = cache_shape(cfg, num_pages, page_size)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def page_slots(table: jax.Array, positions: jax.Array, page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page, row) of each sequence position under `table` [..., P]; positions past the table map to
    page `num_pages`, whose writes are dropped."""
    index = positions // page_size
    page = jnp.take_along_axis(table, jnp.minimum(index, table.shape[-1] - 1), axis=-1)
    page = jnp.where(index < table.shape[-1], page, num_pages)
    return page, positions % page_size


def gather_pages(part: jax.Array, i: int, table: jax.Array) -> jax.Array:
    """Layer i's K or V of the pages in `table` [B, P], laid end to end: [B, P * page_size, kv_heads, head_dim]."""
    pages = part[i, table]  # padding entries (num_pages) are clamped to the last page, then masked
    b, p, s = pages.shape[:3]
    return pages.reshape(b, p * s, *pages.shape[3:])


def gather_attention(mask: jax.Array, tables_bp: jax.Array) -> CacheAttention:
    """Attention to the pages of `tables_bp` [B, P] gathered end to end, under `mask` bool [B, T, P * page_size]."""

    def attend(q: jax.Array, k_all: jax.Array, v_all: jax.Array, i: int, scale: float) -> jax.Array:
        keys, values = (gather_pages(part, i, tables_bp).astype(q.dtype) for part in (k_all, v_all))
        return attention(q, keys, values, mask, scale)

    return attend


def decode_attention(attention_impl: str, tables_bp: jax.Array, lengths_b: jax.Array, page_size: int) -> CacheAttention:
    """The decode step's attention: each row's one query (at sequence index lengths_b [B]) to positions
    [0, lengths_b] of its table `tables_bp` [B, P]. `attention_impl` pallas_gpu / pallas_tpu: the paged kernel
    reads the pages in place (`paged_attention_kernel.paged_decode_attention`, which raises naming the constraint
    a cache breaks); any other: the gather."""
    if attention_impl in paged_attention_kernel.IMPLS:

        def attend(q: jax.Array, k_all: jax.Array, v_all: jax.Array, i: int, scale: float) -> jax.Array:
            out = paged_attention_kernel.paged_decode_attention(q[:, 0], k_all, v_all, i, tables_bp, lengths_b,
                                                                scale=scale, impl=attention_impl)
            return out[:, None]

        return attend
    span = tables_bp.shape[1] * page_size
    return gather_attention((jnp.arange(span)[None, :] <= lengths_b[:, None])[:, None, :], tables_bp)


def _logits(model: VisionLanguageDecoder, hidden_nd: jax.Array) -> jax.Array:
    kernel = model.lm_head_kernel().astype(model.compute_dtype)
    return jnp.einsum("nd,dv->nv", hidden_nd.astype(model.compute_dtype), kernel, preferred_element_type=jnp.float32)


def _decoder(
    model: VisionLanguageDecoder,
    cache: KVCache,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    write: Callable[[jax.Array, int, jax.Array], jax.Array],
    attend: CacheAttention,
    deepstack: Sequence[jax.Array] = (),
    image_slots: jax.Array | None = None,
) -> tuple[KVCache, jax.Array, list[jax.Array]]:
    """The decoder layers against the cache, shared by prefill and decode: per layer, project,
    `write(cache_part, layer, new)` the new K (and V), `attend` to the cache, MLP, and add deepstack
    features after the first layers. Returns the cache, the final-normed hidden states and the top-k
    expert ids [B, T, k] of each routed MoE layer (a layer with `sparse` set, in layer order; none for a
    dense decoder)."""
    k_all, v_all = cache.k, cache.v
    routed: list[jax.Array] = []
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.project(layer.input_norm(x), cos, sin)
        k_all, v_all = write(k_all, i, k.astype(k_all.dtype)), write(v_all, i, v.astype(v_all.dtype))
        x = x + layer.attn.output(attend(q, k_all, v_all, i, layer.attn.scale))
        if getattr(layer, "sparse", False):
            y, routing = layer.mlp.forward(layer.post_attn_norm(x))
            routed.append(routing.topk_ids)
            x = x + y
        else:
            x = x + layer.mlp(layer.post_attn_norm(x))
        if i < len(deepstack):
            x = add_at_slots(x, image_slots, deepstack[i])
    return KVCache(k_all, v_all), model.final_norm(x), routed


def prefill(
    model: VisionLanguageDecoder,
    cache: KVCache,
    slot: jax.Array,
    table_p: jax.Array,
    start: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: Any,
) -> tuple[KVCache, jax.Array]:
    """`prefill_rows` of one request: the fp32 logits [V] at its last real token."""
    cache, logits, _ = prefill_rows_routed(model, cache, table_p[None], start[None], tokens_1t, positions_31t,
                                           length[None], vision)
    return cache, logits[0]


def prefill_rows(
    model: VisionLanguageDecoder,
    cache: KVCache,
    tables_rp: jax.Array,
    starts_r: jax.Array,
    tokens_rt: jax.Array,
    positions_3rt: jax.Array,
    lengths_r: jax.Array,
    vision: Any,
) -> tuple[KVCache, jax.Array]:
    """`prefill_rows_routed` without the expert ids."""
    return prefill_rows_routed(model, cache, tables_rp, starts_r, tokens_rt, positions_3rt, lengths_r, vision)[:2]


def prefill_rows_routed(
    model: VisionLanguageDecoder,
    cache: KVCache,
    tables_rp: jax.Array,
    starts_r: jax.Array,
    tokens_rt: jax.Array,
    positions_3rt: jax.Array,
    lengths_r: jax.Array,
    vision: Any,
) -> tuple[KVCache, jax.Array, list[jax.Array]]:
    """Run the prompt tokens [start, start + T) of R requests at once (each padded to a bucket of T) and store their
    K/V at those positions of each row's page table `tables_rp` int32 [R, P] (padded with num_pages; its width
    bounds the attended cache: start + length <= P * page_size); each row attends to its own cached K/V [0, start)
    and causally to its own new tokens. The rows must not read what another row of the same call writes (a prefix
    one of them is computing): they run side by side, not in order.

    start = 0 is a plain prefill; start > 0 extends a reused prefix (the prefix cache), so only the new suffix is
    computed. tokens_rt int32 [R, T] (image pads expanded; padding after each row's length), positions_3rt int32
    [3, R, T] (each full prompt's M-RoPE ids, sliced), lengths_r int32 [R] (real tokens per row, >= 1), vision:
    the images inside these tokens only (its `image_token_index` indexes the flattened [R * T] tokens) or None.
    Returns the updated cache, the fp32 logits [R, V] at each row's last real token and each routed MoE layer's
    top-k expert ids [R, T, k] (`_decoder`).

    Padding tokens write K/V beyond start + length, into the row's own last page or nowhere (a table entry of
    num_pages); decode overwrites position start + length before it is ever attended to and masks everything after
    it, so that garbage is never read. A padding row (a table of num_pages only) writes nothing.
    """
    _, t = tokens_rt.shape
    num_pages, page_size = cache.k.shape[1], cache.k.shape[2]
    x, deepstack, image_slots = model.embed_inputs(tokens_rt, vision)
    cos, sin = mrope_cos_sin(positions_3rt, model.cfg, model.compute_dtype)
    span = tables_rp.shape[1] * page_size
    positions_rt = starts_r[:, None] + jnp.arange(t)[None, :]
    mask = jnp.arange(span)[None, None, :] <= positions_rt[:, :, None]  # [R, T, P * page_size]
    page_rt, row_rt = page_slots(tables_rp, positions_rt, page_size, num_pages)

    def write(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return part.at[i, page_rt, row_rt].set(new, mode="drop")

    attend = gather_attention(mask, tables_rp)
    cache, hidden, routed = _decoder(model, cache, x, cos, sin, write, attend, deepstack, image_slots)
    last = jnp.take_along_axis(hidden, (lengths_r - 1)[:, None, None], axis=1)[:, 0]  # [R, D]
    return cache, _logits(model, last), routed


def decode(
    model: VisionLanguageDecoder,
    cache: KVCache,
    slots_b: jax.Array,
    tables_bp: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
) -> tuple[KVCache, jax.Array]:
    """`decode_routed` without the expert ids."""
    return decode_routed(model, cache, slots_b, tables_bp, tokens_b, lengths_b, rope_deltas_b)[:2]


def decode_routed(
    model: VisionLanguageDecoder,
    cache: KVCache,
    slots_b: jax.Array,
    tables_bp: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
) -> tuple[KVCache, jax.Array, list[jax.Array]]:
    """One decode step: feed each row its last token, append its K/V, return logits.

    slots_b int32 [B]: the rows' running slots (unused: no per-request state outside the pages);
    tables_bp int32 [B, P]: each row's page table (padded with num_pages; P * page_size bounds the
    attended cache and must exceed every real length); tokens_b int32 [B]: the token at sequence
    index lengths_b (not yet in the cache); lengths_b int32 [B]: tokens already cached per row;
    rope_deltas_b int32 [B]. Padding rows carry a table of num_pages only: their K/V writes are
    dropped, so no page but the rows' own is ever written (shared and cached pages stay intact),
    and their logits are discarded. Attention follows `model.attention_impl` (`decode_attention`).
    Returns the updated cache, fp32 logits [B, V] and each routed MoE layer's top-k expert ids [B, 1, k].
    """
    b = tokens_b.shape[0]
    num_pages, page_size = cache.k.shape[1], cache.k.shape[2]
    x = model.embed(tokens_b[:, None])  # [B, 1, D]
    pos = (lengths_b + rope_deltas_b)[None, :, None]
    cos, sin = mrope_cos_sin(jnp.broadcast_to(pos, (3, b, 1)), model.cfg, model.compute_dtype)
    page_b, row_b = page_slots(tables_bp, lengths_b[:, None], page_size, num_pages)

    def write(part: jax.Array, i: int, new: jax.Array) -> jax.Array:
        return part.at[i, page_b[:, 0], row_b[:, 0]].set(new[:, 0], mode="drop")

    attend = decode_attention(model.attention_impl, tables_bp, lengths_b, page_size)
    cache, hidden, routed = _decoder(model, cache, x, cos, sin, write, attend)
    return cache, _logits(model, hidden[:, 0]), routed
