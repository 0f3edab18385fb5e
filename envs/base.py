"""The interaction-environment contract the rollout drives (DESIGN.md §4 "Environment").

An environment module (passed by `--rollout-interaction-env-path`) exposes:

- `build_env(sample, args) -> BaseInteractionEnv` (required). `args` is a plain attribute
  namespace with at least `max_turns`; read your own keys with `getattr(args, key, default)`.
- `reward_fn(model_text: str, label) -> float` (optional), used when `env.verdict()` is None.
- `CONFIG_KEYS: dict[str, tuple[type, default, help]]` (optional): extra `--custom-config-path`
  keys the module accepts; the config loader rejects any other unknown key.

Episode protocol, as the rollout runs it: `reset()`, then per model turn
`step(model_text) -> (observation, done, info)` (sync, or async: the rollout awaits an awaitable),
`format_observation(observation)` to get the chat message fed back to the model, and finally
`close()`, always, also after an exception. `step` sees only the text the model generated in that
turn, and reward is computed on the model's own text: environment feedback never counts as the
answer.

Observation dict:
    {"obs_str": str,
     "multi_modal_data": {"image": [PIL.Image.Image | "data:image/...;base64,...", ...]},  # optional
     "role": "user" | "tool"}                                                             # optional, default "user"

This package never imports jax.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable
from typing import Any

from PIL import Image

OBSERVATION_ROLES = ("user", "tool")


class BaseInteractionEnv(abc.ABC):
    """One episode's environment. Subclasses implement `reset` and `step`."""

    #: If True, the rollout may call `reset()` and retry a `step` that raised (bounded retries).
    #: Only set it when `reset()` really restores the state a retried step needs.
    recoverable: bool = False

    @abc.abstractmethod
    def reset(self) -> None:
        """Start (or restart) the episode."""

    @abc.abstractmethod
    def step(
        self, response_text: str
    ) -> tuple[dict[str, Any], bool, dict[str, Any]] | Awaitable[tuple[dict[str, Any], bool, dict[str, Any]]]:
        """Consume one model turn's text; return (observation, done, info). May be `async def`."""

    def verdict(self) -> float | None:
        """The episode's final reward as decided by the environment, or None if it has no opinion.

        None makes the rollout fall back to the module's `reward_fn` on the model's text.
        """
        return None

    def close(self) -> None:
        """Release resources. Always called by the rollout, exactly once per episode."""

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        """One chat message for `observation`: images first, then the text (slime's order).

        Returns {"role": "user" | "tool", "content": [{"type": "image", "image": ...}, ...,
        {"type": "text", "text": obs_str}]}. Raises TypeError/ValueError naming the bad field.
        """
        if not isinstance(observation, dict):
            raise TypeError(f"{type(self).__name__}: observation must be a dict, got {type(observation).__name__}")
        obs_str = observation.get("obs_str")
        if not isinstance(obs_str, str):
            raise TypeError(f"{type(self).__name__}: observation['obs_str'] must be str, got {type(obs_str).__name__}")
        role = observation.get("role", "user")
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"{type(self).__name__}: observation['role']={role!r} is not one of {OBSERVATION_ROLES}")
        content: list[dict[str, Any]] = [
            {"type": "image", "image": image} for image in observation_images(observation, type(self).__name__)
        ]
        content.append({"type": "text", "text": obs_str})
        return {"role": role, "content": content}


def observation_images(observation: dict[str, Any], owner: str = "observation") -> list[Image.Image | str]:
    """The validated image list of an observation (possibly empty).

    Accepts PIL images and `data:image/...` URLs; any other modality key is an error because the
    rollout would silently drop it.
    """
    mm = observation.get("multi_modal_data")
    if mm is None:
        return []
    if not isinstance(mm, dict):
        raise TypeError(f"{owner}: observation['multi_modal_data'] must be a dict, got {type(mm).__name__}")
    unknown = set(mm) - {"image"}
    if unknown:
        raise ValueError(f"{owner}: observation['multi_modal_data'] has unsupported keys {sorted(unknown)} (only 'image')")
    images = mm.get("image") or []
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"{owner}: observation['multi_modal_data']['image'] must be a list, got {type(images).__name__}")
    for k, image in enumerate(images):
        if isinstance(image, Image.Image):
            continue
        if isinstance(image, str) and image.startswith("data:image/"):
            continue
        raise TypeError(
            f"{owner}: observation['multi_modal_data']['image'][{k}] must be a PIL.Image or a data:image/ URL, "
            f"got {type(image).__name__}"
        )
    return list(images)
