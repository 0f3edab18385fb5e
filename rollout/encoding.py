"""Token streams of a multi-turn VLM episode: prompt, observation deltas, image pads.

Two views of the same conversation exist:

* the **wire view** sent to the engine: one `<|image_pad|>` per image (compact). SGLang (>= 0.5.9, with
  `SGLANG_MM_AVOID_RETOKENIZE`) keeps the caller's ids and expands each single pad itself; expanded pads
  would be expanded a second time (reference/sglang_api.md §3);
* the **training view** in `Sample.tokens`: each pad expanded to t*h*w/merge^2 pads, exactly as the
  engine expands it, using the same HF image processor on the same PNG pixels.

Model output is never re-tokenized: the engine's sampled ids are appended as they are. Only the tokens
*between* two model turns are produced here, as the text the chat template puts after the assistant's
`<|im_end|>`: the template's separator (the `\\n` slime loses), the observation turn and the next
generation prompt. Special tokens split the tokenizer's input, so tokenizing that delta alone gives the
same ids as tokenizing the whole rendered conversation; `check_prefix_stability` verifies it at finalize.

Chat templates come in two kinds, told apart once per encoder by rendering probe conversations
(`ChatEncoder.template_kind`, logged once):

* **append-only** (Qwen3-VL-Instruct): a conversation's rendering is a prefix of the rendering of any continuation.
  The delta is the rendering of (base conversation + observation + generation prompt) minus the rendering of the
  base conversation, and the finalize check re-renders the whole episode in one go.
* **rewrites history** (Qwen3 / Qwen3-VL-Thinking): an assistant turn after the last user query carries a
  `<think>...</think>` block (empty if it had none), and loses its reasoning once a later user query exists.
  Rollout stays token-in/token-out all the same: the model keeps seeing its earlier turns, reasoning included,
  exactly as it sampled them, and the trainer trains on exactly those tokens. The delta is the template's own text
  after a finished assistant turn: the rendering of (base conversation + observation + generation prompt) cut
  after the base assistant turn's `<|im_end|>`, so the template's rewriting of that turn stays on the discarded
  side of the cut. The finalize check compares with `rerender_as_generated`, a rendering that keeps every model
  turn as generated (a plain `apply_chat_template` of the episode would show the rewritten history the model
  never saw; `rerender_conversation` is that plain re-render).

Template kwargs (`enable_thinking`, ...; `--apply-chat-template-kwargs`) reach every rendering alike: prompt,
observation deltas, probes and re-renders.
"""

from __future__ import annotations

import difflib
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from rollout.clip_cache import ProcessedClipCache
from rollout.clip_cache import cache_key as clip_cache_key
from rollout.image_cache import ProcessedImageCache
from rollout.processing import (
    VisionTokens,
    image_to_data_url,
    load_image,
    num_image_pads,
    png_data_url_size,
    processor_size,
    resize_as_processor,
)
from rollout.video import Clip, ClipError, VideoProcessorConfig
from rollout.video_io import ClipUrls, load_clip

logger = logging.getLogger(__name__)

# A fixed stand-in conversation that ends with a finished assistant turn. The observation is rendered after
# it, so nothing that belongs to the start of a conversation (system prompt, tool list) can leak into a delta.
_BASE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "base"},
    {"role": "assistant", "content": "base"},
]


# Probe conversations that tell append-only templates from ones that rewrite earlier turns: a finished assistant turn
# (without and with reasoning), then a follow-up user query or tool response.
_PROBE_CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    _BASE_CONVERSATION,
    [
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": "<think>\nprobe reasoning\n</think>\n\nprobe answer"},
    ],
)
_PROBE_FOLLOW_UPS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "probe follow-up"}],
    [{"role": "tool", "content": "probe tool response"}],
)

# apply_chat_template's own parameters (and the template's `messages`): not template kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class DeltaEncodingError(ValueError):
    """The chat template cannot be split into per-turn deltas (it is not prefix-stable)."""


class TemplateKind(enum.Enum):
    """How a chat template treats earlier turns when the conversation grows."""

    APPEND_ONLY = "append-only"
    REWRITES_HISTORY = "rewrites-history"


def checked_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra variables for the chat template (`enable_thinking`, ...) as a dict; None is none. Raises ValueError
    for a non-string key or one that is an `apply_chat_template` parameter of its own."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat template kwargs must be a mapping, got {type(kwargs).__name__} {kwargs!r}")
    out = dict(kwargs)
    for key in out:
        if not isinstance(key, str):
            raise ValueError(f"chat template kwarg names must be strings, got {key!r}")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat template kwarg {key!r} is an apply_chat_template parameter that rollout sets itself")
    return out


@dataclass
class EncodedSegment:
    """Tokens of one non-model segment (the prompt or one observation) in both views.

    `wire_ids` are compact (one pad per image or clip), `train_ids` expanded; `image_data` are the segment's
    images as PNG data URLs and `video_data` its clips as lossless video data URLs (engine view), `mm_inputs`
    their processor tensors (training view), None without images and clips.
    """

    wire_ids: list[int]
    train_ids: list[int]
    image_data: list[str] = field(default_factory=list)
    mm_inputs: dict[str, np.ndarray] | None = None
    text: str = ""
    video_data: list[str] = field(default_factory=list)


def compact_pad_runs(ids: Sequence[int], pad: int) -> list[int]:
    """Every run of `pad` in `ids` collapsed to a single `pad` (expanded image placeholders -> compact)."""
    out: list[int] = []
    for token in ids:
        if token == pad and out and out[-1] == pad:
            continue
        out.append(int(token))
    return out


def message_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """Image items of chat messages, in the order the template places their placeholders."""
    return _message_items(messages, "image")


def message_clips(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """Video items of chat messages (`{"type": "video", "video": clip}`), in the order of their placeholders."""
    return _message_items(messages, "video")


def _message_items(messages: Sequence[dict[str, Any]], kind: str) -> list[Any]:
    items = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for item in content:
                if isinstance(item, dict) and item.get("type") == kind:
                    if kind not in item:
                        raise ValueError(f"{kind} content item without its {kind!r} value in a "
                                         f"{message.get('role')!r} message")
                    items.append(item[kind])
    return items


def prompt_with_opening(prompt: list[dict[str, Any]], opening: dict[str, Any]) -> list[dict[str, Any]]:
    """`prompt` with the content of `opening` (a user message: images, then text) appended to its first user
    message; a prompt without one gets `opening` as a new last message. The input is not modified."""
    messages = [dict(m) for m in prompt]
    items = [dict(item) for item in opening["content"]]
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        content = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if content and items and items[-1].get("type") == "text" and content[-1].get("type") == "text":
            items[-1] = {**items[-1], "text": "\n" + items[-1]["text"]}  # its text starts a line of its own
        message["content"] = content + items
        return messages
    return [*messages, {"role": "user", "content": items}]


def _engine_message(message: dict[str, Any]) -> dict[str, Any]:
    """Copy of a message whose image and video items carry no payload: the template only needs their type."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    items = [{"type": it["type"]} if isinstance(it, dict) and it.get("type") in ("image", "video") else it
             for it in content]
    return {**message, "content": items}


class ChatEncoder:
    """Renders chat messages with the model's template and encodes them into both token views."""

    def __init__(self, tokenizer: Any, image_processor: Any, vision: VisionTokens | None = None, *,
                 template_kwargs: Mapping[str, Any] | None = None, video_config: VideoProcessorConfig | None = None):
        self.tokenizer = tokenizer
        self.video_config = video_config  # the checkpoint's video processor; None: clips are refused
        self.clips = None if video_config is None else ProcessedClipCache(video_config)
        self.clip_urls = ClipUrls()  # an env's Clip written to its data URL once per distinct content
        self.image_processor = image_processor
        self.images = ProcessedImageCache(image_processor)
        self.vision = vision or VisionTokens.from_tokenizer(tokenizer)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self._template_kwargs = checked_template_kwargs(template_kwargs)
        self._separator_cache: str | None = None
        self._base_render_cache: str | None = None
        self._kind: TemplateKind | None = None

    # ---------------------------------------------------------------- template
    @property
    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables every rendering passes to the chat template (a copy)."""
        return dict(self._template_kwargs)

    def set_template_kwargs(self, kwargs: Mapping[str, Any] | None) -> None:
        """Use these template kwargs from now on (a no-op when unchanged); the template is classified again."""
        checked = checked_template_kwargs(kwargs)
        if checked == self._template_kwargs:
            return
        self._template_kwargs = checked
        self._separator_cache = self._base_render_cache = None
        self._kind = None

    @property
    def template_kind(self) -> TemplateKind:
        """Append-only or history-rewriting (`classify_template`)."""
        return self.classify_template()

    def classify_template(self) -> TemplateKind:
        """Append-only or history-rewriting: classified once (again after new template kwargs) by rendering probe
        conversations, a finished assistant turn with and without reasoning followed by a user query or a tool
        response; the result is logged once."""
        if self._kind is None:
            kind, reason = self._probe_template()
            self._kind = kind
            kwargs = f" with template kwargs {self._template_kwargs}" if self._template_kwargs else ""
            if kind is TemplateKind.APPEND_ONLY:
                logger.info("chat template%s is append-only (Instruct-style): observation deltas are the rendering of "
                            "each observation after the conversation so far", kwargs)
            else:
                logger.info(
                    "chat template%s rewrites earlier turns (Thinking-style: %s). Rollout stays token-in/token-out: the "
                    "model sees and is trained on its earlier turns, reasoning included, as it generated them; "
                    "observation deltas are the template's text after a finished assistant turn, and the finalize "
                    "check compares with a rendering that keeps every turn as generated", kwargs, reason)
        return self._kind

    def _probe_template(self) -> tuple[TemplateKind, str]:
        for conversation in _PROBE_CONVERSATIONS:
            before = self.render(conversation, add_generation_prompt=False)
            for follow_up in _PROBE_FOLLOW_UPS:
                try:
                    after = self.render([*conversation, *follow_up], add_generation_prompt=True)
                except Exception as e:  # a template without tool messages: that probe cannot tell, the others do
                    logger.debug("chat template probe with a %r follow-up failed: %s", follow_up[0]["role"], e)
                    continue
                if not after.startswith(before):
                    reasoning = "with" if "<think>" in conversation[-1]["content"] else "without"
                    return TemplateKind.REWRITES_HISTORY, (
                        f"an assistant turn {reasoning} reasoning is rendered differently once a "
                        f"{follow_up[0]['role']} message follows it\n" + _first_difference(before, after))
        return TemplateKind.APPEND_ONLY, ""

    # ---------------------------------------------------------------- rendering
    def render(self, messages: Sequence[dict[str, Any]], *, tools: list[dict] | None = None, add_generation_prompt: bool) -> str:
        rendered = self.tokenizer.apply_chat_template(
            [_engine_message(m) for m in messages], tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=False, **self._template_kwargs,
        )
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, expected str")
        return rendered

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---------------------------------------------------------------- images
    def expand_image_pads(self, compact_ids: Sequence[int], grid_thw: np.ndarray | None) -> list[int]:
        """Compact -> training view: the i-th single pad becomes t*h*w/merge^2 pads of image i."""
        pad = self.vision.image_pad
        n_pads = sum(1 for t in compact_ids if t == pad)
        n_images = 0 if grid_thw is None else len(grid_thw)
        if n_pads != n_images:
            raise ValueError(f"{n_pads} image placeholders but {n_images} images")
        out: list[int] = []
        k = 0
        for token in compact_ids:
            if token == pad:
                out.extend([pad] * num_image_pads(grid_thw[k], self.merge_size))
                k += 1
            else:
                out.append(int(token))
        return out

    def compact_image_pads(self, expanded_ids: Sequence[int]) -> list[int]:
        """Training view -> wire view: every run of pads collapses to one pad."""
        return compact_pad_runs(expanded_ids, self.vision.image_pad)

    def _encode_images(self, items: list[Any]) -> tuple[list[str], dict[str, np.ndarray] | None]:
        if not items:
            return [], None
        # PNG data URLs are lossless, and every picture is sent at the size the image processor resizes it to: the
        # engine (whatever its own resize) decodes exactly the pixels the trainer processes here.
        pil: dict[int, Image.Image] = {}
        urls = []
        for i, item in enumerate(items):
            if isinstance(item, str) and self._sent_as_is(item):
                urls.append(item)
            else:
                pil[i] = resize_as_processor(load_image(item), self.image_processor)
                urls.append(image_to_data_url(pil[i]))

        def load(i: int) -> Image.Image:
            return pil[i] if i in pil else load_image(items[i])

        # Keyed by the URL: an image every sample of a group (or every turn) shows is processed once.
        return urls, self.images.process(urls, load)

    def _sent_as_is(self, url: str) -> bool:
        """A PNG data URL already at the processor's size (read from its header: no decode)."""
        size = png_data_url_size(url)
        return size is not None and processor_size(self.image_processor, *size) == size

    # ---------------------------------------------------------------- clips
    def clip_tokens(self, grid_thw_row: Sequence[int], timestamps: Sequence[float]) -> list[int]:
        """The training-view tokens one compact `<|video_pad|>` stands for, laid out as the family's processor lays
        them out (transformers' `Qwen3VLProcessor.replace_video_token` / `Qwen2_5_VLProcessor`).

        Qwen3-VL, Qwen3.5 (timestamps): per frame group its time as text, `<1.5 seconds>`, then the group's pads
        between `<|vision_start|>` and `<|vision_end|>`; the template's own vision markers stay around the whole
        clip (transformers >= 5 expands the pad alone, and vLLM follows the installed transformers). Each timestamp
        lies between two special tokens, so tokenizing it alone gives the ids it has in the whole rendering.
        Qwen2.5-VL: t*h*w / merge^2 pads in one run (time reaches the model through `second_per_grid_ts`).
        """
        t, h, w = (int(x) for x in grid_thw_row)
        per_group = num_image_pads((1, h, w), self.merge_size)
        vt = self.vision
        if self.video_config is None or not self.video_config.temporal_timestamps:
            return [vt.video_pad] * (t * per_group)
        if len(timestamps) != t:
            raise ValueError(f"a clip of {t} frame groups has {len(timestamps)} timestamps")
        out: list[int] = []
        for seconds in timestamps:
            out += self.tokenize(f"<{seconds:.1f} seconds>")
            out += [vt.vision_start, *[vt.video_pad] * per_group, vt.vision_end]
        return out

    def expand_video_pads(self, ids: Sequence[int], clip_tokens: Sequence[Sequence[int]]) -> list[int]:
        """Compact -> training view for clips: the i-th `<|video_pad|>` becomes `clip_tokens[i]`."""
        pad = self.vision.video_pad
        n_pads = sum(1 for t in ids if t == pad)
        if n_pads != len(clip_tokens):
            raise ValueError(f"{n_pads} video placeholders but {len(clip_tokens)} clips")
        out: list[int] = []
        k = 0
        for token in ids:
            if token == pad:
                out.extend(clip_tokens[k])
                k += 1
            else:
                out.append(int(token))
        return out

    def encode_clips(self, items: Sequence[Any], read: Callable[[Any], Clip] = load_clip
                     ) -> tuple[list[str], dict[str, np.ndarray] | None, list[list[int]]]:
        """(the clips as lossless video data URLs, their training tensors, the tokens each clip's pad expands to).

        Items are `Clip`s or what `read` accepts (`rollout.video_io.load_clip`: video data URLs). The tensors are
        `pixel_values_videos`, `video_grid_thw` and, for Qwen2.5-VL, `second_per_grid_ts`.
        """
        if not items:
            return [], None, []
        if self.clips is None:
            raise ClipError("this model directory has no video_preprocessor_config.json: clips cannot be encoded")
        # A Clip from an environment is written to its data URL here (the engine's view), once per distinct content
        # (`clip_urls`); a URL seen before (every turn re-sends the episode's clips, a group shares its prompt's) is
        # neither decoded nor processed again.
        urls = [item if isinstance(item, str) else self.clip_urls.url(item) for item in items]

        def load(i: int) -> Clip:
            return items[i] if isinstance(items[i], Clip) else read(items[i])

        done = self.clips.process([clip_cache_key(url) for url in urls], load)
        mm = {"pixel_values_videos": done.pixel_values_videos, "video_grid_thw": done.video_grid_thw}
        if not self.video_config.temporal_timestamps:
            mm["second_per_grid_ts"] = done.second_per_grid_ts
        tokens = [self.clip_tokens(grid, stamps) for grid, stamps in zip(done.video_grid_thw, done.timestamps)]
        return urls, mm, tokens

    def _segment(self, text: str, image_items: list[Any], clip_items: Sequence[Any] = ()) -> EncodedSegment:
        wire = self.tokenize(text)
        urls, mm = self._encode_images(image_items)
        grid = None if mm is None else mm["image_grid_thw"]
        train = self.expand_image_pads(wire, grid)
        clip_urls, clip_mm, clip_tokens = self.encode_clips(list(clip_items))
        train = self.expand_video_pads(train, clip_tokens)
        if clip_mm is not None:
            mm = {**(mm or {}), **clip_mm}
        return EncodedSegment(wire_ids=wire, train_ids=train, image_data=urls, mm_inputs=mm, text=text,
                              video_data=clip_urls)

    # ---------------------------------------------------------------- segments
    def encode_prompt(self, messages: Sequence[dict[str, Any]], *, tools: list[dict] | None = None) -> EncodedSegment:
        """The initial prompt with the generation prompt appended (the model speaks next)."""
        text = self.render(messages, tools=tools, add_generation_prompt=True)
        return self._segment(text, message_images(messages), message_clips(messages))

    def turn_separator(self) -> str:
        """What the template writes after an assistant's `<|im_end|>` before the next message (Qwen: `\\n`)."""
        if self._separator_cache is None:
            rendered = self.render(_BASE_CONVERSATION, add_generation_prompt=False)
            end = self.tokenizer.convert_ids_to_tokens(self.vision.im_end)
            cut = rendered.rfind(end)
            if cut < 0:
                raise DeltaEncodingError(f"the chat template does not end an assistant turn with {end!r}")
            self._separator_cache = rendered[cut + len(end) :]
        return self._separator_cache

    def encode_observation(self, messages: Sequence[dict[str, Any]], *, model_ended_turn: bool = True) -> EncodedSegment:
        """Delta tokens for observation message(s) following a model turn, ending with the generation prompt.

        `model_ended_turn`: whether the model's last token was `<|im_end|>`. If it stopped otherwise (a stop
        string or another stop id), the delta first closes the assistant turn, so the sequence stays on-template.
        """
        if self._base_render_cache is None:
            self._base_render_cache = self.render(_BASE_CONVERSATION, add_generation_prompt=False)
        prefix = self._base_render_cache
        full = self.render([*_BASE_CONVERSATION, *messages], add_generation_prompt=True)
        if self.template_kind is TemplateKind.REWRITES_HISTORY:
            body = self._delta_after_rewritten_turn(prefix, full)
        else:
            if not full.startswith(prefix):
                raise DeltaEncodingError(
                    "chat template is not prefix-stable: rendering an observation changes earlier text\n"
                    + _first_difference(prefix, full)
                )
            body = self.turn_separator() + full[len(prefix) :]
        end = self.tokenizer.convert_ids_to_tokens(self.vision.im_end)
        opening = "" if model_ended_turn else end
        return self._segment(opening + body, message_images(messages), message_clips(messages))

    def _delta_after_rewritten_turn(self, prefix: str, full: str) -> str:
        """For a history-rewriting template: the text of `full` (base conversation + observation + generation prompt)
        after the base assistant turn's `<|im_end|>`, wherever the template's rewriting of that turn put it.

        Only the base assistant turn may differ between `prefix` (the base alone) and `full`: what comes before it
        must be unchanged, and the cut must leave exactly one turn header between them.
        """
        end = self.tokenizer.convert_ids_to_tokens(self.vision.im_end)
        start = self.tokenizer.convert_ids_to_tokens(self.vision.im_start)
        turn_at = prefix.rfind(start)
        cut = _after_nth(full, end, prefix.count(end))
        if turn_at < 0 or cut < 0 or full[:turn_at] != prefix[:turn_at] or full[turn_at:cut].count(start) != 1:
            raise DeltaEncodingError(
                "chat template rewrites more than the assistant turn before an observation: no per-turn delta exists\n"
                + _first_difference(prefix, full)
            )
        delta = full[cut:]
        if not delta.startswith(self.turn_separator()):
            raise DeltaEncodingError(
                f"chat template separates an assistant turn from an observation with {delta[:20]!r}, "
                f"not with its usual {self.turn_separator()!r}"
            )
        return delta

    # ---------------------------------------------------------------- check
    def rerender_conversation(
        self,
        prompt: Sequence[dict[str, Any]],
        turns: Sequence[tuple[list[int], Sequence[dict[str, Any]] | None]],
        *,
        tools: list[dict] | None = None,
    ) -> str:
        """Render the whole episode in one go: prompt, then per turn the model's text and its observation.

        This is the plain `apply_chat_template` re-render. For a template that rewrites earlier turns it shows the
        rewritten history (earlier reasoning dropped), not what the model saw: see `rerender_as_generated`.
        """
        messages = list(prompt)
        last_obs = True
        for model_ids, observation in turns:
            ids = list(model_ids)
            # Only <|im_end|> is the template's own turn end; another stop token (e.g. <|endoftext|>) the model
            # sampled stays part of the turn's text, and the delta encoding closed the turn after it.
            if ids and ids[-1] == self.vision.im_end:
                ids = ids[:-1]
            messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=False)})
            last_obs = bool(observation)
            if observation:
                messages.extend(observation)
        return self.render(messages, tools=tools, add_generation_prompt=last_obs)

    def rerender_as_generated(
        self,
        prompt: Sequence[dict[str, Any]],
        turns: Sequence[tuple[list[int], Sequence[dict[str, Any]] | None]],
        *,
        tools: list[dict] | None = None,
    ) -> str:
        """The episode as the model saw it, built from template renderings of the real conversation: the prompt
        with its generation prompt; then per turn the model's text verbatim (decoded with special tokens, closed
        with `<|im_end|>` if the model stopped otherwise) and, after an observation, what the template renders
        after that assistant turn for the conversation up to the observation (separator, observation, generation
        prompt). How the template would rewrite earlier turns lies before each cut and never enters.

        Independent of the base conversation `encode_observation` uses, so it checks the deltas against the
        template on the episode's own context (system prompt, tools, earlier images). Costs two renderings per turn.
        """
        end = self.tokenizer.convert_ids_to_tokens(self.vision.im_end)
        text = self.render(prompt, tools=tools, add_generation_prompt=True)
        messages = list(prompt)
        for model_ids, observation in turns:
            ids = list(model_ids)
            ended = bool(ids) and ids[-1] == self.vision.im_end
            text += self.tokenizer.decode(ids, skip_special_tokens=False)
            content = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            messages.append({"role": "assistant", "content": content})
            if not observation:
                continue
            closed = self.render(messages, tools=tools, add_generation_prompt=False)
            messages.extend(observation)
            full = self.render(messages, tools=tools, add_generation_prompt=True)
            cut = _after_nth(full, end, closed.count(end))
            if cut < 0:
                raise DeltaEncodingError("chat template re-render has fewer turn ends than the episode's turns")
            text += ("" if ended else end) + full[cut:]
        return text

    def reference_render(
        self,
        prompt: Sequence[dict[str, Any]],
        turns: Sequence[tuple[list[int], Sequence[dict[str, Any]] | None]],
        *,
        tools: list[dict] | None = None,
    ) -> str:
        """What the finalize check compares the incremental ids with: the plain re-render of the whole episode for an
        append-only template, the as-generated rendering for one that rewrites earlier turns."""
        if self.template_kind is TemplateKind.REWRITES_HISTORY:
            return self.rerender_as_generated(prompt, turns, tools=tools)
        return self.rerender_conversation(prompt, turns, tools=tools)


# ---------------------------------------------------------------------------- SFT transcripts
class TranscriptError(ValueError):
    """A conversation that cannot be laid out as one training sequence with an exact assistant mask."""


@dataclass
class EncodedTranscript:
    """A whole conversation as one training sequence, in the wire view (one pad per image).

    `wire_ids` [L]: the conversation through its last assistant turn's end token, as the model sees it when it
    generates each assistant turn; `loss_mask` [L] 0/1: 1 exactly on the tokens of each trained assistant turn's
    content and its `<|im_end|>`; `texts`/`trained`: the rendered pieces the ids are the tokens of, and whether
    each is trained; `images`: the conversation's image items up to that turn, in placeholder order.
    """

    wire_ids: list[int]
    loss_mask: list[int]
    texts: list[str]
    trained: list[bool]
    images: list[Any]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def training_view(self, encoder: ChatEncoder) -> tuple[list[int], list[int], list[str], dict[str, np.ndarray] | None]:
        """(ids with every pad expanded as the engine expands it, the mask expanded alike (pads are never trained),
        the images as PNG data URLs, their processor tensors or None): the images are processed here, on use."""
        urls, mm = encoder._encode_images(list(self.images))
        grid = None if mm is None else mm["image_grid_thw"]
        ids = encoder.expand_image_pads(self.wire_ids, grid)
        mask: list[int] = []
        k = 0
        for token, m in zip(self.wire_ids, self.loss_mask):
            if token == encoder.vision.image_pad:
                mask.extend([0] * num_image_pads(grid[k], encoder.merge_size))
                k += 1
            else:
                mask.append(m)
        return ids, mask, urls, mm


def encode_transcript(
    encoder: ChatEncoder,
    messages: Sequence[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    trained_turns: Sequence[bool] | None = None,
) -> EncodedTranscript:
    """Tokens and assistant-token loss mask of a finished conversation (SFT), from the chat template alone.

    The sequence is built like a rollout builds an episode, with the assistant turns standing for the model's
    tokens, so SFT trains exactly the view the model generates in: the rendering of the messages before the first
    assistant turn with the generation prompt (mask 0); then per assistant turn the template's text for it after
    that generation prompt, up to and including its `<|im_end|>` (mask 1 when trained, the template's
    separator after it is not part of the turn); and between two assistant turns what the template renders after
    the earlier one's `<|im_end|>` up to the next generation prompt (mask 0: separator, observations, header).
    Each piece is tokenized on its own, as rollout tokenizes prompt and observation deltas; the special tokens
    that delimit the pieces split the tokenizer's input. Messages after the last assistant turn carry no loss and
    are left out.

    For an append-only template (Qwen3-VL-Instruct) the pieces are exactly the template's rendering of the
    conversation (checked here). A history-rewriting template (Qwen3 thinking) renders each earlier turn as the
    model generated it, not as a later re-render would rewrite it (docs/guides/configuration.md, Instruct and Thinking templates).

    `trained_turns`: per assistant message, whether it is trained (default all; slime's `step_loss_mask`).
    Raises TranscriptError for a conversation without assistant turn, an assistant turn with images, or a
    template whose rendering does not split into these pieces.
    """
    end = encoder.tokenizer.convert_ids_to_tokens(encoder.vision.im_end)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise TranscriptError("the conversation has no assistant message (nothing to train)")
    trained = [True] * len(turns) if trained_turns is None else [bool(t) for t in trained_turns]
    if len(trained) != len(turns):
        raise TranscriptError(f"{len(trained)} trained flags for {len(turns)} assistant messages")
    if not any(trained):
        raise TranscriptError("every assistant message is excluded from the loss (step_loss_mask 0): nothing to train")
    if message_clips(messages):
        raise TranscriptError("clips in SFT conversations are not supported yet (docs/guides/video.md)")
    for i in turns:
        if message_images([messages[i]]):
            raise TranscriptError(f"message {i}: an assistant turn cannot contain images (the model never generates them)")

    texts: list[str] = []
    flags: list[bool] = []
    closed = ""  # the rendering through the previous assistant turn (its <|im_end|> counted, not its separator)
    for k, i in enumerate(turns):
        before = encoder.render(messages[:i], tools=tools, add_generation_prompt=True)
        if k == 0:
            texts.append(before)
        else:
            cut = _after_nth(before, end, closed.count(end))
            if cut < 0:
                raise TranscriptError(f"message {i}: the chat template renders fewer turn ends than the conversation "
                                      "has turns before it")
            texts.append(before[cut:])
        flags.append(False)
        through = encoder.render(messages[: i + 1], tools=tools, add_generation_prompt=False)
        if not through.startswith(before):
            raise TranscriptError(f"message {i}: the chat template renders the assistant turn somewhere else than "
                                  "after its generation prompt\n" + _first_difference(before, through))
        turn = through[len(before) :]
        stop = turn.rfind(end)
        if stop < 0:
            raise TranscriptError(f"message {i}: the chat template does not end the assistant turn with {end!r}")
        texts.append(turn[: stop + len(end)])
        flags.append(trained[k])
        closed = through[: len(before) + stop + len(end)]

    if encoder.template_kind is TemplateKind.APPEND_ONLY:
        whole = "".join(texts)
        rendered = encoder.render(messages[: turns[-1] + 1], tools=tools, add_generation_prompt=False)
        if not rendered.startswith(whole) or rendered[len(whole) :] not in ("", encoder.turn_separator()):
            raise TranscriptError("the pieces of the conversation differ from the chat template's rendering of it\n"
                                  + _first_difference(whole, rendered))

    ids: list[int] = []
    mask: list[int] = []
    for text, flag in zip(texts, flags):
        piece = encoder.tokenize(text)
        ids.extend(piece)
        mask.extend([int(flag)] * len(piece))
    images = message_images(messages[: turns[-1] + 1])
    if sum(1 for t in ids if t == encoder.vision.image_pad) != len(images):
        raise TranscriptError(f"the rendering has {sum(1 for t in ids if t == encoder.vision.image_pad)} image "
                              f"placeholders but the conversation {len(images)} images")
    return EncodedTranscript(ids, mask, texts, flags, images)


def _after_nth(text: str, token: str, n: int) -> int:
    """Index just after the n-th occurrence (1-based) of `token` in `text`; -1 if there are fewer (or n < 1)."""
    at = -len(token)
    for _ in range(n):
        at = text.find(token, at + len(token))
        if at < 0:
            return -1
    return at + len(token) if n >= 1 else -1


def check_prefix_stability(encoder: ChatEncoder, wire_ids: Sequence[int], rendered: str, mode: str, name: str = "sample") -> bool:
    """Compare incrementally built compact ids with the template's rendering of the conversation
    (`ChatEncoder.reference_render`: the full re-render, or the as-generated one for a history-rewriting template).

    The incremental text must equal the rendered text, except that the rendering may close a final model turn
    (with `<|im_end|>` and/or the template's separator). Returns True when they agree; on disagreement raises
    (`strict`), logs a warning (`warn`) or does nothing (`off`) and returns False.
    """
    if mode == "off":
        return True
    incremental = encoder.tokenizer.decode(list(wire_ids), skip_special_tokens=False)
    tail = rendered[len(incremental) :]
    end = encoder.tokenizer.convert_ids_to_tokens(encoder.vision.im_end)
    # A finished episode may stop at <|im_end|> (the template adds its separator), or inside a model turn
    # cut by the budget or an abort (the template closes that turn).
    allowed_tails = ("", encoder.turn_separator(), end + encoder.turn_separator())
    ok = rendered.startswith(incremental) and tail in allowed_tails
    if ok:
        return True
    message = f"{name}: incremental token ids differ from the chat template's re-render\n" + _first_difference(incremental, rendered)
    if mode == "strict":
        raise DeltaEncodingError(message)
    if mode != "warn":
        raise ValueError(f"unknown prefix-stability mode {mode!r} (strict, warn, off)")
    logger.warning(message)
    return False


def _first_difference(a: str, b: str, context: int = 40) -> str:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            return f"  at char {i1}: {a[max(0, i1 - context) : i2 + context]!r}\n  vs        {b[max(0, j1 - context) : j2 + context]!r}"
    return f"  lengths differ: {len(a)} vs {len(b)}"
