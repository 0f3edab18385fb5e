"""The Sample contract (DESIGN.md §4): append helpers, validate(), status rules, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout.sample import FINISH_REASON_STATUS, Sample, SampleError, Status, TurnRecord, image_pad_runs

IMG, VS, VE = 7, 5, 6  # image pad, vision start, vision end ids of a made-up vocabulary


def _episode() -> Sample:
    s = Sample(group_index=3, index=1, prompt=[{"role": "user", "content": "q"}], label="12")
    s.set_prompt_tokens([1, 2, 3])
    s.append_model_tokens([10, 11], [-0.5, -0.25])
    s.append_observation_tokens([20, 21, 22])
    s.append_model_tokens([12], [-1.0])
    return s


def test_appends_keep_masks_and_log_probs_aligned_with_response():
    s = _episode()
    s.validate()
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert s.response_length == 6 and s.prompt_length == 3
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]


def test_model_tokens_require_one_finite_log_prob_each():
    s = Sample()
    with pytest.raises(SampleError, match="2 model tokens but 1 log-probs"):
        s.append_model_tokens([1, 2], [-0.1])
    with pytest.raises(SampleError, match="2 model tokens but None"):
        s.append_model_tokens([1, 2], None)
    with pytest.raises(SampleError, match="invalid model-token log-prob"):
        s.append_model_tokens([1], [float("nan")])
    with pytest.raises(SampleError, match="invalid model-token log-prob"):
        s.append_model_tokens([1], [0.5])
    assert s.response_length == 0 and s.tokens == []


def test_validate_catches_each_broken_invariant():
    s = _episode()
    s.loss_mask.append(1)
    with pytest.raises(SampleError, match="len\\(loss_mask\\)=7 != response_length=6"):
        s.validate()
    s = _episode()
    s.rollout_log_probs.pop()
    with pytest.raises(SampleError, match="len\\(rollout_log_probs\\)"):
        s.validate()
    s = _episode()
    s.rollout_log_probs[2] = -0.3  # an observation token with a log-prob
    with pytest.raises(SampleError, match="rollout_log_probs\\[2\\]=-0.3 where loss_mask is 0"):
        s.validate()
    s = _episode()
    s.loss_mask[0] = 2
    with pytest.raises(SampleError, match="not 0/1"):
        s.validate()
    s = _episode()
    s.response_length = 100
    with pytest.raises(SampleError, match="response_length 100 outside"):
        s.validate()


def test_status_transitions():
    s = _episode()
    s.set_status(Status.TRUNCATED)
    s.set_status(Status.PENDING)  # partial rollout resumes a truncated episode
    s.set_status(Status.COMPLETED)
    with pytest.raises(SampleError, match="illegal status transition completed -> failed"):
        s.set_status(Status.FAILED)
    with pytest.raises(SampleError, match="append to a finished episode"):
        s.append_observation_tokens([1])
    f = Sample()
    f.set_status(Status.FAILED)
    with pytest.raises(SampleError, match="failed -> pending"):
        f.set_status(Status.PENDING)
    assert FINISH_REASON_STATUS == {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def test_prompt_tokens_cannot_change_after_response():
    s = _episode()
    with pytest.raises(SampleError, match="prompt tokens set after 6 response tokens"):
        s.set_prompt_tokens([1])


def _image_sample(pads_per_image: list[int], grids: list[list[int]]) -> Sample:
    tokens = [1]
    for n in pads_per_image:
        tokens += [VS] + [IMG] * n + [VE, 2]
    s = Sample()
    s.set_prompt_tokens(tokens)
    s.image_data = [f"data:image/png;base64,{i}" for i in range(len(pads_per_image))]
    grid = np.asarray(grids, dtype=np.int64)
    patches = int(np.prod(grid, axis=1).sum())
    s.multimodal_train_inputs = {"pixel_values": np.zeros((patches, 12), np.float32), "image_grid_thw": grid}
    return s


def test_image_placeholders_must_match_images_and_grids():
    good = _image_sample([4, 6], [[1, 4, 4], [1, 4, 6]])  # 16/4 = 4 pads, 24/4 = 6 pads
    good.validate(image_token_id=IMG, vision_start_token_id=VS)
    assert image_pad_runs(good.tokens, IMG) == [(2, 4), (9, 6)]

    wrong_count = _image_sample([4, 6], [[1, 4, 4], [1, 4, 6]])
    wrong_count.image_data.pop()
    with pytest.raises(SampleError, match="2 image placeholders in tokens but 1 images"):
        wrong_count.validate(image_token_id=IMG)

    wrong_pads = _image_sample([4, 5], [[1, 4, 4], [1, 4, 6]])
    with pytest.raises(SampleError, match="image 1 has 5 pads, grid \\[1, 4, 6\\] needs 6"):
        wrong_pads.validate(image_token_id=IMG)

    wrong_patches = _image_sample([4], [[1, 4, 4]])
    wrong_patches.multimodal_train_inputs["pixel_values"] = np.zeros((15, 12), np.float32)
    with pytest.raises(SampleError, match="pixel_values has 15 patch rows, grid needs 16"):
        wrong_patches.validate(image_token_id=IMG)

    no_start = Sample()
    no_start.set_prompt_tokens([1, IMG, IMG, VE])
    no_start.image_data = ["x"]
    with pytest.raises(SampleError, match="not preceded by vision_start"):
        no_start.validate(image_token_id=IMG, vision_start_token_id=VS)


def test_multimodal_values_must_be_arrays():
    s = _episode()
    s.multimodal_train_inputs = {"pixel_values": [[0.0]]}
    with pytest.raises(SampleError, match="multimodal_train_inputs\\['pixel_values'\\] is list"):
        s.validate()


def test_json_round_trip_preserves_everything_including_arrays():
    s = _image_sample([4], [[1, 4, 4]])
    s.append_model_tokens([30, 31], [-0.1, -2.5])
    s.multimodal_train_inputs["pixel_values"] = np.random.default_rng(0).normal(size=(16, 12)).astype(np.float32)
    s.turns = [TurnRecord(turn=0, generated_tokens=2, finish_reason="stop", env_latency_s=0.01)]
    s.weight_versions = ["3"]
    s.metadata = {"tools": [{"name": "calc"}], "mask": np.arange(4, dtype=np.int32)}
    s.reward = 1.0
    s.set_status(Status.COMPLETED)

    text = json.dumps(s.to_dict())
    back = Sample.from_dict(json.loads(text))
    back.validate(image_token_id=IMG, vision_start_token_id=VS)
    assert back.tokens == s.tokens and back.loss_mask == s.loss_mask
    assert back.rollout_log_probs == s.rollout_log_probs
    assert back.status is Status.COMPLETED and back.reward == 1.0
    assert back.turns == s.turns and back.weight_versions == ["3"]
    for key, value in s.multimodal_train_inputs.items():
        np.testing.assert_array_equal(back.multimodal_train_inputs[key], value)
        assert back.multimodal_train_inputs[key].dtype == value.dtype
    np.testing.assert_array_equal(back.metadata["mask"], s.metadata["mask"])


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(SampleError, match="unknown keys \\['bogus'\\]"):
        Sample.from_dict({"bogus": 1})
