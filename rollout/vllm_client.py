"""`VLLMClient`: the rollout client against a vLLM server (`--engine-api vllm`), protocol in `rollout/vllm_wire.py`.

It keeps `SGLangClient`'s whole behaviour (connection pool, timeouts, bounded retries, the weight-update gate, engine
loss, router worker loss, `sync_weights_from_disk`'s pause -> flush -> update -> continue that never leaves an engine
paused) and changes only what is said on the wire. So the episode loop, the weight syncer and the staleness checks
cannot tell the engines apart:

- `/generate` -> `/inference/v1/generate`, its answer mapped onto SGLang's and checked by the same parser;
- a teacher's prompt log-probs (`/generate` with `logprob_start_len: 0`) -> the same route with
  `sampling_params.prompt_logprobs: 0` (`prompt_logprobs`, on-policy distillation);
- `/pause_generation` -> `/pause`, `/continue_generation` -> `/resume`, `/flush_cache` -> `/reset_prefix_cache`;
- `/update_weights_from_disk` -> `/collective_rpc reload_weights` with the exported directory, then
  `/update_weight_version`; the version is read back from `/weight_info` and must be the one set;
- `/v1/loads` -> `/load` (the requests in flight), `/model_info` -> `/v1/models` + `/weight_info`.

vLLM-only calls: the weight-delta extension's RPCs (`delta_states`, `update_weights_from_disk` with
`load_format=vllm_wire.DELTA_LOAD_FORMAT`, `delta_checksums`; `jaxrl_vlm.vllm_delta` drives them), and the attach
checks that refuse a server which cannot serve training (`check_logprobs_mode`, `check_reloadable_head`).

This module never imports jax.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollout import vllm_wire
from rollout.client import (
    EngineRefused,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailable,
    GenerateResult,
    SGLangClient,
    parse_generate_response,
    parse_prompt_logprobs,
)
from rollout.sglang_wire import as_pause_mode

logger = logging.getLogger(__name__)

ENGINE_APIS = ("sglang", "vllm")


class DeltaUnsupported(RuntimeError):
    """A vLLM worker without the project's weight-delta extension (started without `--worker-extension-cls
    jaxrl_vlm_worker.WeightDeltaExtension`, or not in dev mode): it takes full syncs only. `reason` says what
    answered."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"{url}: {reason}")


class VLLMClient(SGLangClient):
    """Async client for one vLLM server (dev mode, `--enable-scale-out`), or several behind a router."""

    engine_api = "vllm"
    # vLLM 0.32's in-place reload (`reload_weights`) re-creates the embedding's tensor and leaves a tied LM head on
    # the old one: measured, logits stay those of the first weights (0.49 max log-prob error after one update) while
    # the untied model reloads exactly (2e-6). So versions are exported with an explicit head, and the server must
    # have been started from an untied checkpoint (`check_reloadable_head`).
    needs_untied_export = True

    generate_path = vllm_wire.GENERATE_PATH
    lora_load_path = vllm_wire.LOAD_LORA_PATH
    lora_unload_path = vllm_wire.UNLOAD_LORA_PATH

    def _generate_body(self, input_ids: Sequence[int], image_data: Sequence[str] | None,
                       sampling_params: Mapping[str, Any], return_logprob: bool, rid: str,
                       video_data: Sequence[str] | None = None) -> dict[str, Any]:
        try:
            return vllm_wire.generate_body(input_ids, image_data=image_data, params=sampling_params,
                                           return_logprob=return_logprob, rid=rid, lora_name=self.lora_name,
                                           video_data=video_data)
        except vllm_wire.VLLMRequestError as exc:
            raise EngineRequestError(self.url + self.generate_path, None, str(exc), 0,
                                     reason="request cannot be sent to vLLM") from None

    @staticmethod
    def _with_rid(body: dict[str, Any], rid: str) -> dict[str, Any]:
        return {**body, "request_id": rid}

    def _with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` selecting the adapter loaded now by its name as `model` (vLLM's convention), or the base."""
        if body.get("model") == self.lora_name:
            return body
        out = {k: v for k, v in body.items() if k != "model"}
        if self.lora_name is not None:
            out["model"] = self.lora_name
        return out

    def _parse_generate(self, reply: Any, return_logprob: bool) -> GenerateResult:
        """The answer mapped onto SGLang's `/generate` answer, then checked by the same parser."""
        endpoint = self.url + self.generate_path
        try:
            answer = vllm_wire.to_sglang_answer(reply.data, return_logprob=return_logprob)
        except vllm_wire.VLLMAnswerError as exc:
            raise EngineResponseError(endpoint, reply.status, reply.text, reply.attempts, reason=str(exc)) from None
        return parse_generate_response(answer, endpoint=endpoint, return_logprob=return_logprob,
                                       attempts=reply.attempts, raw_text=reply.text, vocab_size=self.vocab_size)

    async def prompt_logprobs(self, input_ids: Sequence[int], *, image_data: Sequence[str] | None = None,
                              temperature: float = 1.0, timeout_s: float | None = None) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for every position i >= 1 after image expansion, from vLLM's prompt
        log-probs on the token route (`sampling_params.prompt_logprobs: 0`, `vllm_wire.prompt_logprobs_body`), mapped
        onto SGLang's answer and read by the same parser. vLLM's prompt log-probs are always those of the
        temperature-1 distribution: another `temperature` is refused (ValueError)."""
        if float(temperature) != vllm_wire.PROMPT_LOGPROBS_TEMPERATURE:
            raise ValueError(f"vLLM scores prompts at temperature 1 only (its prompt log-probs skip the sampling "
                             f"processors), got temperature={temperature}")
        rid = uuid.uuid4().hex
        body = vllm_wire.prompt_logprobs_body(input_ids, image_data=image_data, rid=rid, lora_name=self.lora_name)
        endpoint = self.url + self.generate_path
        reply = await self._request(
            "POST", self.url, self.generate_path,
            body_for_attempt=lambda k: body if k == 1 else self._with_rid(body, f"{rid}.retry{k - 1}"),
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s, wait_for_engine=True)
        try:
            answer = vllm_wire.prompt_logprobs_answer(reply.data)
        except vllm_wire.VLLMAnswerError as exc:
            raise EngineResponseError(endpoint, reply.status, reply.text, reply.attempts, reason=str(exc)) from None
        return parse_prompt_logprobs(answer, endpoint=endpoint, attempts=reply.attempts, raw_text=reply.text)

    # ---- health and info --------------------------------------------------------------------

    async def _probe_health(self, url: str, timeout_s: float) -> tuple[bool, str]:
        """One probe: GET /health (vLLM's answers 200 once the engine serves, also while paused)."""
        try:
            await self._request("GET", url, vllm_wire.HEALTH_PATH, timeout_s=timeout_s, retries=False,
                                bypass_link=True)
        except (EngineRequestError, EngineUnavailable) as exc:
            return False, str(exc)
        return True, ""

    async def get_weight_version(self, url: str | None = None) -> str | None:
        """The worker's weight version (`/weight_info`; "default" until one is set)."""
        worker = self._worker(url)
        data = await self._get_json(worker, vllm_wire.WEIGHT_INFO_PATH)
        try:
            return vllm_wire.weight_version_of(data)
        except vllm_wire.VLLMAnswerError as exc:
            raise EngineResponseError(worker + vllm_wire.WEIGHT_INFO_PATH, 200, repr(data), 1, reason=str(exc)) from None

    async def get_model_info(self, url: str | None = None) -> dict[str, Any]:
        """SGLang's `/model_info` fields that the run reads (model_path, weight_version), from vLLM's routes."""
        worker = self._worker(url)
        models = await self._get_json(worker, vllm_wire.MODELS_PATH)
        entries = models.get("data") if isinstance(models, dict) else None
        if not entries:
            raise EngineResponseError(worker + vllm_wire.MODELS_PATH, 200, repr(models), 1, reason="no model served")
        return {"model_path": entries[0].get("root") or entries[0].get("id"), "is_generation": True,
                "weight_version": await self.get_weight_version(worker), "engine_api": self.engine_api}

    async def get_server_info(self, url: str | None = None) -> dict[str, Any]:
        worker = self._worker(url)
        data = await self._get_json(worker, "/server_info")
        return data if isinstance(data, dict) else {"text": data}

    async def get_loads(self, url: str | None = None) -> dict[str, Any]:
        """SGLang's `/v1/loads` shape of vLLM's `/load` (`server_load`: the requests in flight)."""
        worker = self._worker(url)
        data = await self._get_json(worker, vllm_wire.LOAD_PATH)
        load = data.get("server_load") if isinstance(data, dict) else None
        if not isinstance(load, int) or isinstance(load, bool):
            raise EngineResponseError(worker + vllm_wire.LOAD_PATH, 200, repr(data), 1,
                                      reason="answer has no integer 'server_load'")
        return {"loads": [{"num_running_reqs": load, "num_waiting_reqs": 0}]}

    # ---- control ----------------------------------------------------------------------------

    async def flush_cache(self, url: str | None = None) -> bool:
        """POST /reset_prefix_cache; False when vLLM refuses because requests still run (it answers success false)."""
        data = await self._post_json(self._worker(url), vllm_wire.RESET_PREFIX_CACHE_PATH, {})
        return bool(data.get("success", True))

    async def pause_generation(self, mode: str = "abort", url: str | None = None) -> dict[str, Any]:
        """POST /pause?mode=...: `abort` answers in-flight requests at once as aborted; `retract`/`in_place` keep
        them frozen until /resume."""
        worker = self._worker(url)
        reply = await self._request("POST", worker, vllm_wire.PAUSE_PATH,
                                    params=vllm_wire.pause_query(as_pause_mode(mode).value),
                                    timeout_s=self.control_timeout_s)
        return reply.data if isinstance(reply.data, dict) else {"text": reply.text}

    async def continue_generation(self, url: str | None = None) -> dict[str, Any]:
        return await self._post_json(self._worker(url), vllm_wire.RESUME_PATH, {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False, url: str | None = None) -> None:
        """POST /abort_requests for one rid (vLLM's id of it: `generate-tokens-<rid>`), or every request."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request needs exactly one of rid=... or abort_all=True")
        ids = [] if abort_all else [f"generate-tokens-{rid}"]
        await self._request("POST", self._worker(url), "/abort_requests", json_body={"request_ids": ids},
                            timeout_s=self.control_timeout_s)

    async def _memory_occupation(self, path: str, tags: Sequence[str] | None, url: str | None) -> None:
        """vLLM's /sleep (level 1: weights offloaded, KV cache dropped) and /wake_up for SGLang's release/resume."""
        vllm_path = "/sleep" if path == "/release_memory_occupation" else "/wake_up"
        params = {"level": "1"} if vllm_path == "/sleep" else None
        urls = [url] if url is not None else self.worker_urls
        for u in urls:
            await self._request("POST", self._worker(u), vllm_path, params=params, timeout_s=self.control_timeout_s)

    # ---- weights ----------------------------------------------------------------------------

    async def check_reloadable_head(self) -> None:
        """Raise `EngineRefused` unless every worker's model has its own LM head (`/weight_checker` lists
        `lm_head.weight`): a tied head would silently keep the first weights' logits after every sync."""
        for worker in self.worker_urls:
            data = await self._post_json(worker, vllm_wire.WEIGHT_CHECKER_PATH, {"action": "checksum"})
            names = data.get("checksums") if isinstance(data, dict) else None
            if not isinstance(names, dict):
                raise EngineResponseError(worker + vllm_wire.WEIGHT_CHECKER_PATH, 200, repr(data)[:300], 1,
                                          reason="answer has no 'checksums' object")
            if not any(name.endswith("lm_head.weight") for name in names):
                raise EngineRefused(
                    worker, "this vLLM serves a checkpoint with tied word embeddings, and its in-place weight reload "
                            "does not update a tied LM head (vLLM 0.32): start it from an untied copy, "
                            "`jaxrl-vlm untie-embeddings CHECKPOINT OUT`, or let the run start it (--launch-vllm)")

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        load_format: str | None = None,
        flush_cache: bool | None = None,
        abort_all_requests: bool | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """Reload the worker's weights in place from `model_path` (`/collective_rpc reload_weights`), set
        `weight_version`, and read it back. Returns SGLang's `{"success", "message"}`; a reload vLLM refuses (4xx)
        is `success: false` with its message, as SGLang answers a failed load."""
        if load_format not in (None, "auto", "safetensors", vllm_wire.DELTA_LOAD_FORMAT):
            raise ValueError(f"vLLM reloads an exported directory or applies a weight delta; load_format="
                             f"{load_format!r} is not supported")
        worker = self._worker(url)
        if load_format == vllm_wire.DELTA_LOAD_FORMAT:
            refused = await self._apply_delta(worker, model_path)
            if refused is not None:
                return {"success": False, "message": refused}
        else:
            try:
                await self._request("POST", worker, vllm_wire.COLLECTIVE_RPC_PATH,
                                    json_body=vllm_wire.reload_weights_body(model_path),
                                    timeout_s=self.weight_update_timeout_s)
            except EngineRequestError as exc:
                return {"success": False, "message": f"reload_weights({model_path!r}) refused: {exc}"}
        if weight_version is not None:
            await self._post_json(worker, vllm_wire.UPDATE_WEIGHT_VERSION_PATH,
                                  vllm_wire.update_weight_version_body(weight_version))
            confirmed = await self.get_weight_version(worker)
            if confirmed != str(weight_version):
                return {"success": False, "message": f"vLLM reloaded {model_path!r} but reports weight version "
                                                      f"{confirmed!r}, not {weight_version!r}"}
        return {"success": True, "message": f"reloaded {model_path} (vLLM)", "weight_version": weight_version}

    # ---- weight deltas: the project's worker extension (`vllm_wire.WORKER_EXTENSION_CLS`) -------

    async def collective_rpc(self, method: str, kwargs: Mapping[str, Any] | None = None, *, url: str | None = None,
                             timeout_s: float | None = None) -> list[Any]:
        """`/collective_rpc` of `method` on every vLLM worker process of the server; their answers, in order."""
        worker = self._worker(url)
        data = await self._post_json(worker, vllm_wire.COLLECTIVE_RPC_PATH,
                                     vllm_wire.collective_rpc_body(method, kwargs), timeout_s=timeout_s)
        try:
            return vllm_wire.rpc_results(data, method)
        except vllm_wire.VLLMAnswerError as exc:
            raise EngineResponseError(worker + vllm_wire.COLLECTIVE_RPC_PATH, 200, repr(data)[:300], 1,
                                      reason=str(exc)) from None

    async def delta_states(self, url: str | None = None) -> tuple[vllm_wire.DeltaState, ...]:
        """Each vLLM worker's weight-delta extension state; `DeltaUnsupported` when the server has no extension
        (vLLM answers an unknown method with HTTP 500, a server outside dev mode has no /collective_rpc: 404)."""
        worker = self._worker(url)
        reply = await self._request("POST", worker, vllm_wire.COLLECTIVE_RPC_PATH,
                                    json_body=vllm_wire.collective_rpc_body(vllm_wire.DELTA_STATE_METHOD),
                                    timeout_s=self.control_timeout_s, answer_statuses=frozenset({404, 500}))
        if reply.status != 200:
            raise DeltaUnsupported(worker, f"/collective_rpc {vllm_wire.DELTA_STATE_METHOD} answered HTTP "
                                           f"{reply.status} ({reply.text.strip()[:160]!r})")
        try:
            return tuple(vllm_wire.delta_state_of(r)
                         for r in vllm_wire.rpc_results(reply.data, vllm_wire.DELTA_STATE_METHOD))
        except vllm_wire.VLLMAnswerError as exc:
            raise DeltaUnsupported(worker, str(exc)) from None

    async def _apply_delta(self, worker: str, path: str) -> str | None:
        """Every vLLM worker of `worker` applies the delta directory `path`; None, or why one of them refused (it
        then changed nothing; the others may hold the new version, which the checksums afterwards catch)."""
        results = await self.collective_rpc(vllm_wire.DELTA_APPLY_METHOD, {"path": str(path)}, url=worker,
                                            timeout_s=self.weight_update_timeout_s)
        try:
            answers = [vllm_wire.delta_applied_of(r) for r in results]
        except vllm_wire.VLLMAnswerError as exc:
            return str(exc)
        refused = [a for a in answers if a.refusal is not None]
        if refused:
            return f"the weight-delta extension refused {path}: {refused[0].refusal.value}: {refused[0].message}"
        return None

    async def delta_checksums(self, url: str | None = None, *, recompute: bool = False
                              ) -> list[tuple[str | None, dict[str, str]]]:
        """(version, HF tensor name -> sha256) of what each vLLM worker's extension holds; `recompute` hashes its
        bytes again instead of answering the checksums it verified when it applied them."""
        results = await self.collective_rpc(vllm_wire.DELTA_CHECKSUMS_METHOD, {"recompute": recompute}, url=url,
                                            timeout_s=self.weight_update_timeout_s)
        try:
            return [vllm_wire.delta_checksums_of(r) for r in results]
        except vllm_wire.VLLMAnswerError as exc:
            worker = self._worker(url)
            raise EngineResponseError(worker + vllm_wire.COLLECTIVE_RPC_PATH, 200, repr(results)[:300], 1,
                                      reason=str(exc)) from None

    async def check_logprobs_mode(self) -> None:
        """Raise `EngineRefused` unless every worker reports the log-probs of the sampling distribution, log
        softmax(logits / T) (`--logprobs-mode processed_logprobs`): one token at two temperatures
        (`vllm_wire.logprobs_mode_of`). A model whose candidates are too close to tell is let through, logged."""
        for worker in self.worker_urls:
            candidates = {}
            for k, temperature in enumerate(vllm_wire.PROBE_TEMPERATURES):
                body = vllm_wire.logprobs_probe_body(temperature, f"jaxrl-vlm-logprobs-probe-{k}")
                data = await self._post_json(worker, vllm_wire.GENERATE_PATH, body, timeout_s=self.control_timeout_s)
                try:
                    candidates[temperature] = vllm_wire.probe_logprobs_of(data)
                except vllm_wire.VLLMAnswerError as exc:
                    raise EngineResponseError(worker + vllm_wire.GENERATE_PATH, 200, repr(data)[:300], 1,
                                              reason=str(exc)) from None
            mode = vllm_wire.logprobs_mode_of(candidates)
            problem = vllm_wire.logprobs_mode_problem(mode)
            if problem is not None:
                raise EngineRefused(worker, problem)
            if mode is vllm_wire.LogprobsMode.UNKNOWN:
                logger.warning("%s: could not tell whether vLLM reports tempered log-probs (its candidates' logits "
                               "are too close); it must run with --logprobs-mode processed_logprobs", worker)


async def detect_engine_api(url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """`sglang` or `vllm`: which engine serves `url` (SGLang answers `/model_info` or `/get_model_info`; vLLM's
    `/v1/models` entries are `owned_by: vllm`). Raises `EngineUnavailable` when neither answers."""
    probe = SGLangClient(url, control_timeout_s=timeout_s, api_key=api_key)
    try:
        for path in ("/model_info", "/get_model_info"):
            try:
                reply = await probe._request("GET", probe.url, path, timeout_s=timeout_s, retries=False,
                                             answer_statuses=frozenset({404}))
            except EngineRequestError:
                continue
            if reply.status != 404:
                return "sglang"
        reply = await probe._request("GET", probe.url, vllm_wire.MODELS_PATH, timeout_s=timeout_s, retries=False)
        if vllm_wire.is_vllm_models_answer(reply.data):
            return "vllm"
        raise EngineUnavailable(probe.url + vllm_wire.MODELS_PATH, reply.status, reply.text, 1,
                                reason="the server is neither SGLang (no /model_info) nor vLLM; pass --engine-api")
    finally:
        await probe.close()


def client_class(engine_api: str) -> type[SGLangClient]:
    """The client class speaking `engine_api`'s protocol."""
    if engine_api == "sglang":
        return SGLangClient
    if engine_api == "vllm":
        return VLLMClient
    raise ValueError(f"engine_api={engine_api!r}: choose one of {ENGINE_APIS}")
