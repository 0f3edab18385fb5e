"""Prefix sharing in the embedded engine's paged KV cache: the same answers as without it, fewer prefilled tokens.

Two engines serve this module from the same tiny Qwen3-VL checkpoint (fp32, 4 running requests, pages
of PAGE tokens, a KV memory of MEMORY tokens so that concurrent requests and the cache compete for
pages): `on` with the radix cache, `off` without. Every request goes to both; greedy and seeded
tokens must be identical and log-probs within 1e-5, while `on` reports `cached_tokens` and prefills
less. The `off` engine's plain prefill is itself checked
against transformers in test_engine.py. The host-side page and tree rules (`prefix_cache.py`) are
tested directly, without JAX programs; random request streams are property-tested against each
request run alone.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_tiny import spread_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_vlm.engine import EmbeddedEngine, EngineOptions
from jaxrl_vlm.engine.prefix_cache import (
    ImageSpan,
    PageCache,
    StateSnapshots,
    image_spans,
    page_keys,
    prefix_key,
    reusable_tokens,
    tail_key,
)
from jaxrl_vlm.engine.runner import ModelRunner
from jaxrl_vlm.models import from_hf, to_hf
from rollout.client import GenerateResult, RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.sglang_wire import FinishType, RawGenerate, SamplingParams

MAX_SEQ = 256
PAGE = 8
MEMORY = 640  # tokens of KV memory: 80 pages, 2.5 requests of MAX_SEQ
GREEDY = {"temperature": 0.0, "max_new_tokens": 14, "ignore_eos": True}
PREAMBLE = "You are looking at a geometry figure. Read every label in it carefully before you answer."


def pages_of(n: int) -> int:
    """Tokens of `n` cached ones that a later request can reuse: whole pages."""
    return n // PAGE * PAGE


# ---------------------------------------------------------------------------- host-side rules (no JAX)


def test_page_keys_tell_images_apart_and_reuse_stops_before_the_last_token_and_split_images():
    ids = np.array([1, 2, 3, 9, 9, 9, 4, 5, 6, 7, 8, 8], np.int32)
    a, b = (ImageSpan(3, 6, b"A"),), (ImageSpan(3, 6, b"B"),)
    ka, kb, plain = page_keys(ids, a, 4, 3), page_keys(ids, b, 4, 3), page_keys(ids, (), 4, 3)
    assert ka[0] != kb[0] and ka[1] != kb[1]  # both pages holding pads of the image know which picture it is
    assert ka[2] == kb[2] == plain[2]  # a page after the image is keyed by its ids alone
    assert ka[0] != plain[0]
    assert reusable_tokens(12, 12, ()) == 11  # the last prompt token is always computed
    assert reusable_tokens(11, 20, ()) == 11
    assert reusable_tokens(12, 20, (ImageSpan(6, 14, b"A"),)) == 6  # never inside an image: back to its start
    assert reusable_tokens(16, 20, (ImageSpan(6, 14, b"A"),)) == 16
    assert reusable_tokens(12, 20, (ImageSpan(2, 5, b"A"), ImageSpan(8, 14, b"B"))) == 8
    assert tail_key(ids, a, 4, 1, 2) == page_keys(ids[:6], a, 4, 2)[1] != tail_key(ids, b, 4, 1, 2)


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


def test_kv_memory_is_counted_in_pages_and_must_hold_one_full_request():
    default = EngineOptions(max_batch=4, max_seq_len=100, page_size=16)
    assert default.pages_per_request == 7 and default.num_pages == 4 * 7  # one max_seq_len row per request, in pages
    assert EngineOptions(max_batch=4, max_seq_len=256, page_size=16, max_total_tokens=1000).num_pages == 62
    slots = EngineOptions(max_batch=4, max_seq_len=256, page_size=256)  # the layout before paging
    assert slots.num_pages == 4 and slots.pages_per_request == 1
    with pytest.raises(ValueError, match="one request of max_seq_len=256 tokens needs 16"):
        EngineOptions(max_seq_len=256, page_size=16, max_total_tokens=255)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        EngineOptions(page_size=0)


def _keys(*pages: int) -> list[bytes]:
    return [bytes([p]) for p in pages]


def test_page_cache_shares_the_longest_path_and_counts_holders():
    cache = PageCache(num_pages=8, page_size=4)
    first = cache.allocate(3)
    assert cache.insert(_keys(1, 2, 3), first) == 3
    assert cache.match(_keys(1, 2, 7)) == (first[:2], None)
    assert cache.match(_keys(9)) == ([], None)
    # A sibling that computed the same page itself keeps its copy out of the tree, and so its pages after it.
    other = cache.allocate(2)
    assert cache.insert(_keys(1, 5), [first[0], other[0]]) == 1
    assert cache.insert(_keys(1, 2, 4), [first[0], other[0], other[1]]) == 0
    cache.release(first)
    cache.release(other)
    assert cache.free_pages == 8 - 4 and cache.cached_pages == 4 and cache.available() == 8
    with pytest.raises(ValueError, match="released more often"):
        cache.release([other[1], other[1]])


def test_page_cache_tails_are_found_by_their_tokens_and_replaced_once_their_page_fills():
    cache = PageCache(num_pages=4, page_size=4)
    pages = cache.allocate(2)
    cache.insert(_keys(1), pages[:1], (b"t2", pages[1], 2))  # a request whose second page holds 2 tokens so far
    prompt_tails = {(1, 2): b"t2", (1, 3): b"t3"}.get  # (page, tokens) -> key, as a prompt would spell them
    assert cache.match(_keys(1, 9), lambda j, n: prompt_tails((j, n), b"")) == (pages[:1], (pages[1], 2))
    assert cache.match(_keys(1), lambda j, n: b"other") == (pages[:1], None)
    # It wrote on: the page, now full, enters as a full page and its tail leaves.
    assert cache.insert(_keys(1, 2), pages) == 1
    assert cache.match(_keys(1, 2), lambda j, n: prompt_tails((j, n), b"")) == (pages, None)
    cache.release(pages)
    assert cache.cached_pages == 2 and cache.available() == 4 and cache.allocate(4) is not None


def test_page_cache_evicts_unheld_pages_least_recently_used_leaves_first():
    cache = PageCache(num_pages=6, page_size=4)
    old = cache.allocate(3)
    cache.insert(_keys(1, 2, 3), old)
    cache.release(old)
    new = cache.allocate(2)
    cache.insert(_keys(4, 5), new)
    cache.release(new)
    assert cache.free_pages == 1
    cache.match(_keys(1))  # the root page of the old path is used again, its leaves are not
    held, _ = cache.match(_keys(4, 5))
    cache.hold(held)  # a running request reads them: never evicted
    got = cache.allocate(3)
    assert got is not None and cache.evictions == 2
    assert cache.match(_keys(1, 2, 3))[0] == old[:1]  # leaves of the old path went first
    assert cache.match(_keys(4, 5))[0] == held
    assert cache.allocate(2) is None and cache.free_pages == 0  # only held pages left: nothing changes
    # Dropping the tree (new weights) keeps the pages running requests hold until they let go.
    assert cache.clear() == 3
    assert cache.match(_keys(4))[0] == [] and cache.free_pages == 1
    cache.release(held)
    cache.release(got)
    assert cache.free_pages == 6 and cache.available() == 6


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["run", "finish", "clear"]), st.lists(st.integers(0, 2), min_size=1, max_size=5),
                              st.integers(0, 3)), max_size=40))
def test_page_cache_accounting_holds_under_random_requests(ops):
    """Requests over a 3-letter alphabet of page keys, some ending in a partly filled page (a tail): hold
    their cached prefix, allocate the rest, enter the tree, finish; the pool's counts always equal a
    recount from the holders."""
    cache = PageCache(num_pages=12, page_size=4)
    running: list[list[int]] = []
    for op, path, tail in ops:
        keys = _keys(*path)
        if op == "run":
            reused, copied = cache.match(keys, lambda j, n: bytes([path[j] if j < len(path) else 9, n]))
            cache.hold(reused)
            fresh = cache.allocate(len(keys) - len(reused) + (tail > 0))
            if fresh is None:
                cache.release(reused)
                continue
            pages = reused + fresh
            running.append(pages)
            cache.insert(keys, pages[: len(keys)], (bytes([9, tail]), pages[-1], tail) if tail else None)
        elif op == "finish" and running:
            cache.release(running.pop(0))
        elif op == "clear":
            cache.clear()
        holders = np.zeros((12,), np.int64)
        for pages in running:
            np.add.at(holders, pages, 1)
        tree = set(cache._nodes)
        np.add.at(holders, list(tree), 1)
        assert [cache.refs(p) for p in range(12)] == holders.tolist()
        assert cache.free_pages == int((holders == 0).sum())
        assert cache.evictable_pages() == sum(1 for p in tree if holders[p] == 1)
        assert cache.request_held_pages() == len({p for pages in running for p in pages})
        assert all(len(set(pages)) == len(pages) for pages in running)


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
                        min_patch_bucket=64, page_size=PAGE, max_total_tokens=MEMORY, prefix_cache=prefix_cache)


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


def prepared(engine: EmbeddedEngine, ids: list[int], images: list[str]) -> Any:
    """The engine's prepared prompt (pads expanded, positions, pixels, image identities)."""
    return engine.engine.preparer.prepare(RawGenerate("probe", None, ids, images, SamplingParams(), False, False)).prompt


# ---------------------------------------------------------------------------- engine behaviour


@pytest.mark.slow
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
    # Everything of the previous turn is served from the cache but its last sampled token (its partly
    # filled last page is copied).
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
    # The cached pages of the last prompt hold what a plain prefill of it computes on an empty cache.
    prompt = prepared(on, conv.ids, conv.images)
    full = prompt.num_tokens // PAGE
    pages, _ = on.engine.scheduler._pages.match(page_keys(prompt.input_ids, prompt.images, PAGE, full))
    assert len(pages) == full
    runner = on.engine.runner
    fresh = ModelRunner(runner.model(), EngineOptions(**{**_config(False).__dict__, "max_total_tokens": MAX_SEQ}), runner.banned_ids)
    ints, floats = np.zeros((6,), np.int32), np.zeros((3,), np.float32)
    fresh.prefill(0, list(range(fresh.config.num_pages)), prompt.input_ids, prompt.positions, prompt.pixel_values,
                  prompt.image_grid_thw, None, ints, floats)
    for part in ("k", "v"):
        got = np.asarray(getattr(runner.cache, part)[:, pages])
        want = np.asarray(getattr(fresh.cache, part)[:, :full])
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
    (span,) = prepared(on, second.ids, second.images).images
    assert span.start >= PAGE
    assert a2.cached_tokens == pages_of(span.start)  # reuse stops before the picture
    assert on.stats.encoded_images - images_before == 1


def cached_path(engine: EmbeddedEngine, ids: list[int], tokens: int) -> int:
    """How many of the first `tokens` tokens of a text prompt the engine's tree holds in full pages
    (introspection that, unlike `match`, leaves the recency of the pages alone)."""
    node, held = engine.engine.scheduler._pages._root, 0
    for key in page_keys(np.asarray(ids, np.int32), (), PAGE, tokens // PAGE):
        node = node.children.get(key)
        if node is None:
            break
        held += PAGE
    return held


@pytest.mark.slow
async def test_lru_eviction_under_memory_pressure_and_concurrent_turns_equal_solo_runs(engines, encoder):
    on, off = engines
    await flush(on, off)
    openings = ["Triangle ABC has", "A circle of radius", "Two parallel lines", "The square PQRS"]
    convs = [Conversation(encoder, [text_item(f"{opening} " + "a side that is longer than the others, " * (3 + i) + "find it.")])
             for i, opening in enumerate(openings)]
    cacheable = []
    for conv in convs:  # one after the other: the first conversation is the least recently used
        a, b = await generate_both(engines, conv.ids, [])
        assert_same(a, b)
        assert a.cached_tokens == 0
        cacheable.append(a.prompt_tokens + len(a.output_ids) - 1)
        conv.add_turn(a.output_ids, [text_item("Wrong, think again.")])
    history = [conv.ids[:n] for conv, n in zip(convs, cacheable)]
    assert [cached_path(on, h, n) for h, n in zip(history, cacheable)] == [pages_of(n) for n in cacheable]
    # An unrelated request that needs 3 pages more than are free evicts the 3 least recently used pages,
    # leaves first: the end of the first conversation.
    pages = on.engine.scheduler._pages
    evictions, free = pages.evictions, pages.free_pages
    filler = encoder.encode_prompt([{"role": "user", "content": "Completely unrelated question about circles. " * 40}]).wire_ids
    length = (free + 3) * PAGE - GREEDY["max_new_tokens"]
    assert GREEDY["max_new_tokens"] < length <= len(filler), "resize the conversations: the filler must fit one request"
    a, b = await generate_both(engines, filler[:length], [])
    assert_same(a, b)
    assert a.cached_tokens == 0 and pages.evictions == evictions + 3
    # Its partly filled last page, then its last two full pages.
    assert cached_path(on, history[0], cacheable[0]) == pages_of(cacheable[0]) - 2 * PAGE
    assert [cached_path(on, h, n) for h, n in zip(history[1:], cacheable[1:])] == [pages_of(n) for n in cacheable[1:]]

    # The other three continue concurrently, each reading its own pages; batched answers equal solo cold runs.
    async with client(on) as c:
        together = await asyncio.gather(*(c.generate(conv.ids, sampling_params=GREEDY) for conv in convs[1:]))
    async with client(off) as c:
        solo = [await c.generate(conv.ids, sampling_params=GREEDY) for conv in convs[1:]]
    for got, want, n in zip(together, solo, cacheable[1:]):
        assert_same(got, want)
        assert got.cached_tokens == n
    a, b = await generate_both(engines, convs[0].ids, [])
    assert_same(a, b)
    assert a.cached_tokens < pages_of(cacheable[0])


async def test_a_shared_prefix_is_shared_and_both_conversations_keep_their_cache(engines, encoder, make_test_image):
    on, off = engines
    await flush(on, off)
    figure = image_item(make_test_image(21, (96, 80)))
    ask = "Answer in one short sentence, then explain each step you take. "
    first = Conversation(encoder, [text_item(PREAMBLE), figure, text_item(ask + "What is the area?")])
    second = Conversation(encoder, [text_item(PREAMBLE), figure, text_item(ask + "What is the perimeter?")])
    shared = next(i for i, (x, y) in enumerate(zip(first.ids, second.ids)) if x != y)
    a, b = await generate_both(engines, first.ids, first.images)
    assert_same(a, b)
    images = on.stats.encoded_images
    a2, b2 = await generate_both(engines, second.ids, second.images)
    assert_same(a2, b2)
    expanded_shared = shared + a2.prompt_tokens - len(second.ids)  # the image's pads lie inside the shared part
    (span,) = prepared(on, second.ids, second.images).images
    assert a2.cached_tokens == pages_of(expanded_shared) >= span.end
    assert on.stats.encoded_images == images  # the image lies in the shared pages: not encoded again
    # Both conversations go on with their whole history cached.
    for conv, prev in ((first, a), (second, a2)):
        conv.add_turn(prev.output_ids, [text_item("Show your steps.")])
        got, want = await generate_both(engines, conv.ids, conv.images)
        assert_same(got, want)
        assert got.cached_tokens == prev.prompt_tokens + len(prev.output_ids) - 1


@pytest.mark.slow
async def test_a_group_of_samples_prefills_its_image_prompt_once(engines, encoder, make_test_image):
    on, off = engines
    await flush(on, off)
    conv = Conversation(encoder, [text_item(PREAMBLE), image_item(make_test_image(31, (96, 80))), text_item("Find x.")])
    n = 6
    params = [{"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 100 + i} for i in range(n)]
    before = {e: (e.stats.prefilled_tokens, e.stats.encoded_images) for e in engines}
    results = {}
    for e in engines:  # the samples of a group arrive together
        async with client(e) as c:
            results[e] = await asyncio.gather(*(c.generate(conv.ids, image_data=conv.images, sampling_params=p) for p in params))
    for got, want in zip(results[on], results[off]):
        assert_same(got, want)
    assert len({tuple(r.output_ids) for r in results[on]}) > 1
    prompt = results[on][0].prompt_tokens
    # The first sample prefills the prompt; the others copy its partly filled last page and compute one token.
    assert sorted(r.cached_tokens for r in results[on]) == [0] + [prompt - 1] * (n - 1)
    assert on.stats.prefilled_tokens - before[on][0] == prompt + (n - 1)
    assert off.stats.prefilled_tokens - before[off][0] == n * prompt
    assert on.stats.encoded_images - before[on][1] == 1


@pytest.mark.slow
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


async def test_requests_that_outgrow_the_memory_are_retracted_and_resume_with_the_same_answers(engines, encoder):
    on, off = engines
    await flush(on, off)
    prompts = [encoder.encode_prompt([{"role": "user", "content": f"Case {i}: " + "prove that the angles add up. " * 6}]).wire_ids
               for i in range(4)]
    params = {"temperature": 0.0, "max_new_tokens": 80, "ignore_eos": True}
    assert 4 * (len(prompts[0]) + params["max_new_tokens"]) > MEMORY  # together they cannot all finish in place
    retractions = on.stats.retractions
    async with client(on) as c:
        together = await asyncio.gather(*(c.generate(p, sampling_params=params) for p in prompts))
    async with client(off) as c:
        solo = [await c.generate(p, sampling_params=params) for p in prompts]
    for got, want in zip(together, solo):
        assert_same(got, want)
    assert on.stats.retractions > retractions
    assert sum(r.meta_info["num_retractions"] for r in together) == on.stats.retractions - retractions


# ---------------------------------------------------------------------------- property: sharing never changes answers


_rids = itertools.count()
WORDS = "angle side circle radius chord tangent area perimeter triangle square median altitude".split()


@st.composite
def request_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Requests arriving close together: a prefix from a small pool (two pictures of the same size, long and
    short texts), a few random words, a token budget, sometimes an abort; some continue as a second turn."""
    n = draw(st.integers(3, 9))
    return [{
        "prefix": draw(st.integers(0, 3)),
        "words": draw(st.lists(st.sampled_from(WORDS), max_size=10)),
        "max_new": draw(st.sampled_from([1, 3, 8, 12, 40])),
        "seed": draw(st.integers(0, 3)),
        "abort": draw(st.booleans()) and draw(st.booleans()),
        "delay_ms": draw(st.integers(0, 20)),
        "next_turn": draw(st.booleans()),
    } for _ in range(n)]


def _stream_prompts(encoder: ChatEncoder, make_test_image: Any, stream: list[dict[str, Any]]) -> list[Conversation]:
    prefixes = [
        [text_item(PREAMBLE), image_item(make_test_image(41, (96, 80)))],
        [text_item(PREAMBLE), image_item(make_test_image(42, (96, 80)))],  # same ids as the first, another picture
        [text_item(PREAMBLE + " Use the figure below. " * 16)],  # long: with a few others it fills the memory
        [text_item("Short question.")],
    ]
    return [Conversation(encoder, prefixes[r["prefix"]] + [text_item(" ".join(r["words"]) + " Answer?")]) for r in stream]


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(stream=request_streams())
def test_random_request_streams_give_every_request_its_solo_answer(engines, encoder, make_test_image, stream):
    """Shared, evicted and re-shared pages never change another request's output: each request (greedy or
    seeded) equals itself run alone on the engine without prefix sharing; an aborted one returns a prefix of it."""
    on, off = engines
    convs = _stream_prompts(encoder, make_test_image, stream)

    def params(r: dict[str, Any]) -> dict[str, Any]:
        temperature = 0.0 if r["seed"] == 0 else 1.0
        return {"temperature": temperature, "max_new_tokens": r["max_new"], "ignore_eos": True, "sampling_seed": r["seed"]}

    async def one(c: SGLangClient, i: int, r: dict[str, Any], conv: Conversation, tag: str) -> GenerateResult:
        await asyncio.sleep(r["delay_ms"] / 1000)
        rid = f"{tag}-{i}-{next(_rids)}"
        task = asyncio.ensure_future(c.generate(conv.ids, image_data=conv.images, sampling_params=params(r), rid=rid))
        if r["abort"]:
            await asyncio.sleep(0.002 * r["max_new"])
            await c.abort_request(rid=rid)
        return await task

    async def run() -> None:
        async with client(on) as c:
            together = await asyncio.gather(*(one(c, i, r, conv, "t1") for i, (r, conv) in enumerate(zip(stream, convs))))
        results = [(list(conv.ids), list(conv.images), r, got) for conv, r, got in zip(convs, stream, together)]
        # Second turns of the episodes that were not aborted, concurrently again: they reuse their first turn's pages.
        later = [i for i, (r, got) in enumerate(zip(stream, together)) if r["next_turn"] and got.finish_reason is not FinishType.ABORT
                 and got.prompt_tokens + len(got.output_ids) + 32 + r["max_new"] <= MAX_SEQ]  # the second turn fits the context
        for i in later:
            convs[i].add_turn(together[i].output_ids, [text_item("Check it: " + " ".join(stream[i]["words"][:3]))])
        async with client(on) as c:
            second = await asyncio.gather(*(one(c, i, {**stream[i], "abort": False}, convs[i], "t2") for i in later))
        results += [(convs[i].ids, convs[i].images, {**stream[i], "abort": False}, got) for i, got in zip(later, second)]
        async with client(off) as c:
            for ids, images, r, got in results:
                want = await c.generate(ids, image_data=images, sampling_params=params(r))
                if r["abort"] and got.finish_reason is FinishType.ABORT:
                    assert got.output_ids == want.output_ids[: len(got.output_ids)]
                    np.testing.assert_allclose(got.output_log_probs, want.output_log_probs[: len(got.output_ids)], atol=1e-5)
                else:
                    assert_same(got, want)

    asyncio.run(run())
    pages = on.engine.scheduler._pages  # the engine is idle: only the tree holds pages
    assert pages.free_pages + pages.cached_pages == pages.num_pages
    assert pages.evictable_pages() == pages.cached_pages


# ----------------------------------------------------------------------------- recurrent-state snapshots
def test_state_snapshots_match_the_longest_saved_prefix_within_the_limit():
    ids = np.arange(40, dtype=np.int32)
    snaps = StateSnapshots(rows=3, first_row=8)
    r10 = snaps.reserve(ids, (), 10)
    r25 = snaps.reserve(ids, (), 25)
    assert {r10, r25} <= {8, 9, 10} and r10 != r25
    assert snaps.reserve(ids, (), 25) is None  # that prefix is kept already
    assert snaps.match(ids, (), 39) == (r25, 25)
    assert snaps.match(ids, (), 24) == (r10, 10)  # the limit (pages reused, last token) caps the length
    other = ids.copy()
    other[3] = 99  # a different prefix of the same length never matches
    assert snaps.match(other, (), 39) is None


def test_state_snapshots_tell_images_apart_and_drop_the_least_recently_used():
    ids = np.zeros((12,), np.int32)
    a, b = ImageSpan(2, 6, b"a" * 16), ImageSpan(2, 6, b"b" * 16)
    assert prefix_key(ids, (a,), 8) != prefix_key(ids, (b,), 8)
    assert prefix_key(ids, (a,), 2) == prefix_key(ids, (b,), 2)  # the image starts after the prefix
    snaps = StateSnapshots(rows=2, first_row=0)
    row_a = snaps.reserve(ids, (a,), 8)
    assert snaps.match(ids, (b,), 11) is None
    row_6 = snaps.reserve(ids, (a,), 6)
    assert snaps.match(ids, (a,), 11) == (row_a, 8)  # used: the length-6 one is now the oldest
    row_b = snaps.reserve(ids, (b,), 8)
    assert row_b == row_6 and len(snaps) == 2 and snaps.match(ids, (a,), 7) is None
    assert snaps.clear() == 2 and snaps.match(ids, (a,), 11) is None
