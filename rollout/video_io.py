"""Clips on the wire: a `Clip` as a lossless video file in a data URL, and any clip item read back into a `Clip`.

Why a real video file: SGLang's `video_data`, vLLM's video input and our embedded engine all take a video file (or
a URL of one) and decode it themselves, with the frame rate from its header. Sending the clip as a file they can
read, whose decoded pixels are exactly the trainer's, keeps the engine's `pixel_values_videos` and timestamps equal
to the trainer's, as the lossless PNG data URLs of `processing.image_to_data_url` do for pictures.

Why PNG frames (pix_fmt rgb24) in MP4:
- PNG is lossless, and rgb24 has no chroma subsampling: every RGB value comes back bit for bit, at any width and
  height, odd ones included. A YUV codec (H.264, even lossless 4:4:4) would round the colour conversion.
- MP4 stores a per-track integer timescale and integer sample durations, so the rate is an exact fraction: with
  time base 1/fps (frame k has pts k) the header's average rate (`avg_frame_rate`, what OpenCV's `CAP_PROP_FPS`
  and decord's `get_avg_fps` read) is exactly the clip's, for 29.97, 30000/1001 or 0.5 fps alike. Matroska, the
  usual home of FFV1 (the other lossless RGB codec), keeps timestamps in whole milliseconds (nanoseconds for the
  default duration), so 30000/1001 fps cannot be stored exactly there.
- Both are read by FFmpeg's libavformat/libavcodec, which is what opencv-python (vLLM's default "opencv" video
  backend) and decord (SGLang's video loader) decode with. tests/vllm_real/test_video_wire.py runs vLLM's own
  loader on our bytes and gets the same frames and fps (decord is not installed here, so it is not checked).
  Caveat measured there: vLLM 0.32's opencv loader returns no frame for any one-frame video, whatever the codec
  (its end-of-stream seek); send clips of two frames or more to vLLM.
- The MIME type is `video/mp4`, the one every client and server accepts; SGLang saves the payload as a .mp4 file.

The output is deterministic (a cache key may hash the URL): the muxer runs with `+bitexact` (no FFmpeg version
string, no creation time) and PNG's encoder has no other state. Each frame is Paeth-filtered and deflated at zlib
level 1: lossless at any level, and several times faster than the default for a few percent more bytes.

`load_clip` reads what its `ClipReadPolicy` allows, mirroring `processing.load_image`: the trainer's own inputs may
name any local file; a server facing requests reads data URLs and raw bytes only, plus video files under one
allowed directory; nothing is downloaded. Only the demuxers of common video containers are enabled (MP4/MOV,
Matroska/WebM, AVI, NUT), so FFmpeg never follows a playlist (HLS, concat) to other files or URLs. Bytes are
capped before reading or base64-decoding; the frame size, frame count and total pixels are checked from the stream
header before any frame is decoded, and again while decoding (a header may lie). Frames come back as rgb24 (a
non-RGB foreign video is converted by FFmpeg's swscale, as the engines' loaders do) and the fps is the header's
average rate (else its base rate), as OpenCV and decord read it.

numpy and PyAV only: never imports jax.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

import av
import numpy as np

from rollout.byte_lru import ByteBoundedLRU
from rollout.media_read import DATA_URL, MediaKind, decode_base64, describe, read_local_file, too_many_bytes
from rollout.video import Clip, ClipError

__all__ = [
    "CLIP_MIME_TYPE",
    "DEFAULT_MAX_CLIP_BYTES",
    "DEFAULT_MAX_CLIP_FRAMES",
    "DEFAULT_MAX_CLIP_PIXELS",
    "DEFAULT_MAX_CLIP_TOTAL_PIXELS",
    "MAX_RATE_DENOMINATOR",
    "TRUSTED_CLIPS",
    "VIDEO_DEMUXERS",
    "VIDEO_SUFFIXES",
    "ClipReadPolicy",
    "ClipTooLarge",
    "ClipUrls",
    "clip_rate",
    "clip_to_data_url",
    "load_clip",
]


class ClipTooLarge(ClipError):
    """A clip item is over a byte, frame or pixel cap of its `ClipReadPolicy` (refused before it is decoded when
    the header tells)."""


CLIP_MIME_TYPE = "video/mp4"
# Caps of one clip. Bytes: the file, data URL payload or raw bytes (lossless frames are big: 768 frames of 640x480
# noise are ~700 MB, real frames about half). Frames: transformers' Qwen video processors sample at most 768.
# Pixels of one frame: the image cap of processing.py. Total pixels (frames x width x height): bounds the decoded
# array, 1 Gi pixels = 3 GiB of RGB.
DEFAULT_MAX_CLIP_BYTES = 256 << 20
DEFAULT_MAX_CLIP_FRAMES = 768
DEFAULT_MAX_CLIP_PIXELS = 40_000_000
DEFAULT_MAX_CLIP_TOTAL_PIXELS = 1 << 30
# Local files a restricted reader opens must be named like videos.
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".nut")
# FFmpeg demuxers that may open a clip (libavformat's names: one entry per demuxer, its aliases included).
VIDEO_DEMUXERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "nut")
# A float fps is stored as the nearest fraction with at most this denominator: every broadcast rate (24000/1001,
# 30000/1001, 2997/100, ...) is one, and a float of one comes back as the same float.
MAX_RATE_DENOMINATOR = 1_001_000
_INT32_MAX = 2**31 - 1
_PNG_OPTIONS = {"pred": "paeth", "compression_level": "1"}


@dataclass(frozen=True)
class ClipReadPolicy:
    """What `load_clip` may read, and how much.

    max_bytes: the most bytes of one clip read or decoded from base64 (checked before reading or decoding).
    max_frames: the most frames of one clip (the header's count is checked before decoding, the decoded count while
    decoding).
    max_pixels: the most pixels (width x height) of one frame, checked from the stream header before decoding.
    max_total_pixels: the most pixels of all frames together (frames x width x height): bounds the decoded array.
    read_local_files: whether local paths and `file://` URIs are read at all.
    local_root: when set, only regular files whose real path (symlinks and `..` resolved) lies under this
    directory and whose name has a video suffix (`VIDEO_SUFFIXES`) are read.

    `TRUSTED_CLIPS` (the default) is for the trainer's own inputs (datasets, environments): any local path.
    A server facing requests uses `ClipReadPolicy.for_server`.
    """

    max_bytes: int = DEFAULT_MAX_CLIP_BYTES
    max_frames: int = DEFAULT_MAX_CLIP_FRAMES
    max_pixels: int = DEFAULT_MAX_CLIP_PIXELS
    max_total_pixels: int = DEFAULT_MAX_CLIP_TOTAL_PIXELS
    read_local_files: bool = True
    local_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_frames", "max_pixels", "max_total_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClipReadPolicy.{name} must be a positive int, got {value!r}")
        if self.local_root is not None:
            object.__setattr__(self, "local_root", os.path.realpath(os.path.expanduser(self.local_root)))
            object.__setattr__(self, "read_local_files", True)

    @classmethod
    def for_server(
        cls,
        allowed_local_media_path: str | os.PathLike[str] | None,
        *,
        max_bytes: int = DEFAULT_MAX_CLIP_BYTES,
        max_frames: int = DEFAULT_MAX_CLIP_FRAMES,
        max_pixels: int = DEFAULT_MAX_CLIP_PIXELS,
        max_total_pixels: int = DEFAULT_MAX_CLIP_TOTAL_PIXELS,
    ) -> ClipReadPolicy:
        """A request-facing reader: data URLs and raw bytes only, plus video files under `allowed_local_media_path`
        when it is given (`--allowed-local-media-path`)."""
        caps = dict(max_bytes=max_bytes, max_frames=max_frames, max_pixels=max_pixels,
                    max_total_pixels=max_total_pixels)
        if allowed_local_media_path is None:
            return cls(**caps, read_local_files=False)
        return cls(**caps, read_local_files=True, local_root=os.fspath(allowed_local_media_path))


TRUSTED_CLIPS = ClipReadPolicy()


# --------------------------------------------------------------------------- writing


def clip_rate(fps: float) -> Fraction:
    """The exact rate a clip of `fps` is stored at: the nearest fraction with a denominator of at most
    `MAX_RATE_DENOMINATOR` (30000/1001 for 29.97002997..., 2997/100 for 29.97). ClipError if there is none that
    a video header can hold (a positive fraction of 32-bit integers)."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating, Fraction)):
        raise ClipError(f"a clip's fps must be a number, got {type(fps).__name__}")
    if not (fps > 0 and math.isfinite(fps)):
        raise ClipError(f"a clip's fps must be a positive number, got {fps!r}")
    rate = Fraction(fps).limit_denominator(MAX_RATE_DENOMINATOR)
    if rate <= 0 or rate.numerator > _INT32_MAX:
        raise ClipError(f"fps {fps!r} cannot be stored in a video header (nearest rate with a denominator of at "
                        f"most {MAX_RATE_DENOMINATOR} is {rate})")
    return rate


def _check_frames(frames: Any, source: str) -> np.ndarray:
    if not isinstance(frames, np.ndarray):
        raise ClipError(f"{source}: frames must be a numpy array, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ClipError(f"{source}: frames must be [T, H, W, 3] uint8 RGB, got {frames.shape} {frames.dtype}")
    if min(frames.shape[:3]) < 1:
        raise ClipError(f"{source}: a clip needs at least one frame of at least 1x1 pixels, got {frames.shape}")
    return frames


def clip_to_data_url(clip: Clip) -> str:
    """`data:video/mp4;base64,...` of the clip: PNG frames (rgb24, lossless) in MP4 at the clip's exact rate
    (`clip_rate`; time base 1/fps, frame k at pts k). The same clip always gives the same URL.

    Raises ClipError for a malformed clip or a rate a header cannot hold; the written header is read back and
    must state the clip's size, frame count and rate exactly."""
    if not isinstance(clip, Clip):
        raise ClipError(f"clip_to_data_url takes a Clip, got {type(clip).__name__}")
    frames = _check_frames(clip.frames, "clip")
    rate = clip_rate(clip.fps)
    count, height, width = frames.shape[:3]
    buffer = io.BytesIO()
    try:
        with av.open(buffer, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
            stream = out.add_stream("png", rate=rate, options=dict(_PNG_OPTIONS))
            stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
            stream.codec_context.time_base = 1 / rate
            for k in range(count):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[k]), format="rgb24")
                frame.pts, frame.time_base = k, 1 / rate
                out.mux(stream.encode(frame))
            out.mux(stream.encode(None))
    except (av.FFmpegError, ValueError) as e:
        raise ClipError(f"clip of {count} frames of {width}x{height} at {rate} fps: cannot encode "
                        f"({type(e).__name__}: {e})") from e
    data = buffer.getvalue()
    with av.open(io.BytesIO(data), options={"format_whitelist": ",".join(VIDEO_DEMUXERS)}) as back:
        got = back.streams.video[0]
        stated = (got.frames, got.codec_context.width, got.codec_context.height, got.average_rate)
    if stated != (count, width, height, rate):
        raise ClipError(f"clip of {count} frames of {width}x{height} at {rate} fps: the MP4 header states "
                        f"{stated[0]} frames of {stated[1]}x{stated[2]} at {stated[3]} fps; cannot store it exactly")
    return f"data:{CLIP_MIME_TYPE};base64," + base64.b64encode(data).decode("ascii")


DEFAULT_CLIP_URL_BYTES = 64 << 20


class ClipUrls:
    """`clip_to_data_url`, remembered by the clip's content: an environment hands the same frames to every sample
    of a group and, turn after turn, to every turn that re-sends them, and hashing the frames is a small part of
    encoding them as PNG. Keyed by a digest of the frames' bytes, shape and the rate, so new frames in a reused
    array make a new URL; bounded in bytes of URLs (least recently used out first); thread-safe. A malformed clip
    is never remembered: it raises as `clip_to_data_url` does."""

    def __init__(self, max_bytes: int = DEFAULT_CLIP_URL_BYTES):
        self._urls: ByteBoundedLRU[str] = ByteBoundedLRU(max_bytes, len)

    def url(self, clip: Clip) -> str:
        key = _content_key(clip)
        url = self._urls.get(key)
        if url is None:
            url = clip_to_data_url(clip)
            if key is not None:
                self._urls.put(key, url, ())
        return url


def _content_key(clip: object) -> str | None:
    """A digest of a clip's frames (bytes, shape, dtype) and rate; None for anything that is not a Clip of an array."""
    if not isinstance(clip, Clip) or not isinstance(clip.frames, np.ndarray):
        return None
    frames = np.ascontiguousarray(clip.frames)
    digest = hashlib.blake2b(f"{frames.shape}|{frames.dtype}|{clip.fps!r}|".encode(), digest_size=20)
    digest.update(memoryview(frames).cast("B"))
    return digest.hexdigest()


# --------------------------------------------------------------------------- reading


_VIDEO = MediaKind("video", VIDEO_SUFFIXES, "clips as data URLs", "max_clip_bytes", ClipError, ClipTooLarge)


def _too_many_bytes(n: int, policy: ClipReadPolicy, source: str) -> ClipTooLarge:
    return too_many_bytes(n, policy.max_bytes, source, _VIDEO)


def _check_size(frames: int, width: int, height: int, policy: ClipReadPolicy, source: str, what: str) -> None:
    """ClipTooLarge if `frames` frames of `width` x `height` are over a cap (`what` says where the numbers come
    from: the header, before decoding, or the frames decoded so far)."""
    if width * height > policy.max_pixels:
        raise ClipTooLarge(f"{source}: frames are {width}x{height} = {width * height} pixels ({what}), more than the "
                           f"cap of {policy.max_pixels} (max_clip_pixels); it was not decoded")
    if frames > policy.max_frames:
        raise ClipTooLarge(f"{source}: {frames} frames ({what}), more than the cap of {policy.max_frames} "
                           "(max_clip_frames); it was not decoded")
    if frames * width * height > policy.max_total_pixels:
        raise ClipTooLarge(f"{source}: {frames} frames of {width}x{height} = {frames * width * height} pixels "
                           f"({what}), more than the cap of {policy.max_total_pixels} (max_clip_total_pixels); it was "
                           "not decoded")


def _stream_fps(stream: Any, source: str) -> float:
    """The stream's frame rate as the engines read it: the average rate, else the base (r_frame_rate) rate."""
    for rate in (stream.average_rate, stream.base_rate):
        if rate is not None and rate > 0 and math.isfinite(float(rate)):
            return float(rate)
    raise ClipError(f"{source}: unreadable fps: the video stream states neither an average nor a base frame rate")


def _is_cover_art(stream: Any) -> bool:
    """A video stream that is a still picture attached to the file (cover art), not the clip."""
    try:
        disposition = stream.disposition
    except AttributeError:  # older PyAV (14) does not expose it: no stream counts as cover art
        return False
    return bool(disposition & av.stream.Disposition.attached_pic)


def _decode_bytes(data: bytes, source: str, policy: ClipReadPolicy) -> Clip:
    if not data:
        raise ClipError(f"{source}: empty video data")
    if len(data) > policy.max_bytes:
        raise _too_many_bytes(len(data), policy, source)
    try:
        container = av.open(io.BytesIO(data), options={"format_whitelist": ",".join(VIDEO_DEMUXERS)})
    except (av.FFmpegError, ValueError, EOFError, OSError) as e:
        raise ClipError(f"{source}: cannot decode video ({type(e).__name__}: {e}); readable containers are MP4/MOV, "
                        "Matroska/WebM, AVI and NUT") from e
    with container:
        streams = [s for s in container.streams.video if not _is_cover_art(s)]
        if not streams:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise ClipError(f"{source}: no video stream in the {container.format.name} file (streams: "
                            f"{', '.join(kinds)})")
        stream = streams[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_size(max(stream.frames, 1), width, height, policy, source, "from the header")  # before decoding
        fps = _stream_fps(stream, source)
        frames: list[np.ndarray] = []
        try:
            for frame in container.decode(stream):
                if not frames and not (width and height):  # a header without a size: the first frame's
                    width, height = frame.width, frame.height
                if (frame.width, frame.height) != (width, height):
                    raise ClipError(f"{source}: frames of changing size: frame {len(frames)} is "
                                    f"{frame.width}x{frame.height}, the clip {width}x{height}")
                _check_size(len(frames) + 1, width, height, policy, source, "decoded so far")
                frames.append(frame.to_ndarray(format="rgb24"))
        except ClipError:
            raise
        except (av.FFmpegError, ValueError, EOFError, OSError) as e:
            raise ClipError(f"{source}: cannot decode video frame {len(frames)} ({type(e).__name__}: {e})") from e
    if not frames:
        raise ClipError(f"{source}: zero frames: the video stream decodes to no frame")
    return Clip(np.stack(frames), fps)


def _load_path(path_text: str, given: str, policy: ClipReadPolicy) -> Clip:
    data, source = read_local_file(path_text, given, policy.max_bytes, policy.read_local_files, policy.local_root,
                                   _VIDEO)
    return _decode_bytes(data, source, policy)


def _load_data_url(url: str, policy: ClipReadPolicy) -> Clip:
    match = DATA_URL.match(url)
    if match is None:
        raise ClipError(f"malformed data URL {describe(url)}: expected data:video/<type>;base64,<payload>")
    mime = match["mime"].lower()
    if not mime.startswith("video/"):
        raise ClipError(f"data URL {describe(url)} has media type {mime!r}, not a video")
    if mime == "video/jpeg":
        raise ClipError(f"data URL {describe(url)} is video/jpeg (vLLM's list of JPEG frames, lossy and without a "
                        "frame rate): send a video file, as clip_to_data_url writes")
    if ";base64" not in match["params"].lower():
        raise ClipError(f"data URL {describe(url)} is not base64-encoded")
    data = decode_base64(match["payload"], f"data URL {describe(url)}", policy.max_bytes, _VIDEO)
    return _decode_bytes(data, f"data URL {describe(url)}", policy)


def _check_clip(clip: Clip, policy: ClipReadPolicy) -> Clip:
    source = f"Clip of {getattr(clip.frames, 'shape', '?')} frames"
    frames = _check_frames(clip.frames, source)
    count, height, width = frames.shape[:3]
    _check_size(count, width, height, policy, source, "in memory")
    fps = clip.fps
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)) or not (
            fps > 0 and math.isfinite(fps)):
        raise ClipError(f"{source}: fps must be a positive number, got {fps!r}")
    return clip


def load_clip(item: Clip | str | bytes | os.PathLike[str], policy: ClipReadPolicy = TRUSTED_CLIPS) -> Clip:
    """Decode one clip item into a `Clip` (frames rgb24 [T, H, W, 3] uint8, fps the stream's rate as a float).

    Accepts a `Clip` (returned as is, once checked against the policy's caps), a `data:video/...;base64,` URL (as
    `clip_to_data_url` writes), raw bytes of a video file, a `file://` URI or a local path. http(s) URLs are
    refused: nothing is downloaded. `policy` says which local files may be read (the default, for the trainer's
    own inputs: any) and caps bytes, frames and pixels; a clip over a cap raises `ClipTooLarge`, before decoding
    where the header tells. Every failure raises ClipError naming the item and the cause.
    """
    if isinstance(item, Clip):
        return _check_clip(item, policy)
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        return _decode_bytes(data, f"raw bytes ({len(data)} bytes)", policy)
    if isinstance(item, os.PathLike):
        return _load_path(os.fspath(item), os.fspath(item), policy)
    if not isinstance(item, str):
        raise ClipError(f"unsupported clip item of type {type(item).__name__}; expected a Clip, data URL, raw bytes, "
                        "local path or file:// URI")
    text = item.strip()
    if not text:
        raise ClipError("empty string given as a clip")
    if text[:5].lower() == "data:":
        return _load_data_url(text, policy)
    if text[:7].lower() == "file://":
        path = unquote(text[7:])
        if path.startswith("localhost/"):
            path = path[len("localhost"):]
        return _load_path(path, text, policy)
    if text[:7].lower() == "http://" or text[:8].lower() == "https://":
        raise ClipError(f"refusing to download {describe(text)}: pass a data URL or a local path instead")
    return _load_path(text, text, policy)
