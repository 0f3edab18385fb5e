"""The interaction-environment contract the rollout drives (DESIGN.md §4 "Environment").

An environment module (passed by `--rollout-interaction-env-path`) exposes:

- `build_env(sample, args) -> BaseInteractionEnv` (required). `args` is a plain attribute
  namespace with at least `max_turns` (`require_max_turns`). An env's own options are ONE frozen
  dataclass deriving from `EnvOptions`, each field declared with `option(default, help, ...)`, and
  read once per env with `Options.from_args(args)` (types, bounds and `validate()` checked there).
- `reward_fn(model_text: str, label) -> float` (optional), used when `env.verdict()` is None.
- `CONFIG_KEYS: dict[str, tuple[type, default, help]]` (optional): extra `--custom-config-path`
  keys the module accepts; the config loader rejects any other unknown key. Derive it from the
  options dataclass: `CONFIG_KEYS = Options.config_keys()`.
- `TASK_PROMPT: TaskPrompt` (optional, task modules): the system prompt, tool schema and user
  instruction the dataset loader puts into each prompt (`--prompt-style`; the loader imports the
  task module by path, like the env).
- `session_capacity(args) -> SessionCapacity` (optional): how many episodes one process can hold at once
  with these options, where a resource of its own bounds them (MiniWoB: its Chrome pages). `env-serve`
  serves that many by default and refuses a larger `--max-sessions`.

Episode protocol, as the rollout runs it: `reset()` (sync or `async def`; it returns None, or an observation
dict like `step`'s, role "user", that opens the episode: the rollout appends its text and pictures to the prompt's
first user turn before the first generation, as prompt tokens), then per model turn
`step(model_text) -> (observation, done, info)` (sync, or async: the rollout awaits an awaitable),
`format_observation(observation)` to get the chat message fed back to the model, and finally
`close()`, always, also after an exception. `step` sees only the text the model generated in that
turn, and reward is computed on the model's own text: environment feedback never counts as the
answer.

Time limits and threads (rollout/multiturn.py `call_env_hook`): `step` runs under
`--env-step-timeout` (an overrun is retried like an error), and `reset`, `verdict`, `close` and the
module's `reward_fn` under `--env-hook-timeout` each; `--episode-timeout` bounds reset, turns and
the reward, after which `close()` still runs. A hook past its limit FAILs the episode (cause
`env_timeout`, naming the hook; a step whose retries run out is `env_error`), never the rollout.
A sync hook runs in a daemon worker thread of its own, so it may block (file or network I/O, a
subprocess) without stalling the event loop, but it must not touch the loop (no
`asyncio.get_running_loop()`; make the hook `async def` for that). An `async def` hook runs on the
loop and must not block. A stuck sync hook cannot be killed: its thread is abandoned and runs on
in the background until the function returns (its result is dropped), while the episode FAILs and
the rollout goes on; a stuck async hook is cancelled and never awaited again.

Observation dict:
    {"obs_str": str,
     "multi_modal_data": {"image": [PIL.Image.Image | "data:image/...;base64,...", ...],   # optional
                          "video": [rollout.video.Clip | "data:video/...;base64,...", ...]},  # optional
     "role": "user" | "tool"}                                                             # optional, default "user"

A clip is a list of frames and the rate they were taken at (`Clip.of(frames, fps)`); the model's video processor
samples, resizes and groups its frames (docs/guides/video.md).

This package never imports jax.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import types
import typing
from collections.abc import Awaitable
from typing import Any, ClassVar, TypeVar

from PIL import Image

from rollout.video import Clip

OBSERVATION_ROLES = ("user", "tool")
OBSERVATION_MODALITIES = ("image", "video")

_O = TypeVar("_O", bound="EnvOptions")


# --------------------------------------------------------------------------------------------
# Options: one dataclass per env, CONFIG_KEYS derived from it
# --------------------------------------------------------------------------------------------


def option(default: Any, help: str, *, required: bool = False, ge: float | None = None,
           gt: float | None = None) -> Any:
    """One field of an `EnvOptions` dataclass: its default, its `--custom-config-path` help and its checks.

    `required`: the default is None and the key must be set. `ge`/`gt`: lower bounds (>=, >) of a number.
    """
    if not isinstance(help, str) or not help:
        raise ValueError("option: help must be a non-empty string")
    return dataclasses.field(default=default, metadata={"help": help, "required": required, "ge": ge, "gt": gt})


@functools.lru_cache(maxsize=None)
def _option_specs(cls: type) -> tuple[tuple[dataclasses.Field, bool, type], ...]:
    """(field, whether None is allowed, type without None) of each option of `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING or "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare env options with option(default, help)")
        tp = hints[f.name]
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
        arms = [a for a in typing.get_args(tp) if a is not type(None)] if optional else [tp]
        if len(arms) != 1 or not isinstance(arms[0], type):
            raise TypeError(f"{cls.__name__}.{f.name}: an env option is one type, optionally `| None`; got {tp}")
        specs.append((f, optional, arms[0]))
    return tuple(specs)


class EnvOptions:
    """Base of an env module's options dataclass (`@dataclass(frozen=True) class Options(EnvOptions)`).

    The field name is the `--custom-config-path` key, the annotation its type (`T` or `T | None`), and
    `option(...)` its default, help and bounds. Constructing one checks every field (an int is accepted,
    and stored as float, for a float field) and then calls `validate()` for cross-field checks.
    """

    #: The env's name in error messages ("geo3k build_env: ...").
    ENV_NAME: ClassVar[str] = "env"

    def __post_init__(self) -> None:
        for f, optional, base in _option_specs(type(self)):
            value = getattr(self, f.name)
            if value is None:
                if f.metadata["required"]:
                    raise ValueError(f"args.{f.name} is not set (set {f.name} in --custom-config-path)")
                if optional:
                    continue
            if base is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)  # frozen dataclasses too
            if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
                raise TypeError(f"args.{f.name} must be {base.__name__}, got {value!r}")
            ge, gt = f.metadata["ge"], f.metadata["gt"]
            if ge is not None and value < ge:
                raise ValueError(f"args.{f.name} must be >= {ge}, got {value}")
            if gt is not None and value <= gt:
                raise ValueError(f"args.{f.name} must be > {gt}, got {value}")
        self.validate()

    def validate(self) -> None:
        """Checks across fields or beyond bounds; raise ValueError naming the key. Override as needed."""

    @classmethod
    def config_keys(cls) -> dict[str, tuple[Any, Any, str]]:
        """The module's `CONFIG_KEYS`: {key: (type, default, help)}, as `jaxrl_vlm.config` reads them."""
        hints = typing.get_type_hints(cls)
        return {f.name: (hints[f.name], f.default, f.metadata["help"]) for f, _optional, _base in _option_specs(cls)}

    @classmethod
    def from_args(cls: type[_O], args: Any) -> _O:
        """The options set in `args` (unset keys take their defaults), checked; errors name the env and key."""
        values = {f.name: getattr(args, f.name, f.default) for f, _optional, _base in _option_specs(cls)}
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{cls.ENV_NAME} build_env: {e}") from e


# --------------------------------------------------------------------------------------------
# build_env helpers
# --------------------------------------------------------------------------------------------


def require_max_turns(args: Any, env_name: str) -> int:
    """`args.max_turns` (the rollout's option, which every turn-counting env needs), or a ValueError."""
    max_turns = getattr(args, "max_turns", None)
    if max_turns is None:
        raise ValueError(f"{env_name} build_env: args.max_turns is not set (set max_turns in --custom-config-path)")
    return int(max_turns)


def sample_where(sample: Any) -> str:
    """`sample(group=G, index=I)`, to name a sample in errors."""
    return f"sample(group={getattr(sample, 'group_index', '?')}, index={getattr(sample, 'index', '?')})"


def sample_label(sample: Any) -> Any:
    """`sample.label`, with a whole float read from a numeric column (12.0) turned into the int it means."""
    label = getattr(sample, "label", None)
    if isinstance(label, float) and label.is_integer():
        return int(label)
    return label


# --------------------------------------------------------------------------------------------
# Task prompt
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskPrompt:
    """What a task adds to each dataset prompt: a system message, the tool schema the chat template
    renders (kept in `Sample.metadata["tools"]`) and an instruction appended to the user text.

    None leaves that part out. A task module exposes one as `TASK_PROMPT`.
    """

    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    instruction: str | None = None


@dataclasses.dataclass(frozen=True)
class SessionCapacity:
    """How many episodes one process of an env can hold at once (a module's `session_capacity(args)`), and
    `set_by`: the option that sets it, as an error names it."""

    sessions: int
    set_by: str

    def __post_init__(self) -> None:
        if isinstance(self.sessions, bool) or not isinstance(self.sessions, int) or self.sessions < 1:
            raise ValueError(f"SessionCapacity: sessions must be an int >= 1, got {self.sessions!r}")


class BaseInteractionEnv(abc.ABC):
    """One episode's environment. Subclasses implement `reset` and `step`."""

    #: If True, the rollout may call `reset()` and retry a `step` that raised (bounded retries).
    #: Only set it when `reset()` really restores the state a retried step needs.
    recoverable: bool = False

    #: Episode state read by `check_step` (the shared `step` preamble): set by `close()`, by the env
    #: when the episode ends, and the number of committed turns out of `max_turns`.
    closed: bool = False
    done: bool = False
    turn: int = 0
    max_turns: int | None = None

    @abc.abstractmethod
    def reset(self) -> dict[str, Any] | None | Awaitable[dict[str, Any] | None]:
        """Start (or restart) the episode; may be `async def`. Bounded by `--env-hook-timeout`; a sync one runs in a
        worker thread. Returns None, or the observation that opens the episode (joined to the prompt; the return
        of a reset before a retried step is ignored)."""

    @abc.abstractmethod
    def step(
        self, response_text: str
    ) -> tuple[dict[str, Any], bool, dict[str, Any]] | Awaitable[tuple[dict[str, Any], bool, dict[str, Any]]]:
        """Consume one model turn's text; return (observation, done, info). May be `async def`."""

    def verdict(self) -> float | None:
        """The episode's final reward as decided by the environment, or None if it has no opinion.

        None makes the rollout fall back to the module's `reward_fn` on the model's text. Bounded by
        `--env-hook-timeout` (an overrun FAILs the episode with cause `env_timeout`).
        """
        return None

    def close(self) -> None:
        """Release resources. Always called by the rollout, exactly once per episode (also after a failed or
        stuck `reset`), under `--env-hook-timeout`: one that overruns FAILs the episode with cause `env_timeout`."""
        self.closed = True

    def check_step(self, response_text: Any) -> None:
        """The preamble of `step`: no step after `close()` or after the episode ended, and a str turn text."""
        name = type(self).__name__
        if self.closed:
            raise RuntimeError(f"{name}.step called after close()")
        if self.done:
            raise RuntimeError(f"{name}.step called after the episode ended (turn {self.turn} of {self.max_turns})")
        if not isinstance(response_text, str):
            raise TypeError(f"{name}.step: response_text must be str, got {type(response_text).__name__}")

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        """One chat message for `observation`: images first, then clips, then the text (slime's order).

        Returns {"role": "user" | "tool", "content": [{"type": "image", "image": ...}, ...,
        {"type": "video", "video": ...}, ..., {"type": "text", "text": obs_str}]}. Raises TypeError/ValueError
        naming the bad field.
        """
        if not isinstance(observation, dict):
            raise TypeError(f"{type(self).__name__}: observation must be a dict, got {type(observation).__name__}")
        obs_str = observation.get("obs_str")
        if not isinstance(obs_str, str):
            raise TypeError(f"{type(self).__name__}: observation['obs_str'] must be str, got {type(obs_str).__name__}")
        role = observation.get("role", "user")
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"{type(self).__name__}: observation['role']={role!r} is not one of {OBSERVATION_ROLES}")
        owner = type(self).__name__
        content: list[dict[str, Any]] = [
            {"type": "image", "image": image} for image in observation_images(observation, owner)
        ]
        content += [{"type": "video", "video": clip} for clip in observation_clips(observation, owner)]
        content.append({"type": "text", "text": obs_str})
        return {"role": role, "content": content}


def observation_images(observation: dict[str, Any], owner: str = "observation") -> list[Image.Image | str]:
    """The validated image list of an observation (possibly empty).

    Accepts PIL images and `data:image/...` URLs; a modality key other than image and video is an error because
    the rollout would silently drop it.
    """
    images = _modality_items(observation, "image", owner)
    for k, image in enumerate(images):
        if isinstance(image, Image.Image):
            continue
        if isinstance(image, str) and image.startswith("data:image/"):
            continue
        raise TypeError(
            f"{owner}: observation['multi_modal_data']['image'][{k}] must be a PIL.Image or a data:image/ URL, "
            f"got {type(image).__name__}"
        )
    return images


def observation_clips(observation: dict[str, Any], owner: str = "observation") -> list[Clip | str]:
    """The validated clip list of an observation (possibly empty): `Clip`s and `data:video/...` URLs."""
    clips = _modality_items(observation, "video", owner)
    for k, clip in enumerate(clips):
        if not (isinstance(clip, Clip) or (isinstance(clip, str) and clip.startswith("data:video/"))):
            raise TypeError(f"{owner}: observation['multi_modal_data']['video'][{k}] must be a rollout.video.Clip or a "
                            f"data:video/ URL, got {type(clip).__name__}")
    return clips


def _modality_items(observation: dict[str, Any], key: str, owner: str) -> list[Any]:
    mm = observation.get("multi_modal_data")
    if mm is None:
        return []
    if not isinstance(mm, dict):
        raise TypeError(f"{owner}: observation['multi_modal_data'] must be a dict, got {type(mm).__name__}")
    unknown = set(mm) - set(OBSERVATION_MODALITIES)
    if unknown:
        raise ValueError(f"{owner}: observation['multi_modal_data'] has unsupported keys {sorted(unknown)} "
                         f"(only {', '.join(map(repr, OBSERVATION_MODALITIES))})")
    items = mm.get(key) or []
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{owner}: observation['multi_modal_data'][{key!r}] must be a list, got {type(items).__name__}")
    return list(items)
