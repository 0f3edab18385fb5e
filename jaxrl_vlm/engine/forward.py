"""The engine's device functions, found through the model's family (pure, jit-able): decode cache, prefill,
decode, page copy.

The engine knows no family. Each family registers (`models/families.py`, `FamilyModel`) how it allocates its
`DecodeCache` and how it prefills a prompt into it and decodes one token per running request; the full-attention
families share the paged K/V implementation of `models/paged_kv.py`. What the engine relies on is the cache
protocol (`families.DecodeCache`): positions live in pages of `page_size` tokens named by a request's page table
(padded with `num_pages`: writes there are dropped, reads masked), pages may be shared by requests with a common
prompt prefix and copied on write (`copy_page`), and a running request has a slot that a family with
per-request state (a recurrent linear-attention layer) indexes it by.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_vlm.models.families import DecodeCache, PolicyModel, family_model


def init_cache(cfg: Any, num_pages: int, page_size: int, max_slots: int, dtype: jnp.dtype) -> DecodeCache:
    """The engine's whole decode memory for `cfg`'s family, zeroed (the one device allocation): `num_pages` pages
    of `page_size` tokens, and per-slot state for `max_slots` running requests where the family keeps any."""
    return family_model(cfg).init_cache(cfg, num_pages, page_size, max_slots, dtype)


def copy_page(cache: DecodeCache, src: jax.Array, dst: jax.Array) -> DecodeCache:
    """Page `src` copied into page `dst` (a reused, partly shared page that its new owner goes on to write)."""
    return cache.copy_page(src, dst)


def copy_state(cache: DecodeCache, src: jax.Array, dst: jax.Array) -> DecodeCache:
    """Recurrent-state row `src` copied into row `dst` (a no-op for a cache without recurrent state)."""
    return cache.copy_state(src, dst)


def prefill(
    model: PolicyModel,
    cache: DecodeCache,
    slot: jax.Array,
    table_p: jax.Array,
    start: jax.Array,
    tokens_1t: jax.Array,
    positions_31t: jax.Array,
    length: jax.Array,
    vision: Any,
) -> tuple[DecodeCache, jax.Array]:
    """Prompt tokens [start, start + T) of the request in `slot` (page table `table_p` int32 [P]) into the cache
    (start > 0: after a reused prefix); returns the cache and the fp32 logits [V] at the last real token.
    Shapes and padding: `paged_kv.prefill`."""
    return family_model(model.cfg).prefill(model, cache, slot, table_p, start, tokens_1t, positions_31t, length, vision)


def prefills_rows(cfg: Any) -> bool:
    """Whether `cfg`'s family prefills several prompts in one forward (`prefill_rows`)."""
    return family_model(cfg).prefill_rows is not None


def prefill_rows(
    model: PolicyModel,
    cache: DecodeCache,
    tables_rp: jax.Array,
    starts_r: jax.Array,
    tokens_rt: jax.Array,
    positions_3rt: jax.Array,
    lengths_r: jax.Array,
) -> tuple[DecodeCache, jax.Array]:
    """Text prompt tokens of R requests side by side (none reading what another writes) into the cache; returns the
    cache and the fp32 logits [R, V] at each one's last real token. Shapes and padding: `paged_kv.prefill_rows`."""
    rows = family_model(model.cfg).prefill_rows
    if rows is None:
        raise ValueError(f"{type(model.cfg).__name__}: this family prefills one request at a time")
    return rows(model, cache, tables_rp, starts_r, tokens_rt, positions_3rt, lengths_r, None)


def decode(
    model: PolicyModel,
    cache: DecodeCache,
    slots_b: jax.Array,
    tables_bp: jax.Array,
    tokens_b: jax.Array,
    lengths_b: jax.Array,
    rope_deltas_b: jax.Array,
) -> tuple[DecodeCache, jax.Array]:
    """One decode step of the running requests in `slots_b` [B]: each row's last token in, fp32 logits [B, V] out.
    Shapes and padding: `paged_kv.decode`."""
    return family_model(model.cfg).decode(model, cache, slots_b, tables_bp, tokens_b, lengths_b, rope_deltas_b)
