"""Clips in chat messages: the delta encoding renders them through the chat template, sends one compact
`<|video_pad|>` per clip (with the clip as a lossless video data URL), and expands it for training exactly as
transformers' own processor of the family expands it: `Qwen3VLProcessor.replace_video_token` (a timestamp and the
vision markers around every frame group) and `Qwen2_5_VLProcessor.replace_video_token` (one run of pads), run here on
our processor's grids and frame indices (transformers' video processors need torchvision; the processor itself is
checked against them in tests/vllm_real/test_video_processor.py). No jax."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from envs.base import BaseInteractionEnv
from jaxrl_vlm.tiny_assets import save_tiny_processing
from rollout.encoding import ChatEncoder, TranscriptError, check_prefix_stability, encode_transcript
from rollout.processing import load_image_processor, load_tokenizer
from rollout.video import Clip, ClipError, load_video_processor_config, process_clips
from rollout import video_io
from rollout.video_io import clip_to_data_url, load_clip


def _clip(seed: int, frames: int, size: tuple[int, int] = (40, 56), fps: float = 4.0) -> Clip:
    rng = np.random.default_rng(seed)
    return Clip.of(rng.integers(0, 256, (frames, size[1], size[0], 3), dtype=np.uint8), fps)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def family(request, tmp_path_factory) -> tuple[str, Path, ChatEncoder]:
    out = save_tiny_processing(tmp_path_factory.mktemp(request.param), arch=request.param)
    encoder = ChatEncoder(load_tokenizer(out), load_image_processor(out), video_config=load_video_processor_config(out))
    return request.param, out, encoder


def _reference_ids(family: str, encoder: ChatEncoder, text: str, clips: list[Clip]) -> list[int]:
    """transformers' expansion of every `<|video_pad|>` of the rendered `text`, then the tokenizer on the whole."""
    cfg = encoder.video_config
    done = process_clips(clips, cfg)
    cls = Qwen3VLProcessor if family == "qwen3_vl" else Qwen2_5_VLProcessor
    proc = object.__new__(cls)  # replace_video_token reads only these attributes
    proc.video_processor = SimpleNamespace(merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size)
    proc.video_token, proc.vision_start_token, proc.vision_end_token = "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
    inputs = {"video_grid_thw": done.video_grid_thw,
              "video_metadata": [VideoMetadata(total_num_frames=len(c.frames), fps=c.fps, frames_indices=idx)
                                 for c, idx in zip(clips, done.frame_indices)]}
    pieces = text.split("<|video_pad|>")
    assert len(pieces) == len(clips) + 1
    expanded = pieces[0] + "".join(proc.replace_video_token(inputs, i) + pieces[i + 1] for i in range(len(clips)))
    return encoder.tokenize(expanded)


def test_a_prompt_clip_expands_as_transformers_and_travels_compact_and_lossless(family):
    name, _, encoder = family
    clip = _clip(1, 9)  # Qwen3-VL samples 4 of 9 frames at 2 per second: 2 frame groups, 2 timestamps
    messages = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": "Which way?"}]}]
    seg = encoder.encode_prompt(messages)
    text = encoder.render(messages, add_generation_prompt=True)
    assert seg.wire_ids == encoder.tokenize(text) and seg.wire_ids.count(encoder.vision.video_pad) == 1
    assert seg.train_ids == _reference_ids(name, encoder, text, [clip])
    assert seg.train_ids.count(encoder.vision.video_pad) == int(seg.mm_inputs["video_grid_thw"].prod()) // 4
    if name == "qwen3_vl":
        assert "seconds>" in encoder.tokenizer.decode(seg.train_ids)
        assert "second_per_grid_ts" not in seg.mm_inputs
    else:
        assert seg.mm_inputs["second_per_grid_ts"].tolist() == [pytest.approx(2 / clip.fps)]
    # The engine gets the exact frames and rate back from the wire.
    (url,) = seg.video_data
    back = load_clip(url)
    assert np.array_equal(back.frames, clip.frames) and back.fps == clip.fps
    assert seg.image_data == []


def test_an_observation_with_a_picture_and_a_clip_after_a_clip_prompt(family, make_test_image):
    """Mixed turns: the observation's delta equals transformers' expansion of the template's rendering of the
    whole episode after the first turn, its tensors carry both modalities, and the wire view re-renders."""
    name, _, encoder = family
    first, second = _clip(2, 6), _clip(3, 5, size=(64, 48), fps=2.5)
    prompt = [{"role": "user", "content": [{"type": "video", "video": first}, {"type": "text", "text": "Look."}]}]
    observation = {"role": "user", "content": [{"type": "image", "image": make_test_image(4, (64, 64))},
                                               {"type": "video", "video": second}, {"type": "text", "text": "Again."}]}
    p = encoder.encode_prompt(prompt)
    model_ids = encoder.tokenize("left") + [encoder.vision.im_end]
    obs = encoder.encode_observation([observation])
    assert obs.wire_ids.count(encoder.vision.video_pad) == 1 and len(obs.video_data) == len(obs.image_data) == 1
    assert set(obs.mm_inputs) >= {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    whole = encoder.rerender_conversation(prompt, [(model_ids, [observation])])
    wire = p.wire_ids + model_ids + obs.wire_ids
    assert check_prefix_stability(encoder, wire, whole, "strict")
    train = p.train_ids + model_ids + obs.train_ids
    reference = encoder.expand_image_pads(_reference_ids(name, encoder, whole, [first, second]),
                                          obs.mm_inputs["image_grid_thw"])
    assert train == reference


def test_a_clip_seen_before_is_neither_decoded_nor_processed_again(family):
    """Every turn re-sends the episode's clips as data URLs: the second encoding of the same URL is a cache hit with
    the same tensors and tokens; a different clip misses."""
    _, _, encoder = family
    clip = _clip(8, 6)
    reads = []

    def read(url):
        reads.append(url)
        return load_clip(url)

    (url,), first, tokens = encoder.encode_clips([clip])
    hits = encoder.clips.hits
    (same,), again, tokens_again = encoder.encode_clips([url], read)
    assert same == url and reads == [] and encoder.clips.hits == hits + 1 and tokens_again == tokens
    for key in first:
        np.testing.assert_array_equal(again[key], first[key])
    encoder.encode_clips([clip_to_data_url(_clip(9, 6))], read)
    assert len(reads) == 1  # a new clip is read


def test_a_clip_object_is_written_to_its_url_once_per_distinct_content(family, monkeypatch):
    """An env hands the same frames to every sample of a group: the MP4 is written once, and the URL is exactly
    the one `clip_to_data_url` writes; the same array with new frames, or another rate, is a new clip."""
    _, _, encoder = family
    written = []

    def counting(clip):
        written.append(clip)
        return clip_to_data_url(clip)

    monkeypatch.setattr(video_io, "clip_to_data_url", counting)
    clip = _clip(11, 4)
    (url,), _, _ = encoder.encode_clips([clip])
    (again,), _, _ = encoder.encode_clips([Clip(clip.frames.copy(), clip.fps)])  # another object, same content
    assert again == url == clip_to_data_url(clip) and len(written) == 1
    frames = clip.frames.copy()
    frames[0, 0, 0, 0] ^= 1
    (changed,), _, _ = encoder.encode_clips([Clip(frames, clip.fps)])
    (slower,), _, _ = encoder.encode_clips([Clip(clip.frames, clip.fps / 2)])
    assert len({url, changed, slower}) == 3 and len(written) == 3
    with pytest.raises(ClipError, match="uint8"):
        encoder.encode_clips([Clip(clip.frames.astype(np.float32), clip.fps)])


def test_observations_carry_clips_through_the_env_contract():
    class Env(BaseInteractionEnv):
        def reset(self):
            return None

        def step(self, text):
            return {}, True, {}

    clip = _clip(5, 4)
    message = Env().format_observation({"obs_str": "Watch.", "multi_modal_data": {"video": [clip]}})
    assert message["content"] == [{"type": "video", "video": clip}, {"type": "text", "text": "Watch."}]
    with pytest.raises(TypeError, match=r"\['video'\]\[0\] must be a rollout.video.Clip"):
        Env().format_observation({"obs_str": "x", "multi_modal_data": {"video": [np.zeros((2, 4, 4, 3))]}})
    with pytest.raises(ValueError, match="unsupported keys \\['audio'\\]"):
        Env().format_observation({"obs_str": "x", "multi_modal_data": {"audio": []}})


def test_clips_are_refused_by_name_without_a_video_processor_and_in_sft(family):
    _, out, encoder = family
    plain = ChatEncoder(encoder.tokenizer, encoder.image_processor)
    messages = [{"role": "user", "content": [{"type": "video", "video": _clip(6, 4)}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ClipError, match="no video_preprocessor_config.json"):
        plain.encode_prompt(messages)
    with pytest.raises(TranscriptError, match="clips in SFT conversations"):
        encode_transcript(encoder, [*messages, {"role": "assistant", "content": "left"}])
