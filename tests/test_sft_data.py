"""SFT conversations (`--loss-type sft_loss`): assistant-token masks exact against the chat template, the
conversation file layout and its bad rows, and the shipped tasks' transcripts.

The reference for the masks is independent of our code: transformers' own `return_assistant_tokens_mask` on a copy
of the tiny Qwen3-VL template whose assistant turns are wrapped in `{% generation %}` (content and `<|im_end|>`,
not the separator after it), over the template's full rendering tokenized in one go.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs.color_reveal.env import REVEAL_TEXT, ColorRevealEnv
from envs.color_reveal.prompts import QUESTION
from envs.color_reveal.synthetic import generate_row as color_row
from envs.color_reveal.synthetic import make_sft_dataset as color_sft
from envs.geo3k.grading import parse_tool_calls
from envs.geo3k.prompts import GEO3K_SYSTEM_PROMPT, GEO3K_TOOLS
from envs.geo3k.synthetic import make_sft_dataset as geo3k_sft
from envs.grading import last_boxed_span
from envs.transcripts import transcript_row, write_transcripts
from jaxrl_vlm.data.geo3k import DatasetError, data_url_to_image, load_styled_dataset
from jaxrl_vlm.data.sft import load_conversation_dataset
from jaxrl_vlm.tiny_assets import QWEN3_VL_CHAT_TEMPLATE
from rollout.encoding import ChatEncoder, TemplateKind, TranscriptError, encode_transcript
from rollout.processing import image_to_data_url

ROOT = Path(__file__).resolve().parents[1]

# The tiny template with each assistant turn's content and <|im_end|> inside {% generation %}.
_TURN_OPEN = "{{- '<|im_start|>assistant\\n' ~ text -}}"
_TURN_CLOSE = "    {{- '<|im_end|>\\n' -}}\n  {%- elif message.role == 'tool' -%}"
GENERATION_TEMPLATE = QWEN3_VL_CHAT_TEMPLATE.replace(
    _TURN_OPEN, "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- text -}}").replace(
    _TURN_CLOSE, "    {{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}\n  {%- elif message.role == 'tool' -%}")
assert GENERATION_TEMPLATE.count("generation -%}") == 2, "the tiny template changed: update the markers"


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


def _image(make_test_image, seed: int, size=64) -> str:
    return image_to_data_url(make_test_image(seed, size))


def _conversations(make_test_image) -> dict[str, tuple[list[dict[str, Any]], list[dict] | None]]:
    img = lambda seed, size=64: {"type": "image", "image": _image(make_test_image, seed, size)}  # noqa: E731
    return {
        "one_turn_with_image": ([
            {"role": "user", "content": [img(1), {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": "red"},
        ], None),
        "color_reveal_two_turns": ([
            {"role": "user", "content": [img(2), {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": "blue"},
            {"role": "user", "content": [img(3), {"type": "text", "text": REVEAL_TEXT}]},
            {"role": "assistant", "content": "green"},
        ], None),
        "system_tools_tool_call_and_tool_response": ([
            {"role": "system", "content": GEO3K_SYSTEM_PROMPT},
            {"role": "user", "content": [img(4, (96, 80)), {"type": "text", "text": "Find x."}]},
            {"role": "assistant", "content": '<tool_call>\n{"name": "calc_geo3k_reward", "arguments": {"answer": "7"}}'
                                             '\n</tool_call>'},
            {"role": "tool", "content": "Incorrect. Your answer is wrong."},
            {"role": "assistant", "content": "Let me check again.\n\nThe answer is \\boxed{12}."},
        ], GEO3K_TOOLS),
        "structured_tool_calls_and_whitespace": ([
            {"role": "user", "content": "  spaces\n\nand newlines  "},
            {"role": "assistant", "content": "\n leading newline", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "ok"},
            {"role": "tool", "content": "also ok"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "a trailing question, left out"},
        ], [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    }


def _hf_reference(tokenizer, messages, tools) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask of the template's full rendering (compact image pads)."""
    plain = [{**m, "content": [{"type": "image"} if isinstance(c, dict) and c.get("type") == "image" else c
                               for c in m["content"]]} if isinstance(m["content"], list) else m for m in messages]
    out = tokenizer.apply_chat_template(plain, tools=tools, chat_template=GENERATION_TEMPLATE, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for k, (t, m) in enumerate(zip(ids, mask)):
        if m and (k == 0 or not mask[k - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


@pytest.mark.parametrize("case", ["one_turn_with_image", "color_reveal_two_turns",
                                  "system_tools_tool_call_and_tool_response", "structured_tool_calls_and_whitespace"])
def test_assistant_mask_equals_transformers_generation_mask_of_the_template(encoder, make_test_image, case):
    messages, tools = _conversations(make_test_image)[case]
    transcript = encode_transcript(encoder, messages, tools=tools)
    ref_ids, ref_mask = _hf_reference(encoder.tokenizer, messages, tools)
    n = len(transcript.wire_ids)
    # Our sequence is the template's rendering through the last assistant turn's <|im_end|>: what follows in the
    # full rendering is the separator and the messages that no turn is trained after.
    assert transcript.wire_ids == ref_ids[:n]
    assert transcript.loss_mask == ref_mask[:n]
    assert not any(ref_mask[n:])
    tail = encoder.tokenizer.decode(ref_ids[n:], skip_special_tokens=False)
    assert tail.startswith(encoder.turn_separator())
    # Each trained run is exactly one assistant turn's content (as the template renders it) and its <|im_end|>.
    turns = [m for m in messages if m["role"] == "assistant"]
    runs = [encoder.tokenizer.decode(r, skip_special_tokens=False) for r in _runs(transcript.wire_ids, transcript.loss_mask)]
    assert len(runs) == len(turns)
    for run, turn in zip(runs, turns):
        assert run.endswith("<|im_end|>") and run.startswith(turn["content"])


def test_a_turn_with_step_loss_mask_zero_stays_context_and_leaves_the_mask(encoder, make_test_image):
    messages, _ = _conversations(make_test_image)["color_reveal_two_turns"]
    both = encode_transcript(encoder, messages)
    second = encode_transcript(encoder, messages, trained_turns=[False, True])
    assert second.wire_ids == both.wire_ids
    first_run = _runs(both.wire_ids, both.loss_mask)[0]
    assert _runs(second.wire_ids, second.loss_mask) == _runs(both.wire_ids, both.loss_mask)[1:]
    assert sum(both.loss_mask) - sum(second.loss_mask) == len(first_run)
    with pytest.raises(TranscriptError, match="nothing to train"):
        encode_transcript(encoder, messages, trained_turns=[False, False])


def test_transcripts_that_cannot_be_trained_are_errors(encoder, make_test_image):
    with pytest.raises(TranscriptError, match="no assistant message"):
        encode_transcript(encoder, [{"role": "user", "content": "hi"}])
    picture = {"type": "image", "image": _image(make_test_image, 5)}
    with pytest.raises(TranscriptError, match="cannot contain images"):
        encode_transcript(encoder, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [picture]}])


def test_the_pieces_are_what_rollout_builds_prompt_model_turn_and_observation_delta(encoder, make_test_image):
    """The context pieces are rollout's own: the prompt of `encode_prompt`, the observation delta of
    `encode_observation` after a turn that ended with <|im_end|>."""
    messages, _ = _conversations(make_test_image)["color_reveal_two_turns"]
    transcript = encode_transcript(encoder, messages)
    prompt, turn1, delta, turn2 = transcript.texts
    assert transcript.trained == [False, True, False, True]
    assert prompt == encoder.encode_prompt(messages[:1]).text
    assert delta == encoder.encode_observation(messages[2:3]).text
    assert (turn1, turn2) == ("blue<|im_end|>", "green<|im_end|>")


def test_history_rewriting_template_trains_each_turn_as_generated(tiny_thinking_tokenizer, tiny_image_processor):
    """With a Qwen3 thinking template, the sequence is the episode as the model generated it: the rollout's
    finalize reference (`rerender_as_generated`) of the same turns, not the re-render that drops earlier
    reasoning."""
    encoder = ChatEncoder(tiny_thinking_tokenizer, tiny_image_processor)
    assert encoder.template_kind is TemplateKind.REWRITES_HISTORY
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"},
        {"role": "user", "content": "Wrong, try again."},
        {"role": "assistant", "content": "<think>\ncarefully\n</think>\n\n4"},
    ]
    transcript = encode_transcript(encoder, messages)
    turn_texts = [t for t, trained in zip(transcript.texts, transcript.trained) if trained]
    turns = [(encoder.tokenize(turn_texts[0]), messages[2:3]), (encoder.tokenize(turn_texts[1]), None)]
    assert transcript.text == encoder.rerender_as_generated(messages[:1], turns)
    assert "add them" in turn_texts[0]  # the earlier turn keeps its reasoning, as generated
    assert "add them" not in encoder.render(messages, add_generation_prompt=False)  # a re-render would drop it


# ----------------------------------------------------------------------------- the file layout
def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _png_item(make_test_image, seed: int) -> dict[str, Any]:
    import io

    buf = io.BytesIO()
    make_test_image(seed, 64).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": f"img{seed}.png"}


def test_rows_with_markers_or_items_load_as_valid_training_samples(encoder, make_test_image, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": "<image>" + REVEAL_TEXT}, {"role": "assistant", "content": "blue"}],
         "images": [_png_item(make_test_image, 1), _png_item(make_test_image, 2)], "tools": None},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "no picture"},
                      {"role": "assistant", "content": "ok"}], "images": [], "tools": json.dumps(GEO3K_TOOLS)},
    ]
    dataset = load_conversation_dataset(str(_write_parquet(tmp_path / "c.parquet", rows)), encoder)
    assert len(dataset) == 2 and dataset.rows == [0, 1]
    vision = encoder.vision
    for i in range(2):
        sample = dataset[i]
        sample.validate(image_token_id=vision.image_pad, vision_start_token_id=vision.vision_start, merge_size=2)
        transcript = dataset.transcript(i)
        assert sample.tokens == encoder.expand_image_pads(
            transcript.wire_ids, None if sample.multimodal_train_inputs is None else sample.multimodal_train_inputs["image_grid_thw"])
        # The response starts at the first trained token; the mask follows the wire view's through the pads.
        first = transcript.loss_mask.index(1)
        assert encoder.compact_image_pads(sample.tokens[: sample.prompt_length]) == transcript.wire_ids[:first]
        assert sum(sample.loss_mask) == sum(transcript.loss_mask) and sample.loss_mask[0] == 1
        assert sample.rollout_log_probs == [0.0] * sample.response_length
    assert len(dataset[0].image_data) == 2 and dataset[0].multimodal_train_inputs["image_grid_thw"].shape == (2, 3)
    assert dataset[1].metadata["tools"] == GEO3K_TOOLS and "calc_geo3k_reward" in dataset.transcript(1).texts[0]

    # The same conversation as jsonl with list content items and a data-URL image gives the same tokens.
    url = _image(make_test_image, 1)
    items = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                          {"role": "assistant", "content": "red", "step_loss_mask": 1}], "images": [url]}
    marker = {"messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": "red"}],
              "images": [url]}
    a = load_conversation_dataset(str(_write_jsonl(tmp_path / "a.jsonl", [items])), encoder)[0]
    b = load_conversation_dataset(str(_write_jsonl(tmp_path / "b.jsonl", [marker])), encoder)[0]
    assert a.tokens == b.tokens and a.loss_mask == b.loss_mask
    np.testing.assert_array_equal(a.multimodal_train_inputs["pixel_values"], b.multimodal_train_inputs["pixel_values"])


BAD_ROWS = [
    ({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": []},
     "more <image> markers than the row's 0 images"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "images": ["AAAA"]},
     "image 0"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot' is not one of"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}, "must come first"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "step_loss_mask": 0}]},
     "nothing to train"),
    ({"messages": [{"role": "user", "content": "x", "step_loss_mask": 0}, {"role": "assistant", "content": "y"}]},
     "assistant messages only"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]},
     r"unknown key\(s\) \['weight'\]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "{not json"},
     "field 'tools' is not JSON"),
    ({"messages": "hello"}, "field 'messages' has type str"),
    ({"conversation": []}, "missing field 'messages'"),
]


@pytest.mark.parametrize(("row", "needle"), BAD_ROWS)
def test_a_bad_row_is_an_error_naming_file_row_and_cause(encoder, tmp_path, row, needle):
    path = _write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, row])
    with pytest.raises(DatasetError, match=rf"bad.jsonl: row 1 \(line 2\): .*{needle}"):
        load_conversation_dataset(str(path), encoder)


def test_bad_rows_are_skipped_and_recorded_under_skip(encoder, tmp_path):
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path = _write_jsonl(tmp_path / "mixed.jsonl", [good, BAD_ROWS[2][0], "{not json", good])
    dataset = load_conversation_dataset(str(path), encoder, on_bad_row="skip")
    assert dataset.rows == [0, 3] and [r for r, _ in dataset.skipped] == [1, 2]
    with pytest.raises(DatasetError, match="missing column"):
        load_conversation_dataset(str(_write_parquet(tmp_path / "p.parquet", [{"problem": "x"}])), encoder)


# ----------------------------------------------------------------------------- the shipped tasks' transcripts
def test_color_reveal_transcripts_replay_the_env_from_the_rl_prompt(encoder, tmp_path):
    path = color_sft(str(tmp_path / "cr.parquet"), 16, seed=3, image_size=64)
    dataset = load_conversation_dataset(path, encoder)
    prompts = load_styled_dataset(str(_prompt_file(tmp_path, 16, 3)), "plain")
    table = pq.read_table(path).to_pylist()
    turns = [json.loads(r["params"])["turns"] for r in table]
    assert set(turns) == {1, 2}, "the set teaches both the right first guess and the reveal"
    for i, row in enumerate(table):
        params = json.loads(row["params"])
        transcript = dataset.transcript(i)
        # The conversation opens with the RL prompt of the same row: same picture, same question, same tokens.
        assert transcript.texts[0] == encoder.encode_prompt(prompts[i].prompt).text
        assert dataset[i].image_data[0] == prompts[i].prompt[0]["content"][0]["image"]
        answers = [t.removesuffix("<|im_end|>") for t, trained in zip(transcript.texts, transcript.trained) if trained]
        if params["turns"] == 1:
            assert answers == [params["card"]] and params["reward"] == 1.0
        else:
            assert answers == [params["decoy"], params["card"]] and params["reward"] == pytest.approx(0.9)
            env = ColorRevealEnv(params["card"], max_turns=2, image_size=64)
            observation = env.format_observation(env.step(params["decoy"])[0])
            assert transcript.texts[2] == encoder.encode_observation([observation]).text
            assert len(dataset[i].image_data) == 2


def _prompt_file(tmp_path: Path, n: int, seed: int) -> Path:
    from envs.color_reveal.synthetic import make_dataset

    return Path(make_dataset(str(tmp_path / f"prompts_{seed}.parquet"), n, seed=seed, image_size=64))


def test_geo3k_transcripts_answer_with_the_tool_or_a_box_after_the_rl_prompt(encoder, tmp_path):
    from envs.geo3k.synthetic import make_dataset

    path = geo3k_sft(str(tmp_path / "g.jsonl"), 8, seed=2, image_size=112)
    dataset = load_conversation_dataset(path, encoder)
    prompts = load_styled_dataset(make_dataset(str(tmp_path / "g_prompts.parquet"), 8, seed=2, image_size=112), "geo3k")
    sources = set()
    for i, line in enumerate(Path(path).read_text().splitlines()):
        params = json.loads(json.loads(line)["params"])
        sources.add(params["answer_source"])
        transcript = dataset.transcript(i)
        assert transcript.texts[0] == encoder.encode_prompt(prompts[i].prompt, tools=prompts[i].metadata["tools"]).text
        reply = transcript.texts[1].removesuffix("<|im_end|>")
        if params["answer_source"] == "tool":
            assert [c.answer for c in parse_tool_calls(reply)] == [params["answer"]]
        else:
            assert last_boxed_span(reply)[2] == params["answer"] and "<tool_call>" not in reply
    assert sources == {"tool", "boxed"}


@pytest.mark.parametrize("task", ["color_reveal", "geo3k"])
def test_make_dataset_cli_writes_sft_transcripts(encoder, tmp_path, task):
    out = tmp_path / f"{task}.parquet"
    extra = ["--image-size", "112"] if task == "geo3k" else []
    done = subprocess.run([sys.executable, "-m", "jaxrl_vlm.cli", "make-dataset", str(out), "--task", task, "--sft",
                           "--num-rows", "4", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote 4 synthetic {task} SFT transcripts" in done.stdout
    assert len(load_conversation_dataset(str(out), encoder)) == 4


def test_transcript_rows_round_trip_through_the_writer(encoder, make_test_image, tmp_path):
    picture = make_test_image(7, 64)
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Q?"}]},
                {"role": "assistant", "content": "A."}]
    row = transcript_row(messages, name="t")
    assert row["messages"][0]["content"] == "<image>Q?" and row["images"][0]["path"] == "t_0.png"
    for suffix in ("parquet", "jsonl"):
        path = write_transcripts(str(tmp_path / f"t.{suffix}"), [row])
        sample = load_conversation_dataset(path, encoder)[0]
        (url,) = sample.image_data
        np.testing.assert_array_equal(np.asarray(data_url_to_image(url)), np.asarray(picture.convert("RGB")))
    with pytest.raises(ValueError, match="image marker"):
        transcript_row([{"role": "user", "content": "a <image> in text"}], name="t")
    assert color_row(0, 3, 64)["problem"] == "<image>" + QUESTION
