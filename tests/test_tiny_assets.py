"""The tiny tokenizer, chat template, configs and checkpoint behave like Qwen3-VL-Instruct's."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_vlm.tiny_assets import (
    QWEN2_PRETOKENIZE_REGEX,
    QWEN_ADDED_TOKENS,
    QWEN_SPECIAL_TOKENS,
    build_tiny_backend,
    build_tiny_tokenizer,
    save_tiny_processing,
    tiny_image_processor_config,
    tiny_qwen3_vl_hf_config,
)
from rollout.processing import VisionTokens, hf_reference_processor, load_image_processor, load_tokenizer

IMG = "<|vision_start|><|image_pad|><|vision_end|>"

ZOOM_TOOL = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Zoom into a region of the image.",
        "parameters": {
            "type": "object",
            "properties": {"box": {"type": "array", "items": {"type": "integer"}}},
            "required": ["box"],
        },
    },
}


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# ----------------------------------------------------------------------------- chat template


def test_template_renders_multi_turn_tool_conversation_in_qwen3_vl_format(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a geometry assistant."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which angle is larger?"}],
        },
        {
            "role": "assistant",
            "content": "Let me zoom in.",
            "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}}],
        },
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "Zoomed region."}]},
        {"role": "assistant", "content": "Angle B is larger. \\boxed{B}"},
    ]
    # Written by hand from Qwen's documented Qwen3-VL-Instruct format (Hermes-style tools block).
    expected = (
        "<|im_start|>system\n"
        "You are a geometry assistant.\n\n"
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "zoom", "description": "Zoom into a region of the image.", '
        '"parameters": {"type": "object", "properties": {"box": {"type": "array", "items": {"type": "integer"}}}, '
        '"required": ["box"]}}}\n'
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
        "Which angle is larger?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "Let me zoom in.\n"
        "<tool_call>\n"
        '{"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "<|vision_start|><|image_pad|><|vision_end|>Zoomed region.\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "Angle B is larger. \\boxed{B}<|im_end|>\n"
    )
    assert render(tiny_tokenizer, messages, tools=[ZOOM_TOOL]) == expected


def test_template_has_no_default_system_and_adds_generation_prompt(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "Find x."}]
    assert render(tiny_tokenizer, messages) == "<|im_start|>user\nFind x.<|im_end|>\n"
    assert (
        render(tiny_tokenizer, messages, add_generation_prompt=True)
        == "<|im_start|>user\nFind x.<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert render(tiny_tokenizer, with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nFind x.<|im_end|>\n"
    )


def test_template_groups_consecutive_tool_messages_and_renders_several_calls(tiny_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "a", "arguments": '{"x": 1}'}},  # string arguments pass through verbatim
                {"function": {"name": "b", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
        {"role": "user", "content": "Thanks."},
    ]
    assert render(tiny_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nGo.<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_vision_ids_and_video(tiny_tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "a"}]},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]},
    ]
    assert render(tiny_tokenizer, messages, add_vision_id=True) == (
        "<|im_start|>user\nPicture 1: " + IMG + "Video 1: <|vision_start|><|video_pad|><|vision_end|>a<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nPicture 2: " + IMG + "\n</tool_response><|im_end|>\n"
    )


def test_template_rejects_unknown_roles_and_content_items(tiny_tokenizer) -> None:
    with pytest.raises(Exception, match="unknown role"):
        render(tiny_tokenizer, [{"role": "critic", "content": "x"}])
    with pytest.raises(Exception, match="unsupported content item"):
        render(tiny_tokenizer, [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}])


# ----------------------------------------------------------------------------- tokenizer


def test_vocab_size_eos_pad_and_added_token_ids(tiny_tokenizer) -> None:
    assert len(tiny_tokenizer) == 1024
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.bos_token is None
    added = QWEN_SPECIAL_TOKENS + QWEN_ADDED_TOKENS
    ids = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in added]
    assert all(len(i) == 1 for i in ids), dict(zip(added, ids))
    # Like Qwen, the added tokens take the last ids, in order.
    assert [i[0] for i in ids] == list(range(1024 - len(added), 1024))


def test_special_tokens_are_skipped_but_tool_tags_are_not(tiny_tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>hm</think><tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text
    kept = "assistant\n<think>hm</think><tool_call>\n{}\n</tool_call>"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == kept


UNICODE_SAMPLES = [
    "Find the area of \\triangle ABC if AB = 12.5 cm.",
    "Ünïcödé ñ façade — “quotes” ‘single’ … 漢字かなカナ 한국어 العربية עברית",
    "emoji 🙂👍🏽👨‍👩‍👧 flags 🇫🇷 math ∑∫√∞≠≤ π≈3.14159",
    "tabs\tand\r\nwindows newlines\n\n\n  leading and trailing spaces   ",
    '{"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}',
    "\x00\x01 control \x7f and \u200b zero width",
]


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_decode_encode_round_trips_text(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_decode_encode_round_trips_arbitrary_unicode_up_to_nfc(tiny_tokenizer, text: str) -> None:
    # Qwen's tokenizer applies NFC normalization; byte-level BPE then makes every NFC string round-trip.
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_turn_boundary_tokenizes_stably(tiny_tokenizer) -> None:
    vt = VisionTokens.from_tokenizer(tiny_tokenizer)
    (newline,) = tiny_tokenizer.encode("\n", add_special_tokens=False)
    boundary = tiny_tokenizer.encode("<|im_end|>\n<|im_start|>", add_special_tokens=False)
    assert boundary == [vt.im_end, newline, vt.im_start]
    # Delta encoding relies on this: encoding a conversation in pieces split after "<|im_end|>\n"
    # gives the same ids as encoding it whole.
    turns = [
        "<|im_start|>user\n" + IMG + "What is x?<|im_end|>\n",
        "<|im_start|>assistant\nx = 4.\n\n<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\nWrong.\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ]
    whole = tiny_tokenizer.encode("".join(turns), add_special_tokens=False)
    pieces = [i for t in turns for i in tiny_tokenizer.encode(t, add_special_tokens=False)]
    assert whole == pieces


def _tokenizer_json_sha(vocab_size: int, seed: int) -> str:
    return hashlib.sha256(build_tiny_backend(vocab_size, seed).to_str().encode()).hexdigest()


def test_tokenizer_build_is_deterministic_across_processes() -> None:
    here = _tokenizer_json_sha(1024, 0)
    code = (
        "import hashlib; from jaxrl_vlm.tiny_assets import build_tiny_backend; "
        "print(hashlib.sha256(build_tiny_backend(1024, 0).to_str().encode()).hexdigest())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert here == there
    assert _tokenizer_json_sha(1024, 1) != here  # the seed changes the corpus


def test_saved_files_are_byte_identical_and_load_as_the_built_tokenizer(tmp_path: Path) -> None:
    first = save_tiny_processing(tmp_path / "a")
    second = save_tiny_processing(tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == ["chat_template.jinja", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                     "video_preprocessor_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert json.loads((first / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX
    # transformers rebuilds a Qwen2Tokenizer from vocab + merges with its own Qwen2 pipeline:
    # equal ids prove our tokenizer.json uses the same normalizer / pre-tokenizer as Qwen2.
    built = build_tiny_tokenizer()
    loaded = load_tokenizer(first)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert loaded.chat_template == built.chat_template
    for text in UNICODE_SAMPLES + ["<|im_start|>user\n" + IMG + "Go<|im_end|>\n<tool_call>"]:
        assert loaded.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)


def test_vocab_too_small_is_an_error() -> None:
    with pytest.raises(ValueError, match="too small"):
        build_tiny_tokenizer(vocab_size=200)


def test_image_processor_config_has_qwen3_vl_values() -> None:
    cfg = tiny_image_processor_config(64 * 64, 128 * 128)
    assert (cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]) == (16, 2, 2)
    assert cfg["image_mean"] == cfg["image_std"] == [0.5, 0.5, 0.5]
    assert cfg["size"] == {"shortest_edge": 4096, "longest_edge": 16384}
    with pytest.raises(ValueError, match="min_pixels"):
        tiny_image_processor_config(128 * 128, 64 * 64)


# ----------------------------------------------------------------------------- HF config and checkpoint


def test_hf_config_token_ids_match_tokenizer_and_load_in_transformers(tiny_tokenizer, tiny_hf_config) -> None:
    from transformers import Qwen3VLConfig

    vt = VisionTokens.from_tokenizer(tiny_tokenizer)
    vt.check_hf_config(tiny_hf_config)
    cfg = Qwen3VLConfig(**tiny_hf_config)
    assert cfg.image_token_id == tiny_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.text_config.vocab_size == len(tiny_tokenizer)
    assert cfg.text_config.eos_token_id == vt.im_end
    assert cfg.text_config.bos_token_id == cfg.text_config.pad_token_id == tiny_tokenizer.pad_token_id
    assert cfg.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    assert cfg.text_config.rope_parameters["mrope_interleaved"] is True
    assert (cfg.vision_config.depth, cfg.vision_config.hidden_size, cfg.vision_config.out_hidden_size) == (2, 32, 64)
    assert list(cfg.vision_config.deepstack_visual_indexes) == [0, 1]


def test_hf_config_overrides_merge_and_are_validated(tiny_tokenizer) -> None:
    cfg = tiny_qwen3_vl_hf_config(tiny_tokenizer, tie_word_embeddings=False, text_config={"num_hidden_layers": 3})
    assert cfg["tie_word_embeddings"] is False
    assert cfg["text_config"]["num_hidden_layers"] == 3 and cfg["text_config"]["hidden_size"] == 64
    with pytest.raises(ValueError, match="mrope_section"):
        tiny_qwen3_vl_hf_config(tiny_tokenizer, text_config={"head_dim": 32})
    with pytest.raises(ValueError, match="out_hidden_size"):
        tiny_qwen3_vl_hf_config(tiny_tokenizer, vision_config={"out_hidden_size": 32})
    with pytest.raises(ValueError, match="perfect square"):
        tiny_qwen3_vl_hf_config(tiny_tokenizer, vision_config={"num_position_embeddings": 60})
    with pytest.raises(ValueError, match="deepstack"):
        tiny_qwen3_vl_hf_config(tiny_tokenizer, text_config={"num_hidden_layers": 1})
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_qwen3_vl_hf_config(tiny_tokenizer, text_config={"vocab_size": 1000})


def test_tiny_checkpoint_loads_and_runs_a_forward_with_an_image(
    tiny_hf_checkpoint, tiny_tokenizer, tiny_image_processor, make_test_image
) -> None:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    # The checkpoint dir is a complete model dir: our loaders read it as they would a released one.
    assert load_tokenizer(tiny_hf_checkpoint).encode("a<|im_end|>") == tiny_tokenizer.encode("a<|im_end|>")
    assert load_image_processor(tiny_hf_checkpoint).patch_size == 16
    generation = json.loads((tiny_hf_checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(VisionTokens.from_tokenizer(tiny_tokenizer).eos_ids)

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_hf_checkpoint), dtype=torch.float32).eval()
    assert model.config.image_token_id == tiny_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.vocab_size == len(tiny_tokenizer)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    processor = hf_reference_processor(tiny_tokenizer, tiny_image_processor)

    def logits_for(image):
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 4  # 64x64 -> 4x4 patches -> 4 pads
        with torch.no_grad():
            out = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=inputs["mm_token_type_ids"],
            )
        assert out.logits.shape == (1, inputs["input_ids"].shape[1], len(tiny_tokenizer))
        return out.logits[0, -1].numpy()

    first = logits_for(make_test_image(0, 64))
    again = logits_for(make_test_image(0, 64))
    other = logits_for(make_test_image(1, 64))
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 1e-6  # the image reaches the last position's logits
