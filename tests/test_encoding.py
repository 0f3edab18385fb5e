"""Observation delta tokens equal a full re-render of the conversation (template truth), in both views, for the
Qwen3-VL-style template and the Qwen2.5-VL-style one (default system prompt, no tool rendering)."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.encoding import ChatEncoder, DeltaEncodingError, check_prefix_stability
from rollout.processing import hf_reference_processor, image_to_data_url, load_image_processor, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc_geo3k_reward",
            "description": "Check an answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    }
]


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def encoder(family, tiny_processing_dir, tiny_qwen25_processing_dir):
    path = {"qwen3_vl": tiny_processing_dir, "qwen2_5_vl": tiny_qwen25_processing_dir}[family]
    return ChatEncoder(load_tokenizer(path), load_image_processor(path))


@pytest.fixture(scope="module")
def tiny_tokenizer(encoder):
    """The family's tokenizer (same vocabulary for both; the chat template differs)."""
    return encoder.tokenizer


@pytest.fixture(scope="module")
def tiny_image_processor(encoder):
    return encoder.image_processor


def _image_item(img):
    return {"type": "image", "image": image_to_data_url(img)}


def _conversation(make_test_image):
    """A prompt with two images, then three model turns answered by a tool response with an image and a user text."""
    prompt = [
        {"role": "system", "content": "You solve geometry problems."},
        {
            "role": "user",
            "content": [
                _image_item(make_test_image(1, (64, 96))),
                {"type": "text", "text": "Compare the figures."},
                _image_item(make_test_image(2, (128, 64))),
                {"type": "text", "text": "Find x."},
            ],
        },
    ]
    model_texts = [
        'I will check.\n<tool_call>\n{"name": "calc_geo3k_reward", "arguments": {"answer": "12"}}\n</tool_call>',
        "Then x is \\frac{3}{4}.",
        "Final: \\boxed{5\\sqrt{3}}",
    ]
    observations = [
        [{"role": "tool", "content": [_image_item(make_test_image(3, (96, 96))), {"type": "text", "text": "incorrect"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Try again; one turn left."}]}],
        None,
    ]
    return prompt, model_texts, observations


def _incremental(encoder, prompt, model_texts, observations, tools):
    """Build both views turn by turn the way the episode loop does; model ids come from the tokenizer here."""
    seg = encoder.encode_prompt(prompt, tools=tools)
    wire, train, images = list(seg.wire_ids), list(seg.train_ids), list(seg.image_data)
    grids = [seg.mm_inputs["image_grid_thw"]] if seg.mm_inputs else []
    model_turns = []
    for text, obs in zip(model_texts, observations):
        ids = encoder.tokenize(text) + [encoder.vision.im_end]
        model_turns.append(ids)
        wire += ids
        train += ids
        if obs:
            o = encoder.encode_observation(obs)
            wire += o.wire_ids
            train += o.train_ids
            images += o.image_data
            if o.mm_inputs:
                grids.append(o.mm_inputs["image_grid_thw"])
    return wire, train, images, np.concatenate(grids), model_turns


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
def test_delta_tokens_equal_full_rerender(encoder, tiny_tokenizer, make_test_image, tools):
    prompt, model_texts, observations = _conversation(make_test_image)
    wire, train, images, grid, model_turns = _incremental(encoder, prompt, model_texts, observations, tools)

    # Independent reference: the whole conversation rendered in one go by the chat template, then tokenized.
    messages = list(prompt)
    for text, obs in zip(model_texts, observations):
        messages.append({"role": "assistant", "content": text})
        messages.extend(obs or [])
    full_text = encoder.render(messages, tools=tools, add_generation_prompt=False)
    full_ids = tiny_tokenizer.encode(full_text, add_special_tokens=False)
    # The re-render ends with the separator after the last <|im_end|>; the episode ends at <|im_end|>.
    assert full_ids[: len(wire)] == wire
    assert tiny_tokenizer.decode(full_ids[len(wire) :]) == "\n"
    # The newline after each model <|im_end|> (the one slime loses) is present.
    nl = tiny_tokenizer.encode("\n", add_special_tokens=False)
    end = encoder.vision.im_end
    for k, t in enumerate(wire[:-1]):
        if t == end:
            assert wire[k + 1 : k + 1 + len(nl)] == nl
    # The system prompt and tool list appear exactly once.
    text = tiny_tokenizer.decode(wire, skip_special_tokens=False)
    assert text.count("You solve geometry problems.") == 1
    if tools and encoder.tokenizer.chat_template.startswith("{#- Qwen2.5-VL"):
        # Qwen2.5-VL's template renders no tool schemas: only the model's own call names the tool.
        assert text.count("# Tools") == 0 and text.count("calc_geo3k_reward") == 1
    elif tools:
        assert text.count("# Tools") == 1 and text.count("calc_geo3k_reward") == 2  # schema + the model call
    if encoder.tokenizer.chat_template.startswith("{#- Qwen2.5-VL"):
        assert text.count("You are a helpful assistant.") == 0  # the conversation has its own system prompt

    rendered = encoder.rerender_conversation(prompt, list(zip(model_turns, observations)), tools=tools)
    assert check_prefix_stability(encoder, wire, rendered, "strict")


def test_training_view_equals_hf_processor_expansion(encoder, family, tiny_tokenizer, tiny_image_processor, make_test_image):
    prompt, model_texts, observations = _conversation(make_test_image)
    wire, train, images, grid, _ = _incremental(encoder, prompt, model_texts, observations, None)
    assert len(images) == 3 and grid.shape == (3, 3)
    # transformers' own processor of the family expands the pads of the whole conversation text.
    from rollout.processing import load_image

    processor = hf_reference_processor(tiny_tokenizer, tiny_image_processor, family)
    text = tiny_tokenizer.decode(wire, skip_special_tokens=False)
    ref = processor(text=[text], images=[load_image(u) for u in images], return_tensors="np")
    assert ref["input_ids"][0].tolist() == train
    np.testing.assert_array_equal(ref["image_grid_thw"], grid)
    assert tiny_image_processor.patch_size == {"qwen3_vl": 16, "qwen2_5_vl": 14}[family]
    # compact(expand(x)) == x and expand(compact(y)) == y
    assert encoder.compact_image_pads(train) == wire
    assert encoder.expand_image_pads(wire, grid) == train


def test_expand_rejects_mismatched_image_count(encoder):
    pad = encoder.vision.image_pad
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        encoder.expand_image_pads([pad, 5, pad], np.array([[1, 4, 4]]))


def test_default_system_prompt_of_the_qwen25_template_appears_once(encoder, family, make_test_image):
    """Without a system message, Qwen2.5-VL's template adds "You are a helpful assistant." (Qwen3-VL's adds
    nothing); the delta of a later turn must not repeat it, and the whole episode equals the re-render."""
    prompt = [{"role": "user", "content": [_image_item(make_test_image(4, (64, 64))), {"type": "text", "text": "Find x."}]}]
    wire, _, _, _, model_turns = _incremental(encoder, prompt, ["x is 3.", "Final: 3"],
                                              [[{"role": "user", "content": "Check again."}], None], None)
    text = encoder.tokenizer.decode(wire, skip_special_tokens=False)
    assert text.count("You are a helpful assistant.") == (1 if family == "qwen2_5_vl" else 0)
    rendered = encoder.rerender_conversation(prompt, list(zip(model_turns, [[{"role": "user", "content": "Check again."}], None])))
    assert check_prefix_stability(encoder, wire, rendered, "strict")


def test_model_turn_without_im_end_is_closed_on_template(encoder, tiny_tokenizer):
    obs = [{"role": "user", "content": "next"}]
    closed = encoder.encode_observation(obs, model_ended_turn=False)
    normal = encoder.encode_observation(obs)
    assert closed.wire_ids == [encoder.vision.im_end] + normal.wire_ids
    assert tiny_tokenizer.decode(normal.wire_ids, skip_special_tokens=False) == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_prefix_check_modes(encoder, tiny_tokenizer, caplog):
    prompt = [{"role": "user", "content": "hello"}]
    seg = encoder.encode_prompt(prompt)
    answer = encoder.tokenize("hi") + [encoder.vision.im_end]
    wire = seg.wire_ids + answer
    rendered = encoder.rerender_conversation(prompt, [(answer, None)])
    assert check_prefix_stability(encoder, wire, rendered, "strict")
    broken = seg.wire_ids + encoder.tokenize("hi") + encoder.tokenize(" extra") + [encoder.vision.im_end]
    with pytest.raises(DeltaEncodingError, match="differ from the chat template"):
        check_prefix_stability(encoder, broken, rendered, "strict")
    assert check_prefix_stability(encoder, broken, rendered, "warn") is False
    assert "differ from the chat template" in caplog.text
    assert check_prefix_stability(encoder, broken, rendered, "off") is True
