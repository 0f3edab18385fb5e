"""SGLang's native HTTP protocol, in one place (reference/sglang_api.md §1-2).

Everything that speaks or reads the protocol here uses this module: the rollout client, the scripted fake
server (`rollout.fake_engine`) and the embedded JAX engine's server (`jaxrl_vlm.engine.server`). It holds the
request fields and their validation, the `/generate` answer, the typed finish reasons, the pause modes, the
control bodies and answers, and the route table. Pure data and small functions: no jax, no aiohttp.
"""

from __future__ import annotations

import base64
import datetime
import enum
import hmac
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

# ---------------------------------------------------------------------------------------------- fields

# GenerateReqInput field names (sglang io_struct.py). sgl-router 0.3.2 adds the last five to every body it
# forwards, and SGLang accepts them.
GENERATE_KEYS = frozenset({
    "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params", "rid",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "modalities", "session_params", "session_id", "routing_key", "priority",
    "lora_path", "lora_id", "return_hidden_states", "return_routed_experts", "custom_logit_processor",
    "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "model", "background", "no_logs", "return_bytes", "return_entropy",
})
# SamplingParams field names (sglang sampling_params.py).
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed",
    "custom_params", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag", "stream_interval",
})
DEFAULT_MAX_NEW_TOKENS = 128
# The most generations one `/generate` body may start (sampling_params.n, times the prompts of a batch).
# SGLang has no such limit; without one, `n = 1e9` makes a server loop and grow until it stops answering.
DEFAULT_MAX_N = 256

# SGLang treats a temperature below this as greedy (top_k = 1) and then reports log-probs of the untempered
# distribution (reference/sglang_api.md).
GREEDY_TEMPERATURE = 1e-6


def logprob_temperature(temperature: float) -> float:
    """The temperature whose `log_softmax(logits / T)` the engine reports for a request sampled at `temperature`.

    The trainer scores tokens at this temperature so that its log-probs are those of the policy that sampled.
    """
    return 1.0 if float(temperature) < GREEDY_TEMPERATURE else float(temperature)


# ---------------------------------------------------------------------------------------------- errors


class RequestError(ValueError):
    """A request a server refuses (HTTP 400); the message names the field at fault."""


class RequestModelError(RequestError):
    """The body does not fit SGLang's request model: not a JSON object, or a top-level field missing, of the wrong
    type or outside its choices. SGLang's pydantic validation answers its OpenAI-style error object."""


class SchemaTypeError(RequestError):
    """A sampling parameter of the wrong JSON type, which SGLang's `/generate` schema gate refuses before parsing
    (`{"error": "<message>"}`)."""


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error object for a refused value (`{"error": {"message": ...}}`)."""
    return {"error": {"message": message}}


def refusal_body(error: RequestError) -> dict[str, Any]:
    """The body SGLang 0.5.23 answers with for `error`, by its kind (checked against SGLang's own app by
    tests/sglang_conformance): request-model validation, the schema gate, or a refused value."""
    if isinstance(error, RequestModelError):
        return {"object": "error", "message": str(error), "type": "Bad Request", "param": None, "code": 400}
    if isinstance(error, SchemaTypeError):
        return {"error": str(error)}
    return error_body(str(error))


def parse_json_body(raw: bytes | str, where: str) -> Any:
    """A request body as JSON; RequestError (HTTP 400) for invalid UTF-8, invalid JSON or nesting too deep to
    parse (json raises RecursionError, which would otherwise be a 500)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestModelError(f"{where}: request body nests JSON too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise RequestModelError(f"{where}: request body is not valid JSON ({e})") from e


# ---------------------------------------------------------------------------------------------- API key

# SGLang's `--api-key`: every request must carry `Authorization: Bearer <key>`, except paths starting with
# these (health and readiness probes stay open, as in SGLang 0.5.23's utils/auth.py decide_request_auth).
AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED_BODY = {"error": "Unauthorized"}  # SGLang's 401 answer


def authorization_header(api_key: str) -> dict[str, str]:
    """The header a client sends to a server started with `--api-key`."""
    return {"Authorization": f"Bearer {api_key}"}


def is_authorized(path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether a request to `path` with this Authorization header may be served (always, without a key). The
    scheme matches case-insensitively ("bearer k" is accepted, as SGLang does); the key in constant time."""
    if api_key is None or path.startswith(AUTH_EXEMPT_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(token.encode("utf-8", "replace"), api_key.encode("utf-8", "replace"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaTypeError(f"sampling_params.{key} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
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
class Unsupported:
    """Fields a server accepts only at SGLang's default, because it does not implement them: such a request is
    refused naming the field, never served differently."""

    server: str
    request: Mapping[str, Any] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- sampling


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
    def from_json(cls, params: Any, vocab_size: int | None = None, unsupported: Unsupported | None = None,
                  max_n: int = DEFAULT_MAX_N) -> SamplingParams:
        """Validate a `sampling_params` object. `vocab_size` (when known) bounds `logit_bias` ids; `max_n`
        bounds `n`."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RequestError(f"sampling_params must be an object, got {type(params).__name__}")
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            raise RequestError(f"SamplingParams got unexpected keyword argument(s): {unknown}")
        if unsupported is not None:
            for key, default in unsupported.sampling.items():
                if params.get(key, default) not in (default, None):
                    raise RequestError(f"sampling_params.{key}={params[key]!r} is not supported by {unsupported.server}")

        max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if max_new is None:
            max_new = DEFAULT_MAX_NEW_TOKENS
        if not _is_int(max_new):
            raise SchemaTypeError(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new!r}")
        if max_new < 0:
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

        n = params.get("n", 1)
        if n is None:
            n = 1
        if not _is_int(n) or n < 1:
            raise RequestError(f"sampling_params.n must be an integer >= 1, got {n!r}")
        if n > max_n:
            raise RequestError(f"sampling_params.n={n} is more than this server's maximum of {max_n} (max_n)")
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
            logit_bias=_logit_bias(params.get("logit_bias"), vocab_size),
            n=int(n),
        )


def _logit_bias(bias: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = bias or {}
    if not isinstance(bias, dict):
        raise RequestError(f"sampling_params.logit_bias must be an object of token id -> bias, got {bias!r}")
    parsed: list[tuple[int, float]] = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"sampling_params.logit_bias key {key!r} is not a token id") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"sampling_params.logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
            raise RequestError(f"sampling_params.logit_bias[{key!r}] must be a number, got {value!r}")
        parsed.append((token, float(value)))
    return tuple(parsed)


# ---------------------------------------------------------------------------------------------- /generate request


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
    return_routed_experts: bool = False
    # SGLang's `logprob_start_len`: -1, output log-probs only; k >= 0, also `input_token_logprobs` from prompt
    # position k (positions after image expansion). The embedded engine scores prompts with max_new_tokens 0 only.
    logprob_start_len: int = -1
    # SGLang's `video_data`: one video (a data URL of a video file, base64 or a path) per `<|video_pad|>`.
    video_data: list[str] = field(default_factory=list)


def check_generate_keys(body: Any) -> None:
    """A `/generate` body must be an object of GenerateReqInput fields (a typo is refused, not ignored)."""
    if not isinstance(body, dict):
        raise RequestModelError("request body must be a JSON object (GenerateReqInput)")
    unknown = sorted(set(body) - GENERATE_KEYS)
    if unknown:
        raise RequestError(f"unknown GenerateReqInput field(s): {unknown}")


def prompt_field(body: Mapping[str, Any]) -> str:
    """Which of text / input_ids / input_embeds carries the prompt (exactly one must)."""
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError("Either text, input_ids or input_embeds should be provided (exactly one).")
    return given[0]


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """Broadcast a batch field: one value for every prompt, or a list with one per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return list(value)
    return [value] * n


def _media_list(value: Any, where: str, server: str, kind: str = "images") -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if not isinstance(item, str):
            what = f"an object with format {item.get('format')!r}" if isinstance(item, dict) else type(item).__name__
            raise RequestError(f"{where}[{i}] is {what}; {server} takes {kind} as data URLs, base64 strings or local paths")
    return list(items)


def _per_prompt_media(body: Mapping[str, Any], key: str, n_prompts: int, is_batch: bool) -> list[Any]:
    """`body[key]` (image_data, video_data) as one entry per prompt: a batch lists one per prompt."""
    if not is_batch:
        return [body.get(key)]
    media = [None] * n_prompts if body.get(key) is None else body[key]
    if not isinstance(media, list) or len(media) != n_prompts:
        raise RequestError(f"{key} of a batch must be a list with one entry per prompt ({n_prompts})")
    return media


def parse_generate(body: Any, vocab_size: int, unsupported: Unsupported,
                   max_n: int = DEFAULT_MAX_N) -> tuple[list[RawGenerate], bool]:
    """Validate a `/generate` body. Returns (prompts, is_batch); `n > 1` expands into n prompts.

    At most `max_n` generations in all (n times the prompts of a batch), checked before any is built."""
    check_generate_keys(body)
    for key, default in unsupported.request.items():
        if body.get(key, default) not in (default, None, False):
            raise RequestError(f"{key}={body[key]!r} is not supported by {unsupported.server}")
    start = body.get("logprob_start_len")
    start = -1 if start is None else start
    if not _is_int(start) or start < -1:
        raise RequestError(f"logprob_start_len must be an integer >= -1, got {start!r}")
    kind = prompt_field(body)
    if kind == "input_embeds":
        raise RequestError(f"input_embeds is not supported by {unsupported.server}")
    if kind == "text":
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
    params_list = _per_item(body.get("sampling_params"), n_prompts, "sampling_params")
    rids = _per_item(body.get("rid"), n_prompts, "rid") if is_batch else [body.get("rid")]
    images = _per_prompt_media(body, "image_data", n_prompts, is_batch)
    videos = _per_prompt_media(body, "video_data", n_prompts, is_batch)
    logprob = _flag(body, "return_logprob", False, "")
    text_in_lp = _flag(body, "return_text_in_logprobs", False, "")
    routed = _flag(body, "return_routed_experts", False, "")
    all_params = [SamplingParams.from_json(p, vocab_size, unsupported, max_n) for p in params_list]
    if start >= 0 and any(p.max_new_tokens != 0 for p in all_params):
        # Prompt scoring is one full forward, outside the paged decode path (engine/runner.py `score`).
        raise RequestError(f"logprob_start_len={start}: {unsupported.server} returns input-token log-probs only "
                           "for prompts scored without generation (sampling_params.max_new_tokens 0)")
    total = sum(p.n for p in all_params)
    if total > max_n:
        raise RequestError(f"this request asks for {total} generations ({n_prompts} prompt(s) x n); this server "
                           f"starts at most {max_n} per request (max_n)")
    out: list[RawGenerate] = []
    for i, prompt in enumerate(prompts):
        params = all_params[i]
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r}")
        base_rid = rid or uuid.uuid4().hex
        where = f"[{i}]" if is_batch else ""
        image_items = _media_list(images[i], "image_data" + where, unsupported.server)
        video_items = _media_list(videos[i], "video_data" + where, unsupported.server, "videos")
        for k in range(params.n):
            out.append(RawGenerate(
                rid=base_rid if params.n == 1 else sub_request_rid(base_rid, k),
                text=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else [int(t) for t in prompt],
                image_data=image_items,
                video_data=video_items,
                params=params,
                return_logprob=logprob,
                return_text_in_logprobs=text_in_lp,
                return_routed_experts=routed,
                logprob_start_len=start,
            ))
    return out, is_batch or len(out) > 1


# ---------------------------------------------------------------------------------------------- finish reasons


class FinishType(enum.StrEnum):
    """`meta_info.finish_reason.type` (sglang schedule_batch.py). A str, so it compares equal to the wire text."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_TYPES = tuple(t.value for t in FinishType)


@dataclass(frozen=True)
class FinishReason:
    """Why a generation ended. stop: `matched` is the stop token id (int) or stop string (str); length:
    `length` is the max_new_tokens reached; abort: `message`, `status_code`, `err_type`."""

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @classmethod
    def stopped(cls, matched: int | str) -> FinishReason:
        return cls(FinishType.STOP, matched=matched)

    @classmethod
    def at_length(cls, length: int) -> FinishReason:
        return cls(FinishType.LENGTH, length=length)

    @classmethod
    def aborted(cls, message: str, status_code: int | None = None, err_type: str | None = None) -> FinishReason:
        return cls(FinishType.ABORT, message=message, status_code=status_code, err_type=err_type)

    def to_json(self) -> dict[str, Any]:
        """SGLang's object: FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR, FINISH_LENGTH or FINISH_ABORT."""
        if self.type is FinishType.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.type is FinishType.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}

    @classmethod
    def from_json(cls, fr: Any) -> FinishReason:
        """Parse `meta_info.finish_reason`; a ValueError names what breaks the contract."""
        if not isinstance(fr, dict) or fr.get("type") not in FINISH_TYPES:
            raise ValueError(f"meta_info.finish_reason must be an object with type in {FINISH_TYPES}, got {fr!r}")
        kind = FinishType(fr["type"])
        matched = fr.get("matched") if kind is FinishType.STOP else None
        if matched is not None and (isinstance(matched, bool) or not isinstance(matched, (int, str))):
            raise ValueError(f"meta_info.finish_reason.matched must be an int id or a str, got {matched!r}")
        length, message, status, err_type = fr.get("length"), fr.get("message"), fr.get("status_code"), fr.get("err_type")
        return cls(
            kind, matched=matched,
            length=length if _is_int(length) else None,
            message=message if isinstance(message, str) else None,
            status_code=status if _is_int(status) else None,
            err_type=err_type if isinstance(err_type, str) else None,
        )


# ---------------------------------------------------------------------------------------------- weight versions


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens `[start, end)` of one answer were sampled with weights `version`.

    SGLang 0.5.23 reports `meta_info.weight_versions` as such spans when weights changed while the request was alive
    (pause `retract` / `in_place`; `utils/weight_versions.py`), and `weight_version` is then the last span's: reading
    only `weight_version` would record every token as the newest version."""

    version: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


def parse_weight_version_spans(meta: Mapping[str, Any], num_tokens: int) -> tuple[WeightVersionSpan, ...]:
    """The spans of an answer's output tokens, in order: `meta_info.weight_versions` when present, else one span
    of `weight_version` over all of them (none when the answer names no version). A ValueError names what breaks
    the contract: spans must be `{version: str, start: int, end: int}`, contiguous from 0 and end at `num_tokens`."""
    raw = meta.get("weight_versions")
    if raw is None:
        version = meta.get("weight_version")
        return () if version is None else (WeightVersionSpan(str(version), 0, num_tokens),)
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"meta_info.weight_versions must be a non-empty list of spans, got {raw!r}")
    spans: list[WeightVersionSpan] = []
    for i, span in enumerate(raw):
        if not (isinstance(span, dict) and isinstance(span.get("version"), str) and _is_int(span.get("start"))
                and _is_int(span.get("end"))):
            raise ValueError(f"meta_info.weight_versions[{i}] must be {{version: str, start: int, end: int}}, got {span!r}")
        expected_start = spans[-1].end if spans else 0
        if span["start"] != expected_start or span["end"] < span["start"]:
            raise ValueError(f"meta_info.weight_versions[{i}] = {span!r} does not continue the spans at token "
                             f"{expected_start}")
        spans.append(WeightVersionSpan(span["version"], span["start"], span["end"]))
    if spans[-1].end != num_tokens:
        raise ValueError(f"meta_info.weight_versions end at token {spans[-1].end}, but the answer has {num_tokens} "
                         "output tokens")
    return tuple(spans)


# ---------------------------------------------------------------------------------------------- /generate answer


def generate_response(
    *,
    rid: str,
    text: str,
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    finish: FinishReason | Mapping[str, Any],
    prompt_tokens: int,
    weight_version: str,
    e2e_latency: float,
    return_logprob: bool,
    token_text: Callable[[int], str] | None = None,
    cached_tokens: int = 0,
    num_retractions: int = 0,
    routed_experts: str | None = None,
    input_logprobs: Sequence[tuple[float | None, int]] = (),
) -> dict[str, Any]:
    """One `/generate` answer as SGLang builds it. `token_text` (return_text_in_logprobs) fills the third
    entry of each `output_token_logprobs` item; `finish` may be a raw object (a scripted fault);
    `routed_experts` (`encode_routed_experts`) is added to `meta_info` when given (return_routed_experts);
    `input_logprobs` (logprob_start_len >= 0) are the (logprob, id) pairs of `input_token_logprobs`, the logprob
    None at prompt position 0 (nothing precedes it), as SGLang answers."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish.to_json() if isinstance(finish, FinishReason) else dict(finish),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": weight_version,
        "num_retractions": num_retractions,
    }
    if return_logprob:
        meta.update(_logprob_fields(output_ids, output_logprobs, token_text))
        meta["input_token_logprobs"] = [[lp, int(t), None if token_text is None else token_text(int(t))]
                                        for lp, t in input_logprobs]
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts
    meta["e2e_latency"] = e2e_latency
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def encode_routed_experts(ids: Any) -> str:
    """`meta_info.routed_experts` as SGLang sends it (0.5.7+, `return_routed_experts`): the base64 of the int32
    bytes of [prompt_tokens + completion_tokens - 1, num_hidden_layers, top_k] expert ids, C order (every
    forwarded position: the prompt's and every output token's but the last, which was never fed back)."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(meta: Mapping[str, Any]) -> Any:
    """int32 [positions, num_hidden_layers * top_k] from `meta_info.routed_experts` (None when absent); the row
    count is prompt_tokens + completion_tokens - 1, as SGLang sends it (a ValueError names a mismatch)."""
    raw = meta.get("routed_experts")
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError(f"meta_info.routed_experts must be a base64 string, got {type(raw).__name__}")
    flat = np.frombuffer(base64.b64decode(raw), dtype="<i4").astype(np.int32)
    rows = int(meta.get("prompt_tokens", 0)) + int(meta.get("completion_tokens", 0)) - 1
    if rows <= 0 or flat.size % rows:
        raise ValueError(f"meta_info.routed_experts holds {flat.size} ids, not a multiple of prompt_tokens + "
                         f"completion_tokens - 1 = {rows} positions")
    return flat.reshape(rows, -1)


def _logprob_fields(output_ids: Sequence[int], output_logprobs: Sequence[float],
                    token_text: Callable[[int], str] | None) -> dict[str, Any]:
    """The log-prob keys of `meta_info` (`return_logprob`): `(logprob, id, text|None)` triples per output token."""
    return {
        "input_token_logprobs": [],
        "output_token_logprobs": [[lp, t, None if token_text is None else token_text(t)]
                                  for lp, t in zip(output_logprobs, output_ids)],
        "output_token_logprobs_length": len(output_ids),
    }


# SGLang's message for a request aborted before it was scheduled (`TokenizerManager._handle_abort_req`).
QUEUED_ABORT_MESSAGE = "Abort in waiting queue"


def queued_abort_response(
    *,
    rid: str,
    text: str,
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    weight_version: str,
    e2e_latency: float,
    return_logprob: bool,
    token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """The answer SGLang 0.5.23 sends for a request aborted in its waiting queue (never scheduled, or retracted
    and re-queued): the tokenizer manager builds it, not the scheduler, so `meta_info` has no `prompt_tokens`,
    `cached_tokens`, `reasoning_tokens` or `num_retractions`, and the finish reason only `type` and `message`."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "abort", "message": QUEUED_ABORT_MESSAGE},
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
    }
    if return_logprob:
        meta.update(_logprob_fields(output_ids, output_logprobs, token_text))
    meta["completion_tokens"] = len(output_ids)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def sub_request_rid(rid: str, k: int) -> str:
    """The rid of generation k of a request with `sampling_params.n > 1` (SGLang's io_struct: `<rid>_<k>`)."""
    return f"{rid}_{k}"


# ---------------------------------------------------------------------------------------------- control


# `/release_memory_occupation` and `/resume_memory_occupation` take `{"tags": [...]}` of these (omitted: all).
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache")

# Our embedded engine's extension of `/update_weights_from_disk`: with this `load_format`, `model_path` names
# weights a trainer in the engine's own process staged in memory (`Engine.stage_weights`) instead of a
# directory, so the update runs the same pause/flush/update/continue sequence and sets the same version
# without touching a disk. Other engines (SGLang) do not know it: the trainer uses it only with its own engine.
IN_MEMORY_LOAD_FORMAT = "jaxrl_in_memory"


def require_body(body: Any, path: str) -> Any:
    """`body` itself; a missing one is refused as SGLang's request model refuses it (pause, continue, release and
    resume take a JSON body, even if only `{}`)."""
    if body is None:
        raise RequestModelError(f"{path}: empty request body, expected a JSON object")
    return body


def parse_memory_tags(body: Any) -> tuple[str, ...] | None:
    """The tags of a memory-occupation body (None: all); RequestError for anything but a list of known tags."""
    if body is None or (isinstance(body, dict) and body.get("tags") is None):
        return None
    tags = body.get("tags") if isinstance(body, dict) else body
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
        raise RequestError(f"tags must be a list of {list(MEMORY_TAGS)}, got {tags!r}")
    return tuple(tags)


class PauseMode(enum.StrEnum):
    """`/pause_generation` modes: abort returns in-flight requests as aborted; retract re-queues them (the
    cache can then be flushed); in_place keeps them in the running batch (flush_cache then fails)."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


PAUSE_MODES = tuple(m.value for m in PauseMode)


def as_pause_mode(mode: Any) -> PauseMode:
    """A pause mode from a caller; ValueError otherwise."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return PauseMode(mode)


def parse_pause(body: Any) -> PauseMode:
    """The mode of a `/pause_generation` body (missing, null or empty: abort, SGLang's default)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestModelError("pause_generation body must be a JSON object")
    mode = body.get("mode", PauseMode.ABORT) or PauseMode.ABORT
    if mode not in PAUSE_MODES:
        raise RequestModelError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return PauseMode(mode)


def paused_answer() -> dict[str, Any]:
    return {"status": "ok", "message": "Generation paused successfully."}


def continued_answer() -> dict[str, Any]:
    return {"status": "ok", "message": "Generation continued successfully."}


# `/flush_cache` answers 200 with FLUSH_OK, or 400 with FLUSH_BUSY while requests run or wait (callers retry).
_FLUSH_NOTE = "(When there are running or waiting requests, the operation will not be performed.)\n"
FLUSH_OK = "Cache flushed.\nPlease check backend logs for more details. " + _FLUSH_NOTE
# `/freeze_gc` answers 200 with this text (SGLang's `freeze_gc_async`).
FREEZE_GC_OK = "Garbage collection frozen.\n"
FLUSH_BUSY = "Cache not flushed. Please check backend logs for more details. " + _FLUSH_NOTE


@dataclass(frozen=True)
class AbortRequest:
    """A `/abort_request` body: one rid, or every request (`rid` None). SGLang aborts every request whose rid starts
    with `rid` (so a client's `<rid>.retry1` goes too), and treats a body with neither as a no-op."""

    rid: str | None

    def to_json(self) -> dict[str, Any]:
        return {"abort_all": True} if self.rid is None else {"rid": self.rid}

    @classmethod
    def from_json(cls, body: Any) -> AbortRequest | None:
        """The abort a body asks for; None for SGLang's no-op (`{}`, an empty rid without abort_all). `abort_all`
        follows pydantic's bool parsing, as SGLang's AbortReq does ("false" is false, never read as true)."""
        if not isinstance(body, dict):
            raise RequestError("abort_request body must be a JSON object with 'rid' or 'abort_all'")
        rid, abort_all = body.get("rid"), pydantic_bool(body.get("abort_all", False), "abort_all")
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r}")
        if abort_all:
            return cls(None)
        return cls(rid) if rid else None


# The strings pydantic (SGLang's request models) reads as a bool.
_PYDANTIC_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_PYDANTIC_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def pydantic_bool(value: Any, name: str) -> bool:
    """A bool field as SGLang's pydantic request models parse it: JSON bools, 0/1, and the strings
    true/false/yes/no/on/off/1/0 (any case); anything else is a 400."""
    if isinstance(value, bool):
        return value
    if _is_int(value) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _PYDANTIC_TRUE | _PYDANTIC_FALSE:
        return value.lower() in _PYDANTIC_TRUE
    if value is None:
        return False
    raise RequestModelError(f"{name} must be a boolean, got {value!r}")


@dataclass(frozen=True)
class UpdateWeightsRequest:
    """A `/update_weights_from_disk` body. None fields are left out, so the server applies its default."""

    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool | None = None
    abort_all_requests: bool | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": self.model_path}
        for key in ("weight_version", "load_format", "flush_cache", "abort_all_requests"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body

    @classmethod
    def from_json(cls, body: Any) -> UpdateWeightsRequest:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
            raise RequestModelError("update_weights_from_disk needs a non-empty string 'model_path'")
        version, load_format = body.get("weight_version"), body.get("load_format")
        if version is not None and not isinstance(version, str):  # SGLang's model refuses an int too (400)
            raise RequestModelError(f"weight_version must be a string, got {version!r}")
        if load_format is not None and not isinstance(load_format, str):
            raise RequestModelError(f"load_format must be a string, got {load_format!r}")
        return cls(
            model_path=body["model_path"],
            weight_version=None if version is None else str(version),
            load_format=load_format,
            flush_cache=None if body.get("flush_cache") is None else pydantic_bool(body["flush_cache"], "flush_cache"),
            # pydantic's bool, as SGLang's request model: "false" is false, never read as true
            abort_all_requests=pydantic_bool(body.get("abort_all_requests", False), "abort_all_requests"),
        )


def update_weights_answer(success: bool, message: str, num_paused_requests: int) -> dict[str, Any]:
    """The `/update_weights_from_disk` answer (HTTP 200 on success, 400 on failure)."""
    return {"success": success, "message": message, "num_paused_requests": num_paused_requests}


def loads_response(*, version: str, running: int, waiting: int, used_tokens: int, max_total_tokens: int,
                   max_running_requests: int, cache_hit_rate: float = 0.0) -> dict[str, Any]:
    """The body of `GET /v1/loads` (one data-parallel rank), which `SGLangClient.abort_all` polls until idle.

    SGLang 0.5.23's shape, key for key (`entrypoints/http_server.py`, checked against its own app by
    tests/sglang_conformance): an ISO-8601 timestamp, the version, the accelerator and one load object per rank
    (a Unix timestamp, request and token counts, usage ratios; `decode_moments` only with `include=core`
    details, null here). Counters an embedded engine does not keep are 0."""
    now = time.time()
    return {
        "timestamp": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "version": version,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [{
            "timestamp": now,
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": used_tokens,
            "num_total_tokens": used_tokens,
            "num_active_tokens": used_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": max_total_tokens,
            "max_running_requests": max_running_requests,
            "token_usage": used_tokens / max(1, max_total_tokens),
            "gen_throughput": 0.0,
            "cache_hit_rate": float(cache_hit_rate),
            "utilization": running / max(1, max_running_requests),
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }],
    }


# ---------------------------------------------------------------------------------------------- routes
# SGLang 0.5.23 has no `/get_weight_version`: the version is in `/model_info` only.


@dataclass(frozen=True)
class Route:
    """An endpoint both servers serve; `name` keys the server's handler."""

    methods: tuple[str, ...]
    path: str
    name: str


_GET, _POST = ("GET",), ("POST",)
ROUTES: tuple[Route, ...] = (
    Route(("POST", "PUT"), "/generate", "generate"),
    Route(_GET, "/health", "health"),
    Route(_GET, "/health_generate", "health_generate"),
    Route(_GET, "/get_model_info", "model_info"),  # the older name of /model_info
    Route(_GET, "/model_info", "model_info"),
    Route(_GET, "/get_server_info", "server_info"),  # the older name of /server_info
    Route(_GET, "/server_info", "server_info"),
    Route(_GET, "/ready", "ready"),
    Route(("GET", "POST"), "/flush_cache", "flush_cache"),
    Route(("GET", "POST"), "/freeze_gc", "freeze_gc"),
    Route(_POST, "/pause_generation", "pause_generation"),
    Route(_POST, "/continue_generation", "continue_generation"),
    Route(_POST, "/abort_request", "abort_request"),
    Route(_POST, "/update_weights_from_disk", "update_weights_from_disk"),
    Route(_GET, "/v1/loads", "loads"),
    Route(("GET", "POST"), "/release_memory_occupation", "release_memory_occupation"),
    Route(("GET", "POST"), "/resume_memory_occupation", "resume_memory_occupation"),
)

_H = TypeVar("_H")


def route_handlers(handlers: Mapping[str, _H]) -> list[tuple[str, str, _H]]:
    """(method, path, handler) for every route; `handlers` must name exactly the routes' handlers."""
    names = {r.name for r in ROUTES}
    if set(handlers) != names:
        raise ValueError(f"handlers missing {sorted(names - set(handlers))}, unknown {sorted(set(handlers) - names)}")
    return [(method, r.path, handlers[r.name]) for r in ROUTES for method in r.methods]
