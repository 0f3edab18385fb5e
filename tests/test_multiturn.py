"""The episode loop against a real (scripted) SGLang-speaking server on loopback.

Covers every termination path, the budget arithmetic (property-tested), env and engine failures, and the
one-time merge of multimodal tensors.
"""

from __future__ import annotations

import asyncio
import itertools
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.base import BaseInteractionEnv
from rollout.client import RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.fake_engine import Abort, Drop, FakeSGLangServer, Hang, Respond, Tokens
from rollout.multiturn import RolloutContext, generate, merge_multimodal_chunks
from rollout.sample import Sample, Status, Termination, TerminationKind, TruncationCause


# ----------------------------------------------------------------------------- scripted environment
class ScriptedEnv(BaseInteractionEnv):
    """Each step pops one action: ("obs", text, n_images), ("done",), ("raise", msg), ("hang",)."""

    def __init__(self, plan: list[tuple], make_image, recoverable: bool = False, verdict_value: float | None = 1.0):
        self.plan = list(plan)
        self.make_image = make_image
        self.recoverable = recoverable
        self.verdict_value = verdict_value
        self.steps: list[str] = []
        self.resets = 0
        self.closed = 0

    def reset(self) -> None:
        self.resets += 1

    async def step(self, response_text: str):
        self.steps.append(response_text)
        action = self.plan.pop(0) if self.plan else ("obs", "continue", 0)
        kind = action[0]
        if kind == "raise":
            raise RuntimeError(action[1])
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "done":
            return {"obs_str": ""}, True, {}
        _, text, n_images = action
        images = [self.make_image(len(self.steps) * 10 + k, 64) for k in range(n_images)]
        obs = {"obs_str": text}
        if images:
            obs["multi_modal_data"] = {"image": images}
        return obs, False, {"turn": len(self.steps)}

    def verdict(self):
        return self.verdict_value

    def close(self) -> None:
        self.closed += 1


def _env_module(env: ScriptedEnv) -> types.ModuleType:
    module = types.ModuleType("scripted_env")
    module.build_env = lambda sample, args: env
    module.reward_fn = lambda text, label: float(label in text)
    return module


def _args(ctx: RolloutContext, **overrides: Any) -> types.SimpleNamespace:
    base = dict(
        rollout_max_response_len=200, rollout_max_context_len=None, max_turns=3, max_env_retries_per_turn=1,
        env_step_timeout=5.0, episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0,
        rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=False,
        rollout_context=ctx,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor):
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


def _model_reply(encoder: ChatEncoder, text: str = "the answer is 7") -> Tokens:
    ids = encoder.tokenize(text) + [encoder.vision.im_end]
    return Tokens(output_ids=tuple(ids), log_probs=tuple(-0.1 * (k + 1) for k in range(len(ids))))


def _prompt_sample(make_image, with_image: bool = True) -> Sample:
    from rollout.processing import image_to_data_url

    content: list[dict] = [{"type": "text", "text": "Find x."}]
    if with_image:
        content.insert(0, {"type": "image", "image": image_to_data_url(make_image(0, 64))})
    return Sample(prompt=[{"role": "user", "content": content}], label="7")


async def _run(encoder, env, sample, script=None, generate_fn=None, client_retries: int = 0, privileged=None,
               **arg_overrides):
    server = FakeSGLangServer(
        script=script,
        generate_fn=generate_fn or (lambda body: _model_reply(encoder)),
        eos_token_id=encoder.vision.im_end,
        image_token_id=encoder.vision.image_pad,
    )
    async with server:
        client = SGLangClient(server.url, timeout_s=1.0, retry=RetryPolicy(max_retries=client_retries, backoff_base_s=0.01, backoff_max_s=0.02))
        async with client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=_env_module(env),
                                 generate_slots=asyncio.Semaphore(8), privileged=privileged)
            out = await generate(_args(ctx, **arg_overrides), sample)
    return out, server


def _check_alignment(sample: Sample, encoder: ChatEncoder) -> None:
    sample.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)


# ----------------------------------------------------------------------------- termination paths
async def test_env_done_completes_and_closes_env(encoder, make_test_image):
    env = ScriptedEnv([("obs", "wrong, try again", 1), ("done",)], make_test_image)
    s, server = await _run(encoder, env, _prompt_sample(make_test_image))
    assert s.status is Status.COMPLETED and str(s.termination) == "env_done"
    assert env.closed == 1 and env.resets == 1 and len(env.steps) == 2
    assert s.reward == 1.0 and s.metadata["reward_source"] == "env_verdict"
    _check_alignment(s, encoder)
    assert len(s.image_data) == 2  # prompt image + observation image
    assert s.multimodal_train_inputs["image_grid_thw"].shape == (2, 3)
    # Every request carried all images so far and compact pads only.
    reqs = server.requests_to("/generate")
    assert [len(r.body.get("image_data", [])) for r in reqs] == [1, 2]
    for r in reqs:
        assert r.body["input_ids"].count(encoder.vision.image_pad) == len(r.body["image_data"])
        assert r.body["sampling_params"]["logit_bias"] == {str(t): -1.0e9 for t in encoder.vision.banned_ids}
    # The env saw the model's own text only, never special tokens.
    assert env.steps == ["the answer is 7", "the answer is 7"]
    assert s.metadata["prefix_stable"] is True


class OpeningEnv(ScriptedEnv):
    """A ScriptedEnv whose reset opens the episode with a line of text and a picture."""

    def reset(self):
        super().reset()
        return {"obs_str": "You see a card.", "multi_modal_data": {"image": [self.make_image(99, 64)]}}


async def test_self_distillation_renders_the_prompt_again_with_the_privileged_text(encoder, make_test_image):
    """--opd-type self: the finished episode carries its prompt (with the env's opening) rendered with the
    privileged text at the end of the first user turn; a label without the field fails that sample by name."""
    from rollout.privileged import PrivilegedView

    view = PrivilegedView("label", "The answer is {privileged}.")
    env = OpeningEnv([("obs", "wrong, try again", 1), ("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), privileged=view)
    assert s.status is Status.COMPLETED
    student = encoder.tokenizer.decode(s.tokens[: s.prompt_length])
    teacher = encoder.tokenizer.decode(s.privileged_prompt_tokens)
    assert "You see a card." in student  # the env's opening is in both
    assert teacher == student.replace("<|im_end|>", "\nThe answer is 7.<|im_end|>", 1)
    pad = encoder.vision.image_pad
    assert s.privileged_prompt_tokens.count(pad) == s.tokens[: s.prompt_length].count(pad) > 0
    s.validate()

    bad = _prompt_sample(make_test_image)
    bad.label = {"answer": "7"}
    env = OpeningEnv([("done",)], make_test_image)
    s, _ = await _run(encoder, env, bad, privileged=PrivilegedView("label.hint", "{privileged}"))
    assert s.status is Status.FAILED and str(s.termination) == "finalize_error"
    assert "--opsd-privileged-field label.hint" in s.metadata["error"]
    assert env.closed == 1


async def test_max_turns_completes_without_an_unanswered_observation(encoder, make_test_image):
    env = ScriptedEnv([("obs", "more", 0)] * 5, make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_turns=2)
    assert s.status is Status.COMPLETED and str(s.termination) == "max_turns"
    assert len(s.turns) == 2
    # The response ends with the model's <|im_end|>: the last observation was not appended.
    assert s.tokens[-1] == encoder.vision.im_end and s.loss_mask[-1] == 1
    _check_alignment(s, encoder)


async def test_length_finish_truncates(encoder, make_test_image):
    long_reply = Tokens(output_ids=tuple(encoder.tokenize("word " * 50)))
    env = ScriptedEnv([], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), generate_fn=lambda b: long_reply,
                      rollout_max_response_len=1000)
    # Without a stop token the fake engine reports `length` (max_new_tokens not reached means the model stopped early).
    assert s.status is Status.TRUNCATED and str(s.termination) == "truncated:length"
    # Typed outcome on the sample and its last turn record; nothing left to parse in the metadata.
    assert s.termination == Termination(TerminationKind.TRUNCATED, TruncationCause.LENGTH)
    assert s.turns[-1].truncation_cause is TruncationCause.LENGTH and "termination" not in s.metadata
    assert env.steps == [] and env.closed == 1
    _check_alignment(s, encoder)


async def test_a_turn_cut_at_max_tokens_per_turn_is_closed_and_judged(encoder, make_test_image):
    """--max-tokens-per-turn: a reply cut at the cap goes to the env (its delta closes the assistant turn) and the
    episode goes on; the budget still binds when it is the smaller limit."""
    long_reply = Tokens(output_ids=tuple(encoder.tokenize("word " * 50)))
    env = ScriptedEnv([("obs", "again", 0)] * 3 + [("done",)], make_test_image)
    s, server = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_turns=10,
                           generate_fn=lambda b: long_reply, rollout_max_response_len=1000, max_tokens_per_turn=8)
    assert s.status is Status.COMPLETED and str(s.termination) == "env_done"
    assert [r.body["sampling_params"]["max_new_tokens"] for r in server.requests_to("/generate")] == [8] * 4
    assert len(env.steps) == 4 and all(r.finish_reason == "length" for r in s.turns)
    _check_alignment(s, encoder)  # each cut turn was closed with <|im_end|> before its observation (mask 0)
    end = encoder.vision.im_end
    response = s.tokens[s.prompt_length:]
    closing = [i for i in range(1, len(response)) if response[i] == end and s.loss_mask[i] == 0 and s.loss_mask[i - 1] == 1]
    assert len(closing) == 3
    # The budget binds first: the turn that reaches it ends the episode TRUNCATED.
    env = ScriptedEnv([("obs", "again", 0)] * 10, make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_turns=10,
                      generate_fn=lambda b: long_reply, rollout_max_response_len=30, max_tokens_per_turn=8)
    assert s.status is Status.TRUNCATED and s.response_length <= 30


async def test_budget_clips_max_new_tokens_and_truncates_with_cause(encoder, make_test_image):
    env = ScriptedEnv([("obs", "again", 0)] * 10, make_test_image)
    s, server = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_turns=10, rollout_max_response_len=30)
    assert s.status is Status.TRUNCATED
    assert s.response_length <= 30
    max_news = [r.body["sampling_params"]["max_new_tokens"] for r in server.requests_to("/generate")]
    assert max_news[0] == 30 and all(b < a for a, b in zip(max_news, max_news[1:]))
    assert str(s.termination) in ("truncated:response_budget", "truncated:observation_exceeds_response_budget")
    _check_alignment(s, encoder)


async def test_observation_that_does_not_fit_ends_episode(encoder, make_test_image):
    env = ScriptedEnv([("obs", "a very long observation " * 20, 0)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), rollout_max_response_len=40)
    assert s.status is Status.TRUNCATED and str(s.termination) == "truncated:observation_exceeds_response_budget"
    assert s.turns[-1].observation_tokens > 40 - s.response_length
    assert sum(s.loss_mask) == s.response_length  # only the model turn was appended
    _check_alignment(s, encoder)


async def test_context_limit_binds(encoder, make_test_image):
    env = ScriptedEnv([("obs", "again", 0)] * 10, make_test_image)
    sample = _prompt_sample(make_test_image, with_image=False)
    s, server = await _run(encoder, env, sample, max_turns=10, rollout_max_response_len=1000, rollout_max_context_len=60)
    assert s.status is Status.TRUNCATED and s.termination.cause in (
        TruncationCause.CONTEXT, TruncationCause.OBSERVATION_EXCEEDS_CONTEXT)
    assert len(s.tokens) <= 60
    first = server.requests_to("/generate")[0]
    assert first.body["sampling_params"]["max_new_tokens"] == 60 - s.prompt_length


async def test_engine_abort_marks_aborted(encoder, make_test_image):
    env = ScriptedEnv([], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False),
                      script=[Abort(output_ids=tuple(encoder.tokenize("partial")))])
    assert s.status is Status.ABORTED and str(s.termination) == "abort"
    assert s.response_length == len(encoder.tokenize("partial")) and env.closed == 1


# ----------------------------------------------------------------------------- failures
async def test_env_raising_exhausts_retries_and_fails_without_crashing(encoder, make_test_image):
    env = ScriptedEnv([("raise", "boom 1"), ("raise", "boom 2"), ("raise", "boom 3")], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_env_retries_per_turn=2)
    assert s.status is Status.FAILED and str(s.termination) == "env_error"
    assert "boom 3" in s.metadata["error"] and len(s.metadata["env_errors"]) == 3
    assert s.turns[-1].env_retries == 2 and env.closed == 1
    assert env.resets == 1  # not recoverable: retried without reset


async def test_recoverable_env_is_reset_and_retried(encoder, make_test_image):
    env = ScriptedEnv([("raise", "flaky"), ("done",)], make_test_image, recoverable=True)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), max_env_retries_per_turn=2)
    assert s.status is Status.COMPLETED and env.resets == 2 and s.turns[0].env_retries == 1


async def test_hanging_env_times_out_then_fails(encoder, make_test_image):
    env = ScriptedEnv([("hang",), ("hang",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), env_step_timeout=0.2, max_env_retries_per_turn=1)
    assert s.status is Status.FAILED and "timed out" in s.metadata["error"] and env.closed == 1


async def test_server_503_then_success(encoder, make_test_image):
    env = ScriptedEnv([("done",)], make_test_image)
    s, server = await _run(encoder, env, _prompt_sample(make_test_image), script=[Respond(503, "busy"), Respond(503, "busy")], client_retries=3)
    assert s.status is Status.COMPLETED
    assert len(server.requests_to("/generate")) == 3


async def test_server_dropping_connection_is_retried(encoder, make_test_image):
    env = ScriptedEnv([("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), script=[Drop()], client_retries=2)
    assert s.status is Status.COMPLETED


async def test_unreachable_engine_fails_episode_with_error(encoder, make_test_image):
    env = ScriptedEnv([("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), script=[Hang(), Hang()], client_retries=1)
    assert s.status is Status.FAILED and str(s.termination) == "engine_error"
    assert "/generate" in s.metadata["error"] and env.closed == 1


async def test_episode_wall_clock_limit(encoder, make_test_image):
    env = ScriptedEnv([("hang",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), env_step_timeout=60, episode_timeout=0.3)
    assert s.status is Status.FAILED and str(s.termination) == "episode_timeout" and env.closed == 1


async def test_banned_token_from_engine_fails_episode(encoder, make_test_image):
    bad = Tokens(output_ids=(encoder.vision.image_pad, encoder.vision.im_end))
    env = ScriptedEnv([("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), generate_fn=lambda b: bad)
    assert s.status is Status.FAILED and str(s.termination) == "banned_token"


async def test_reward_fn_sees_model_text_only(encoder, make_test_image):
    # The observation contains the label; the model never says it: reward must be 0.
    env = ScriptedEnv([("obs", "the answer is 7", 0), ("done",)], make_test_image, verdict_value=None)
    reply = Tokens(output_ids=tuple(encoder.tokenize("I think 3") + [encoder.vision.im_end]))
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), generate_fn=lambda b: reply)
    assert s.reward == 0.0 and s.metadata["reward_source"] == "reward_fn"
    assert "the answer is 7" in s.response  # the observation is in the transcript...


# ----------------------------------------------------------------------------- one-time merge
async def test_twenty_turn_episode_with_image_every_turn_merges_once(encoder, make_test_image):
    env = ScriptedEnv([("obs", f"look {k}", 1) for k in range(19)] + [("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image), max_turns=20, rollout_max_response_len=20000)
    assert s.status is Status.COMPLETED and len(s.turns) == 20
    mm = s.multimodal_train_inputs
    assert set(mm) == {"pixel_values", "image_grid_thw"}
    assert mm["image_grid_thw"].shape == (20, 3)  # 1 prompt image + 19 observation images
    assert mm["pixel_values"].shape[0] == int(np.prod(mm["image_grid_thw"], axis=1).sum())
    _check_alignment(s, encoder)


def test_merge_rejects_inconsistent_keys_and_non_arrays():
    a = {"pixel_values": np.zeros((4, 2)), "image_grid_thw": np.ones((1, 3))}
    with pytest.raises(ValueError, match="chunk 1 has image keys"):
        merge_multimodal_chunks([a, {"pixel_values": np.zeros((4, 2))}], "s")
    with pytest.raises(TypeError, match="not ndarray"):
        merge_multimodal_chunks([a, {"pixel_values": [1], "image_grid_thw": np.ones((1, 3))}], "s")
    assert merge_multimodal_chunks([], "s") is None
    merged = merge_multimodal_chunks([a, {}, a], "s")
    assert merged["pixel_values"].shape == (8, 2)


def test_merge_takes_pictures_and_clips_from_the_turns_that_show_them():
    """A prompt with a picture, an observation with a clip, one with both: each key concatenated over the turns
    that have it, in turn order; a clip without the second_per_grid_ts the others carry is refused."""
    pic = {"pixel_values": np.zeros((4, 2)), "image_grid_thw": np.ones((1, 3))}
    clip = {"pixel_values_videos": np.ones((8, 2)), "video_grid_thw": np.full((1, 3), 2),
            "second_per_grid_ts": np.ones(1, np.float32)}
    both = {**pic, **{k: v + 1 for k, v in clip.items()}}
    merged = merge_multimodal_chunks([pic, clip, both], "s")
    assert merged["pixel_values"].shape == (8, 2) and merged["image_grid_thw"].shape == (2, 3)
    assert merged["pixel_values_videos"][:, 0].tolist() == [1] * 8 + [2] * 8
    assert merged["second_per_grid_ts"].tolist() == [1, 2]
    no_seconds = {k: v for k, v in clip.items() if k != "second_per_grid_ts"}
    with pytest.raises(ValueError, match="chunk 1 has video keys .* chunk 0 has"):
        merge_multimodal_chunks([clip, no_seconds], "s")


# ----------------------------------------------------------------------------- budget property
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reply_lens=st.lists(st.integers(1, 25), min_size=1, max_size=6),
    obs_words=st.lists(st.integers(0, 12), min_size=6, max_size=6),
    budget=st.integers(5, 120),
    stop_early=st.booleans(),
)
def test_budget_property(encoder, make_test_image, reply_lens, obs_words, budget, stop_early):
    """Random turn lengths: the response never exceeds the budget and masks/log-probs align with tokens."""
    word = encoder.tokenize(" x")
    replies = itertools.cycle(reply_lens)

    def gen(body):
        n = next(replies)
        ids = (word * n)[:n] + ([encoder.vision.im_end] if stop_early else [])
        return Tokens(output_ids=tuple(ids), log_probs=tuple(-0.01 * (i + 1) for i in range(len(ids))))

    plan = [("obs", "y " * w, 0) for w in obs_words]
    env = ScriptedEnv(plan, make_test_image)
    s, server = asyncio.run(_run(encoder, env, _prompt_sample(make_test_image, with_image=False), generate_fn=gen,
                                 max_turns=6, rollout_max_response_len=budget))
    assert s.status in (Status.COMPLETED, Status.TRUNCATED)
    assert s.response_length <= budget
    _check_alignment(s, encoder)
    # Each request asked for no more than what was left of the budget.
    for req in server.requests_to("/generate"):
        sent = len(req.body["input_ids"])
        assert req.body["sampling_params"]["max_new_tokens"] <= budget - (sent - s.prompt_length)
    # Model tokens carry their log-probs, observation tokens carry 0 and mask 0.
    lp = np.array(s.rollout_log_probs)
    mask = np.array(s.loss_mask)
    assert np.all(lp[mask == 1] < 0) and np.all(lp[mask == 0] == 0)


async def test_truncated_turn_text_still_reaches_the_reward(encoder, make_test_image):
    # The only turn is cut by `length`: the env never steps, so the reward_fn grades the partial text.
    env = ScriptedEnv([], make_test_image, verdict_value=None)
    reply = Tokens(output_ids=tuple(encoder.tokenize("so the answer is 7 and")))
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), generate_fn=lambda b: reply)
    assert s.status is Status.TRUNCATED and s.reward == 1.0 and s.metadata["model_text"] == ["so the answer is 7 and"]


async def test_model_stopping_with_endoftext_stays_on_template(encoder, tiny_tokenizer, make_test_image):
    endoftext = tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext in encoder.vision.eos_ids and endoftext != encoder.vision.im_end
    reply = Tokens(output_ids=tuple(encoder.tokenize("first try") + [endoftext]))
    env = ScriptedEnv([("obs", "again", 0), ("done",)], make_test_image)
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False), generate_fn=lambda b: reply)
    assert s.status is Status.COMPLETED and s.metadata["prefix_stable"] is True
    # The sampled <|endoftext|> is kept (mask 1) and the delta closes the turn with <|im_end|> (mask 0).
    k = s.tokens.index(endoftext)
    assert s.tokens[k + 1] == encoder.vision.im_end
    assert s.loss_mask[k - s.prompt_length] == 1 and s.loss_mask[k + 1 - s.prompt_length] == 0


async def test_nonfinite_reward_fails_the_episode(encoder, make_test_image):
    env = ScriptedEnv([("done",)], make_test_image, verdict_value=float("nan"))
    s, _ = await _run(encoder, env, _prompt_sample(make_test_image, with_image=False))
    assert s.status is Status.FAILED and str(s.termination) == "reward_error"
    assert "non-finite reward nan" in s.metadata["error"] and s.reward is None and env.closed == 1
