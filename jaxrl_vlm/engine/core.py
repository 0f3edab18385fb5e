"""The engine without HTTP: model, tokenizer, image processor, runner and scheduler from one model dir."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_vlm.devices import pick_devices
from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.placement import replica_placements
from jaxrl_vlm.engine.protocol import PromptPreparer
from jaxrl_vlm.engine.replicas import ReplicatedScheduler
from jaxrl_vlm.engine.runner import ModelRunner
from jaxrl_vlm.engine.scheduler import Scheduler
from jaxrl_vlm.models.hf_io import from_hf, load_hf_config
from jaxrl_vlm.sharding.layout import shardings_for
from rollout.processing import load_image_processor, load_tokenizer

logger = logging.getLogger(__name__)


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
                        shardings_for=shardings_for(first.mesh, first.rules, load_hf_config(str(model_dir))))
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
        self._staged_lock = threading.Lock()
        schedulers = [
            Scheduler(r, self.tokenizer, self.eos_ids, weight_version=weight_version,
                      staged_weights=lambda name, i=i: self._take_staged(name, i))
            for i, r in enumerate(self.runners)
        ]
        self.scheduler: Scheduler | ReplicatedScheduler = (
            schedulers[0] if len(schedulers) == 1 else ReplicatedScheduler(schedulers))
        self.preparer = PromptPreparer(self.tokenizer, self.image_processor, self.cfg, self.config.image_policy)
        self.architectures = _architectures(model_dir)

    @property
    def has_image_understanding(self) -> bool:
        return self.image_processor is not None

    def start(self) -> None:
        self.scheduler.start()

    # ------------------------------------------------------------------ in-memory weights

    def stage_weights(self, name: str, params: Any, via_dtype: Any = None) -> None:
        """Put a trainer's parameter state (same model; any devices and shardings) into every replica's shardings
        under `name`, while the engine keeps serving. `/update_weights_from_disk` with `model_path=name` and
        `load_format` IN_MEMORY_LOAD_FORMAT then swaps it in: the same sequence and version as a disk sync, with
        no disk. `via_dtype`: round through this dtype first (the dtype a disk sync would have exported), so both
        paths serve the same numbers. Replaces anything staged under `name`."""
        if via_dtype is not None:
            dtype = jnp.dtype(via_dtype)
            params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        staged = jax.block_until_ready([runner.stage_params(params) for runner in self.runners])
        with self._staged_lock:
            for i, state in enumerate(staged):
                self._staged[(name, i)] = state

    def discard_staged(self, name: str) -> None:
        """Free weights staged under `name` that no update consumed (a failed or abandoned sync)."""
        with self._staged_lock:
            for key in [k for k in self._staged if k[0] == name]:
                del self._staged[key]

    def _take_staged(self, name: str, replica: int) -> nnx.State:
        with self._staged_lock:
            state = self._staged.pop((name, replica), None)
        if state is None:
            raise ValueError(f"no weights are staged in memory under {name!r} (stage_weights first)")
        return state

    def stop(self) -> None:
        self.scheduler.stop()


def _architectures(model_dir: str | os.PathLike) -> list[str]:
    try:
        return list(json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError):
        return []
