"""rollout/video_io.py: clips as lossless MP4 (PNG rgb24) data URLs, and every clip item read back under a policy.

The round trip is bit-exact on noise frames of odd sizes and keeps the frame rate exactly; every malformed item,
every cap and every local-file rule raises ClipError (ClipTooLarge for caps) naming the cause.
tests/vllm_real/test_video_wire.py checks that vLLM's own loader reads the same bytes to the same frames.
"""

from __future__ import annotations

import base64
import io
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from rollout.video import Clip, ClipError
from rollout.video_io import (
    TRUSTED_CLIPS,
    VIDEO_DEMUXERS,
    ClipReadPolicy,
    ClipTooLarge,
    clip_rate,
    clip_to_data_url,
    load_clip,
)

PREFIX = "data:video/mp4;base64,"


def _noise(t: int = 5, h: int = 17, w: int = 23, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def _bytes_of(url: str) -> bytes:
    assert url.startswith(PREFIX)
    return base64.b64decode(url[len(PREFIX):])


def _url_of(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _header(data: bytes) -> tuple[str, int, int, int, Fraction | None]:
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        return c.format.name, s.frames, s.codec_context.width, s.codec_context.height, s.average_rate


def _write(fmt: str, frames: list[np.ndarray], rate: Fraction = Fraction(2)) -> bytes:
    """A PNG-coded file of `frames` in container `fmt`; frames of another size than the first are encoded by a
    second encoder and muxed into the same stream (a clip whose size changes)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as out:
        stream = out.add_stream("png", rate=rate)
        stream.height, stream.width = frames[0].shape[:2] if frames else (17, 23)
        stream.pix_fmt = "rgb24"
        out.start_encoding()
        for k, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts, frame.time_base = k, 1 / rate
            if f.shape[:2] == (stream.height, stream.width):
                out.mux(stream.encode(frame))
                continue
            other = av.CodecContext.create("png", "w")
            other.height, other.width = f.shape[:2]
            other.pix_fmt, other.time_base = "rgb24", 1 / rate
            for packet in other.encode(frame):
                packet.stream, packet.time_base, packet.pts, packet.dts = stream, 1 / rate, k, k
                out.mux(packet)
        out.mux(stream.encode(None))
    return buffer.getvalue()


# --------------------------------------------------------------------------- the round trip


@pytest.mark.parametrize("shape", [(5, 17, 23), (1, 1, 1), (3, 9, 31), (2, 32, 48)])
def test_round_trip_is_bit_exact_on_noise(shape):
    clip = Clip.of(_noise(*shape), 2.0)
    url = clip_to_data_url(clip)
    back = load_clip(url)
    assert back.frames.dtype == np.uint8 and back.frames.shape == (*shape, 3)
    np.testing.assert_array_equal(back.frames, clip.frames)
    assert back.fps == 2.0


@pytest.mark.parametrize(("fps", "rate"), [(2, Fraction(2)), (1.5, Fraction(3, 2)), (29.97, Fraction(2997, 100)),
                                           (30000 / 1001, Fraction(30000, 1001)), (0.5, Fraction(1, 2))])
def test_fps_round_trips_exactly_and_the_header_states_the_exact_rate(fps, rate):
    assert clip_rate(fps) == rate
    url = clip_to_data_url(Clip.of(_noise(), fps))
    name, frames, width, height, average = _header(_bytes_of(url))
    assert (frames, width, height, average) == (5, 23, 17, rate)
    assert "mp4" in name.split(",")
    back = load_clip(url)
    assert back.fps == float(fps)  # exactly the float given
    np.testing.assert_array_equal(back.frames, _noise())


def test_url_is_deterministic_and_a_bitexact_mp4():
    clip = Clip.of(_noise(), 30000 / 1001)
    url = clip_to_data_url(clip)
    assert url == clip_to_data_url(Clip.of(_noise(), 30000 / 1001))
    assert url != clip_to_data_url(Clip.of(_noise(seed=1), 30000 / 1001))
    assert url != clip_to_data_url(Clip.of(_noise(), 29.97))
    data = _bytes_of(url)
    assert data[4:8] == b"ftyp"
    assert b"Lavf" not in data  # +bitexact: no FFmpeg version in the file, so the URL does not change with it
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].codec_context.name == "png"


def test_raw_bytes_round_trip():
    data = _bytes_of(clip_to_data_url(Clip.of(_noise(), 1.5)))
    for item in (data, bytearray(data), memoryview(data)):
        back = load_clip(item)
        np.testing.assert_array_equal(back.frames, _noise())
        assert back.fps == 1.5


def test_a_clip_item_is_returned_unchanged():
    clip = Clip.of(_noise(), 2.0)
    assert load_clip(clip) is clip
    assert load_clip(clip, ClipReadPolicy.for_server(None)) is clip


def test_a_clip_item_over_a_cap_or_malformed_is_refused():
    clip = Clip.of(_noise(), 2.0)
    with pytest.raises(ClipTooLarge, match="5 frames .*max_clip_frames"):
        load_clip(clip, ClipReadPolicy(max_frames=4))
    with pytest.raises(ClipTooLarge, match="391 pixels .*max_clip_pixels"):
        load_clip(clip, ClipReadPolicy(max_pixels=390))
    with pytest.raises(ClipTooLarge, match="max_clip_total_pixels"):
        load_clip(clip, ClipReadPolicy(max_total_pixels=5 * 391 - 1))
    with pytest.raises(ClipError, match="uint8"):
        load_clip(Clip(_noise().astype(np.float32), 2.0))
    with pytest.raises(ClipError, match="fps must be a positive number"):
        load_clip(Clip(_noise(), float("nan")))


def test_writing_refuses_what_it_cannot_store():
    with pytest.raises(ClipError, match="takes a Clip"):
        clip_to_data_url(_noise())  # type: ignore[arg-type]
    with pytest.raises(ClipError, match="uint8"):
        clip_to_data_url(Clip(_noise().astype(np.int16), 2.0))
    with pytest.raises(ClipError, match="at least one frame"):
        clip_to_data_url(Clip(_noise()[:0], 2.0))
    with pytest.raises(ClipError, match="positive number"):
        clip_to_data_url(Clip(_noise(), 0.0))
    with pytest.raises(ClipError, match="cannot be stored"):
        clip_to_data_url(Clip(_noise(), 1e-9))  # rounds to 0 with denominators up to 1001000


# --------------------------------------------------------------------------- malformed items

_GOOD = None


def _good() -> bytes:
    global _GOOD
    if _GOOD is None:
        _GOOD = _bytes_of(clip_to_data_url(Clip.of(_noise(), 30000 / 1001)))
    return _GOOD


def _audio_only_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buffer.getvalue()


def _png_image() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(_noise(1)[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def _box_body(data: bytearray, path: tuple[bytes, ...]) -> int:
    """Offset of the body of the MP4 box at `path` (e.g. moov/trak/mdia/mdhd)."""
    start, end = 0, len(data)
    for name in path:
        i = start
        while i + 8 <= end:
            size, kind = int.from_bytes(data[i:i + 4], "big"), bytes(data[i + 4:i + 8])
            assert size >= 8, (name, size)
            if kind == name:
                start, end = i + 8, i + size
                break
            i += size
        else:
            raise AssertionError(f"no {name!r} box")
    return start


def _without_rate(data: bytes) -> bytes:
    """The MP4 with every duration zeroed (sample deltas, track, media and movie durations): no rate is stated."""
    b = bytearray(data)
    trak = (b"moov", b"trak")
    stts = _box_body(b, (*trak, b"mdia", b"minf", b"stbl", b"stts"))
    for e in range(int.from_bytes(b[stts + 4:stts + 8], "big")):
        b[stts + 8 + 8 * e + 4:stts + 8 + 8 * e + 8] = bytes(4)
    for path, offset in [((b"moov", b"mvhd"), 16), ((*trak, b"mdia", b"mdhd"), 16), ((*trak, b"tkhd"), 20)]:
        body = _box_body(b, path)
        assert b[body] == 0  # version 0: 32-bit fields
        b[body + offset:body + offset + 4] = bytes(4)
    return bytes(b)


def test_the_rate_patch_leaves_a_readable_file_without_a_rate():
    patched = _without_rate(_good())
    with av.open(io.BytesIO(patched)) as c:
        s = c.streams.video[0]
        assert (s.average_rate, s.base_rate) == (None, None)
        assert len(list(c.decode(s))) == 5  # the frames are still there: only the rate is missing


@pytest.mark.parametrize(
    ("item", "cause"),
    [
        ("data:video/mp4;base64", "malformed data URL"),
        ("data:image/png;base64,AAAA", "media type 'image/png', not a video"),
        ("data:;base64,AAAA", "media type '', not a video"),
        ("data:video/jpeg;base64,AAAA,BBBB", "video/jpeg"),
        ("data:video/mp4,AAAA", "not base64-encoded"),
        ("data:video/mp4;base64,@@@@", "invalid base64"),
        ("data:video/mp4;base64,", "empty video data"),
        (_url_of(b"not a video at all" * 8), "cannot decode video"),
        (b"", "empty video data"),
        (b"garbage bytes " * 16, "cannot decode video"),
        (lambda: _good()[:200], "cannot decode video"),
        (lambda: _png_image(), "cannot decode video"),  # a picture is not a clip: the png demuxer is not enabled
        (lambda: _url_of(_audio_only_mp4()), "no video stream"),
        (lambda: _write("avi", []), "zero frames"),
        (lambda: _write("mp4", [_noise(1)[0], _noise(1, 9, 11)[0]]), "frames of changing size"),
        (lambda: _url_of(_without_rate(_good())), "unreadable fps"),
        ("http://example.com/clip.mp4", "refusing to download"),
        ("HTTPS://example.com/clip.mp4", "refusing to download"),
        ("   ", "empty string"),
        (12345, "unsupported clip item of type int"),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None,
)
def test_every_malformed_item_raises_clip_error_naming_the_cause(item, cause):
    item = item() if callable(item) else item
    with pytest.raises(ClipError) as info:
        load_clip(item)
    assert cause in str(info.value)
    assert not isinstance(info.value, ClipTooLarge)


def test_the_message_names_the_source():
    url = _url_of(b"x" * 300)
    with pytest.raises(ClipError) as info:
        load_clip(url)
    assert repr(url[:60] + "...") in str(info.value) and f"({len(url)} chars)" in str(info.value)
    with pytest.raises(ClipError, match=r"raw bytes \(7 bytes\)"):
        load_clip(b"garbage")


def test_other_containers_with_exact_headers_are_read():
    frames = list(_noise())
    for fmt in ("avi", "nut", "mov"):
        back = load_clip(_write(fmt, frames, Fraction(30000, 1001)))
        np.testing.assert_array_equal(back.frames, _noise())
        assert back.fps == 30000 / 1001, fmt
    assert "mov,mp4,m4a,3gp,3g2,mj2" in VIDEO_DEMUXERS


# --------------------------------------------------------------------------- caps


def test_byte_cap_is_checked_before_decoding():
    data = _good()
    policy = ClipReadPolicy(max_bytes=len(data) - 1)
    with pytest.raises(ClipTooLarge, match="max_clip_bytes"):
        load_clip(data, policy)
    with pytest.raises(ClipTooLarge, match="max_clip_bytes"):
        load_clip(_url_of(data), policy)
    # invalid base64 too long for the cap: refused by its length, never decoded
    with pytest.raises(ClipTooLarge, match="max_clip_bytes"):
        load_clip("data:video/mp4;base64," + "@" * 400, ClipReadPolicy(max_bytes=100))
    assert load_clip(data, ClipReadPolicy(max_bytes=len(data))).frames.shape[0] == 5


def test_frame_and_pixel_caps_are_checked_from_the_header():
    url = clip_to_data_url(Clip.of(_noise(), 2.0))  # 5 frames of 23x17 = 391 pixels
    with pytest.raises(ClipTooLarge, match=r"5 frames \(from the header\).*max_clip_frames"):
        load_clip(url, ClipReadPolicy(max_frames=4))
    with pytest.raises(ClipTooLarge, match=r"23x17 = 391 pixels \(from the header\).*max_clip_pixels"):
        load_clip(url, ClipReadPolicy(max_pixels=390))
    with pytest.raises(ClipTooLarge, match=r"1955 pixels \(from the header\).*max_clip_total_pixels"):
        load_clip(url, ClipReadPolicy(max_total_pixels=1954))
    exact = ClipReadPolicy(max_frames=5, max_pixels=391, max_total_pixels=1955)
    np.testing.assert_array_equal(load_clip(url, exact).frames, _noise())


def test_frame_cap_is_enforced_while_decoding_when_the_header_has_no_count():
    data = _write("nut", list(_noise()))
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].frames == 0  # NUT states no frame count
    with pytest.raises(ClipTooLarge, match=r"5 frames \(decoded so far\).*max_clip_frames"):
        load_clip(data, ClipReadPolicy(max_frames=4))
    assert load_clip(data, ClipReadPolicy(max_frames=5)).frames.shape[0] == 5


def test_policy_validates_its_caps():
    for name in ("max_bytes", "max_frames", "max_pixels", "max_total_pixels"):
        with pytest.raises(ValueError, match=name):
            ClipReadPolicy(**{name: 0})
        with pytest.raises(ValueError, match=name):
            ClipReadPolicy(**{name: True})
    server = ClipReadPolicy.for_server(None, max_frames=7)
    assert (server.read_local_files, server.local_root, server.max_frames) == (False, None, 7)
    assert TRUSTED_CLIPS.read_local_files and TRUSTED_CLIPS.local_root is None


# --------------------------------------------------------------------------- local files


@pytest.fixture()
def media(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "media"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    data = _good()
    paths = {"inside": root / "clip.mp4", "outside": outside / "clip.mp4", "bad_suffix": root / "clip.bin"}
    for p in paths.values():
        p.write_bytes(data)
    paths["escaping_link"] = root / "link.mp4"
    paths["escaping_link"].symlink_to(paths["outside"])
    paths["inner_link"] = root / "inner.mkv"
    paths["inner_link"].symlink_to(paths["inside"])
    paths["dir"] = root / "folder.mp4"
    paths["dir"].mkdir()
    paths["root"] = root
    return paths


def _assert_good(clip: Clip) -> None:
    np.testing.assert_array_equal(clip.frames, _noise())
    assert clip.fps == 30000 / 1001


def test_trusted_policy_reads_paths_and_file_uris(media):
    path = media["outside"]
    for item in (str(path), path, f"file://{path}", f"file://localhost{path}", "  " + str(path) + "\n"):
        _assert_good(load_clip(item))
    with pytest.raises(ClipError, match="video file not found"):
        load_clip(str(path) + ".missing")
    with pytest.raises(ClipError, match="not a regular file"):
        load_clip(media["dir"])
    with pytest.raises(ClipTooLarge, match="max_clip_bytes"):
        load_clip(path, ClipReadPolicy(max_bytes=100))


def test_a_server_without_local_root_reads_no_file(media):
    policy = ClipReadPolicy.for_server(None)
    for item in (str(media["inside"]), media["inside"], f"file://{media['inside']}", "clip.mp4"):
        with pytest.raises(ClipError, match="does not read"):
            load_clip(item, policy)
    _assert_good(load_clip(_url_of(_good()), policy))  # data URLs still work


def test_a_server_reads_only_video_files_under_its_root(media):
    policy = ClipReadPolicy.for_server(media["root"])
    _assert_good(load_clip(media["inside"], policy))
    _assert_good(load_clip(f"file://{media['inside']}", policy))
    _assert_good(load_clip(media["inner_link"], policy))  # a link that stays under the root
    with pytest.raises(ClipError, match="outside the allowed local media path"):
        load_clip(media["outside"], policy)
    with pytest.raises(ClipError, match="outside the allowed local media path"):
        load_clip(media["escaping_link"], policy)  # the symlink is resolved before the check
    with pytest.raises(ClipError, match="outside the allowed local media path"):
        load_clip(os.path.join(media["root"], "..", "outside", "clip.mp4"), policy)
    with pytest.raises(ClipError, match="not a video file name"):
        load_clip(media["bad_suffix"], policy)
    with pytest.raises(ClipError, match="not a regular file"):
        load_clip(media["dir"], policy)
