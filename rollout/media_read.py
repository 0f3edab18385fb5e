"""Reading one media item safely, the part pictures (`processing.load_image`) and clips (`video_io.load_clip`) share:
base64 capped before it is decoded, and local files only where the reader's policy allows, capped in bytes.

Both readers face requests on a server, so the rules must not drift apart: a local path is read only when the policy
reads local files at all, and, under an allowed root, only a regular file whose real path (symlinks and `..`
resolved) lies under it and whose name has the kind's suffix. Errors are raised as the caller's classes (`MediaKind`),
so each reader keeps its own error types and messages.

Never imports jax.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass

# data:<mime>[;param...],<payload>
DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)$", re.DOTALL)


@dataclass(frozen=True)
class MediaKind:
    """What a reader reads: its noun in messages ("image", "video"), the file name suffixes it accepts, what a client
    should send instead of a local file, the name of its byte cap, and its error classes."""

    noun: str
    suffixes: tuple[str, ...]
    send_instead: str  # e.g. "images as data URLs or base64"
    cap_name: str  # e.g. "max_image_bytes"
    error: type[ValueError]
    too_large: type[ValueError]


def describe(text: str) -> str:
    """A short repr of a (possibly huge) string for messages, with its length."""
    return repr(text if len(text) <= 60 else text[:60] + "...") + f" ({len(text)} chars)"


def too_many_bytes(n: int, max_bytes: int, source: str, kind: MediaKind) -> ValueError:
    return kind.too_large(f"{source}: {n} bytes, more than the cap of {max_bytes} bytes ({kind.cap_name})")


def decode_base64(payload: str, source: str, max_bytes: int, kind: MediaKind) -> bytes:
    """The bytes of a base64 payload (whitespace ignored), its size checked against `max_bytes` before decoding."""
    compact = re.sub(r"\s+", "", payload)
    if len(compact) // 4 * 3 > max_bytes + 3:  # base64 carries 3 bytes per 4 chars
        raise too_many_bytes(len(compact) // 4 * 3, max_bytes, source, kind)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise kind.error(f"{source}: invalid base64 ({e})") from e


def local_path(path: str, given: str, read_local_files: bool, local_root: str | None, kind: MediaKind) -> str:
    """The file a reader may open for `path` (`given`: what the caller passed, for messages), or the kind's error
    saying why it may not."""
    if not read_local_files:
        raise kind.error(
            f"{describe(given)} names a local file, which this server does not read: send {kind.send_instead} "
            f"(or start the server with --allowed-local-media-path DIR to allow {kind.noun} files under DIR)"
        )
    path = os.path.expanduser(path)
    if local_root is None:
        return path
    real = os.path.realpath(path)  # symlinks and .. resolved before the containment check
    if os.path.commonpath([real, local_root]) != local_root:
        raise kind.error(f"{kind.noun} path {describe(given)} is outside the allowed local media path {local_root}")
    if not real.lower().endswith(kind.suffixes):
        article = "an" if kind.noun[0] in "aeiou" else "a"
        raise kind.error(f"{kind.noun} path {describe(given)} is not {article} {kind.noun} file name "
                         f"(allowed: {', '.join(kind.suffixes)})")
    return real


def read_local_file(path_text: str, given: str, max_bytes: int, read_local_files: bool, local_root: str | None,
                    kind: MediaKind) -> tuple[bytes, str]:
    """(the bytes of the local file `path_text` may name, a description of it for messages): the policy's checks
    (`local_path`), a regular file, at most `max_bytes` (checked from its size, and again while reading)."""
    path = local_path(path_text, given, read_local_files, local_root, kind)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise kind.error(f"{kind.noun} file not found: {path} (from {describe(given)})") from None
    except OSError as e:
        raise kind.error(f"cannot read {kind.noun} file {path}: {e}") from e
    if not stat.S_ISREG(info.st_mode):
        raise kind.error(f"{kind.noun} path {path} is not a regular file")
    source = f"{kind.noun} file {path}"
    if info.st_size > max_bytes:
        raise too_many_bytes(info.st_size, max_bytes, source, kind)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a file that grows (or lies about its size) is still capped
    except OSError as e:
        raise kind.error(f"cannot read {kind.noun} file {path}: {e}") from e
    return data, source
