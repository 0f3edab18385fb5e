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
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from PIL import Image

from rollout.processing import VisionTokens, image_to_data_url, load_image, num_image_pads, process_images

logger = logging.getLogger(__name__)

# A fixed stand-in conversation that ends with a finished assistant turn. The observation is rendered after
# it, so nothing that belongs to the start of a conversation (system prompt, tool list) can leak into a delta.
_BASE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "base"},
    {"role": "assistant", "content": "base"},
]


class DeltaEncodingError(ValueError):
    """The chat template cannot be split into per-turn deltas (it is not prefix-stable)."""


@dataclass
class EncodedSegment:
    """Tokens of one non-model segment (the prompt or one observation) in both views.

    `wire_ids` are compact (one pad per image), `train_ids` expanded; `image_data` are the segment's images as
    PNG data URLs (engine view) and `mm_inputs` their processor tensors (training view), None without images.
    """

    wire_ids: list[int]
    train_ids: list[int]
    image_data: list[str] = field(default_factory=list)
    mm_inputs: dict[str, np.ndarray] | None = None
    text: str = ""


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
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for item in content:
                if isinstance(item, dict) and item.get("type") == "image":
                    if "image" not in item:
                        raise ValueError(f"image content item without an 'image' value in a {message.get('role')!r} message")
                    images.append(item["image"])
    return images


def _engine_message(message: dict[str, Any]) -> dict[str, Any]:
    """Copy of a message whose image items carry no payload: the template only needs their type."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    items = [{"type": "image"} if isinstance(it, dict) and it.get("type") == "image" else it for it in content]
    return {**message, "content": items}


class ChatEncoder:
    """Renders chat messages with the model's template and encodes them into both token views."""

    def __init__(self, tokenizer: Any, image_processor: Any, vision: VisionTokens | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.vision = vision or VisionTokens.from_tokenizer(tokenizer)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self._separator_cache: str | None = None
        self._base_render_cache: str | None = None

    # ---------------------------------------------------------------- rendering
    def render(self, messages: Sequence[dict[str, Any]], *, tools: list[dict] | None = None, add_generation_prompt: bool) -> str:
        rendered = self.tokenizer.apply_chat_template(
            [_engine_message(m) for m in messages], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
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
        pil: list[Image.Image] = [load_image(item) for item in items]
        # PNG data URLs are lossless, so the engine decodes exactly the pixels the trainer processes here.
        urls = [item if isinstance(item, str) and item.startswith("data:image/png") else image_to_data_url(img) for item, img in zip(items, pil)]
        return urls, process_images(self.image_processor, pil)

    def _segment(self, text: str, image_items: list[Any]) -> EncodedSegment:
        wire = self.tokenize(text)
        urls, mm = self._encode_images(image_items)
        grid = None if mm is None else mm["image_grid_thw"]
        return EncodedSegment(wire_ids=wire, train_ids=self.expand_image_pads(wire, grid), image_data=urls, mm_inputs=mm, text=text)

    # ---------------------------------------------------------------- segments
    def encode_prompt(self, messages: Sequence[dict[str, Any]], *, tools: list[dict] | None = None) -> EncodedSegment:
        """The initial prompt with the generation prompt appended (the model speaks next)."""
        text = self.render(messages, tools=tools, add_generation_prompt=True)
        return self._segment(text, message_images(messages))

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
        if not full.startswith(prefix):
            raise DeltaEncodingError(
                "chat template is not prefix-stable: rendering an observation changes earlier text\n"
                + _first_difference(prefix, full)
            )
        end = self.tokenizer.convert_ids_to_tokens(self.vision.im_end)
        opening = "" if model_ended_turn else end
        text = opening + self.turn_separator() + full[len(prefix) :]
        return self._segment(text, message_images(messages))

    # ---------------------------------------------------------------- check
    def rerender_conversation(
        self,
        prompt: Sequence[dict[str, Any]],
        turns: Sequence[tuple[list[int], Sequence[dict[str, Any]] | None]],
        *,
        tools: list[dict] | None = None,
    ) -> str:
        """Render the whole episode in one go: prompt, then per turn the model's text and its observation."""
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


def check_prefix_stability(encoder: ChatEncoder, wire_ids: Sequence[int], rendered: str, mode: str, name: str = "sample") -> bool:
    """Compare incrementally built compact ids with a full re-render of the conversation.

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
