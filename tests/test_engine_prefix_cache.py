"""Prefix caching in the embedded engine: the same answers as with the cache off, fewer prefilled tokens.

Two engines serve this module from the same tiny Qwen3-VL checkpoint (fp32, 4 slots): `on` with the
prefix cache, `off` without. Every request goes to both; greedy and seeded tokens must be identical
and log-probs within 1e-5, while `on` reports `cached_tokens` and prefills less. The `off` engine's
plain prefill is itself checked against transformers in test_engine.py. The host-side matching rules
(`prefix_cache.py`) are tested directly, without JAX programs.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_tiny import spread_weights

from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.engine.prefix_cache import ImageSpan, PrefixCache, fit_start, image_spans, reusable_prefix
from jaxrl_vlm.models import from_hf, to_hf
from rollout.client import GenerateResult, RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.sglang_wire import RawGenerate, SamplingParams

MAX_SEQ = 256
MIN_REUSE = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": 14, "ignore_eos": True}
PREAMBLE = "You are looking at a geometry figure. Read every label in it carefully before you answer."


# ---------------------------------------------------------------------------- host-side rules (no JAX)


def test_reusable_prefix_stops_at_differing_or_partial_images_and_before_the_last_token():
    cached = np.array([1, 2, 3, 9, 9, 9, 4, 5, 6, 7], np.int32)
    cached_imgs = (ImageSpan(3, 6, b"A"),)
    same = np.array([1, 2, 3, 9, 9, 9, 4, 5, 6, 7, 8, 8], np.int32)
    assert reusable_prefix(cached, cached_imgs, same, (ImageSpan(3, 6, b"A"),)) == 10  # whole cache
    assert reusable_prefix(cached, cached_imgs, same, (ImageSpan(3, 6, b"B"),)) == 3  # same ids, other picture
    assert reusable_prefix(cached, (), same, (ImageSpan(3, 6, b"A"),)) == 3  # cache without that image
    assert reusable_prefix(cached, cached_imgs, same[:10], (ImageSpan(3, 6, b"A"),)) == 9  # last token is computed
    diverge = same.copy()
    diverge[5] = 0  # differs inside the image: the image is only partly in the common prefix
    assert reusable_prefix(cached, cached_imgs, diverge, (ImageSpan(3, 5, b"A"),)) == 3
    assert reusable_prefix(cached, cached_imgs, np.array([7, 2, 3], np.int32), ()) == 0


def test_image_spans_hash_pixels_and_grid():
    pad, merge = 252, 2
    ids = np.array([1, 250, pad, pad, 251, 250, pad, pad, 251, 5], np.int32)
    grid = np.array([[1, 2, 4], [1, 4, 2]])
    pixels = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    spans = image_spans(ids, pixels, grid, pad, merge)
    assert [(s.start, s.end) for s in spans] == [(2, 4), (6, 8)]
    other = pixels.copy()
    other[12] += 1.0  # a pixel of the second image
    changed = image_spans(ids, other, grid, pad, merge)
    assert changed[0].key == spans[0].key and changed[1].key != spans[1].key
    regrid = image_spans(ids, pixels, np.array([[1, 4, 2], [1, 2, 4]]), pad, merge)
    assert regrid[0].key != spans[0].key  # same pixel bytes, other shape
    with pytest.raises(ValueError, match="do not match"):
        image_spans(ids[:-3], pixels, grid, pad, merge)


def test_fit_start_keeps_the_padded_suffix_inside_the_slot():
    buckets = (32, 64, 128, 256)
    assert fit_start(100, 130, (), buckets, 256) == 100  # 30 -> bucket 32, rows [100, 132)
    assert fit_start(240, 250, (), buckets, 256) == 224  # 10 -> 32 rows from 240 would pass 256
    # Moving back to 224 lands inside an image [220, 230): cut to its start, suffix 30 still fits 32.
    assert fit_start(240, 250, (ImageSpan(220, 230, b"x"),), buckets, 256) == 220
    # Cutting to the image start makes the suffix need 64 rows: move back again.
    assert fit_start(240, 250, (ImageSpan(200, 230, b"x"),), buckets, 256) == 192
    assert fit_start(10, 250, (), buckets, 256) == 0  # 240 tokens need the whole slot: plain prefill


def test_prefix_cache_picks_the_longest_prefix_and_tracks_recency():
    cache = PrefixCache()
    cache.put(0, np.array([1, 2, 3, 4], np.int32), ())
    cache.put(1, np.array([1, 2, 3, 4, 5, 6], np.int32), ())
    cache.put(2, np.array([1, 2, 9], np.int32), ())
    assert cache.best(np.array([1, 2, 3, 4, 5, 6, 7], np.int32), ()) == (1, 6, 0)
    # Tie on the reusable length: the slot that loses fewer cached tokens.
    assert cache.best(np.array([1, 2, 3, 4, 0], np.int32), ()) == (0, 4, 0)
    assert cache.best(np.array([1, 2, 3, 7, 7], np.int32), ()) == (0, 3, 1)
    assert cache.best(np.array([8, 8], np.int32), ()) is None
    assert cache.lru() == 0
    cache.touch(0)
    assert cache.lru() == 1
    cache.take(1)
    assert cache.slots() == [0, 2] and cache.lru() == 2
    assert cache.clear() == [0, 2] and cache.lru() is None


# ---------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with spread-out weights (HF's init gives near-uniform logits and ties)."""
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_hf_checkpoint), dtype=torch.float32).eval()
    spread_weights(hf, seed=3, embed_std=0.1)
    out = tmp_path_factory.mktemp("prefix_ckpt")
    hf.save_pretrained(str(out))
    for item in tiny_hf_checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("config.json", "generation_config.json"):
            shutil.copy2(item, out / item.name)
    return out


def _config(prefix_cache: bool) -> EngineOptions:
    return EngineOptions(max_batch=4, max_seq_len=MAX_SEQ, min_prefill_bucket=64, min_kv_bucket=MAX_SEQ, decode_batch_sizes=(4,),
                        min_patch_bucket=64, prefix_cache=prefix_cache, prefix_cache_min_tokens=MIN_REUSE)


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    """(prefix cache on, prefix cache off)."""
    on = EmbeddedEngine(str(checkpoint), config=_config(True))
    off = EmbeddedEngine(str(checkpoint), config=_config(False))
    on.start()
    off.start()
    yield on, off
    on.stop()
    off.stop()


@pytest.fixture(scope="module")
def encoder(engines: tuple[EmbeddedEngine, EmbeddedEngine]) -> ChatEncoder:
    return ChatEncoder(engines[0].engine.tokenizer, engines[0].engine.image_processor)


def client(engine: EmbeddedEngine) -> SGLangClient:
    return SGLangClient(engine.url, retry=RetryPolicy(max_retries=0), timeout_s=120.0)


async def flush(*engs: EmbeddedEngine) -> None:
    for e in engs:
        async with client(e) as c:
            assert await c.flush_cache()


async def generate_both(engines: tuple[EmbeddedEngine, EmbeddedEngine], ids: list[int], images: list[str],
                        params: dict[str, Any] = GREEDY) -> tuple[GenerateResult, GenerateResult]:
    on, off = engines
    async with client(on) as a, client(off) as b:
        return tuple(await asyncio.gather(a.generate(ids, image_data=images, sampling_params=params),
                                          b.generate(ids, image_data=images, sampling_params=params)))


def assert_same(on: GenerateResult, off: GenerateResult) -> None:
    assert on.output_ids == off.output_ids
    np.testing.assert_allclose(on.output_log_probs, off.output_log_probs, atol=1e-5, rtol=0)


class Conversation:
    """Wire ids and image data URLs of a growing episode, as rollout/multiturn.py builds them."""

    def __init__(self, encoder: ChatEncoder, content: list[dict[str, Any]]):
        self.encoder = encoder
        seg = encoder.encode_prompt([{"role": "user", "content": content}])
        self.ids, self.images = list(seg.wire_ids), list(seg.image_data)

    def add_turn(self, output_ids: list[int], content: list[dict[str, Any]]) -> None:
        seg = self.encoder.encode_observation([{"role": "user", "content": content}], model_ended_turn=False)
        self.ids += output_ids + seg.wire_ids
        self.images += seg.image_data


def image_item(image: Any) -> dict[str, Any]:
    return {"type": "image", "image": image}


def text_item(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def warm_slot_of(engine: EmbeddedEngine, ids_prefix_len: int) -> list[int]:
    """Warm slots whose cached ids are at least this long (test introspection)."""
    prefix = engine.engine.scheduler._prefix
    return [s for s in prefix.slots() if prefix.cached_ids(s).shape[0] >= ids_prefix_len]


# ---------------------------------------------------------------------------- engine behaviour


async def test_three_turn_image_episode_equals_the_cache_off_engine_and_skips_cached_work(engines, encoder, make_test_image):
    on, off = engines
    await flush(on, off)
    conv = Conversation(encoder, [text_item(PREAMBLE), image_item(make_test_image(5, (96, 80))), text_item("What is x?")])
    before = {e: (e.stats.prefilled_tokens, e.stats.encoded_images) for e in engines}
    seeded = {"temperature": 1.0, "max_new_tokens": 14, "ignore_eos": True, "sampling_seed": 7}
    turns = [
        (GREEDY, [image_item(make_test_image(8, (80, 96))), text_item("Here is the figure from above. Again?")]),
        (seeded, [text_item("Not quite. Check the angle at B and answer once more.")]),
        (GREEDY, None),
    ]
    results = []
    for params, observation in turns:
        a, b = await generate_both(engines, conv.ids, conv.images, params)
        assert_same(a, b)
        assert b.cached_tokens == 0
        results.append((a, b))
        if observation is not None:
            conv.add_turn(a.output_ids, observation)
    a1, a2, a3 = (r[0] for r in results)
    assert a1.cached_tokens == 0
    # Everything of the previous turn is served from the cache but its last sampled token.
    assert a2.cached_tokens == a1.prompt_tokens + len(a1.output_ids) - 1
    assert a3.cached_tokens == a2.prompt_tokens + len(a2.output_ids) - 1
    prefilled = {e: e.stats.prefilled_tokens - before[e][0] for e in engines}
    assert prefilled[off] == sum(r[1].prompt_tokens for r in results)
    assert prefilled[on] == prefilled[off] - a2.cached_tokens - a3.cached_tokens
    # The vision tower saw each image once with the cache, the growing list every turn without.
    assert on.stats.encoded_images - before[on][1] == 2
    assert off.stats.encoded_images - before[off][1] == 1 + 2 + 2
    keys = on.engine.runner.program_calls
    assert any(k[0] == "extend" and k[-1] is not None for k in keys) and any(k[0] == "extend" and k[-1] is None for k in keys)
    # The K/V kept in the warm slot equals what a plain prefill + decode computed in the cache-off engine.
    length = a3.prompt_tokens + len(a3.output_ids) - 1
    (slot,) = warm_slot_of(on, length)
    off_slot = 0  # sequential requests always take the lowest empty slot
    for part in ("k", "v"):
        got = np.asarray(getattr(on.engine.runner.cache, part)[:, slot, :length])
        want = np.asarray(getattr(off.engine.runner.cache, part)[:, off_slot, :length])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


async def test_a_different_image_of_the_same_size_is_not_reused(engines, encoder, make_test_image):
    on, off = engines
    await flush(on, off)
    def conv(seed: int) -> Conversation:
        return Conversation(encoder, [text_item(PREAMBLE), image_item(make_test_image(seed, (96, 80))),
                                      text_item("Which side is longest?")])

    first, second = conv(11), conv(12)
    assert first.ids == second.ids  # the wire ids cannot tell the pictures apart
    a, b = await generate_both(engines, first.ids, first.images)
    assert_same(a, b)
    images_before = on.stats.encoded_images
    a2, b2 = await generate_both(engines, second.ids, second.images)
    assert_same(a2, b2)
    assert b2.output_ids != b.output_ids, "the picture does not change the answer: the test could not see a stale image"
    expanded = on.engine.preparer.prepare(RawGenerate("probe", None, second.ids, second.images, SamplingParams(), False, False)).prompt
    (span,) = expanded.images
    assert span.start >= MIN_REUSE
    assert a2.cached_tokens == span.start  # reuse stops where the picture starts
    assert on.stats.encoded_images - images_before == 1


async def test_lru_eviction_under_slot_pressure_and_concurrent_turns_equal_solo_runs(engines, encoder):
    on, off = engines
    await flush(on, off)
    openings = ["Triangle ABC has", "A circle of radius", "Two parallel lines", "The square PQRS"]
    convs = [Conversation(encoder, [text_item(f"{opening} " + "a side that is longer than the others, " * (2 + i) + "find it.")])
             for i, opening in enumerate(openings)]
    cacheable = []
    for conv in convs:  # fill the 4 slots in order: the first conversation is the least recently used
        a, b = await generate_both(engines, conv.ids, [])
        assert_same(a, b)
        assert a.cached_tokens == 0
        cacheable.append(a.prompt_tokens + len(a.output_ids) - 1)
        conv.add_turn(a.output_ids, [text_item("Wrong, think again.")])
    assert len(on.engine.scheduler._prefix) == 4
    evictions = on.stats.prefix_evictions
    unrelated = encoder.encode_prompt([{"role": "user", "content": "Completely unrelated question about circles."}]).wire_ids
    a, b = await generate_both(engines, unrelated, [])
    assert_same(a, b)
    assert a.cached_tokens == 0 and on.stats.prefix_evictions == evictions + 1

    # The other three continue concurrently: each finds its own slot; batched answers equal solo cold runs.
    async with client(on) as c:
        together = await asyncio.gather(*(c.generate(conv.ids, sampling_params=GREEDY) for conv in convs[1:]))
    async with client(off) as c:
        solo = [await c.generate(conv.ids, sampling_params=GREEDY) for conv in convs[1:]]
    for got, want, n in zip(together, solo, cacheable[1:]):
        assert_same(got, want)
        assert got.cached_tokens == n
    # The least recently used conversation was the one evicted.
    a, b = await generate_both(engines, convs[0].ids, [])
    assert_same(a, b)
    assert a.cached_tokens == 0


async def test_a_shared_prefix_is_copied_and_both_conversations_keep_their_cache(engines, encoder, make_test_image):
    on, off = engines
    await flush(on, off)
    figure = image_item(make_test_image(21, (96, 80)))
    first = Conversation(encoder, [text_item(PREAMBLE), figure, text_item("What is the area?")])
    second = Conversation(encoder, [text_item(PREAMBLE), figure, text_item("What is the perimeter?")])
    shared = next(i for i, (x, y) in enumerate(zip(first.ids, second.ids)) if x != y)
    a, b = await generate_both(engines, first.ids, first.images)
    assert_same(a, b)
    copies, images = on.stats.prefix_copies, on.stats.encoded_images
    a2, b2 = await generate_both(engines, second.ids, second.images)
    assert_same(a2, b2)
    expanded_shared = shared + a2.prompt_tokens - len(second.ids)  # the image's pads lie inside the shared part
    assert a2.cached_tokens == expanded_shared >= MIN_REUSE
    assert on.stats.prefix_copies == copies + 1 and on.stats.encoded_images == images
    # Both conversations go on with their whole history cached.
    for conv, prev in ((first, a), (second, a2)):
        conv.add_turn(prev.output_ids, [text_item("Show your steps.")])
        got, want = await generate_both(engines, conv.ids, conv.images)
        assert_same(got, want)
        assert got.cached_tokens == prev.prompt_tokens + len(prev.output_ids) - 1


async def test_weight_reload_and_flush_drop_the_cache(engines, encoder, checkpoint, tmp_path):
    on, off = engines
    await flush(on, off)
    conv = Conversation(encoder, [text_item(PREAMBLE + " Find the perimeter.")])
    a, b = await generate_both(engines, conv.ids, [])
    conv.add_turn(a.output_ids, [text_item("Again, with units.")])

    new_model = from_hf(checkpoint)
    new_model.embed_vd[...] = new_model.embed_vd[...] * -1.0  # a different policy, same architecture
    new_dir = to_hf(new_model, tmp_path / "weights_v2", dtype=jnp.float32, copy_from=checkpoint)
    try:
        for e in engines:  # no pause / flush first (sync_weights_from_disk would flush): the update alone must drop the cache
            async with client(e) as c:
                assert (await c.update_weights_from_disk(str(new_dir), "2"))["success"] is True
        a2, b2 = await generate_both(engines, conv.ids, [])
        assert a2.cached_tokens == 0 and a2.weight_version == "2"
        assert_same(a2, b2)
        # The new weights' K/V is cached again; /flush_cache drops it.
        conv.add_turn(a2.output_ids, [text_item("Once more.")])
        async with client(on) as c:
            assert await c.flush_cache()
        a3, b3 = await generate_both(engines, conv.ids, [])
        assert a3.cached_tokens == 0
        assert_same(a3, b3)
    finally:
        for e in engines:
            async with client(e) as c:
                assert (await c.update_weights_from_disk(str(checkpoint), "1"))["success"] is True
