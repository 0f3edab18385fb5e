"""The engine without HTTP: model, tokenizer, image processor, runner and scheduler from one model dir."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from jaxrl_vlm.engine.options import EngineOptions
from jaxrl_vlm.engine.protocol import PromptPreparer
from jaxrl_vlm.engine.runner import ModelRunner
from jaxrl_vlm.engine.scheduler import Scheduler
from jaxrl_vlm.models.hf_io import from_hf
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
    """Everything `/generate` needs, loaded from an HF Qwen3-VL directory (weights, config.json,
    tokenizer files, optional preprocessor_config.json for images)."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineOptions | None = None, *, weight_version: str = "default"):
        self.model_path = str(model_dir)
        self.config = config or EngineOptions()
        media = self.config.allowed_local_media_path
        if media is not None and not Path(media).is_dir():
            raise ValueError(f"allowed_local_media_path={media!r} is not a directory")
        model = from_hf(model_dir, param_dtype=self.config.jnp_param_dtype, compute_dtype=self.config.jnp_compute_dtype)
        self.cfg = model.cfg
        self.tokenizer = load_tokenizer(model_dir)
        has_images = (Path(model_dir) / "preprocessor_config.json").is_file()
        self.image_processor = load_image_processor(model_dir) if has_images else None
        if not has_images:
            logger.warning("%s has no preprocessor_config.json: requests with images will be refused", model_dir)
        # A sampled pad or vision marker would break M-RoPE positions of every later token.
        banned = (self.cfg.vision_start_token_id, self.cfg.vision_end_token_id, self.cfg.image_token_id, self.cfg.video_token_id)
        self.eos_ids = read_eos_ids(model_dir, self.tokenizer, self.cfg.eos_token_id)
        self.runner = ModelRunner(model, self.config, banned)
        self.scheduler = Scheduler(self.runner, self.tokenizer, self.eos_ids, weight_version=weight_version)
        self.preparer = PromptPreparer(self.tokenizer, self.image_processor, self.cfg, self.config.image_policy)
        self.architectures = _architectures(model_dir)

    @property
    def has_image_understanding(self) -> bool:
        return self.image_processor is not None

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()


def _architectures(model_dir: str | os.PathLike) -> list[str]:
    try:
        return list(json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError):
        return []
