"""The engine without HTTP: model, tokenizer, image processor, runner and scheduler from one model dir.

Its control methods (`pause_generation`, `flush_cache`, `update_weights_from_disk`, `continue_generation`,
`weight_version`) are what the HTTP handlers of `engine.server` call, and what a trainer in the same process calls
directly (`SGLangClient.local_engine`): one code path, the same answers, without an HTTP round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxrl_vlm import gc_heap, weight_delta
from jaxrl_vlm.device_lock import devices_of, exclusive
from jaxrl_vlm.devices import pick_devices
from jaxrl_vlm.engine import weights
from jaxrl_vlm.engine.inbox import ContinueMsg, ControlMsg, FlushMsg, PauseMsg, Reply, UpdateWeightsMsg
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.placement import replica_placements
from jaxrl_vlm.engine.protocol import PromptPreparer
from jaxrl_vlm.engine.replicas import ReplicatedScheduler
from jaxrl_vlm.engine.runner import ModelRunner
from jaxrl_vlm.engine.scheduler import Scheduler
from jaxrl_vlm.models.hf_io import from_hf, load_hf_config
from jaxrl_vlm.sharding.layout import shardings_for
from rollout.client import EngineUnavailable
from rollout.processing import load_image_processor, load_tokenizer
from rollout.video import optional_video_config
from rollout.sglang_wire import IN_MEMORY_LOAD_FORMAT, PauseMode, UpdateWeightsRequest, update_weights_answer

logger = logging.getLogger(__name__)

# What `update_weights_from_disk` reads: HF safetensors directories, or weights staged in memory by name.
LOAD_FORMATS = (None, "auto", "safetensors", IN_MEMORY_LOAD_FORMAT)


class SchedulerUnavailable(EngineUnavailable):
    """The scheduler thread is not running, or did not answer a control call in time. The server answers 503 with
    `detail`; a caller in the same process gets the EngineUnavailable an unreachable server gives, so the client's
    retries and weight-sync sequence treat both alike."""

    def __init__(self, detail: str):
        super().__init__("the embedded engine's scheduler", None, detail, 1, reason="no answer")
        self.detail = detail


def threadsafe_setter(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> Callable[[Any], None]:
    """A callback that any thread (the scheduler's) may call once to complete `future` on `loop`."""
    def deliver(value: Any) -> None:
        if not future.done():
            future.set_result(value)

    return lambda value: loop.call_soon_threadsafe(deliver, value)


def read_eos_ids(model_dir: str | os.PathLike, tokenizer: Any, config_eos: int | None) -> tuple[int, ...]:
    """Ids that end generation: `generation_config.json`'s eos_token_id (int or list), the model
    config's eos and the tokenizer's eos, as SGLang collects them; de-duplicated, in that order."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen}: invalid JSON ({e})") from e
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    ids.extend(t for t in (config_eos, getattr(tokenizer, "eos_token_id", None)) if t is not None)
    return tuple(dict.fromkeys(int(t) for t in ids))


class Engine:
    """Everything `/generate` needs, loaded from an HF directory of a registered model family (weights,
    config.json, tokenizer files, optional preprocessor_config.json for images), on `dp_size` replicas of `tp_size`
    devices each (`config`). `scheduler` is the one scheduler, or all of them behind a router; `runners`
    are the replicas' runners (`runner` the first)."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineOptions | None = None, *, weight_version: str = "default"):
        self.model_path = str(model_dir)
        self.config = config or EngineOptions()
        media = self.config.allowed_local_media_path
        if media is not None and not Path(media).is_dir():
            raise ValueError(f"allowed_local_media_path={media!r} is not a directory")
        devices = None if self.config.device_ids is None else pick_devices(self.config.device_ids, "engine devices")
        placements = replica_placements(self.config.tp_size, self.config.dp_size, devices, self.config.ep_size)
        first = placements[0]
        # Loaded straight into the first replica's shards; the other replicas copy them device to device.
        model = from_hf(model_dir, param_dtype=self.config.jnp_param_dtype, compute_dtype=self.config.jnp_compute_dtype,
                        shardings_for=shardings_for(first.mesh, first.rules, load_hf_config(str(model_dir))),
                        attention_impl=self.config.attention_impl)
        self.cfg = model.cfg
        self.tokenizer = load_tokenizer(model_dir)
        has_images = (Path(model_dir) / "preprocessor_config.json").is_file()
        self.image_processor = load_image_processor(model_dir) if has_images else None
        if not has_images:
            logger.warning("%s has no preprocessor_config.json: requests with images will be refused", model_dir)
        # A sampled pad or vision marker would break M-RoPE positions of every later token.
        banned = (self.cfg.vision_start_token_id, self.cfg.vision_end_token_id, self.cfg.image_token_id, self.cfg.video_token_id)
        self.eos_ids = read_eos_ids(model_dir, self.tokenizer, self.cfg.eos_token_id)
        self.runners = [ModelRunner(model, self.config, banned, placement=p) for p in placements]
        self.runner = self.runners[0]
        self._staged: dict[tuple[str, int], nnx.State] = {}  # (name, replica) -> weights staged in memory
        # (name, replica) -> the weight version a staged delta was applied to: the update must still find it served.
        self._staged_base: dict[tuple[str, int], str] = {}
        self._staged_lock = threading.Lock()
        self._gc_lock = threading.Lock()
        self._gc_held = False  # a `gc_heap` hold, from start (the `freeze_gc` option) or `/freeze_gc` until stop
        schedulers = [
            Scheduler(r, self.tokenizer, self.eos_ids, weight_version=weight_version,
                      staged_weights=lambda name, i=i: self._take_staged(name, i))
            for i, r in enumerate(self.runners)
        ]
        self._schedulers = schedulers
        self.scheduler: Scheduler | ReplicatedScheduler = (
            schedulers[0] if len(schedulers) == 1 else ReplicatedScheduler(schedulers))
        self.preparer = PromptPreparer(self.tokenizer, self.image_processor, self.cfg, self.config.image_policy,
                                       video_config=optional_video_config(model_dir))
        self.architectures = _architectures(model_dir)

    @property
    def has_image_understanding(self) -> bool:
        return self.image_processor is not None

    def start(self) -> None:
        self.scheduler.start()
        if self.config.freeze_gc:
            self._take_gc_hold()

    def freeze_gc(self) -> int:
        """SGLang's `/freeze_gc`: freeze what the engine's warm-up created too (a hold until `stop`, with or without
        the `freeze_gc` option). Returns how many objects are frozen."""
        self._take_gc_hold()
        return gc_heap.freeze_more("engine /freeze_gc")

    def _take_gc_hold(self) -> None:
        with self._gc_lock:
            if not self._gc_held:
                gc_heap.hold("engine")
                self._gc_held = True

    # ------------------------------------------------------------------ control (the HTTP handlers and in process)

    async def control(self, make: Callable[[Reply], ControlMsg], timeout_s: float | None = None) -> Any:
        """Send the control message `make(reply)` to the scheduler thread and await its answer on the running loop,
        for at most `timeout_s` (default: control_timeout_s); SchedulerUnavailable if it does not come."""
        timeout_s = self.config.control_timeout_s if timeout_s is None else timeout_s
        if not self.scheduler.alive:
            raise SchedulerUnavailable("the engine scheduler is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.scheduler.call(make(threadsafe_setter(loop, future)))
        try:
            async with asyncio.timeout(timeout_s):  # (wait_for would add loop iterations to every call)
                return await future
        except TimeoutError:
            state = "is not running" if not self.scheduler.alive else "is busy or stuck (e.g. in a device call)"
            detail = f"the engine scheduler did not answer within {timeout_s:g} s: it {state}"
            raise SchedulerUnavailable(detail) from None

    async def pause_generation(self, mode: PauseMode) -> dict[str, Any]:
        """SGLang's `/pause_generation`: `mode` abort answers in-flight requests as aborted, retract re-queues them,
        in_place keeps them in the batch."""
        return await self.control(lambda reply: PauseMsg(mode, reply))

    async def continue_generation(self) -> dict[str, Any]:
        return await self.control(ContinueMsg)

    async def flush_cache(self) -> bool:
        """True once the prefix cache is dropped; False (nothing changed) while requests run or wait."""
        return await self.control(FlushMsg)

    async def update_weights_from_disk(self, update: UpdateWeightsRequest) -> dict[str, Any]:
        """SGLang's `/update_weights_from_disk` answer (`success`, `message`, `num_paused_requests`): the update runs
        once nothing decodes (or the engine is paused); `success: false` with the old weights serving when it
        cannot load. SchedulerUnavailable when the scheduler did not answer within weight_update_timeout_s."""
        if update.load_format not in LOAD_FORMATS:
            return update_weights_answer(False, f"load_format={update.load_format!r} is not supported "
                                                f"(safetensors, or {IN_MEMORY_LOAD_FORMAT!r})", 0)
        timeout_s = self.config.weight_update_timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            return await self.control(lambda reply: UpdateWeightsMsg(update, reply, deadline), timeout_s)
        except SchedulerUnavailable as e:
            # Not started by the deadline: the scheduler drops it. Started: it may still finish (check the version).
            raise SchedulerUnavailable(f"{e.detail}. An update that had not started is dropped; one that had "
                                       "started may still finish (check weight_version in /model_info).") from None

    @property
    def weight_version(self) -> str:
        """The version the engine serves (every replica's; "mixed:..." while they disagree)."""
        return self.scheduler.weight_version

    # ------------------------------------------------------------------ in-memory weights

    def stage_weights(self, name: str, params: Any, via_dtype: Any = None, partial: bool = False,
                      may_alias: bool = False) -> None:
        """Put a trainer's parameters (its model, or a parameter state; same family and config; any devices and
        shardings) into every replica's shardings under `name`, while the engine keeps serving.
        `/update_weights_from_disk` with `model_path=name` and `load_format` IN_MEMORY_LOAD_FORMAT then swaps them in:
        the same sequence and version as a disk sync, with no disk. `via_dtype`: round through this dtype first (the
        dtype a disk sync would have exported), so both paths serve the same numbers. Replaces anything staged under
        `name`. The trainer's buffers are copied once (the cast), not aliased, since its train step donates them;
        with `may_alias` (a trainer that keeps them, `Trainer.share_params`) the arrays that already fit a replica's
        dtype and shardings are served as they are, with no copy (`weights.place_weights`). `partial`: `params` holds
        some of the parameters (`ModelRunner.stage_params`); the others keep the served arrays."""
        # device_lock: the trainer's devices and the engine's, held while the weights cross between them
        with exclusive(devices_of(params).union(*(runner.placement.devices for runner in self.runners))):
            staged = jax.block_until_ready([runner.stage_params(params, via_dtype, partial, may_alias)
                                            for runner in self.runners])
        self._put_staged(name, staged, None)

    def stage_delta(self, name: str, delta: weight_delta.WeightDelta) -> None:
        """Stage the weights served now with `delta` (`jaxrl_vlm.weight_delta`) applied, under `name` for every
        replica, while the engine keeps serving; the in-memory update then swaps them in, as after `stage_weights`.

        The delta is applied once, on the host bytes of the first replica's parameters (only the tensors it changes
        sparsely are fetched), each changed tensor is checked against its manifest checksum, and the new tensors
        are placed in every replica's shardings; unchanged tensors are shared, not copied. Raises a
        `weight_delta.WeightDeltaError`, with nothing staged, when the served weights are not the delta's base (the
        trainer then sends a full sync); the update refuses the staged weights if another version was swapped in
        meanwhile."""
        if any(runner.weights_released for runner in self.runners):
            raise weight_delta.BaseMismatch("the engine's weights are released (/release_memory_occupation): a delta "
                                            "needs them on the devices; send a full sync")
        version = self.scheduler.weight_version
        new = weights.delta_tensors(self.runner.params, delta, version)
        staged = jax.block_until_ready([weights.with_tensors(runner.params, new) for runner in self.runners])
        self._put_staged(name, staged, delta.manifest.base_version)

    def weight_checksums(self, replica: int = 0) -> dict[str, str]:
        """`weight_delta.tensor_checksum` of every parameter replica `replica` holds now, by `weights.tensor_name`:
        what the trainer compares with a delta's manifest after the update."""
        return weights.state_checksums(self.runners[replica].held_params)

    def _put_staged(self, name: str, staged: list[nnx.State], base_version: str | None) -> None:
        with self._staged_lock:
            for i, state in enumerate(staged):
                self._staged[(name, i)] = state
                if base_version is None:
                    self._staged_base.pop((name, i), None)
                else:
                    self._staged_base[(name, i)] = base_version

    def discard_staged(self, name: str) -> None:
        """Free weights staged under `name` that no update consumed (a failed or abandoned sync)."""
        with self._staged_lock:
            for key in [k for k in self._staged if k[0] == name]:
                del self._staged[key]
                self._staged_base.pop(key, None)

    def _take_staged(self, name: str, replica: int) -> nnx.State:
        """Called by replica `replica`'s scheduler thread, which alone changes its weight version."""
        with self._staged_lock:
            state = self._staged.pop((name, replica), None)
            base = self._staged_base.pop((name, replica), None)
        if state is None:
            raise ValueError(f"no weights are staged in memory under {name!r} (stage_weights first)")
        served = self._schedulers[replica].weight_version
        if base is not None and served != base:
            raise weight_delta.BaseMismatch(f"weights staged under {name!r} are a delta on version {base}, but this "
                                            f"replica serves version {served} by now; send a full sync")
        return state

    def stop(self) -> None:
        try:
            self.scheduler.stop()
        finally:
            with self._gc_lock:
                if self._gc_held:
                    gc_heap.release("engine")
                    self._gc_held = False


def _architectures(model_dir: str | os.PathLike) -> list[str]:
    try:
        return list(json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError):
        return []
