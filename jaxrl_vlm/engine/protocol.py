"""The embedded engine's side of `/generate`: what it refuses, prompt preparation, its answer.

The wire format itself (fields, validation, finish reasons, answer shape) is `rollout.sglang_wire`. A
request the engine cannot honour exactly (streaming, input log-probs, penalties, grammars) is refused
with a `RequestError` naming the field (`EMBEDDED_UNSUPPORTED`), never silently served differently.

Images: each `<|vision_start|><|image_pad|><|vision_end|>` is one image (compact, as the rollout sends), paired in
order with `image_data`, then expanded with the same HF image processor the trainer uses (`rollout.processing`,
`ChatEncoder`). Already-expanded pads are refused, as SGLang 0.5.23's Qwen-VL fast path refuses them (its
`build_input_ids` asserts one pad per image).

Clips: each `<|video_pad|>` is one clip, paired in order with `video_data` (lossless video data URLs, as the rollout
sends them: `rollout.video_io`), processed by the same numpy video processor the trainer's encoder runs
(`rollout.video`) and expanded by the same `ChatEncoder.clip_tokens` (timestamps and frame groups for Qwen3-VL and
Qwen3.5, one run for Qwen2.5-VL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxrl_vlm.engine.clips import ClipInputs, clip_spans
from jaxrl_vlm.engine.prefix_cache import ImageSpan, image_spans
from jaxrl_vlm.models.families import VisionLanguageConfig
from jaxrl_vlm.models.rope import get_rope_index
from rollout.encoding import ChatEncoder, compact_pad_runs
from rollout.image_cache import ProcessedImageCache, cache_key
from rollout.processing import ImageDecodeError, ImageReadPolicy, load_image
from rollout.sglang_wire import (
    FinishReason,
    FinishType,
    RawGenerate,
    RequestError,
    SamplingParams,
    Unsupported,
    encode_routed_experts,
    generate_response,
    queued_abort_response,
)
from rollout.video import ClipError, VideoProcessorConfig
from rollout.video_io import ClipReadPolicy, load_clip

# What the embedded engine does not implement: such a request is refused naming the field (HTTP 400).
EMBEDDED_UNSUPPORTED = Unsupported(
    server="the embedded engine",
    request={
        "input_embeds": None, "audio_data": None, "stream": False, "top_logprobs_num": None,
        "token_ids_logprob": None, "return_hidden_states": False,
        "custom_logit_processor": None, "lora_path": None, "lora_id": None,
    },
    sampling={
        "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    },
)


@dataclass
class PreparedPrompt:
    """A prompt ready for prefill.

    input_ids int32 [L] (image pads expanded), positions int32 [3, L] (M-RoPE), rope_delta (decode
    positions continue at index + rope_delta), pixel_values float32 [P, C*T*p*p] and image_grid_thw
    int64 [N, 3] (None without images), clips the same for clips. images: where each image's and clip's pads are
    and a digest of its pixels, in token order, for the prefix cache (None: not computed yet; the scheduler
    computes it then, `visual_spans`).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    rope_delta: int
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    images: tuple[ImageSpan, ...] | None = None
    clips: ClipInputs | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class GenerateRequest:
    """A validated, tokenized request as the scheduler runs it."""

    rid: str
    prompt: PreparedPrompt
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    return_routed_experts: bool = False  # SGLang's field: answer with meta_info.routed_experts (MoE families)
    # SGLang's logprob_start_len: >= 0 asks for input_token_logprobs from that (expanded) prompt position on; the
    # scheduler then scores the prompt (max_new_tokens is 0, `parse_generate` checks it) instead of prefilling it.
    logprob_start_len: int = -1

    @property
    def scores_prompt(self) -> bool:
        return self.logprob_start_len >= 0


def visual_spans(prompt: PreparedPrompt, cfg: VisionLanguageConfig) -> tuple[ImageSpan, ...]:
    """Every picture's and clip's span and identity in `prompt` (pads expanded), in token order."""
    images = image_spans(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw, cfg.image_token_id,
                         cfg.vision.spatial_merge_size)
    return tuple(sorted(images + clip_spans(prompt.input_ids, prompt.clips, cfg), key=lambda span: span.start))


class PromptPreparer:
    """Turns `RawGenerate` into `GenerateRequest`: tokenize, decode images, expand pads, positions.

    `image_policy` says what `image_data` items may be read (data URLs and base64, local files only under the
    allowed directory) and caps their bytes and pixels. Thread-safe for concurrent `prepare` calls (the
    tokenizer and processor are read-only; the cache of preprocessed images locks).
    """

    def __init__(self, tokenizer: Any, image_processor: Any | None, cfg: VisionLanguageConfig,
                 image_policy: ImageReadPolicy, video_config: VideoProcessorConfig | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.cfg = cfg
        self.image_policy = image_policy
        # Clips are read as the images are: data URLs and base64, local files only under the same directory.
        self.clip_policy = ClipReadPolicy.for_server(image_policy.local_root if image_policy.read_local_files else None)
        self.encoder = (ChatEncoder(tokenizer, image_processor, video_config=video_config)
                        if image_processor is not None else None)
        # The encoder's own cache (one per engine); without an image processor no image is ever processed.
        self.images = self.encoder.images if self.encoder is not None else ProcessedImageCache(None)

    def prepare(self, raw: RawGenerate) -> GenerateRequest:
        ids = list(self.tokenizer.encode(raw.text)) if raw.text is not None else list(raw.input_ids or [])
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        compact = compact_pad_runs(ids, self.cfg.image_token_id)
        if len(compact) != len(ids):
            raise RequestError(
                f"input_ids hold already-expanded image pads ({len(ids) - len(compact)} extra <|image_pad|>): send one "
                "pad per image, <|vision_start|><|image_pad|><|vision_end|> (SGLang 0.5.23 refuses expanded pads too)")
        n_pads = sum(1 for t in compact if t == self.cfg.image_token_id)
        if n_pads != len(raw.image_data):
            raise RequestError(
                f"image count mismatch: {n_pads} image placeholder(s) (<|vision_start|><|image_pad|><|vision_end|>) "
                f"in the prompt but {len(raw.image_data)} image(s) in image_data"
            )
        pixel_values = grid = None
        if raw.image_data:
            if self.encoder is None:
                raise RequestError("this model directory has no preprocessor_config.json: image input is not available")

            def load(i: int) -> Any:
                try:
                    return load_image(raw.image_data[i], self.image_policy)
                except ImageDecodeError as e:
                    raise RequestError(f"image_data[{i}]: {e}") from e

            try:  # a data URL seen before (a group's shared prompt, earlier turns) is neither decoded nor processed
                mm = self.images.process([cache_key(item) for item in raw.image_data], load)
            except RequestError:  # an unreadable image_data item, named by `load`
                raise
            except ValueError as e:  # e.g. an image too small for the processor's smart resize
                raise RequestError(f"image_data: the image processor refused the images ({e})") from e
            pixel_values, grid = mm["pixel_values"], mm["image_grid_thw"]
            expanded = self.encoder.expand_image_pads(compact, grid)
        else:
            expanded = compact
        expanded, clips = self._expand_clips(expanded, raw.video_data)
        input_ids = np.asarray(expanded, np.int32)
        try:
            positions, deltas = get_rope_index(
                input_ids[None], grid, None, self.cfg, video_grid_thw=None if clips is None else clips.video_grid_thw,
                second_per_grid_ts=None if clips is None else clips.second_per_grid_ts)
        except ValueError as e:
            raise RequestError(f"cannot place the images and clips in the prompt: {e}") from e
        prompt = PreparedPrompt(input_ids, positions[:, 0], int(deltas[0]), pixel_values, grid, clips=clips)
        prompt.images = visual_spans(prompt, self.cfg)  # hashing the pixels here keeps it off the scheduler thread
        return GenerateRequest(raw.rid, prompt, raw.params, raw.return_logprob, raw.return_text_in_logprobs,
                               return_routed_experts=raw.return_routed_experts,
                               logprob_start_len=raw.logprob_start_len)

    def _expand_clips(self, ids: list[int], video_data: list[str]) -> tuple[list[int], ClipInputs | None]:
        """`ids` with each compact `<|video_pad|>` expanded as the trainer's encoder expands it, and the clips'
        processor outputs (None without clips)."""
        pad = self.cfg.video_token_id
        if len(compact_pad_runs(ids, pad)) != len(ids):
            raise RequestError("input_ids hold already-expanded video pads: send one <|video_pad|> per clip, as the "
                               "chat template renders it")
        n_pads = sum(1 for t in ids if t == pad)
        if n_pads != len(video_data):
            raise RequestError(f"clip count mismatch: {n_pads} video placeholder(s) (<|video_pad|>) in the prompt but "
                               f"{len(video_data)} clip(s) in video_data")
        if not video_data:
            return ids, None
        if self.encoder is None or self.encoder.video_config is None:
            raise RequestError("video input needs preprocessor_config.json and video_preprocessor_config.json in the "
                               "model directory; this one lacks one of them")

        def read(item: str) -> Any:
            try:
                return load_clip(item, self.clip_policy)
            except ClipError as e:
                raise RequestError(f"video_data[{video_data.index(item)}]: {e}") from e

        try:
            _, mm, tokens = self.encoder.encode_clips(video_data, read)
        except RequestError:
            raise
        except ValueError as e:  # ClipError: e.g. a clip too small for the processor's smart resize
            raise RequestError(f"video_data: the video processor refused the clips ({e})") from e
        return (self.encoder.expand_video_pads(ids, tokens),
                ClipInputs(mm["pixel_values_videos"], mm["video_grid_thw"], mm.get("second_per_grid_ts")))


@dataclass
class GenerateOutput:
    """What the scheduler hands back for one request."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    weight_version: str
    e2e_latency: float
    num_retractions: int = 0
    error: str | None = None  # an engine failure (HTTP 500), not a finish reason
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queued: bool = False  # aborted while waiting (never scheduled, or retracted): SGLang's queued-abort answer
    # return_routed_experts: int32 [prompt_tokens + completion_tokens - 1, num_hidden_layers, top_k] (None: not
    # asked, or the request holds no pages any more)
    routed_experts: Any = None
    # logprob_start_len >= 0: (logprob, id) of prompt positions [start, prompt_tokens), logprob None at position 0
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)


def response_body(req: GenerateRequest, out: GenerateOutput, tokenizer: Any) -> dict[str, Any]:
    """The `/generate` answer for one request: SGLang trims a matched stop from the text, not from output_ids."""
    params, finish = req.params, out.finish_reason
    stopped = not params.no_stop_trim and finish.type is FinishType.STOP
    text_ids = out.output_ids
    if stopped and isinstance(finish.matched, int) and text_ids:
        text_ids = text_ids[:-1]
    text = tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
    if finish.type is FinishType.STOP and isinstance(finish.matched, str):
        # SGLang's detokenizer cuts at the matched stop string: before it, or after it with no_stop_trim.
        cut = text.find(finish.matched)
        if cut >= 0:
            text = text[:cut] if stopped else text[:cut + len(finish.matched)]
    token_text = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if req.return_text_in_logprobs else None
    if out.queued:
        return queued_abort_response(
            rid=out.rid, text=text, output_ids=out.output_ids, output_logprobs=out.output_logprobs,
            weight_version=out.weight_version, e2e_latency=out.e2e_latency, return_logprob=req.return_logprob,
            token_text=token_text)
    return generate_response(
        rid=out.rid, text=text, output_ids=out.output_ids, output_logprobs=out.output_logprobs, finish=finish,
        prompt_tokens=out.prompt_tokens, weight_version=out.weight_version, e2e_latency=out.e2e_latency,
        return_logprob=req.return_logprob, cached_tokens=out.cached_tokens, num_retractions=out.num_retractions,
        token_text=token_text,
        routed_experts=None if out.routed_experts is None else encode_routed_experts(out.routed_experts),
        input_logprobs=out.input_logprobs,
    )
