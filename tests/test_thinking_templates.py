"""Thinking models in multi-turn: chat templates that rewrite earlier turns (issue 21).

The fixture templates (`jaxrl_vlm.tiny_assets.QWEN3_THINKING_CHAT_TEMPLATE` and the VL-Thinking variant whose
generation prompt opens `<think>`) render an assistant turn after the last user query with a think block and
drop its reasoning once a later user query exists, as the Qwen3 thinking templates do. Rollout stays
token-in/token-out: the model sees its earlier turns as it generated them, observation deltas are the template's
text after a finished assistant turn, and the finalize check compares with a rendering that keeps every turn as
generated. The Instruct template keeps its behaviour (tests/test_encoding.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from envs.base import BaseInteractionEnv
from jaxrl_vlm.config import load_config
from rollout.client import RetryPolicy, SGLangClient
from rollout.encoding import ChatEncoder, DeltaEncodingError, TemplateKind, check_prefix_stability
from rollout.fake_engine import FakeSGLangServer, Tokens
from rollout.multiturn import RolloutContext, generate, get_context
from rollout.processing import hf_reference_processor, image_to_data_url, load_image
from rollout.sample import Sample, Status

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
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
TOOLS_HEADER = (
    "<|im_start|>system\nYou solve geometry problems.\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc_geo3k_reward", "description": "Check an answer.", "parameters": '
    '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# ----------------------------------------------------------------------------- the fixture template itself
def test_fixture_template_reproduces_qwen3_thinking_semantics(tiny_thinking_tokenizer):
    tok = tiny_thinking_tokenizer
    q = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}
    a1 = {"role": "assistant", "content": "<think>\nlook\n</think>\n\nx = 3"}
    tool = {"role": "tool", "content": "incorrect"}
    a2 = {"role": "assistant", "content": "x = 4"}
    # The last assistant turn after the last query: think block; an earlier one with reasoning after the query too.
    assert _render(tok, [q, a1, tool, a2]) == (
        f"<|im_start|>user\n{IMG}Find x.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nlook\n</think>\n\nx = 3<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nincorrect\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{EMPTY_THINK}x = 4<|im_end|>\n"
    )
    # A later user query strips the reasoning of every earlier turn; a turn without reasoning that is not last
    # gets no think block.
    assert _render(tok, [q, a1, tool, a2, {"role": "user", "content": "Sure?"}], add_generation_prompt=True) == (
        f"<|im_start|>user\n{IMG}Find x.<|im_end|>\n<|im_start|>assistant\nx = 3<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nincorrect\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nx = 4<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )
    # A user message that only wraps a tool response is no query either; reasoning_content is honoured.
    wrapped = {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}
    a3 = {"role": "assistant", "content": "done", "reasoning_content": "\nchecked\n"}
    assert _render(tok, [q, a3, wrapped, a2]).startswith(
        f"<|im_start|>user\n{IMG}Find x.<|im_end|>\n<|im_start|>assistant\n<think>\nchecked\n</think>\n\ndone<|im_end|>")
    assert _render(tok, [q], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert _render(tok, [q], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n" + EMPTY_THINK)


def test_vl_thinking_fixture_opens_think_in_every_generation_prompt(tiny_vl_thinking_tokenizer):
    tok = tiny_vl_thinking_tokenizer
    q = {"role": "user", "content": "Find x."}
    assert _render(tok, [q], add_generation_prompt=True) == "<|im_start|>user\nFind x.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    # The model's turn is "reasoning</think>answer": the template reads the reasoning without an opening tag.
    turn = {"role": "assistant", "content": "look\n</think>\n\nx = 3"}
    assert _render(tok, [q, turn]).endswith("<|im_start|>assistant\n<think>\nlook\n</think>\n\nx = 3<|im_end|>\n")
    assert "look" not in _render(tok, [q, turn, q])


# ----------------------------------------------------------------------------- classification
def test_templates_are_classified_once_and_logged(tiny_tokenizer, tiny_thinking_tokenizer, tiny_vl_thinking_tokenizer,
                                                  tiny_image_processor, caplog):
    caplog.set_level(logging.INFO, logger="rollout.encoding")
    instruct = ChatEncoder(tiny_tokenizer, tiny_image_processor)
    thinking = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)
    vl_thinking = ChatEncoder(tiny_vl_thinking_tokenizer, tiny_image_processor, template_kwargs={"enable_thinking": True})
    assert instruct.template_kind is TemplateKind.APPEND_ONLY
    assert thinking.template_kind is TemplateKind.REWRITES_HISTORY
    assert vl_thinking.template_kind is TemplateKind.REWRITES_HISTORY
    for _ in range(3):
        thinking.classify_template()
        instruct.classify_template()
    records = [r.getMessage() for r in caplog.records if r.name == "rollout.encoding"]
    assert len(records) == 3
    assert sum("append-only" in m for m in records) == 1 and sum("rewrites earlier turns" in m for m in records) == 2
    # New template kwargs classify again (and log again); the same ones do not.
    thinking.set_template_kwargs({"enable_thinking": False})
    thinking.set_template_kwargs({"enable_thinking": False})
    assert thinking.template_kind is TemplateKind.REWRITES_HISTORY
    assert len([r for r in caplog.records if r.name == "rollout.encoding"]) == 4


def test_template_kwargs_that_are_apply_chat_template_parameters_are_rejected(tiny_thinking_tokenizer, tiny_image_processor):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor, template_kwargs={"add_generation_prompt": False})
    encoder = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)
    with pytest.raises(ValueError, match="mapping"):
        encoder.set_template_kwargs(["enable_thinking"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'tokenize'"):
        encoder.set_template_kwargs({"tokenize": True})


# ----------------------------------------------------------------------------- delta text
@pytest.fixture(scope="module")
def thinking(tiny_thinking_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)


def _text(encoder: ChatEncoder, ids) -> str:
    return encoder.tokenizer.decode(list(ids), skip_special_tokens=False)


def test_issue_repro_user_observation_after_a_thinking_turn(thinking):
    """The issue's repro: this raised `DeltaEncodingError: chat template is not prefix-stable`."""
    seg = thinking.encode_observation([{"role": "user", "content": "Are you sure?"}])
    assert seg.text == "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    assert _text(thinking, seg.wire_ids) == seg.text
    assert seg.wire_ids == thinking.tokenize(seg.text)


def test_delta_text_of_tool_and_image_observations(thinking, make_test_image):
    image = image_to_data_url(make_test_image(5, (96, 64)))
    tool = [
        {"role": "tool", "content": [{"type": "image", "image": image}, {"type": "text", "text": "incorrect"}]},
        {"role": "tool", "content": "second result"},
    ]
    seg = thinking.encode_observation(tool)
    assert seg.text == (
        f"\n<|im_start|>user\n<tool_response>\n{IMG}incorrect\n</tool_response>\n<tool_response>\nsecond result\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert seg.image_data == [image] and seg.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert seg.train_ids == thinking.expand_image_pads(seg.wire_ids, seg.mm_inputs["image_grid_thw"])
    user = thinking.encode_observation([{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Look."}]}])
    assert user.text == f"\n<|im_start|>user\n{IMG}Look.<|im_end|>\n<|im_start|>assistant\n"
    # A model turn that stopped without <|im_end|> is closed first, as for the Instruct template.
    closed = thinking.encode_observation([{"role": "user", "content": "next"}], model_ended_turn=False)
    assert closed.text == "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_template_kwargs_reach_prompt_and_observation(tiny_thinking_tokenizer, tiny_vl_thinking_tokenizer,
                                                      tiny_image_processor):
    off = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor, template_kwargs={"enable_thinking": False})
    assert off.encode_prompt([{"role": "user", "content": "q"}]).text.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert off.encode_observation([{"role": "user", "content": "next"}]).text == (
        f"\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}")
    vl = ChatEncoder(tiny_vl_thinking_tokenizer, tiny_image_processor)
    assert vl.encode_observation([{"role": "tool", "content": "ok"}]).text == (
        "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


# ----------------------------------------------------------------------------- whole episodes
@dataclass(frozen=True)
class Variant:
    """A thinking template setup: tokenizer fixture, template kwargs, what its generation prompt adds after the
    assistant header, and the model's three turns in that setup's format."""

    tokenizer: str
    kwargs: dict[str, Any] | None
    opened: str
    model_texts: tuple[str, str, str]


VARIANTS = {
    "qwen3_thinking": Variant("tiny_thinking_tokenizer", None, "", (
        '<think>\nThe figures differ.\n</think>\n\nI will check.\n<tool_call>\n{"name": "calc_geo3k_reward", '
        '"arguments": {"answer": "12"}}\n</tool_call>',
        "<think>\nMaybe 3/4.\n</think>\n\nThen x is \\frac{3}{4}.",
        "<think>\nRecompute.\n</think>\n\nFinal: \\boxed{5\\sqrt{3}}",
    )),
    "enable_thinking_false": Variant("tiny_thinking_tokenizer", {"enable_thinking": False}, EMPTY_THINK, (
        "I will check.", "Then x is \\frac{3}{4}.", "Final: \\boxed{5\\sqrt{3}}",
    )),
    "vl_thinking": Variant("tiny_vl_thinking_tokenizer", None, "<think>\n", (
        "The figures differ.\n</think>\n\nI will check.",
        "Maybe 3/4.\n</think>\n\nThen x is \\frac{3}{4}.",
        "Recompute.\n</think>\n\nFinal: \\boxed{5\\sqrt{3}}",
    )),
}


def _episode(make_test_image):
    """Prompt with two images; turn 1 answered by a tool response with an image, turn 2 by a user text."""
    prompt = [
        {"role": "system", "content": "You solve geometry problems."},
        {"role": "user", "content": [
            {"type": "image", "image": image_to_data_url(make_test_image(1, (64, 96)))},
            {"type": "text", "text": "Compare the figures."},
            {"type": "image", "image": image_to_data_url(make_test_image(2, (128, 64)))},
            {"type": "text", "text": "Find x."},
        ]},
    ]
    observations = [
        [{"role": "tool", "content": [{"type": "image", "image": image_to_data_url(make_test_image(3, (96, 96)))},
                                      {"type": "text", "text": "incorrect"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Try again; one turn left."}]}],
        None,
    ]
    return prompt, observations


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_thinking_episode_wire_ids_equal_the_incremental_reference(request, tiny_image_processor, make_test_image,
                                                                   variant, tools):
    v = VARIANTS[variant]
    tok = request.getfixturevalue(v.tokenizer)
    encoder = ChatEncoder(tok, tiny_image_processor, template_kwargs=v.kwargs)
    prompt, observations = _episode(make_test_image)

    # Incremental, as the episode loop builds it: prompt, then per turn sampled ids + observation delta.
    seg = encoder.encode_prompt(prompt, tools=tools)
    wire, train, images = list(seg.wire_ids), list(seg.train_ids), list(seg.image_data)
    grids = [seg.mm_inputs["image_grid_thw"]]
    turns = []
    for text, obs in zip(v.model_texts, observations):
        ids = encoder.tokenize(text) + [encoder.vision.im_end]
        wire += ids
        train += ids
        turns.append((ids, obs))
        if obs:
            o = encoder.encode_observation(obs)
            wire += o.wire_ids
            train += o.train_ids
            images += o.image_data
            if o.mm_inputs:
                grids.append(o.mm_inputs["image_grid_thw"])

    # The reference, written out: the template's prompt, each model turn exactly as generated (its reasoning
    # stays), and between turns the template's text after a finished assistant turn.
    header = TOOLS_HEADER if tools else "<|im_start|>system\nYou solve geometry problems.<|im_end|>\n"
    gen = "<|im_start|>assistant\n" + v.opened
    pieces = [
        header + f"<|im_start|>user\n{IMG}Compare the figures.{IMG}Find x.<|im_end|>\n" + gen,
        v.model_texts[0] + "<|im_end|>",
        f"\n<|im_start|>user\n<tool_response>\n{IMG}incorrect\n</tool_response><|im_end|>\n" + gen,
        v.model_texts[1] + "<|im_end|>",
        "\n<|im_start|>user\nTry again; one turn left.<|im_end|>\n" + gen,
        v.model_texts[2] + "<|im_end|>",
    ]
    reference_ids = [t for k, piece in enumerate(pieces) for t in
                     (turns[k // 2][0] if k % 2 else encoder.tokenize(piece))]
    assert wire == reference_ids
    assert _text(encoder, wire) == "".join(pieces)
    assert encoder.compact_image_pads(train) == wire

    # Each delta is what the template itself renders after that turn in the real conversation (system prompt,
    # tools and earlier images included).
    messages = list(prompt)
    for k, (text, obs) in enumerate(zip(v.model_texts, observations)):
        messages.append({"role": "assistant", "content": text})
        if obs:
            messages.extend(obs)
            rendered = encoder.render(messages, tools=tools, add_generation_prompt=True)
            assert rendered.endswith("<|im_end|>" + pieces[2 * k + 2])

    # The finalize check's reference keeps every turn as generated: strict passes.
    reference = encoder.reference_render(prompt, turns, tools=tools)
    assert reference == "".join(pieces)
    assert check_prefix_stability(encoder, wire, reference, "strict")
    # A plain apply_chat_template re-render shows the history the model never saw: earlier reasoning is gone
    # (turn 1's is dropped by the later user query), so it is not the reference.
    plain = encoder.rerender_conversation(prompt, turns, tools=tools)
    if variant != "enable_thinking_false":
        assert "The figures differ." in _text(encoder, wire) and "The figures differ." not in plain
        with pytest.raises(DeltaEncodingError, match="differ from the chat template"):
            check_prefix_stability(encoder, wire, plain, "strict")

    # Training view: transformers' Qwen3-VL processor expands the pads of the same text identically.
    processor = hf_reference_processor(tok, tiny_image_processor)
    ref = processor(text=[_text(encoder, wire)], images=[load_image(u) for u in images], return_tensors="np")
    assert ref["input_ids"][0].tolist() == train
    np.testing.assert_array_equal(ref["image_grid_thw"], np.concatenate(grids))


def test_check_passes_for_turns_cut_short_or_stopped_by_another_eos(thinking):
    prompt = [{"role": "user", "content": "q"}]
    endoftext = thinking.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stopped = thinking.tokenize("<think>\nhm\n</think>\n\na") + [endoftext]  # stops on <|endoftext|>: delta closes
    cut = thinking.tokenize("<think>\nstill thinking")  # the budget ran out mid-reasoning
    obs = [{"role": "user", "content": "go on"}]
    wire = thinking.encode_prompt(prompt).wire_ids + stopped
    wire += thinking.encode_observation(obs, model_ended_turn=False).wire_ids + cut
    reference = thinking.reference_render(prompt, [(stopped, obs), (cut, None)])
    assert check_prefix_stability(thinking, wire, reference, "strict")
    # An episode that ends on an appended observation (no answer fit) ends on the generation prompt.
    wire2 = thinking.encode_prompt(prompt).wire_ids + stopped + thinking.encode_observation(obs, model_ended_turn=False).wire_ids
    assert check_prefix_stability(thinking, wire2, thinking.reference_render(prompt, [(stopped, obs)]), "strict")
    # And a wrong delta is still caught.
    bad = thinking.encode_prompt(prompt).wire_ids + stopped + thinking.encode_observation(obs).wire_ids + cut
    with pytest.raises(DeltaEncodingError):
        check_prefix_stability(thinking, bad, reference, "strict")


# ----------------------------------------------------------------------------- configuration
def test_apply_chat_template_kwargs_is_accepted_as_json_and_reaches_the_encoder(tiny_thinking_tokenizer,
                                                                                 tiny_image_processor):
    cfg = load_config(None, ["--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert cfg.multiturn.apply_chat_template_kwargs == {"enable_thinking": False}
    assert load_config(None, []).multiturn.apply_chat_template_kwargs == {}
    args = cfg.to_namespace()
    encoder = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)
    args.rollout_context = RolloutContext(client=None, encoder=encoder, env_module=None,  # type: ignore[arg-type]
                                          generate_slots=asyncio.Semaphore(1))
    assert get_context(args).encoder.template_kwargs == {"enable_thinking": False}
    assert encoder.encode_prompt([{"role": "user", "content": "q"}]).text.endswith(EMPTY_THINK)
    # A namespace without the option leaves the encoder's own kwargs.
    bare = types.SimpleNamespace(rollout_context=args.rollout_context)
    assert get_context(bare).encoder.template_kwargs == {"enable_thinking": False}


# ----------------------------------------------------------------------------- rollout
class ThinkingEnv(BaseInteractionEnv):
    """Answers with a tool response carrying an image, then a user text, then is done."""

    def __init__(self, make_image):
        self.make_image = make_image
        self.steps: list[str] = []
        self.closed = 0

    def reset(self) -> None:
        pass

    async def step(self, response_text: str):
        self.steps.append(response_text)
        if len(self.steps) == 1:
            return {"obs_str": "incorrect", "role": "tool", "multi_modal_data": {"image": [self.make_image(7, 64)]}}, False, {}
        if len(self.steps) == 2:
            return {"obs_str": "Try again.", "role": "user"}, False, {}
        return {"obs_str": ""}, True, {}

    def verdict(self) -> float:
        return 1.0

    def close(self) -> None:
        self.closed += 1


async def _rollout(encoder: ChatEncoder, make_image, generate_fn, n: int, **overrides: Any):
    envs: list[ThinkingEnv] = []

    def build_env(sample, args):
        envs.append(ThinkingEnv(make_image))
        return envs[-1]

    module = types.ModuleType("thinking_env")
    module.build_env = build_env
    server = FakeSGLangServer(generate_fn=generate_fn, eos_token_id=encoder.vision.im_end,
                              image_token_id=encoder.vision.image_pad)
    async with server:
        client = SGLangClient(server.url, timeout_s=10.0, retry=RetryPolicy(max_retries=0))
        async with client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=module, generate_slots=asyncio.Semaphore(8))
            args = types.SimpleNamespace(
                rollout_max_response_len=400, rollout_max_context_len=None, max_turns=3, max_env_retries_per_turn=0,
                env_step_timeout=5.0, episode_timeout=30.0, delta_check="strict", rollout_temperature=1.0,
                rollout_top_p=1.0, rollout_top_k=-1, rollout_stop_token_ids=[], partial_rollout=False,
                rollout_context=ctx, apply_chat_template_kwargs={},
            )
            vars(args).update(overrides)
            samples = []
            for k in range(n):
                content = [{"type": "image", "image": image_to_data_url(make_image(k, 64))},
                           {"type": "text", "text": f"Find x in figure {k}."}]
                samples.append(Sample(group_index=k, index=0, prompt=[{"role": "user", "content": content}], label="7"))
            out = await asyncio.gather(*(generate(args, s) for s in samples))
    return out, server, envs


@pytest.mark.parametrize("variant", ["qwen3_thinking", "vl_thinking"])
async def test_multiturn_rollout_with_a_thinking_template_has_no_failed_samples(
        request, tiny_image_processor, make_test_image, variant):
    v = VARIANTS[variant]
    encoder = ChatEncoder(request.getfixturevalue(v.tokenizer), tiny_image_processor)
    replies = iter([v.model_texts[k % 3] for k in range(100)])

    def reply(body):
        ids = encoder.tokenize(next(replies)) + [encoder.vision.im_end]
        return Tokens(output_ids=tuple(ids), log_probs=tuple(-0.1 for _ in ids))

    samples, server, envs = await _rollout(encoder, make_test_image, reply, n=1)
    (s,) = samples
    assert s.status is Status.COMPLETED, s.metadata.get("error")
    assert s.metadata["prefix_stable"] is True and s.reward == 1.0
    s.validate(image_token_id=encoder.vision.image_pad, vision_start_token_id=encoder.vision.vision_start)
    assert len(s.image_data) == 2 and envs[0].closed == 1
    # Token-in/token-out: each request extends the previous one by the sampled ids and the delta, so the model
    # sees its earlier reasoning exactly as it generated it.
    reqs = [r.body for r in server.requests_to("/generate")]
    assert len(reqs) == 3
    for before, after in zip(reqs, reqs[1:]):
        assert after["input_ids"][: len(before["input_ids"])] == before["input_ids"]
    text = _text(encoder, reqs[2]["input_ids"])
    assert "Maybe 3/4." in text and ("The figures differ." in text)
    # Trained on exactly those tokens: the training view compacts to the last request plus the last turn's ids.
    last_turn = s.tokens[len(s.tokens) - s.turns[-1].generated_tokens:]
    assert encoder.compact_image_pads(s.tokens) == reqs[2]["input_ids"] + last_turn
    assert "The figures differ." in _text(encoder, s.tokens[s.prompt_length:])


async def test_random_thinking_model_never_fails_the_strict_check(tiny_thinking_tokenizer, tiny_image_processor,
                                                                  make_test_image):
    """A random model (any id but the banned vision tokens: stray `<think>`, `</think>`, `<|im_start|>`, partial
    UTF-8 bytes; stopping on <|im_end|>, on <|endoftext|> or cut by the budget) never fails the delta check."""
    encoder = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)
    rng = random.Random(0)
    banned = set(encoder.vision.banned_ids) | set(encoder.vision.eos_ids)
    vocab = [t for t in range(len(encoder.tokenizer)) if t not in banned]
    special = [encoder.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_start|>")]
    endings = [(encoder.vision.im_end,), (encoder.tokenizer.convert_tokens_to_ids("<|endoftext|>"),), ()]

    pool = vocab + special * 20

    def reply(body):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))] + list(rng.choice(endings))
        return Tokens(output_ids=tuple(ids))

    samples, _, _ = await _rollout(encoder, make_test_image, reply, n=24, rollout_max_response_len=120)
    statuses = [s.status for s in samples]
    assert Status.FAILED not in statuses, [s.metadata.get("error") for s in samples if s.status is Status.FAILED]
    assert all(s.metadata["prefix_stable"] is True for s in samples)
    assert {Status.COMPLETED, Status.TRUNCATED} >= set(statuses) and Status.COMPLETED in statuses
