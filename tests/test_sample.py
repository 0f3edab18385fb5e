"""The Sample contract (DESIGN.md §4): append helpers, validate(), status rules, JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout.sample import (
    FINISH_REASON_STATUS,
    Sample,
    SampleError,
    Status,
    Termination,
    TerminationKind,
    TruncationCause,
    TurnRecord,
    image_pad_runs,
)

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


# ----------------------------------------------------------------------------- typed outcomes
@pytest.mark.parametrize("kind", list(TerminationKind))
def test_termination_strings_round_trip_and_give_the_status(kind):
    causes = list(TruncationCause) if kind is TerminationKind.TRUNCATED else [None]
    for cause in causes:
        t = Termination(kind, cause)
        assert Termination.parse(str(t)) == t
        assert t.metric_name == str(t).replace(":", "/")
        expected = {"env_done": Status.COMPLETED, "max_turns": Status.COMPLETED, "truncated": Status.TRUNCATED,
                    "abort": Status.ABORTED, "weight_update_rerun": Status.ABORTED}.get(kind.value, Status.FAILED)
        assert t.status is expected


def test_termination_needs_a_cause_exactly_when_truncated():
    assert str(Termination.truncated(TruncationCause.LENGTH)) == "truncated:length"
    with pytest.raises(SampleError, match="truncation cause is required"):
        Termination(TerminationKind.TRUNCATED)
    with pytest.raises(SampleError, match="truncation cause is required"):
        Termination(TerminationKind.ENV_DONE, TruncationCause.LENGTH)
    for bad in ("truncated", "done", "truncated:tired", "abort:length"):
        with pytest.raises(ValueError, match=f"unknown termination '{bad}'"):
            Termination.parse(bad)
    assert TruncationCause.CONTEXT.by_observation() is TruncationCause.OBSERVATION_EXCEEDS_CONTEXT


def test_termination_and_truncation_cause_round_trip_through_json():
    s = _episode()
    s.turns = [TurnRecord(turn=0, generated_tokens=3, truncation_cause=TruncationCause.RESPONSE_BUDGET)]
    s.set_status(Status.TRUNCATED)
    s.termination = Termination.truncated(TruncationCause.RESPONSE_BUDGET)
    data = json.loads(json.dumps(s.to_dict()))
    assert data["termination"] == "truncated:response_budget"
    assert data["turns"][0]["truncation_cause"] == "response_budget"
    back = Sample.from_dict(data)
    back.validate()
    assert back.termination == s.termination and back.turns == s.turns
    assert back.turns[0].truncation_cause is TruncationCause.RESPONSE_BUDGET


def test_dicts_from_before_the_typed_field_move_the_metadata_string_over():
    s = _episode()
    s.set_status(Status.COMPLETED)
    old = {k: v for k, v in s.to_dict().items() if k != "termination"}
    old["metadata"] = {"termination": "env_done", "tools": []}
    back = Sample.from_dict(old)
    assert back.termination == Termination(TerminationKind.ENV_DONE) and back.metadata == {"tools": []}
    old["metadata"] = {"termination": "my_custom_end"}  # not ours: left where it was
    back = Sample.from_dict(old)
    assert back.termination is None and back.metadata == {"termination": "my_custom_end"}


def test_validate_checks_termination_against_status_and_resume_clears_it():
    s = _episode()
    s.set_status(Status.ABORTED)
    s.termination = Termination(TerminationKind.ENV_DONE)
    with pytest.raises(SampleError, match="termination env_done gives status completed, but the status is aborted"):
        s.validate()
    s.termination = Termination(TerminationKind.ABORT)
    s.validate()
    s.set_status(Status.PENDING)  # a partial rollout resumes the episode
    assert s.termination is None
    s.validate()
