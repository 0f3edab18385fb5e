"""The cache of preprocessed images (rollout/image_cache.py): a hit is exactly what the processor computes, only
data URLs are cached, the byte bound holds, and errors are the uncached path's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rollout.image_cache import ProcessedImageCache, cache_key
from rollout.processing import image_to_data_url, load_image, process_images


def _urls(make_test_image, seeds, size=64):
    return [image_to_data_url(make_test_image(s, size)) for s in seeds]


def test_hits_give_the_processors_own_tensors_in_order(tiny_image_processor, make_test_image):
    urls = _urls(make_test_image, [1, 2]) + [image_to_data_url(make_test_image(3, (96, 64)))]
    cache = ProcessedImageCache(tiny_image_processor)
    loads: list[int] = []

    def load(items):
        def f(i):
            loads.append(i)
            return load_image(items[i])
        return f

    first = cache.process(urls, load(urls))
    assert loads == [0, 1, 2] and cache.misses == 3 and cache.hits == 0
    # A conversation that shows them again, reordered and repeated, plus one new picture.
    again = [urls[2], urls[0], urls[0], image_to_data_url(make_test_image(4))]
    loads.clear()
    out = cache.process(again, load(again))
    assert loads == [3], "only the new picture is decoded"
    assert cache.hits == 3 and cache.misses == 4
    want = process_images(tiny_image_processor, [load_image(u) for u in again])
    np.testing.assert_array_equal(out["image_grid_thw"], want["image_grid_thw"])
    np.testing.assert_array_equal(out["pixel_values"], want["pixel_values"])
    assert out["pixel_values"].flags.writeable  # the caller's own array; the cached rows stay read-only
    ref = process_images(tiny_image_processor, [load_image(u) for u in urls])
    np.testing.assert_array_equal(first["pixel_values"], ref["pixel_values"])


def test_only_data_urls_are_keys(tmp_path, make_test_image):
    path = tmp_path / "a.png"
    make_test_image(1).save(path)
    assert cache_key(str(path)) is None and cache_key(make_test_image(1)) is None
    url = image_to_data_url(make_test_image(1))
    assert cache_key(url) == url


def test_uncacheable_items_are_processed_every_time(tiny_image_processor, tmp_path, make_test_image):
    path = tmp_path / "a.png"
    make_test_image(1).save(path)
    cache = ProcessedImageCache(tiny_image_processor)
    for _ in range(2):
        cache.process([None], lambda i: load_image(str(path)))
    assert cache.misses == 2 and len(cache) == 0
    make_test_image(2).save(path)  # the file changed: its new pixels are used
    out = cache.process([None], lambda i: load_image(str(path)))
    want = process_images(tiny_image_processor, [make_test_image(2)])
    np.testing.assert_array_equal(out["pixel_values"], want["pixel_values"])


def test_the_byte_bound_evicts_least_recently_used(tiny_image_processor, make_test_image):
    urls = _urls(make_test_image, range(5))
    one = process_images(tiny_image_processor, [load_image(urls[0])])["pixel_values"].nbytes
    cache = ProcessedImageCache(tiny_image_processor, max_bytes=2 * one)
    for u in urls[:2]:
        cache.process([u], lambda i, u=u: load_image(u))
    cache.process([urls[0]], lambda i: pytest.fail("urls[0] is cached"))  # urls[0] becomes the most recent
    cache.process([urls[2]], lambda i: load_image(urls[2]))  # evicts urls[1]
    assert len(cache) == 2 and cache.nbytes == 2 * one
    reloaded: list[int] = []
    cache.process([urls[1]], lambda i: reloaded.append(i) or load_image(urls[1]))
    assert reloaded == [0]
    off = ProcessedImageCache(tiny_image_processor, max_bytes=0)
    off.process([urls[0]], lambda i: load_image(urls[0]))
    assert len(off) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        ProcessedImageCache(tiny_image_processor, max_bytes=-1)


def test_errors_propagate_and_nothing_is_cached(tiny_image_processor, make_test_image):
    cache = ProcessedImageCache(tiny_image_processor)

    def broken(i):
        raise OSError("unreadable")

    with pytest.raises(OSError, match="unreadable"):
        cache.process(["data:image/png;base64,AAAA"], broken)
    assert len(cache) == 0
    u = image_to_data_url(make_test_image(1, (2, 600)))
    with pytest.raises(ValueError, match="aspect ratio"):  # the processor's smart resize refuses it
        cache.process([u], lambda i: load_image(u))
    assert len(cache) == 0
    assert cache.process([], lambda i: None)["pixel_values"].shape[0] == 0


def test_concurrent_use_is_consistent(tiny_image_processor, make_test_image):
    urls = _urls(make_test_image, range(4))
    want = {u: process_images(tiny_image_processor, [load_image(u)])["pixel_values"] for u in urls}
    cache = ProcessedImageCache(tiny_image_processor)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(20):
                u = urls[(k + j) % len(urls)]
                out = cache.process([u], lambda i, u=u: load_image(u))
                np.testing.assert_array_equal(out["pixel_values"], want[u])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 4
