"""SGLang's native `/generate` wire format: request validation, prompt preparation, response bodies.

Field names, defaults and finish-reason shapes are those of SGLang's `GenerateReqInput`,
`SamplingParams` and `schedule_batch.py` (see `reference/sglang_api.md` §1). A request the engine
cannot honour exactly (streaming, input log-probs, penalties, grammars) is refused with a
`RequestError` naming the field, never silently served differently.

Images: each `<|vision_start|>` + one or more `<|image_pad|>` + `<|vision_end|>` run is one image
(compact, as the rollout sends, or already expanded), paired in order with `image_data`, then
expanded with the same HF image processor the trainer uses (`rollout.processing`, `ChatEncoder`).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from jaxrl_vlm.engine.prefix_cache import ImageSpan, image_spans
from jaxrl_vlm.models.config import Qwen3VLConfig
from jaxrl_vlm.models.rope import get_rope_index
from rollout.encoding import ChatEncoder, compact_pad_runs
from rollout.sglang_wire import GENERATE_KEYS, SAMPLING_KEYS
from rollout.processing import ImageDecodeError, load_image, process_images

# GenerateReqInput / SamplingParams field names (sglang io_struct.py, sampling_params.py).
# Fields we accept only at their SGLang default (the engine does not implement them).
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
}
_UNSUPPORTED_REQUEST_DEFAULTS: dict[str, Any] = {
    "input_embeds": None, "video_data": None, "audio_data": None, "stream": False, "top_logprobs_num": None,
    "token_ids_logprob": None, "return_hidden_states": False, "return_routed_experts": False,
    "custom_logit_processor": None, "lora_path": None, "lora_id": None,
}
DEFAULT_MAX_NEW_TOKENS = 128


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400); the message names the field at fault."""


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error object."""
    return {"error": {"message": message}}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise RequestError(f"sampling_params.{key} must be a finite number, got {value!r}")
    return float(value)


def _flag(obj: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, validated (SGLang names and defaults)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

    @property
    def needs_filter(self) -> bool:
        """Whether top-k / top-p / min-p change the distribution (selects the filtered program)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_json(cls, params: Any, vocab_size: int) -> SamplingParams:
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RequestError(f"sampling_params must be an object, got {type(params).__name__}")
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            raise RequestError(f"SamplingParams got unexpected keyword argument(s): {unknown}")
        for key, default in _UNSUPPORTED_SAMPLING_DEFAULTS.items():
            if params.get(key, default) not in (default, None):
                raise RequestError(f"sampling_params.{key}={params[key]!r} is not supported by the embedded engine")

        max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if max_new is None:
            max_new = DEFAULT_MAX_NEW_TOKENS
        if not _is_int(max_new) or max_new < 0:
            raise RequestError(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new!r}")
        temperature = _number(params, "temperature", 1.0)
        if temperature < 0:
            raise RequestError(f"sampling_params.temperature must be non-negative, got {temperature}")
        top_p = _number(params, "top_p", 1.0)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
        top_k = params.get("top_k", -1)
        if top_k is None:
            top_k = -1
        if not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
            raise RequestError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {top_k!r}")
        min_p = _number(params, "min_p", 0.0)
        if not 0.0 <= min_p <= 1.0:
            raise RequestError(f"sampling_params.min_p must be in [0, 1], got {min_p}")

        stop = params.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise RequestError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise RequestError("sampling_params.stop must not contain an empty string")

        stop_ids = params.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of integers, got {stop_ids!r}")

        seed = params.get("sampling_seed")
        if seed is not None and not _is_int(seed):
            raise RequestError(f"sampling_params.sampling_seed must be an integer, got {seed!r}")

        bias = params.get("logit_bias") or {}
        if not isinstance(bias, dict):
            raise RequestError(f"sampling_params.logit_bias must be an object of token id -> bias, got {bias!r}")
        parsed_bias: list[tuple[int, float]] = []
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise RequestError(f"sampling_params.logit_bias key {key!r} is not a token id") from None
            if not 0 <= token < vocab_size:
                raise RequestError(f"sampling_params.logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
                raise RequestError(f"sampling_params.logit_bias[{key!r}] must be a number, got {value!r}")
            parsed_bias.append((token, float(value)))

        n = params.get("n", 1)
        if n is None:
            n = 1
        if not _is_int(n) or n < 1:
            raise RequestError(f"sampling_params.n must be an integer >= 1, got {n!r}")
        where = "sampling_params."
        return cls(
            max_new_tokens=int(max_new),
            temperature=temperature,
            top_p=top_p,
            top_k=int(top_k),
            min_p=min_p,
            stop=stop,
            stop_token_ids=frozenset(int(t) for t in stop_ids),
            ignore_eos=_flag(params, "ignore_eos", False, where),
            skip_special_tokens=_flag(params, "skip_special_tokens", True, where),
            spaces_between_special_tokens=_flag(params, "spaces_between_special_tokens", True, where),
            no_stop_trim=_flag(params, "no_stop_trim", False, where),
            sampling_seed=None if seed is None else int(seed),
            logit_bias=tuple(parsed_bias),
            n=int(n),
        )


@dataclass
class RawGenerate:
    """One prompt of a (possibly batched) `/generate` body, validated but not yet tokenized."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    image_data: list[str]
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool


def _per_item(value: Any, n: int, name: str, is_item: Any) -> list[Any]:
    """Broadcast a batch field: one value for every prompt, or a list with one per prompt."""
    if isinstance(value, list) and not is_item(value):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return list(value)
    return [value] * n


def _image_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if not isinstance(item, str):
            kind = f"an object with format {item.get('format')!r}" if isinstance(item, dict) else type(item).__name__
            raise RequestError(
                f"{where}[{i}] is {kind}; the embedded engine takes images as data URLs, base64 strings or local paths"
            )
    return list(items)


def parse_generate(body: Any, vocab_size: int) -> tuple[list[RawGenerate], bool]:
    """Validate a `/generate` body. Returns (prompts, is_batch); `n > 1` expands into n prompts."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object (GenerateReqInput)")
    unknown = sorted(set(body) - GENERATE_KEYS)
    if unknown:
        raise RequestError(f"unknown GenerateReqInput field(s): {unknown}")
    for key, default in _UNSUPPORTED_REQUEST_DEFAULTS.items():
        if body.get(key, default) not in (default, None, False):
            raise RequestError(f"{key}={body[key]!r} is not supported by the embedded engine")
    start = body.get("logprob_start_len")
    if start is not None and start != -1:
        raise RequestError(f"logprob_start_len={start!r}: input-token log-probs are not supported (use -1)")
    given = [k for k in ("text", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError("Either text, input_ids or input_embeds should be provided (exactly one).")

    if body.get("text") is not None:
        text = body["text"]
        is_batch = isinstance(text, list)
        prompts: list[Any] = text if is_batch else [text]
        if not prompts or not all(isinstance(t, str) for t in prompts):
            raise RequestError("text must be a string or a non-empty list of strings")
    else:
        ids = body["input_ids"]
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        for i, row in enumerate(prompts):
            if not isinstance(row, list) or not row or not all(_is_int(t) for t in row):
                where = f"input_ids[{i}]" if is_batch else "input_ids"
                raise RequestError(f"{where} must be a non-empty list of integer token ids")
            bad = [t for t in row if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"input_ids contain ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    n_prompts = len(prompts)
    params_list = _per_item(body.get("sampling_params"), n_prompts, "sampling_params", lambda v: False)
    rids = _per_item(body.get("rid"), n_prompts, "rid", lambda v: False) if is_batch else [body.get("rid")]
    images = [body.get("image_data")]
    if is_batch:
        images = [None] * n_prompts if body.get("image_data") is None else body["image_data"]
        if not isinstance(images, list) or len(images) != n_prompts:
            raise RequestError(f"image_data of a batch must be a list with one entry per prompt ({n_prompts})")
    logprob = _flag(body, "return_logprob", False, "")
    text_in_lp = _flag(body, "return_text_in_logprobs", False, "")
    out: list[RawGenerate] = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams.from_json(params_list[i], vocab_size)
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r}")
        base_rid = rid or uuid.uuid4().hex
        image_items = _image_list(images[i], "image_data" + (f"[{i}]" if is_batch else ""))
        for k in range(params.n):
            out.append(
                RawGenerate(
                    rid=base_rid if params.n == 1 else f"{base_rid}-{k}",
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=None if isinstance(prompt, str) else [int(t) for t in prompt],
                    image_data=image_items,
                    params=params,
                    return_logprob=logprob,
                    return_text_in_logprobs=text_in_lp,
                )
            )
    return out, is_batch or len(out) > 1


@dataclass
class PreparedPrompt:
    """A prompt ready for prefill.

    input_ids int32 [L] (image pads expanded), positions int32 [3, L] (M-RoPE), rope_delta (decode
    positions continue at index + rope_delta), pixel_values float32 [P, C*T*p*p] and image_grid_thw
    int64 [N, 3] (None without images). images: where each image's pads are and a digest of its
    pixels, for the prefix cache (None: not computed yet; the scheduler computes it then).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    rope_delta: int
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    images: tuple[ImageSpan, ...] | None = None

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


class PromptPreparer:
    """Turns `RawGenerate` into `GenerateRequest`: tokenize, decode images, expand pads, positions.

    Thread-safe for concurrent `prepare` calls (stateless apart from read-only tokenizer/processor).
    """

    def __init__(self, tokenizer: Any, image_processor: Any | None, cfg: Qwen3VLConfig):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.cfg = cfg
        self.encoder = ChatEncoder(tokenizer, image_processor) if image_processor is not None else None

    def prepare(self, raw: RawGenerate) -> GenerateRequest:
        ids = list(self.tokenizer.encode(raw.text)) if raw.text is not None else list(raw.input_ids or [])
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        if self.cfg.video_token_id in ids:
            raise RequestError(f"input contains video pad tokens (id {self.cfg.video_token_id}); video input is not supported")
        compact = compact_pad_runs(ids, self.cfg.image_token_id)  # SGLang's legacy path accepts both forms
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
            images = []
            for i, item in enumerate(raw.image_data):
                try:
                    images.append(load_image(item))
                except ImageDecodeError as e:
                    raise RequestError(f"image_data[{i}]: {e}") from e
            try:
                mm = process_images(self.image_processor, images)
            except ValueError as e:  # e.g. an image too small for the processor's smart resize
                raise RequestError(f"image_data: the image processor refused the images ({e})") from e
            pixel_values, grid = mm["pixel_values"], mm["image_grid_thw"]
            expanded = self.encoder.expand_image_pads(compact, grid)
        else:
            expanded = compact
        input_ids = np.asarray(expanded, np.int32)
        try:
            positions, deltas = get_rope_index(input_ids[None], grid, None, self.cfg)
        except ValueError as e:
            raise RequestError(f"cannot place the images in the prompt: {e}") from e
        # Hashing the pixels here keeps it off the scheduler thread.
        images = image_spans(input_ids, pixel_values, grid, self.cfg.image_token_id, self.cfg.vision.spatial_merge_size)
        prompt = PreparedPrompt(input_ids, positions[:, 0], int(deltas[0]), pixel_values, grid, images)
        return GenerateRequest(raw.rid, prompt, raw.params, raw.return_logprob, raw.return_text_in_logprobs)


@dataclass
class GenerateOutput:
    """What the scheduler hands back for one request."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: str
    e2e_latency: float
    num_retractions: int = 0
    error: str | None = None  # an engine failure (HTTP 500), not a finish reason
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


def response_body(req: GenerateRequest, out: GenerateOutput, tokenizer: Any) -> dict[str, Any]:
    """The `/generate` answer for one request, as SGLang builds it."""
    params = req.params
    matched = out.finish_reason.get("matched")
    text_ids = out.output_ids
    if not params.no_stop_trim and out.finish_reason.get("type") == "stop" and _is_int(matched) and text_ids:
        text_ids = text_ids[:-1]  # SGLang trims a matched stop token from the text, not from output_ids
    text = tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
    if not params.no_stop_trim and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": out.weight_version,
        "num_retractions": out.num_retractions,
    }
    if req.return_logprob:
        texts = (
            [tokenizer.decode([t], skip_special_tokens=False) for t in out.output_ids]
            if req.return_text_in_logprobs
            else [None] * len(out.output_ids)
        )
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(out.output_logprobs, out.output_ids, texts)]
        meta["output_token_logprobs_length"] = len(out.output_ids)
    meta["e2e_latency"] = out.e2e_latency
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}
