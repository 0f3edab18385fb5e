"""Tokenizer, chat template, image processor and image I/O for Qwen3-VL.

One module, used by rollout encoding, the embedded engine and the trainer, for
real Qwen3-VL checkpoints and for the tiny test ones alike, so that all three
see the same ids, the same image tensors and the same pad counts.

Why not `AutoProcessor`: `Qwen3VLProcessor` needs a video processor, which
needs torchvision; we never install it. The tokenizer and the PIL image
processor (`Qwen2VLImageProcessorPil`, which Qwen3-VL uses with patch 16) are
loaded separately instead.

Images travel as lossless RGB PNG data URLs: the engine decodes and
preprocesses them again, so any lossy step would make its pixels differ from
the trainer's.

`load_image` reads what its `ImageReadPolicy` allows: the trainer's own inputs may name any local file; a
server facing requests reads data URLs and base64 only, plus image files under one allowed directory. Every
image is capped in bytes (checked before reading or base64-decoding) and pixels (checked from its header
before decoding), so a decompression bomb or a huge file is refused, not decoded.

transformers is imported lazily (it costs seconds); the image helpers need only
Pillow. Never imports jax.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import unquote

import numpy as np
from PIL import Image, UnidentifiedImageError

from rollout.media_read import DATA_URL, MediaKind, decode_base64, describe, read_local_file, too_many_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

__all__ = [
    "CLIP_IMAGE_MEAN",
    "CLIP_IMAGE_STD",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_SUFFIXES",
    "TRUSTED_IMAGES",
    "ImageDecodeError",
    "ImageReadPolicy",
    "ImageTooLarge",
    "VisionTokens",
    "check_image_pixels",
    "frame_patches",
    "hf_reference_processor",
    "image_to_data_url",
    "load_image",
    "load_image_processor",
    "load_tokenizer",
    "max_frame_patches",
    "num_image_pads",
    "process_images",
    "read_chat_template",
    "to_rgb",
]


# CLIP's normalization, which the Qwen2-VL and Qwen2.5-VL image and video processors use.
CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageDecodeError(ValueError):
    """An image item could not be read or decoded; the message says what was given and why it failed."""


class ImageTooLarge(ImageDecodeError):
    """An image item is over the byte or pixel cap of its `ImageReadPolicy` (refused before it is decoded)."""


# Caps of one image: bytes read (file, data URL or base64 payload, decoded) and pixels decoded (width x height,
# checked from the header before any pixel is decoded). 40 megapixels is ~120 MB as RGB; Qwen3-VL's processor
# resizes anything above ~16.7 megapixels down anyway.
DEFAULT_MAX_IMAGE_BYTES = 64 << 20
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
# Local files a restricted reader opens must be named like images (SGLang's rule for local paths).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
# PIL formats that may be opened: common raster formats only (never EPS, which runs Ghostscript). PIL's JPEG
# opener also covers multi-picture (MPO) camera JPEGs.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")


@dataclass(frozen=True)
class ImageReadPolicy:
    """What `load_image` may read, and how much.

    max_bytes: the most bytes of one image read or decoded from base64 (checked before reading or decoding).
    max_pixels: the most pixels (width x height) of one image, checked from its header before decoding.
    read_local_files: whether local paths and `file://` URIs are read at all.
    local_root: when set, only regular files whose real path (symlinks and `..` resolved) lies under this
    directory and whose name has an image suffix (`IMAGE_SUFFIXES`) are read.

    `TRUSTED_IMAGES` (the default) is for the trainer's own inputs (datasets, environments): any local path.
    A server facing requests uses `ImageReadPolicy.for_server`.
    """

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    read_local_files: bool = True
    local_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageReadPolicy.{name} must be a positive int, got {value!r}")
        if self.local_root is not None:
            object.__setattr__(self, "local_root", os.path.realpath(os.path.expanduser(self.local_root)))
            object.__setattr__(self, "read_local_files", True)

    @classmethod
    def for_server(
        cls,
        allowed_local_media_path: str | os.PathLike[str] | None,
        *,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> ImageReadPolicy:
        """A request-facing reader: data URLs and base64 only, plus image files under
        `allowed_local_media_path` when it is given (`--allowed-local-media-path`)."""
        if allowed_local_media_path is None:
            return cls(max_bytes, max_pixels, read_local_files=False)
        return cls(max_bytes, max_pixels, read_local_files=True, local_root=os.fspath(allowed_local_media_path))


TRUSTED_IMAGES = ImageReadPolicy()


def check_image_pixels(size: tuple[int, int], max_pixels: int, source: str) -> None:
    """Raise `ImageTooLarge` if an image of `size` (width, height, from its header) is over `max_pixels`."""
    width, height = (int(x) for x in size)
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"{source}: image is {width}x{height} = {width * height} pixels, more than the cap of {max_pixels} "
            "(max_image_pixels); it was not decoded"
        )


# --------------------------------------------------------------------------- tokenizer


def _require_dir(model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    return path


def read_chat_template(model_dir: str | os.PathLike[str]) -> str | None:
    """The chat template shipped next to the model, or None.

    Precedence follows transformers' processors: `chat_template.jinja`, then
    `chat_template.json` (key "chat_template"; Qwen3-VL checkpoints ship this one).
    A template inside tokenizer_config.json is the tokenizer's own fallback.
    """
    path = _require_dir(model_dir)
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = path / "chat_template.json"
    if as_json.is_file():
        try:
            data = json.loads(as_json.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{as_json}: not valid JSON ({e})") from e
        template = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(template, str) or not template:
            raise ValueError(f"{as_json}: expected a non-empty string under key 'chat_template'")
        return template
    return None


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load the fast (tokenizers-backed) tokenizer of a Qwen3-VL model dir, with its chat template set.

    Uses the class the dir's tokenizer_config names (Qwen2Tokenizer for Qwen3-VL), as
    SGLang and transformers do, so ids match the engine's. Raises if there is no chat template.
    """
    path = _require_dir(model_dir)
    has_json = (path / "tokenizer.json").is_file()
    has_bpe_files = (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    if not (has_json or has_bpe_files):
        raise FileNotFoundError(f"{path}: no tokenizer.json (or vocab.json + merges.txt); not a tokenizer directory")

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"{path}: loaded {type(tokenizer).__name__}, expected a tokenizers-backed fast tokenizer")
    template = read_chat_template(path)
    if template is not None:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        raise ValueError(
            f"{path}: no chat template (looked for chat_template.jinja, chat_template.json and "
            "'chat_template' in tokenizer_config.json)"
        )
    return tokenizer


def _single_token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no single token for {token!r} "
            f"(it encodes to {ids}); is this a Qwen-VL tokenizer?"
        )
    return ids[0]


@dataclass(frozen=True)
class VisionTokens:
    """Ids of Qwen-VL's control tokens, resolved by token string (never hard-coded numbers).

    `eos_ids`: ids that end generation: the tokenizer's eos, `<|im_end|>` and
    `<|endoftext|>` (Qwen's generation_config lists both), de-duplicated, in that order.
    """

    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    im_start: int
    im_end: int
    eos_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerFast) -> VisionTokens:
        """Look every control token up by its string; raise ValueError if one is not a single token."""
        im_end = _single_token_id(tokenizer, "<|im_end|>")
        eos: list[int] = []
        candidates = [tokenizer.eos_token_id, im_end]
        if "<|endoftext|>" in tokenizer.get_vocab():
            candidates.append(_single_token_id(tokenizer, "<|endoftext|>"))
        for token_id in candidates:
            if token_id is not None and token_id not in eos:
                eos.append(int(token_id))
        return cls(
            vision_start=_single_token_id(tokenizer, "<|vision_start|>"),
            vision_end=_single_token_id(tokenizer, "<|vision_end|>"),
            image_pad=_single_token_id(tokenizer, "<|image_pad|>"),
            video_pad=_single_token_id(tokenizer, "<|video_pad|>"),
            im_start=_single_token_id(tokenizer, "<|im_start|>"),
            im_end=im_end,
            eos_ids=tuple(eos),
        )

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """Tokens the policy must never sample: a sampled pad or vision marker breaks M-RoPE later."""
        return (self.vision_start, self.vision_end, self.image_pad, self.video_pad)

    def check_hf_config(self, config: Mapping[str, Any], source: str = "config.json") -> None:
        """Raise ValueError if a Qwen3-VL config's multimodal token ids disagree with the tokenizer's."""
        expected = {
            "image_token_id": self.image_pad,
            "video_token_id": self.video_pad,
            "vision_start_token_id": self.vision_start,
            "vision_end_token_id": self.vision_end,
        }
        for key, token_id in expected.items():
            if key not in config:
                raise ValueError(f"{source}: missing key {key!r}")
            if int(config[key]) != token_id:
                raise ValueError(f"{source}: {key}={config[key]} but the tokenizer has id {token_id}")


# --------------------------------------------------------------------------- image processor

# Keys whose Qwen2-VL class defaults (patch 14) differ from Qwen3-VL's: a config
# that omits them would silently produce wrong grids.
_REQUIRED_PREPROCESSOR_KEYS = ("patch_size", "merge_size", "temporal_patch_size")


def load_image_processor(model_dir: str | os.PathLike[str]) -> Qwen2VLImageProcessorPil:
    """The PIL (torchvision-free) Qwen2-VL image processor configured by `model_dir/preprocessor_config.json`.

    Released Qwen3-VL configs name `Qwen2VLImageProcessorFast` (torchvision); the PIL class
    implements the same smart-resize and patch layout without torchvision.
    """
    path = _require_dir(model_dir)
    config_path = path / "preprocessor_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; a Qwen3-VL model dir ships its image preprocessing config")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    kind = config.get("image_processor_type", "")
    if not str(kind).startswith("Qwen2VLImageProcessor"):
        raise ValueError(f"{config_path}: image_processor_type={kind!r} is not a Qwen2-VL/Qwen3-VL image processor")
    missing = [key for key in _REQUIRED_PREPROCESSOR_KEYS if key not in config]
    if missing:
        raise ValueError(f"{config_path}: missing keys {missing} (Qwen3-VL needs them explicitly)")

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)


def process_images(image_processor: Any, images: Sequence[Image.Image]) -> dict[str, np.ndarray]:
    """Preprocess images for the vision tower.

    Returns `pixel_values` [patches, C*T*P*P] float32 (patches of all images
    concatenated, in image order) and `image_grid_thw` [images, 3] int64, as numpy.
    An empty list gives zero-row arrays of the same widths.
    """
    patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size**2
    if len(images) == 0:
        return {
            "pixel_values": np.zeros((0, patch_dim), np.float32),
            "image_grid_thw": np.zeros((0, 3), np.int64),
        }
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"images[{i}] is a {type(image).__name__}, expected a PIL image (see load_image)")
    out = image_processor(images=[to_rgb(image) for image in images], return_tensors="np")
    pixel_values = np.asarray(out["pixel_values"], dtype=np.float32)
    grid_thw = np.asarray(out["image_grid_thw"], dtype=np.int64)
    num_patches = int(grid_thw.prod(axis=1).sum())
    if grid_thw.shape != (len(images), 3) or pixel_values.shape != (num_patches, patch_dim):
        raise ValueError(
            f"image processor returned pixel_values {pixel_values.shape} and image_grid_thw {grid_thw.shape} "
            f"for {len(images)} images; expected ({num_patches}, {patch_dim}) and ({len(images)}, 3)"
        )
    return {"pixel_values": pixel_values, "image_grid_thw": grid_thw}


def frame_patches(image_grid_thw: Any) -> np.ndarray:
    """Patches of each image frame (h x w of every `image_grid_thw` row [t, h, w]): what `max_frame_patches` bounds."""
    return np.asarray(image_grid_thw, np.int64).reshape(-1, 3)[:, 1:].prod(axis=1)


def max_frame_patches(image_processor: Any) -> int:
    """The most patches one image frame can have after this processor: its smart resize keeps height x width
    within the pixel cap (`size.longest_edge`, or `max_pixels`), in whole patches. The vision attention of
    training uses it as a static bound (`patch_attention_block`)."""
    size = getattr(image_processor, "size", None)
    cap = None
    if size is not None:
        cap = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
    cap = cap or getattr(image_processor, "max_pixels", None)
    if not cap:
        raise ValueError(f"{type(image_processor).__name__} states no pixel cap (size.longest_edge / max_pixels)")
    return int(cap) // int(image_processor.patch_size) ** 2


def num_image_pads(grid_thw_row: Sequence[int] | np.ndarray, merge_size: int) -> int:
    """Number of `<|image_pad|>` tokens one image expands to: t*h*w / merge_size**2."""
    t, h, w = (int(x) for x in grid_thw_row)
    if min(t, h, w) < 1 or h % merge_size or w % merge_size:
        raise ValueError(f"image grid (t={t}, h={h}, w={w}) is not a positive multiple of merge_size={merge_size}")
    return t * h * w // (merge_size * merge_size)


def hf_reference_processor(tokenizer: PreTrainedTokenizerFast, image_processor: Any, family: str = "qwen3_vl") -> Any:
    """transformers' own `Qwen3VLProcessor` (or `Qwen2_5_VLProcessor` for family "qwen2_5_vl") for images only
    (no video processor, so no torchvision).

    It expands pads and returns `mm_token_type_ids`; tests use it as an independent reference.
    """
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processors = {"qwen3_vl": Qwen3VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}
    if family not in processors:
        raise ValueError(f"family={family!r}: choose one of {tuple(processors)}")

    class _ImageOnlyQwen3VLProcessor(processors[family]):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return _ImageOnlyQwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


# --------------------------------------------------------------------------- image I/O


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of `image`, compositing transparency onto white, exactly as transformers' processors do."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image.copy()
    return image.convert("RGB")


def processor_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) that `image_processor` resizes a `width` x `height` image to (Qwen2-VL's smart resize:
    multiples of patch x merge, pixels within its range)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    size = image_processor.size
    h, w = smart_resize(height, width, factor=image_processor.patch_size * image_processor.merge_size,
                        min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    return w, h


def resize_as_processor(image: Image.Image, image_processor: Any) -> Image.Image:
    """`image` at the size `image_processor` would resize it to, resized the way it does (PIL, its resample filter);
    `image` itself when it already has that size.

    Sending the engine the resized pixels makes its own preprocessing an identity: an engine whose processor
    resizes differently (vLLM's and SGLang's torchvision path: ~2e-3 log-prob drift on a 50x70 picture, measured
    against a real vLLM) then sees exactly the trainer's pixels. Processing the result again gives bit-identical
    `pixel_values` (tests/test_processing.py)."""
    target = processor_size(image_processor, image.width, image.height)
    if target == image.size:
        return image
    return to_rgb(image).resize(target, resample=image_processor.resample)


def png_data_url_size(url: str) -> tuple[int, int] | None:
    """(width, height) from a PNG data URL's IHDR chunk, decoding 33 bytes instead of the image; None when `url` is
    not a well-formed PNG data URL (the full decode then reports why)."""
    prefix = "data:image/png;base64,"
    if not url.startswith(prefix):
        return None
    try:
        head = base64.b64decode(url[len(prefix):len(prefix) + 44], validate=True)
    except (ValueError, binascii.Error):
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def image_to_data_url(image: Image.Image) -> str:
    """`data:image/png;base64,...` of the RGB image (lossless, so the engine sees the trainer's pixels).

    compress_level=1: PNG is lossless at any level; level 1 encodes several times faster.
    """
    buffer = io.BytesIO()
    to_rgb(image).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


_IMAGE = MediaKind("image", IMAGE_SUFFIXES, "images as data URLs or base64", "max_image_bytes", ImageDecodeError,
                   ImageTooLarge)


def _too_many_bytes(n: int, policy: ImageReadPolicy, source: str) -> ImageTooLarge:
    return too_many_bytes(n, policy.max_bytes, source, _IMAGE)


def _decode_bytes(data: bytes, source: str, policy: ImageReadPolicy) -> Image.Image:
    if not data:
        raise ImageDecodeError(f"{source}: empty image data")
    if len(data) > policy.max_bytes:
        raise _too_many_bytes(len(data), policy, source)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # lazy: reads the header only
    except Image.DecompressionBombError as e:  # PIL's own guard (above 2 x Image.MAX_IMAGE_PIXELS)
        raise ImageTooLarge(f"{source}: {e}") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageDecodeError(f"{source}: cannot decode image ({type(e).__name__}: {e})") from e
    check_image_pixels(image.size, policy.max_pixels, source)  # before a single pixel is decoded
    try:
        image.load()  # force the decode so corrupt data fails here
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageDecodeError(f"{source}: cannot decode image ({type(e).__name__}: {e})") from e
    return to_rgb(image)


def _load_path(path_text: str, given: str, policy: ImageReadPolicy) -> Image.Image:
    data, source = read_local_file(path_text, given, policy.max_bytes, policy.read_local_files, policy.local_root,
                                   _IMAGE)
    return _decode_bytes(data, source, policy)


def _load_data_url(url: str, policy: ImageReadPolicy) -> Image.Image:
    match = DATA_URL.match(url)
    if match is None:
        raise ImageDecodeError(f"malformed data URL {describe(url)}: expected data:image/<type>;base64,<payload>")
    mime = match["mime"].lower()
    if mime and not mime.startswith("image/"):
        raise ImageDecodeError(f"data URL {describe(url)} has media type {mime!r}, not an image")
    if ";base64" not in match["params"].lower():
        raise ImageDecodeError(f"data URL {describe(url)} is not base64-encoded")
    data = decode_base64(match["payload"], f"data URL {describe(url)}", policy.max_bytes, _IMAGE)
    return _decode_bytes(data, f"data URL {describe(url)}", policy)


def load_image(item: Image.Image | str | bytes | os.PathLike[str], policy: ImageReadPolicy = TRUSTED_IMAGES) -> Image.Image:
    """Decode one image item into an RGB PIL image.

    Accepts a PIL image, a `data:image/...;base64,` URL (png, jpeg, ...), a `file://` URI,
    a local path, raw bytes, or a bare base64 string (SGLang's fallback for any other
    string; base64 never contains '.', so a string with one is taken as a path).
    http(s) URLs are refused: nothing is downloaded. `policy` says which local files may be read
    (the default, for the trainer's own inputs: any) and caps bytes and pixels; an image over a cap
    raises `ImageTooLarge` before it is decoded. Raises ImageDecodeError naming the cause.
    """
    if isinstance(item, Image.Image):
        check_image_pixels(item.size, policy.max_pixels, f"PIL image {item!r}")
        try:
            item.load()
        except (OSError, ValueError, SyntaxError) as e:
            raise ImageDecodeError(f"PIL image {item!r}: cannot decode ({type(e).__name__}: {e})") from e
        return to_rgb(item)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(item), f"raw bytes ({len(item)} bytes)", policy)
    if isinstance(item, os.PathLike):
        return _load_path(os.fspath(item), os.fspath(item), policy)
    if not isinstance(item, str):
        raise ImageDecodeError(
            f"unsupported image item of type {type(item).__name__}; expected a PIL image, data URL, "
            "base64 string, local path or file:// URI"
        )
    text = item.strip()
    if not text:
        raise ImageDecodeError("empty string given as an image")
    if text[:5].lower() == "data:":
        return _load_data_url(text, policy)
    if text[:7].lower() == "file://":
        path = unquote(text[7:])
        if path.startswith("localhost/"):
            path = path[len("localhost") :]
        return _load_path(path, text, policy)
    if text[:7].lower() == "http://" or text[:8].lower() == "https://":
        raise ImageDecodeError(f"refusing to download {describe(text)}: pass a data URL or a local path instead")
    # A restricted reader never probes the filesystem to tell a path from base64: every file it may read
    # has an image suffix, hence a '.'.
    if "." in text or (policy.local_root is None and policy.read_local_files and os.path.exists(text)):
        return _load_path(text, text, policy)
    if policy.local_root is None and policy.read_local_files:
        source = f"string {describe(text)} (not an existing path, so read as bare base64)"
    elif policy.read_local_files:
        source = f"string {describe(text)} (read as bare base64: it has no image file suffix)"
    else:
        source = f"string {describe(text)} (read as bare base64: this server reads no local paths)"
    data = decode_base64(text, source, policy.max_bytes, _IMAGE)
    return _decode_bytes(data, f"bare base64 string {describe(text)}", policy)
