"""The engine session of a run: the embedded JAX engine, a launched SGLang or vLLM, or an external SGLang/vLLM/router.

Whichever it is, the rollout code sees one `SGLangClient` and the `RolloutContext` on `args`; everything the
session started is stopped on exit, also when the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

from envs.remote import remote_task
from jaxrl_vlm.config import Config
from jaxrl_vlm.engine import EmbeddedEngine
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.lora.serving import VLLM_LORA_ENV, engine_serves, sglang_lora_args, vllm_lora_args
from jaxrl_vlm.sglang_launcher import SGLangProcess
from jaxrl_vlm.vllm_launcher import VLLMProcess
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import close_suspended
from rollout.encoding import ChatEncoder
from rollout.loading import load_module
from rollout.options import total_generate_concurrency
from rollout.processing import load_image_processor, load_tokenizer
from rollout.rewards import RewardSettings
from rollout.run import RolloutContext, RolloutRun
from rollout.privileged import PrivilegedView
from rollout.teacher import TeacherScorer, connect_teacher
from rollout.vllm_client import VLLMClient, client_class, detect_engine_api
from rollout.video import optional_video_config

logger = logging.getLogger(__name__)


async def check_external_engine(cfg: Config) -> None:
    """Refuse an external engine that cannot serve this run (`EngineRefused`) before anything is loaded: a vLLM
    that reports untempered log-probs (`VLLMClient.check_logprobs_mode`: started without `--logprobs-mode
    processed_logprobs`), or started from a checkpoint with tied embeddings, whose reload would keep the first
    weights' head (`VLLMClient.check_reloadable_head`). An engine the run starts needs no head check (a launched vLLM
    starts from the untied export); the session checks again when the trainer attaches."""
    url, key = cfg.engine.engine_url, cfg.engine.engine_api_key
    if not url:
        return
    api = cfg.engine.engine_api if cfg.engine.engine_api != "auto" else await detect_engine_api(url, api_key=key)
    if api != "vllm":
        return
    client = VLLMClient(url, worker_urls=cfg.engine.engine_worker_urls or None, api_key=key,
                        timeout_s=cfg.engine.engine_request_timeout)
    try:
        await client.check_reloadable_head()  # reads the weights' checksums: no generation, works while paused
        # Resumed before the log-probs probe, which generates: a trainer that died mid weight sync leaves it paused.
        await client.resume_and_wait_healthy(timeout_s=cfg.engine.engine_start_timeout)
        await client.check_logprobs_mode()
    finally:
        await client.close()


def task_env_module(cfg: Config) -> ModuleType:
    """The env module episodes run with: the task's (--rollout-interaction-env-path), played on the env server at
    --env-url when one is set (its prompts and reward_fn stay the task's)."""
    task = load_module(cfg.rollout.rollout_interaction_env_path, "--rollout-interaction-env-path")
    return task if cfg.multiturn.env_url is None else remote_task(task)


@contextlib.asynccontextmanager
async def rollout_session(
    cfg: Config, model_dir: Path, serve_dir: Path, args: Any, weight_version: str = "default"
) -> AsyncIterator[SGLangClient]:
    """Engine (embedded unless --engine-url / --launch-sglang), client and rollout context.

    Yields the SGLangClient; `args.rollout_context` is set for the episode functions. `serve_dir` holds the
    weights the embedded engine starts from (the resumed version after `--load`, labelled `weight_version`).
    """
    engine: EmbeddedEngine | None = None
    launched: SGLangProcess | VLLMProcess | None = None
    client: SGLangClient | None = None
    teacher_engine: EmbeddedEngine | None = None
    teacher: TeacherScorer | None = None
    key = cfg.engine.engine_api_key
    client_options = dict(timeout_s=cfg.engine.engine_request_timeout, retry=RetryPolicy(max_retries=cfg.engine.engine_max_retries),
                          api_key=key)
    try:
        if cfg.engine.engine_url:
            api = cfg.engine.engine_api
            if api == "auto":
                api = await detect_engine_api(cfg.engine.engine_url, api_key=key)
                logger.info("engine at %s speaks %s's API (--engine-api auto)", cfg.engine.engine_url, api)
            # Only an external engine can die and come back on its own; the job arms the link once attached.
            client = client_class(api)(cfg.engine.engine_url, worker_urls=cfg.engine.engine_worker_urls or None,
                                       reconnect_timeout_s=cfg.engine.engine_reconnect_timeout,
                                       allow_worker_loss=cfg.engine.allow_worker_loss, **client_options)
        elif cfg.engine.launch_vllm:
            launched = VLLMProcess(
                cfg.engine.vllm_python or "", str(serve_dir), host=cfg.engine.engine_host, port=cfg.engine.engine_port,
                extra_args=[*cfg.engine.vllm_args, *_vllm_dtype_args(cfg), *vllm_lora_args(cfg.lora, cfg.engine.vllm_args),
                            *(["--api-key", key] if key else [])],
                log_path=Path(cfg.train.output_dir) / "vllm.log",
            )
            if engine_serves(cfg.lora):  # the adapter routes exist only with runtime LoRA updating on
                launched.extra_env = {**launched.extra_env, **VLLM_LORA_ENV}
            client = VLLMClient(launched.start(), **client_options)
            await launched.wait_ready(client, timeout_s=cfg.engine.engine_start_timeout)
        elif cfg.engine.launch_sglang:
            launched = SGLangProcess(
                cfg.engine.sglang_python or "", str(serve_dir), host=cfg.engine.engine_host, port=cfg.engine.engine_port,
                extra_args=[*cfg.engine.sglang_args, *_parallel_args(cfg), *sglang_lora_args(cfg.lora, cfg.engine.sglang_args),
                            *_routing_args(cfg), *(["--api-key", key] if key else [])],
                log_path=Path(cfg.train.output_dir) / "sglang.log",
            )
            client = SGLangClient(launched.start(), **client_options)
            await launched.wait_ready(client, timeout_s=cfg.engine.engine_start_timeout)
        else:
            engine = EmbeddedEngine(str(serve_dir), host=cfg.engine.engine_host, port=cfg.engine.engine_port,
                                    config=EngineOptions.from_run_config(cfg), weight_version=weight_version,
                                    api_key=key)
            client = SGLangClient(engine.start(), **client_options)
            client.local_engine = engine.engine  # same process: weights may be synced in memory
        if engine is None:
            # A trainer that died between /pause_generation and /continue_generation leaves an external engine
            # paused (every /generate and SGLang's own /health wait): resume every worker, then wait for health.
            await client.resume_and_wait_healthy(timeout_s=cfg.engine.engine_start_timeout)
        else:
            await client.wait_healthy(timeout_s=cfg.engine.engine_start_timeout)
        if isinstance(client, VLLMClient):  # launched or external: its log-probs must be the sampling policy's
            await client.check_logprobs_mode()
        encoder = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir),
                              video_config=optional_video_config(model_dir))
        client.vocab_size = len(encoder.tokenizer)  # an engine returning an id outside it fails the sample by name
        if cfg.rollout.use_opd and cfg.rollout.opd_type == "engine":  # trainer: the train step scores (job/trainer.py)
            teacher_engine, teacher = await _start_teacher(cfg, encoder, client_options)
        args.rollout_context = RolloutContext(
            client=client, encoder=encoder, env_module=task_env_module(cfg),
            generate_slots=asyncio.Semaphore(
                total_generate_concurrency(cfg.rollout.sglang_server_concurrency, cfg.engine.engine_worker_urls)),
            router_mode=bool(cfg.engine.engine_worker_urls),
            teacher=teacher,
            privileged=(PrivilegedView(cfg.rollout.opsd_privileged_field, cfg.rollout.opsd_privileged_template)
                        if cfg.rollout.use_opd and cfg.rollout.opd_type == "self" else None),
        )
        yield client
    finally:
        if teacher is not None:
            await teacher.close()
        if teacher_engine is not None:
            teacher_engine.stop()
        if getattr(args, "rollout_context", None) is not None:
            await close_suspended(args)
        if client is not None:
            await client.close()
        if engine is not None:
            engine.stop()
        if launched is not None:
            launched.stop()


async def _start_teacher(cfg: Config, encoder: ChatEncoder, client_options: dict[str, Any],
                         ) -> tuple[EmbeddedEngine | None, TeacherScorer]:
    """--use-opd --opd-type engine: the teacher's client, to --opd-teacher-url (SGLang's or vLLM's protocol,
    --opd-teacher-api) or to an embedded engine serving --opd-teacher-checkpoint (started here with the run's engine
    settings, on the rollout devices; the caller stops it). The teacher must share the student's tokenizer and
    image processor: its prompt log-probs are read by position of the student's trajectory."""
    r = cfg.rollout
    engine = None
    options = {**client_options, "api_key": None}
    if r.opd_teacher_checkpoint is not None:
        if not (Path(r.opd_teacher_checkpoint) / "config.json").is_file():
            raise FileNotFoundError(f"--opd-teacher-checkpoint {r.opd_teacher_checkpoint} has no config.json: it must "
                                    "be an HF model directory (weights, config, tokenizer, processor)")
        engine = EmbeddedEngine(r.opd_teacher_checkpoint, host=cfg.engine.engine_host, port=0,
                                config=EngineOptions.from_run_config(cfg), weight_version="teacher")
        url = engine.start()
        logger.info("OPD teacher: embedded engine serving %s at %s", r.opd_teacher_checkpoint, url)
        client = SGLangClient(url, **options)
        try:
            await client.wait_healthy(timeout_s=cfg.engine.engine_start_timeout)
        except BaseException:
            await client.close()
            engine.stop()
            raise
    else:
        # An external teacher in its own protocol (--opd-teacher-api; auto asks it), checked with a probe prompt.
        client = await connect_teacher(r.opd_teacher_url, r.opd_teacher_api,
                                       start_timeout_s=cfg.engine.engine_start_timeout, **options)
        logger.info("OPD teacher: %s (%s's API)", r.opd_teacher_url, getattr(client, "engine_api", "sglang"))
    client.vocab_size = len(encoder.tokenizer)
    return engine, TeacherScorer(client, encoder, concurrency=r.opd_teacher_concurrency,
                                 timeout_s=cfg.engine.engine_request_timeout)


def rollout_run(cfg: Config, args: Any) -> RolloutRun:
    """The job's typed rollout run, inside `rollout_session` (which put the rollout context on `args`): every
    option read from the typed config, the one source of its value; `args` goes along for user code only."""
    rewards = RewardSettings(rm_type=cfg.algo.rm_type, reward_key=cfg.algo.reward_key)
    return RolloutRun.typed(cfg.rollout, cfg.multiturn, rewards, args)


def _parallel_args(cfg: Config) -> list[str]:
    """--tp-size / --dp-size / --ep-size for a launched SGLang, unless its own arguments already say (they win)."""
    out: list[str] = []
    for flag, value in (("--tp-size", cfg.engine.tp_size), ("--dp-size", cfg.engine.dp_size),
                        ("--ep-size", cfg.engine.ep_size)):
        given = any(a == flag or a.startswith(flag + "=") for a in cfg.engine.sglang_args)
        if value > 1 and not given:
            out += [flag, str(value)]
    return out


def _routing_args(cfg: Config) -> list[str]:
    """`--enable-return-routed-experts` for routing replay, unless SGLang's arguments already say: without it SGLang
    answers every request without `meta_info.routed_experts`, silently (sglang 0.5.23, RoutedExpertsCapturer), and
    the run would stop at its first batch."""
    flag = "--enable-return-routed-experts"
    if not cfg.rollout.use_rollout_routing_replay or any(a == flag for a in cfg.engine.sglang_args):
        return []
    return [flag]


def _vllm_dtype_args(cfg: Config) -> list[str]:
    """`--dtype` of the weights the run exports (vLLM's own default `auto` would serve bf16 and silently round fp32
    weights), unless vLLM's arguments already say."""
    if any(a == "--dtype" or a.startswith("--dtype=") for a in cfg.engine.vllm_args):
        return []
    return ["--dtype", cfg.engine.weight_sync_dtype or cfg.model.param_dtype]
