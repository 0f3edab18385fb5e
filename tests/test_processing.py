"""rollout.processing: loading, image tensors, pad counts and image I/O, against independent references."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollout.processing import (
    ImageDecodeError,
    VisionTokens,
    hf_reference_processor,
    image_to_data_url,
    load_image,
    load_image_processor,
    load_tokenizer,
    num_image_pads,
    process_images,
    to_rgb,
)

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def smart_resize_by_hand(
    height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 32
) -> tuple[int, int]:
    """Qwen-VL's resize rule, restated from its description: round each side to a multiple of
    `factor`, then scale (keeping the aspect ratio) into [min_pixels, max_pixels]."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


# ----------------------------------------------------------------------------- image tensors


def test_process_images_matches_transformers_processor_for_two_sizes(
    tiny_tokenizer, tiny_image_processor, make_test_image
) -> None:
    images = [make_test_image(0, 64), make_test_image(1, (128, 96))]  # (width, height)
    ours = process_images(tiny_image_processor, images)

    # Hand-computed: 64x64 -> 4x4 patches of 16; 96 high x 128 wide -> 6x8 patches.
    np.testing.assert_array_equal(ours["image_grid_thw"], [[1, 4, 4], [1, 6, 8]])
    assert ours["image_grid_thw"].dtype == np.int64
    assert ours["pixel_values"].shape == (16 + 48, 3 * 2 * 16 * 16)
    assert ours["pixel_values"].dtype == np.float32

    # transformers' own Qwen3VLProcessor on the rendered prompt.
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.count(IMG) == 2
    reference = hf_reference_processor(tiny_tokenizer, tiny_image_processor)(
        text=[prompt], images=images, return_tensors="np"
    )
    assert reference["pixel_values"].shape == ours["pixel_values"].shape
    np.testing.assert_array_equal(reference["image_grid_thw"], ours["image_grid_thw"])
    np.testing.assert_array_equal(reference["pixel_values"], ours["pixel_values"])

    # Pads per image: transformers' expansion == num_image_pads == t*h*w/4 (4 and 12 by hand).
    vt = VisionTokens.from_tokenizer(tiny_tokenizer)
    ids = reference["input_ids"][0].tolist()
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == vt.image_pad:
            j = i
            while j < len(ids) and ids[j] == vt.image_pad:
                j += 1
            assert ids[i - 1] == vt.vision_start and ids[j] == vt.vision_end
            runs.append(j - i)
            i = j
        else:
            i += 1
    merge = tiny_image_processor.merge_size
    assert runs == [num_image_pads(row, merge) for row in ours["image_grid_thw"]] == [4, 12]
    assert int(reference["mm_token_type_ids"].sum()) == 16  # 1 marks image tokens


def _patchify_by_hand(pixels: np.ndarray, patch: int) -> np.ndarray:
    """Rows [P, C*2*patch*patch] of a normalized [H, W, C] image: one row per patch in 2x2 merge-block order
    (blocks row-major), each laid out (channel, temporal copy, py, px), the single frame repeated in time."""
    rows = []
    for block_row in range(pixels.shape[0] // (2 * patch)):
        for block_col in range(pixels.shape[1] // (2 * patch)):
            for mh in range(2):
                for mw in range(2):
                    r, c = 2 * block_row + mh, 2 * block_col + mw
                    block = pixels[patch * r : patch * (r + 1), patch * c : patch * (c + 1)].transpose(2, 0, 1)  # [C, P, P]
                    rows.append(np.stack([block, block], axis=1).reshape(-1))  # [C, T, P, P]
    return np.stack(rows).astype(np.float32)


def test_pixel_values_layout_matches_numpy_patchify(tiny_image_processor, make_test_image) -> None:
    """Independent reference for a 64x64 image (no resize): rescale to [0,1], normalize with
    mean = std = 0.5, then one row per 16x16 patch in 2x2 merge-block order, each row laid out
    (channel, temporal copy, py, px) with the single frame repeated over the temporal patch."""
    image = make_test_image(7, 64)
    pixels = (np.asarray(image, dtype=np.float64) / 255.0 - 0.5) / 0.5  # [H, W, C]
    expected = _patchify_by_hand(pixels, 16)
    got = process_images(tiny_image_processor, [image])["pixel_values"]
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("size", [(100, 70), (256, 256), (40, 40), (300, 50)])
def test_grid_follows_smart_resize(tiny_image_processor, make_test_image, size) -> None:
    width, height = size
    h, w = smart_resize_by_hand(height, width, min_pixels=64 * 64, max_pixels=128 * 128)
    grid = process_images(tiny_image_processor, [make_test_image(3, size)])["image_grid_thw"]
    np.testing.assert_array_equal(grid, [[1, h // 16, w // 16]])


def test_released_qwen3_vl_preprocessor_config_upscales_small_images(tmp_path: Path, make_test_image) -> None:
    # The values of Qwen3-VL-2B-Instruct's preprocessor_config.json.
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast",
            }
        )
    )
    processor = load_image_processor(tmp_path)
    grid = process_images(processor, [make_test_image(0, 64)])["image_grid_thw"]
    h, w = smart_resize_by_hand(64, 64, min_pixels=65536, max_pixels=16777216)
    assert (h, w) == (256, 256)
    np.testing.assert_array_equal(grid, [[1, 16, 16]])
    assert num_image_pads(grid[0], processor.merge_size) == 64


def test_empty_image_list_gives_zero_rows(tiny_image_processor) -> None:
    out = process_images(tiny_image_processor, [])
    assert out["pixel_values"].shape == (0, 1536) and out["pixel_values"].dtype == np.float32
    assert out["image_grid_thw"].shape == (0, 3) and out["image_grid_thw"].dtype == np.int64


def test_process_images_rejects_non_images(tiny_image_processor) -> None:
    with pytest.raises(TypeError, match=r"images\[1\]"):
        process_images(tiny_image_processor, [Image.new("RGB", (64, 64)), "data:image/png;base64,AAAA"])


def test_num_image_pads() -> None:
    assert num_image_pads([1, 4, 4], 2) == 4
    assert num_image_pads(np.array([2, 6, 8]), 2) == 24
    with pytest.raises(ValueError, match="merge_size=2"):
        num_image_pads([1, 5, 4], 2)


# ----------------------------------------------------------------------------- loaders


def test_vision_tokens_resolved_by_string(tiny_tokenizer) -> None:
    vt = VisionTokens.from_tokenizer(tiny_tokenizer)
    by_string = {
        "vision_start": "<|vision_start|>",
        "vision_end": "<|vision_end|>",
        "image_pad": "<|image_pad|>",
        "video_pad": "<|video_pad|>",
        "im_start": "<|im_start|>",
        "im_end": "<|im_end|>",
    }
    for field, token in by_string.items():
        assert getattr(vt, field) == tiny_tokenizer.convert_tokens_to_ids(token)
        assert tiny_tokenizer.decode([getattr(vt, field)]) == token
    assert vt.eos_ids == (vt.im_end, tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert set(vt.banned_ids) == {vt.vision_start, vt.vision_end, vt.image_pad, vt.video_pad}


def test_vision_tokens_check_hf_config_names_the_key(tiny_tokenizer, tiny_hf_config) -> None:
    vt = VisionTokens.from_tokenizer(tiny_tokenizer)
    vt.check_hf_config(tiny_hf_config)
    with pytest.raises(ValueError, match="image_token_id=151655"):
        vt.check_hf_config({**tiny_hf_config, "image_token_id": 151655}, source="ckpt/config.json")


def test_load_tokenizer_prefers_chat_template_files(tiny_processing_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_processing_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    # Without any template file or tokenizer_config key there is no template: a clear error.
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(model_dir)
    # Qwen3-VL checkpoints ship the template as chat_template.json.
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}!"}))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
    (model_dir / "chat_template.jinja").write_text("{{ messages[0].content }}?")
    assert load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi?"


def test_loaders_name_the_missing_or_bad_file(tiny_processing_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        load_image_processor(tmp_path)
    config = json.loads((tiny_processing_dir / "preprocessor_config.json").read_text())
    wrong_type = {**config, "image_processor_type": "CLIPImageProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(wrong_type))
    with pytest.raises(ValueError, match="CLIPImageProcessor"):
        load_image_processor(tmp_path)
    del config["patch_size"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="patch_size"):
        load_image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_image_processor(tmp_path)


# ----------------------------------------------------------------------------- image I/O


def test_data_url_round_trip_is_pixel_exact(make_test_image) -> None:
    image = make_test_image(5, (80, 48))
    url = image_to_data_url(image)
    assert url.startswith("data:image/png;base64,")
    decoded = load_image(url)
    assert decoded.mode == "RGB" and decoded.size == (80, 48)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))


def test_transparent_images_get_the_same_pixels_in_trainer_and_engine(tiny_image_processor, make_test_image) -> None:
    rgba = make_test_image(2, 64).convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (64, 1))
    rgba.putalpha(Image.fromarray(alpha))
    # The trainer preprocesses the original image; the engine decodes the PNG data URL.
    trainer_view = process_images(tiny_image_processor, [rgba])["pixel_values"]
    engine_view = process_images(tiny_image_processor, [load_image(image_to_data_url(rgba))])["pixel_values"]
    np.testing.assert_array_equal(trainer_view, engine_view)
    # Transparency composites onto white: a fully transparent pixel becomes white.
    assert tuple(np.asarray(to_rgb(rgba))[0, 0]) == (255, 255, 255)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_load_image_accepts_every_documented_form(tmp_path: Path, make_test_image) -> None:
    image = make_test_image(4, 64)
    pixels = np.asarray(image)
    png = _encoded(image, "PNG")
    jpeg = _encoded(image, "JPEG")
    jpeg_pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    path = tmp_path / "dir with space" / "img.png"
    path.parent.mkdir()
    path.write_bytes(png)

    same_as_png = [
        image,
        "data:image/png;base64," + base64.b64encode(png).decode(),
        base64.b64encode(png).decode(),  # bare base64
        str(path),
        path,
        "file://" + str(path).replace(" ", "%20"),
        png,
    ]
    for item in same_as_png:
        decoded = load_image(item)
        assert decoded.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(decoded), pixels)
    np.testing.assert_array_equal(
        np.asarray(load_image("data:image/jpeg;base64," + base64.b64encode(jpeg).decode())), jpeg_pixels
    )
    # Bare base64 of a JPEG starts with "/9j/": still base64, not a path.
    np.testing.assert_array_equal(np.asarray(load_image(base64.b64encode(jpeg).decode())), jpeg_pixels)
    assert load_image(image.convert("L")).mode == "RGB"


def test_corrupt_and_missing_images_raise_image_decode_error_naming_the_cause(tmp_path: Path, make_test_image) -> None:
    png = _encoded(make_test_image(4, 64), "PNG")
    good_b64 = base64.b64encode(png).decode()

    with pytest.raises(ImageDecodeError, match=r"data URL .*cannot decode image"):
        load_image("data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode())  # truncated PNG
    with pytest.raises(ImageDecodeError, match=r"raw bytes .*cannot decode image"):
        load_image(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    with pytest.raises(ImageDecodeError, match="invalid base64"):
        load_image("data:image/png;base64," + good_b64[:-3])  # truncated base64 text
    with pytest.raises(ImageDecodeError, match="invalid base64"):
        load_image(good_b64[:-1])
    missing = tmp_path / "missing.png"
    with pytest.raises(ImageDecodeError, match=f"image file not found: {missing}"):
        load_image(str(missing))
    with pytest.raises(ImageDecodeError, match="image file not found"):
        load_image("file://" + str(missing))
    bad_file = tmp_path / "bad.png"
    bad_file.write_bytes(png[:100])
    with pytest.raises(ImageDecodeError, match=f"image file {bad_file}: cannot decode"):
        load_image(bad_file)
    with pytest.raises(ImageDecodeError, match="refusing to download"):
        load_image("https://example.com/a.png")
    with pytest.raises(ImageDecodeError, match="not an image"):
        load_image("data:text/plain;base64," + good_b64)
    with pytest.raises(ImageDecodeError, match="not base64"):
        load_image("data:image/png," + good_b64)
    with pytest.raises(ImageDecodeError, match="empty"):
        load_image(b"")
    with pytest.raises(ImageDecodeError, match="unsupported image item of type int"):
        load_image(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- Qwen2.5-VL preprocessing


@pytest.fixture(scope="module")
def qwen25_image_processor(tiny_qwen25_processing_dir: Path):
    return load_image_processor(tiny_qwen25_processing_dir)


def test_qwen25_pixel_values_are_clip_normalized_patch_14_rows(qwen25_image_processor, make_test_image) -> None:
    """Independent reference for an 84x84 image (no resize): rescale to [0,1], normalize with CLIP's mean/std,
    one row per 14x14 patch in 2x2 merge-block order (3 x 3 blocks), laid out (channel, temporal copy, py, px)."""
    mean = np.array([0.48145466, 0.4578275, 0.40821073])
    std = np.array([0.26862954, 0.26130258, 0.27577711])
    image = make_test_image(7, 84)
    pixels = (np.asarray(image, dtype=np.float64) / 255.0 - mean) / std
    got = process_images(qwen25_image_processor, [image])
    np.testing.assert_array_equal(got["image_grid_thw"], [[1, 6, 6]])
    np.testing.assert_allclose(got["pixel_values"], _patchify_by_hand(pixels, 14), atol=1e-5)


@pytest.mark.parametrize("size", [(100, 70), (256, 256), (40, 40), (300, 50)])
def test_qwen25_grid_follows_smart_resize_with_factor_28(qwen25_image_processor, make_test_image, size) -> None:
    width, height = size
    h, w = smart_resize_by_hand(height, width, min_pixels=64 * 64, max_pixels=128 * 128, factor=28)
    grid = process_images(qwen25_image_processor, [make_test_image(3, size)])["image_grid_thw"]
    np.testing.assert_array_equal(grid, [[1, h // 14, w // 14]])


def test_qwen25_process_images_matches_transformers_qwen2_5_vl_processor(
    tiny_qwen25_processing_dir: Path, qwen25_image_processor, make_test_image
) -> None:
    tokenizer = load_tokenizer(tiny_qwen25_processing_dir)
    images = [make_test_image(0, 64), make_test_image(1, (128, 96))]
    ours = process_images(qwen25_image_processor, images)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    reference = hf_reference_processor(tokenizer, qwen25_image_processor, "qwen2_5_vl")(
        text=[prompt], images=images, return_tensors="np"
    )
    np.testing.assert_array_equal(reference["image_grid_thw"], ours["image_grid_thw"])
    np.testing.assert_array_equal(reference["pixel_values"], ours["pixel_values"])
    pads = int((reference["input_ids"][0] == VisionTokens.from_tokenizer(tokenizer).image_pad).sum())
    assert pads == sum(num_image_pads(row, 2) for row in ours["image_grid_thw"]) == int(reference["mm_token_type_ids"].sum())
