"""The LLM-as-judge environment against a scripted judge: a real SGLang-speaking HTTP server on loopback.

The judge replies are scripted as token ids of the tiny tokenizer; what the env sent is checked by decoding
the recorded request ids and comparing with an independent rendering of the chat template. The tiny
processing dir has an image processor, so by default the question's image goes to the judge too.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import shutil
import socket
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from envs import llm_judge
from envs.llm_judge import (
    FORMAT_REMINDER,
    NEUTRAL_FEEDBACK,
    REDACTED,
    JudgeError,
    active_judge_clients,
    build_env,
    parse_judge_reply,
    prompt_question_text,
    redact_reference,
    shutdown_judge_clients,
    validate_prompt_template,
)
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Respond, Tokens
from rollout.processing import image_to_data_url, load_image
from rollout.sample import Sample, Status

QUESTION = "In triangle ABC the legs are 6 and 8. How long is the hypotenuse?"
REFERENCE = "10"
EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llm_judge_example.yaml"


# ----------------------------------------------------------------------------- helpers
def _im_end(tokenizer: Any) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def judge_says(tokenizer: Any, text: str) -> Tokens:
    """A judge reply: the text's ids, then the end-of-turn id (as a real engine would emit)."""
    return Tokens(output_ids=(*tokenizer.encode(text, add_special_tokens=False), _im_end(tokenizer)))


DIAGRAM = image_to_data_url(Image.new("RGB", (64, 64), (200, 30, 30)))


def _sample(label: Any = REFERENCE, image: Any = DIAGRAM) -> Sample:
    prompt = [
        {"role": "system", "content": "Call tools when you need them."},
        {"role": "user", "content": [
            {"type": "image", "image": image},
            {"type": "text", "text": QUESTION},
        ]},
    ]
    return Sample(group_index=2, index=5, prompt=prompt, label=label)


def _judge_user(text: str, n_images: int) -> dict[str, Any]:
    """The judge's user message as the chat template sees it: `n_images` image items, then the text."""
    if n_images == 0:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*[{"type": "image"}] * n_images, {"type": "text", "text": text}]}


def _args(url: str, tokenizer_dir: Path, **overrides: Any) -> types.SimpleNamespace:
    base = dict(max_turns=3, judge_url=url, judge_tokenizer_path=str(tokenizer_dir), judge_timeout_s=5.0,
                judge_max_retries=0, judge_retry_backoff_s=0.01)
    base.update(overrides)
    return types.SimpleNamespace(**base)


def _judge_server(tokenizer: Any, script: list) -> FakeSGLangServer:
    return FakeSGLangServer(script=script, eos_token_id=_im_end(tokenizer))


def _decoded_request(server: FakeSGLangServer, tokenizer: Any, k: int) -> str:
    return tokenizer.decode(server.requests_to("/generate")[k].body["input_ids"], skip_special_tokens=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- reply grammar (pure)
@pytest.mark.parametrize(
    ("reply", "correct", "feedback", "form"),
    [
        ("The legs give 10 by Pythagoras.\nVERDICT: CORRECT", True, "The legs give 10 by Pythagoras.", "verdict_line"),
        ("You added the legs.\n\n**VERDICT:** INCORRECT\n\n", False, "You added the legs.", "verdict_line"),
        ("verdict : incorrect.", False, "", "verdict_line"),
        ("`VERDICT: CORRECT`", True, "", "verdict_line"),
        ("<think>VERDICT: INCORRECT</think>Fine.\nVERDICT: CORRECT", True, "Fine.", "verdict_line"),
        ("Looks wrong, the sum is not the hypotenuse. \\boxed{incorrect}", False,
         "Looks wrong, the sum is not the hypotenuse.", "boxed"),
        ("\\boxed{ \\text{Correct} }", True, "", "boxed"),
    ],
)
def test_parse_judge_reply_accepts_the_documented_grammar(reply, correct, feedback, form):
    parsed = parse_judge_reply(reply)
    assert parsed is not None
    assert (parsed.correct, parsed.feedback, parsed.form) == (correct, feedback, form)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "I am not sure.",
        "VERDICT: CORRECT\nbut let me add one more thing",  # only the final line decides
        "VERDICT: MAYBE",
        "VERDICT: CORRECT-ish",
        "\\boxed{correct} and the answer is \\boxed{10}",  # the last box is not a verdict
        "<think>VERDICT: CORRECT</think>",  # a verdict inside the reasoning is not the verdict
        "\\boxed{correct",  # unbalanced
    ],
)
def test_parse_judge_reply_rejects_replies_without_a_final_verdict(reply):
    assert parse_judge_reply(reply) is None


def test_redaction_is_whole_word_and_case_insensitive():
    assert redact_reference("x = 3. Not 35 or 3.5x", "3") == (f"x = {REDACTED}. Not 35 or {REDACTED}.5x", True)
    assert redact_reference("The answer is Ten, not ten-ish", "ten") == (f"The answer is {REDACTED}, not {REDACTED}-ish", True)
    assert redact_reference("nothing here", "10") == ("nothing here", False)


def test_template_validation_names_the_bad_field():
    assert validate_prompt_template("{question} {response} {{literal}}") == ("question", "response")
    with pytest.raises(ValueError, match=r"unknown field \{answer\}"):
        validate_prompt_template("{question} {answer} {response}")
    with pytest.raises(ValueError, match=r"must contain \{response\}"):
        validate_prompt_template("{question} {reference}")
    with pytest.raises(ValueError, match="literal braces"):
        validate_prompt_template("{response} \\boxed{correct")


def test_question_text_is_the_user_text_items():
    assert prompt_question_text(_sample().prompt) == QUESTION
    assert prompt_question_text("plain string prompt ") == "plain string prompt"


# ----------------------------------------------------------------------------- against a scripted judge
async def test_correct_verdict_ends_the_episode_with_reward_one(tiny_tokenizer, tiny_processing_dir):
    script = [judge_says(tiny_tokenizer, "Pythagoras gives it.\nVERDICT: CORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir))
        env.reset()
        assert env.verdict() is None
        obs, done, info = await env.step("The hypotenuse is 10.")
        await env.close()
    assert done is True
    assert env.verdict() == 1.0
    assert info["verdict"] == "correct" and info["judge_format"] == "verdict_line" and info["judge_attempts"] == 1
    assert obs == {"obs_str": "Pythagoras gives it.", "role": "user"}
    params = judge.requests_to("/generate")[0].body["sampling_params"]
    assert params["max_new_tokens"] == 512 and params["temperature"] == 0.0
    assert set(params["stop_token_ids"]) == {tiny_tokenizer.eos_token_id, _im_end(tiny_tokenizer)}
    assert params["skip_special_tokens"] is True


async def test_incorrect_verdict_sends_the_judge_feedback_to_the_policy(tiny_tokenizer, tiny_processing_dir):
    feedback = "You added the legs; the hypotenuse needs the square root of the sum of squares."
    script = [judge_says(tiny_tokenizer, f"{feedback}\n**VERDICT:** INCORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir))
        obs, done, info = await env.step("It is 14.")
        await env.close()
    assert done is False
    assert env.verdict() == 0.0
    assert info["verdict"] == "incorrect"
    assert obs["obs_str"] == f"Incorrect. {feedback}"
    assert "VERDICT" not in obs["obs_str"]
    message = env.format_observation(obs)
    assert message == {"role": "user", "content": [{"type": "text", "text": obs["obs_str"]}]}


async def test_reference_leaked_by_the_judge_is_redacted(tiny_tokenizer, tiny_processing_dir):
    script = [judge_says(tiny_tokenizer, "Wrong: the right value is 10, not 14.\nVERDICT: INCORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir))
        obs, _done, info = await env.step("14")
        await env.close()
    assert obs["obs_str"] == f"Incorrect. Wrong: the right value is {REDACTED}, not 14."
    assert info["feedback_redacted"] is True


async def test_unparseable_reply_is_reasked_once_with_a_format_reminder(tiny_tokenizer, tiny_processing_dir):
    first = "Hmm, the student seems to know Pythagoras."
    script = [judge_says(tiny_tokenizer, first), judge_says(tiny_tokenizer, "Right.\nVERDICT: CORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir))
        obs, done, info = await env.step("10")
        await env.close()
    assert (done, env.verdict(), info["verdict"], info["judge_attempts"]) == (True, 1.0, "correct", 2)
    assert len(judge.requests_to("/generate")) == 2
    first_prompt = env.render_prompt("10", 1)
    expected_retry = tiny_tokenizer.apply_chat_template(
        [_judge_user(first_prompt, n_images=1), {"role": "assistant", "content": first},
         {"role": "user", "content": FORMAT_REMINDER}],
        tokenize=False, add_generation_prompt=True,
    )
    assert _decoded_request(judge, tiny_tokenizer, 1) == expected_retry


async def test_unparseable_twice_gives_neutral_feedback_and_never_counts_as_correct(tiny_tokenizer, tiny_processing_dir):
    script = [
        judge_says(tiny_tokenizer, "Not quite.\nVERDICT: INCORRECT"),
        judge_says(tiny_tokenizer, "I cannot decide."),
        judge_says(tiny_tokenizer, "Still thinking... \\boxed{10}"),
    ]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir))
        _, done1, info1 = await env.step("12")
        obs2, done2, info2 = await env.step("10")
        await env.close()
    assert (info1["verdict"], done1) == ("incorrect", False)
    assert (info2["verdict"], info2["judge_format"], info2["judge_attempts"]) == ("unparseable", None, 2)
    assert obs2 == {"obs_str": NEUTRAL_FEEDBACK, "role": "user"}
    assert done2 is False
    assert env.unparseable_turns == 1
    assert env.verdict() == 0.0  # the last parseable verdict, never a free pass

    # With no parseable verdict at all the env has no opinion (the episode then cannot be rewarded).
    script = [judge_says(tiny_tokenizer, "?"), judge_says(tiny_tokenizer, "??")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir, max_turns=1))
        _, done, info = await env.step("10")
        await env.close()
    assert (info["verdict"], done, env.verdict()) == ("unparseable", True, None)


async def test_judge_503_then_success_is_retried_by_the_client(tiny_tokenizer, tiny_processing_dir):
    script = [Respond(503, "overloaded"), judge_says(tiny_tokenizer, "VERDICT: CORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir, judge_max_retries=2))
        obs, done, info = await env.step("10")
        await env.close()
    assert (done, env.verdict(), info["judge_http_retries"]) == (True, 1.0, 1)
    assert obs["obs_str"] == "Correct."
    bodies = [r.body for r in judge.requests_to("/generate")]
    assert len(bodies) == 2 and bodies[0]["input_ids"] == bodies[1]["input_ids"]


async def test_unreachable_judge_raises_a_clear_error_and_changes_nothing(tiny_tokenizer, tiny_processing_dir):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env = build_env(_sample(), _args(url, tiny_processing_dir, judge_max_retries=1))
    assert env.recoverable is True
    with pytest.raises(JudgeError, match=rf"LLM judge at {url} \(turn 1 of 3\) failed: {url}/generate"):
        await env.step("10")
    assert (env.turn, env.verdict(), env.history) == (0, None, [])  # a retried step repeats turn 1
    env.reset()
    with pytest.raises(JudgeError, match=url):
        await env.step("10")
    await env.close()
    assert active_judge_clients() == {}


async def test_prompt_template_rendering_reaches_the_judge_as_chat_template_ids(tiny_tokenizer, tiny_processing_dir):
    template = "Q: {question}\nREF: {reference}\nA: {response}\nturn {turn}/{max_turns} {{keep braces}}"
    script = [judge_says(tiny_tokenizer, "VERDICT: INCORRECT"), judge_says(tiny_tokenizer, "VERDICT: CORRECT")]
    async with _judge_server(tiny_tokenizer, script) as judge:
        # judge_send_images=False: the sample has an image and the judge dir an image processor, yet
        # the request is text-only.
        env = build_env(_sample(), _args(judge.url, tiny_processing_dir, judge_prompt_template=template,
                                         judge_max_new_tokens=64, judge_temperature=0.7, judge_send_images=False))
        await env.step("It is 14.")
        await env.step("It is 10.")
        await env.close()
    for k, (answer, turn) in enumerate([("It is 14.", 1), ("It is 10.", 2)]):
        user_text = f"Q: {QUESTION}\nREF: {REFERENCE}\nA: {answer}\nturn {turn}/3 {{keep braces}}"
        expected = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
        assert _decoded_request(judge, tiny_tokenizer, k) == expected
        body = judge.requests_to("/generate")[k].body
        assert body["sampling_params"]["max_new_tokens"] == 64
        assert body["sampling_params"]["temperature"] == 0.7
        assert "image_data" not in body  # judge_send_images=False


async def test_judge_request_carries_the_question_images_as_the_policy_sends_them(
        tiny_tokenizer, tiny_image_processor, tiny_processing_dir, make_test_image):
    first_image = make_test_image(1, (96, 64))  # a PIL image: sent as a fresh PNG data URL
    second_image = image_to_data_url(make_test_image(2, 64))  # already a PNG data URL: sent as given
    prompt = [
        {"role": "system", "content": "Call tools when you need them."},
        {"role": "user", "content": [
            {"type": "image", "image": first_image},
            {"type": "text", "text": QUESTION},
            {"type": "image", "image": second_image},
        ]},
    ]
    sample = Sample(group_index=2, index=5, prompt=prompt, label=REFERENCE)
    pad = tiny_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    unsure = "Hard to say."
    script = [judge_says(tiny_tokenizer, unsure), judge_says(tiny_tokenizer, "VERDICT: INCORRECT")]
    # The fake judge checks, as SGLang does, one compact pad per image_data item.
    async with FakeSGLangServer(script=script, eos_token_id=_im_end(tiny_tokenizer), image_token_id=pad,
                                tokens_per_image=4) as judge:
        env = build_env(sample, _args(judge.url, tiny_processing_dir))
        _obs, _done, info = await env.step("It is 14.")
        await env.close()
    assert (info["verdict"], info["judge_attempts"]) == ("incorrect", 2)
    first, retry = (r.body for r in judge.requests_to("/generate"))
    user_text = env.render_prompt("It is 14.", 1)

    # Independent of our encoder: the judge tokenizer's own chat template on the same messages (images in
    # their original order, before the text), one <|vision_start|><|image_pad|><|vision_end|> per image.
    expected = tiny_tokenizer.apply_chat_template([_judge_user(user_text, n_images=2)], tokenize=False,
                                                  add_generation_prompt=True)
    assert _decoded_request(judge, tiny_tokenizer, 0) == expected
    assert expected.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert first["input_ids"].count(pad) == len(first["image_data"]) == 2
    expected_retry = tiny_tokenizer.apply_chat_template(
        [_judge_user(user_text, n_images=2), {"role": "assistant", "content": unsure},
         {"role": "user", "content": FORMAT_REMINDER}], tokenize=False, add_generation_prompt=True)
    assert _decoded_request(judge, tiny_tokenizer, 1) == expected_retry
    assert retry["image_data"] == first["image_data"]  # a re-ask shows the judge the same images

    # Exactly what the policy's ChatEncoder produces for the same message.
    policy_view = ChatEncoder(tiny_tokenizer, tiny_image_processor).encode_prompt([{"role": "user", "content": [
        {"type": "image", "image": first_image}, {"type": "image", "image": second_image},
        {"type": "text", "text": user_text}]}])
    assert first["input_ids"] == policy_view.wire_ids
    assert first["image_data"] == policy_view.image_data
    # The pixels the judge decodes are the question's (lossless PNG), in order.
    assert first["image_data"][0].startswith("data:image/png;base64,")
    assert np.array_equal(np.asarray(load_image(first["image_data"][0])), np.asarray(first_image.convert("RGB")))
    assert first["image_data"][1] == second_image


async def test_judge_without_an_image_processor_is_text_only_and_says_so_once(tiny_tokenizer, tiny_processing_dir,
                                                                              tmp_path, caplog):
    text_judge = tmp_path / "text_judge"
    shutil.copytree(tiny_processing_dir, text_judge)
    (text_judge / "preprocessor_config.json").unlink()
    script = [judge_says(tiny_tokenizer, "VERDICT: INCORRECT")] * 3
    with caplog.at_level(logging.WARNING, logger="envs.llm_judge"):
        async with _judge_server(tiny_tokenizer, script) as judge:
            envs = [build_env(_sample(), _args(judge.url, text_judge)) for _ in range(2)]
            for env in envs:
                await env.step("It is 14.")
            await envs[0].step("It is 12.")
            for env in envs:
                await env.close()
    bodies = [r.body for r in judge.requests_to("/generate")]
    assert len(bodies) == 3 and all("image_data" not in b for b in bodies)
    expected = tiny_tokenizer.apply_chat_template([_judge_user(envs[0].render_prompt("It is 14.", 1), n_images=0)],
                                                  tokenize=False, add_generation_prompt=True)
    assert _decoded_request(judge, tiny_tokenizer, 0) == expected
    notes = [r.getMessage() for r in caplog.records if "NOT sent" in r.getMessage()]
    assert len(notes) == 1, notes  # once per judge dir, not per env or turn
    assert str(text_judge) in notes[0] and "no preprocessor_config.json" in notes[0]


def _truncated_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()[:60]).decode("ascii")


@pytest.mark.parametrize("image", ["data:image/png;base64,AAAA", _truncated_png()], ids=["not_an_image", "truncated"])
def test_corrupt_question_image_fails_build_env_naming_the_sample(tiny_processing_dir, image):
    with pytest.raises(ValueError, match=r"llm_judge build_env: sample\(group=2, index=5\): data URL .*cannot decode"):
        build_env(_sample(image=image), _args("http://127.0.0.1:1", tiny_processing_dir))
    # Images the judge is not sent are never decoded.
    env = build_env(_sample(image=image), _args("http://127.0.0.1:1", tiny_processing_dir, judge_send_images=False))
    assert env.image_data == []


async def test_judge_client_is_shared_and_closed_by_the_last_env(tiny_tokenizer, tiny_processing_dir):
    script = [judge_says(tiny_tokenizer, "VERDICT: INCORRECT")] * 3
    async with _judge_server(tiny_tokenizer, script) as judge:
        args = _args(judge.url, tiny_processing_dir)
        env_a, env_b = build_env(_sample(), args), build_env(_sample(), args)
        await asyncio.gather(env_a.step("1"), env_b.step("2"))
        (client, users), = active_judge_clients().values()
        assert users == 2 and env_a._client is env_b._client is client
        assert client.sessions_created == 1
        await env_a.close()
        assert active_judge_clients()[args_key(env_a)] == (client, 1)
        assert client._session is not None and not client._session.closed
        await env_b.close()
        await env_b.close()  # idempotent
        assert active_judge_clients() == {} and client._session is None

        # An explicit shutdown closes pools that envs still hold; a later step gets a fresh pool.
        env_c = build_env(_sample(), args)
        await env_c.step("3")
        old = env_c._client
        await shutdown_judge_clients()
        assert active_judge_clients() == {} and old._session is None
        await env_c.close()


def args_key(env: llm_judge.LlmJudgeEnv) -> llm_judge.JudgeClientSettings:
    return env.options.client_settings


def test_build_env_reports_missing_and_bad_settings(tiny_processing_dir):
    with pytest.raises(ValueError, match="args.judge_url is not set"):
        build_env(_sample(), types.SimpleNamespace(max_turns=2, judge_tokenizer_path=str(tiny_processing_dir)))
    with pytest.raises(ValueError, match="judge_url must start with http"):
        build_env(_sample(), _args("localhost:30000", tiny_processing_dir))
    with pytest.raises(TypeError, match="args.judge_max_new_tokens must be int"):
        build_env(_sample(), _args("http://127.0.0.1:1", tiny_processing_dir, judge_max_new_tokens="many"))
    with pytest.raises(ValueError, match=r"sample\(group=2, index=5\).*has no label"):
        build_env(_sample(label=None), _args("http://127.0.0.1:1", tiny_processing_dir))
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        build_env(_sample(), _args("http://127.0.0.1:1", tiny_processing_dir.parent / "no_such_tokenizer"))


def test_example_custom_config_loads_with_the_declared_judge_keys():
    from jaxrl_vlm.config import load_config

    cfg = load_config(None, ["--custom-config-path", str(EXAMPLE_CONFIG)])
    args = cfg.to_namespace()
    assert args.rollout_interaction_env_path == "envs.llm_judge"
    for key, (_tp, _default, _help) in llm_judge.CONFIG_KEYS.items():
        assert hasattr(args, key), key
    assert set(validate_prompt_template(args.judge_prompt_template)) == set(llm_judge.TEMPLATE_FIELDS)
    # One judge step's worst case (every request and re-send times out, with full backoffs) fits in the
    # rollout's env step timeout, so the rollout never cancels a judge call that could still succeed.
    backoffs = sum(min(8.0, args.judge_retry_backoff_s * 2**k) for k in range(args.judge_max_retries))
    worst = (args.judge_parse_retries + 1) * ((args.judge_max_retries + 1) * args.judge_timeout_s + backoffs)
    assert args.env_step_timeout >= worst


# ----------------------------------------------------------------------------- in the rollout's episode loop
async def test_episode_with_a_judge_feedback_turn_is_rewarded_by_the_judge(tiny_tokenizer, tiny_image_processor,
                                                                         tiny_processing_dir):
    from rollout.client import RetryPolicy, SGLangClient
    from rollout.encoding import ChatEncoder
    from rollout.multiturn import RolloutContext, generate

    encoder = ChatEncoder(tiny_tokenizer, tiny_image_processor)
    replies = iter(["my answer is 14", "my answer is 10"])

    def policy(body: dict) -> Tokens:
        return Tokens(output_ids=(*encoder.tokenize(next(replies)), encoder.vision.im_end))

    feedback = "Square the legs before adding them."
    judge_script = [judge_says(tiny_tokenizer, f"{feedback}\nVERDICT: INCORRECT"),
                    judge_says(tiny_tokenizer, "VERDICT: CORRECT")]
    sample = Sample(prompt=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], label=REFERENCE)
    async with _judge_server(tiny_tokenizer, judge_script) as judge, \
            FakeSGLangServer(generate_fn=policy, eos_token_id=encoder.vision.im_end) as engine:
        client = SGLangClient(engine.url, timeout_s=5.0, retry=RetryPolicy(max_retries=0))
        async with client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=llm_judge,
                                 generate_slots=asyncio.Semaphore(4))
            args = _args(judge.url, tiny_processing_dir, rollout_context=ctx, rollout_max_response_len=200,
                         rollout_max_context_len=None, max_env_retries_per_turn=1, env_step_timeout=10.0,
                         episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0, rollout_top_p=1.0,
                         rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=False)
            out = await generate(args, sample)
    assert out.status is Status.COMPLETED, out.metadata
    assert out.reward == 1.0 and out.metadata["reward_source"] == "env_verdict"
    assert [info["verdict"] for info in out.metadata["env_info"]] == ["incorrect", "correct"]
    # The judge graded the model's own text of each turn.
    assert "my answer is 14" in _decoded_request(judge, tiny_tokenizer, 0)
    assert "my answer is 10" in _decoded_request(judge, tiny_tokenizer, 1)
    # The feedback reached the policy as observation tokens (loss mask 0), and its second prompt.
    second_prompt = tiny_tokenizer.decode(engine.requests_to("/generate")[1].body["input_ids"])
    assert f"Incorrect. {feedback}" in second_prompt
    response_ids = out.tokens[out.prompt_length:]
    observed = tiny_tokenizer.decode([t for t, m in zip(response_ids, out.loss_mask) if m == 0])
    assert f"Incorrect. {feedback}" in observed
    assert active_judge_clients() == {}  # env.close() ran and released the pool


async def test_unreachable_judge_in_an_episode_fails_it_with_the_judge_url(tiny_tokenizer, tiny_image_processor,
                                                                          tiny_processing_dir):
    from rollout.client import RetryPolicy, SGLangClient
    from rollout.encoding import ChatEncoder
    from rollout.multiturn import RolloutContext, generate

    encoder = ChatEncoder(tiny_tokenizer, tiny_image_processor)
    url = f"http://127.0.0.1:{_free_port()}"
    sample = Sample(prompt=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], label=REFERENCE)
    reply = Tokens(output_ids=(*encoder.tokenize("10"), encoder.vision.im_end))
    async with FakeSGLangServer(generate_fn=lambda body: reply, eos_token_id=encoder.vision.im_end) as engine:
        async with SGLangClient(engine.url, timeout_s=5.0, retry=RetryPolicy(max_retries=0)) as client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=llm_judge,
                                 generate_slots=asyncio.Semaphore(4))
            args = _args(url, tiny_processing_dir, rollout_context=ctx, rollout_max_response_len=200,
                         rollout_max_context_len=None, max_env_retries_per_turn=1, env_step_timeout=10.0,
                         episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0, rollout_top_p=1.0,
                         rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=False)
            out = await generate(args, sample)
    assert out.status is Status.FAILED
    assert len(out.metadata["env_errors"]) == 2  # first try + one retry after reset()
    assert all(f"LLM judge at {url}" in e for e in out.metadata["env_errors"])
    assert active_judge_clients() == {}
