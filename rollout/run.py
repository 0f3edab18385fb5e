"""One rollout run, typed: options, runtime services and the driver's cross-step state, passed explicitly.

The default rollout path (`rollout.driver` -> `rollout.streaming` -> the episode loop of `rollout.multiturn`)
receives a `RolloutRun` and reads its typed fields; it never re-reads slime's flat `args`. `RolloutRun.from_args`
is the one place that turns a slime namespace into a run (slime's public entry points, `generate_rollout(args, ...)`
and `generate(args, sample, sampling_params)`, start there). The namespace travels on as `RolloutRun.args` only
for user code (slime's hooks, custom generate functions, envs), which keeps slime's names; a derived run (eval's
sampling, `RolloutRun.derive`) gets its own namespace written from its typed options.

Also here, below the driver and the episode loop that both use them: `RolloutContext` (client, encoder, env module,
generate slots, router mode, suspended episodes) and `DriverState` with its checkpoint form.

Never imports jax.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from rollout.client import SGLangClient
from rollout.encoding import ChatEncoder
from rollout.options import MultiTurnOptions, RolloutOptions
from rollout.rewards import RewardSettings
from rollout.sample import Sample, Status
from rollout.privileged import PrivilegedView
from rollout.teacher import TeacherScorer

logger = logging.getLogger(__name__)


class ContextError(RuntimeError):
    """A run without its rollout context (it is created by the job's engine session)."""


@dataclass
class RolloutContext:
    """What every episode of a rollout shares. Created by the job's engine session; the
    default path reads it from `RolloutRun.context`, user code from `args.rollout_context`.

    `generate_slots` bounds concurrent `/generate` requests (not env time: a slow env must not hold a slot).
    `suspended` keeps the live state of partially rolled-out episodes between rollout steps.
    """

    client: SGLangClient
    encoder: ChatEncoder
    env_module: ModuleType | None
    generate_slots: asyncio.Semaphore
    router_mode: bool = False
    suspended: dict[tuple[int, int], Any] = field(default_factory=dict)  # rollout.multiturn.EpisodeState values
    # Set by the driver while it aborts stragglers: episodes stop before their next /generate.
    aborting: bool = False
    # --use-opd: the teacher that scores each finished episode (rollout/teacher.py); None without distillation.
    teacher: TeacherScorer | None = None
    # --opd-type self: renders each finished episode's privileged prompt (rollout/privileged.py); None otherwise.
    privileged: PrivilegedView | None = None

    @property
    def reward_fn(self) -> Callable[[str, Any], float] | None:
        return getattr(self.env_module, "reward_fn", None) if self.env_module is not None else None


def get_context(args: Any) -> RolloutContext:
    """The rollout context on `args`, its encoder set up from `args` (the driver and every episode come through
    here): `--apply-chat-template-kwargs` when `args` carries it (a namespace without it leaves the encoder's own),
    and the chat template classified, which logs once."""
    multiturn = MultiTurnOptions.from_args(args) if hasattr(args, "apply_chat_template_kwargs") else None
    return _prepared_context(args, multiturn)


def _prepared_context(args: Any, multiturn: MultiTurnOptions | None) -> RolloutContext:
    """`args.rollout_context` with its encoder set up: `multiturn`'s chat-template kwargs (None keeps the
    encoder's own) and the chat template classified, which logs once."""
    ctx = getattr(args, "rollout_context", None)
    if not isinstance(ctx, RolloutContext):
        raise ContextError("args.rollout_context is not set: episodes run inside rollout.driver, which creates it")
    if isinstance(ctx.encoder, ChatEncoder):  # an offline context (restoring driver state) has none
        if multiturn is not None:
            ctx.encoder.set_template_kwargs(multiturn.apply_chat_template_kwargs)
        ctx.encoder.classify_template()
    return ctx


# ----------------------------------------------------------------------------- driver state
# A resumed group may hold episodes that already finished in an earlier step: they pass through unchanged.
RUNNABLE = (Status.PENDING, Status.ABORTED)
# Version of the dict written by `driver_checkpoint_state`. Version 2 added `next_group_index`; version 1 (which
# kept it beside the driver state) is still read when the caller passes the index. Version 3 added
# `filtered_long_prompts` (older states read as 0). Version 4 added `dropped_groups` and `unreported` (older states
# read as none).
DRIVER_STATE_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)


class DriverStateError(ValueError):
    """A checkpointed driver state that cannot be restored; the message names the entry that is wrong."""


@dataclass
class CarriedGroup:
    """A group suspended by partial rollout, resumed first in the next step.

    `prompt` is the pristine prompt Sample the group was made from: the resume policy restarts the group's
    unfinished episodes from it, because their live envs cannot be checkpointed (module docstring).
    """

    group_index: int
    prompt: Sample
    samples: list[Sample]


@dataclass
class Unreported:
    """What the streaming rollout counted since its last batch besides whole-group drops (`RolloutResult`'s
    FAILED samples, per-sample drop counts and finished episodes): reported with the next batch, so a checkpoint
    taken before it carries them."""

    failed: list[Sample] = field(default_factory=list)
    sample_drops: dict[str, int] = field(default_factory=dict)
    episodes: int = 0

    def to_dict(self, where: str) -> dict[str, Any]:
        return {"failed": [_sample_json(s, f"{where}.failed[{i}]") for i, s in enumerate(self.failed)],
                "sample_drops": {str(k): int(v) for k, v in self.sample_drops.items()}, "episodes": int(self.episodes)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Unreported":
        if not isinstance(data, dict):
            raise DriverStateError(f"{where} must be a dict, got {type(data).__name__}")
        _check_keys(data, {"failed", "sample_drops", "episodes"}, where)
        failed = [_sample_from(d, f"{where}.failed[{i}]") for i, d in enumerate(_list(data, "failed", where))]
        drops = data["sample_drops"]
        if not isinstance(drops, dict) or not all(isinstance(k, str) and k for k in drops):
            raise DriverStateError(f"{where}.sample_drops must be a dict of reason -> count, got {drops!r}")
        counts = {k: _index(v, f"{where}.sample_drops[{k!r}]") for k, v in drops.items()}
        return cls(failed=failed, sample_drops=counts, episodes=_index(data["episodes"], f"{where}.episodes"))


@dataclass
class DriverState:
    """What the driver carries from one rollout step to the next (`args.driver_state`).

    `next_group_index` numbers groups globally (per-request sampling seeds derive from it); `prompt_buffer` holds
    prompts fetched from the source but not used yet; `partial_groups` are the groups suspended by partial
    rollout, resumed first in the next step; `filtered_long_prompts` counts the prompts skipped over the run for
    `--rollout-max-prompt-len`. `dropped_groups` are (group index, reason) of the groups the streaming rollout
    dropped whole since its last batch (stale or filtered): they are counted with the next batch, so a checkpoint
    taken before that batch carries them and the resumed run counts them instead (nothing is dropped silently);
    `unreported` does the same for the FAILED samples and per-sample counts of that moment.
    """

    next_group_index: int = 0
    prompt_buffer: list[Sample] = field(default_factory=list)
    partial_groups: list[CarriedGroup] = field(default_factory=list)
    filtered_long_prompts: int = 0
    dropped_groups: list[tuple[int, str]] = field(default_factory=list)
    unreported: Unreported = field(default_factory=Unreported)

    def held(self) -> dict[str, int]:
        """What a used state holds (empty for a fresh one)."""
        held = {"next_group_index": self.next_group_index, "partial_groups": len(self.partial_groups),
                "prompt_buffer": len(self.prompt_buffer), "filtered_long_prompts": self.filtered_long_prompts,
                "dropped_groups": len(self.dropped_groups),
                "unreported": len(self.unreported.failed) + sum(self.unreported.sample_drops.values())
                + self.unreported.episodes}
        return {k: v for k, v in held.items() if v}

    def to_dict(self) -> dict[str, Any]:
        """The JSON-serializable checkpoint form (it only reads: the run goes on with its live episodes)."""
        buffer = [_sample_json(s, f"prompt_buffer[{i}]") for i, s in enumerate(self.prompt_buffer)]
        groups = []
        for k, carried in enumerate(self.partial_groups):
            where = f"partial_groups[{k}] (group {carried.group_index})"
            groups.append({
                "group_index": int(carried.group_index),
                "prompt": _sample_json(carried.prompt, f"{where} prompt"),
                "finished": [_sample_json(s, f"{where} sample {s.index}")
                             for s in carried.samples if s.status not in RUNNABLE],
                # Unfinished episodes are restarted on resume: only their indices are needed.
                "restart": sorted(int(s.index) for s in carried.samples if s.status in RUNNABLE),
            })
        return {"version": DRIVER_STATE_VERSION, "next_group_index": int(self.next_group_index),
                "prompt_buffer": buffer, "partial_groups": groups,
                "filtered_long_prompts": int(self.filtered_long_prompts),
                "dropped_groups": [{"group_index": int(g), "reason": str(r)} for g, r in self.dropped_groups],
                "unreported": self.unreported.to_dict("unreported")}

    @classmethod
    def from_dict(cls, data: Any, *, next_group_index: int | None = None) -> "DriverState":
        """Rebuild a `to_dict` state under the resume policy (module docstring). A version-1 dict has no group
        counter: pass the one saved beside it as `next_group_index`. Raises DriverStateError naming the entry."""
        version = _version(data)
        expected = {"version", "prompt_buffer", "partial_groups"} | ({"next_group_index"} if version >= 2 else set())
        expected |= {"filtered_long_prompts"} if version >= 3 else set()
        expected |= {"dropped_groups", "unreported"} if version >= 4 else set()
        _check_keys(data, expected, "driver state")
        filtered = _index(data["filtered_long_prompts"], "driver state.filtered_long_prompts") if version >= 3 else 0
        dropped = [_dropped_group_from(d, f"dropped_groups[{k}]")
                   for k, d in enumerate(_list(data, "dropped_groups", "driver state"))] if version >= 4 else []
        unreported = Unreported.from_dict(data["unreported"], "unreported") if version >= 4 else Unreported()
        if version >= 2:
            counter = _index(data["next_group_index"], "driver state.next_group_index")
            if next_group_index is not None and next_group_index != counter:
                raise DriverStateError(f"driver state has next_group_index {counter} but {next_group_index} was "
                                       "passed beside it")
        elif next_group_index is None:
            raise DriverStateError("a version 1 driver state has no next_group_index: pass the one saved beside it")
        else:
            counter = _index(next_group_index, "next_group_index")
        buffer = [_sample_from(d, f"prompt_buffer[{i}]")
                  for i, d in enumerate(_list(data, "prompt_buffer", "driver state"))]
        groups = [_carried_from(d, f"partial_groups[{k}]")
                  for k, d in enumerate(_list(data, "partial_groups", "driver state"))]
        seen = Counter(g.group_index for g in groups)
        repeated = sorted(g for g, count in seen.items() if count > 1)
        if repeated:
            raise DriverStateError(f"driver state carries group indices {repeated} more than once")
        late = [g.group_index for g in groups if g.group_index >= counter] + [g for g, _ in dropped if g >= counter]
        if late:
            raise DriverStateError(
                f"driver state carries groups {late} but its next_group_index is {counter}: the driver state and "
                "the group counter come from different checkpoints"
            )
        return cls(next_group_index=counter, prompt_buffer=buffer, partial_groups=groups,
                   filtered_long_prompts=filtered, dropped_groups=dropped, unreported=unreported)


def driver_state(args: Any) -> DriverState:
    """The driver state of a run, created fresh on first use."""
    state = getattr(args, "driver_state", None)
    if state is None:
        state = DriverState()
        args.driver_state = state
    elif not isinstance(state, DriverState):
        raise TypeError(f"args.driver_state is {type(state).__name__}, not a DriverState")
    return state


def episode_copy(prompt: Sample, group_index: int, index: int) -> Sample:
    """A fresh episode of `prompt`: also how a restored group restarts an episode, so both start identically."""
    s = copy.deepcopy(prompt)
    s.group_index = group_index
    s.index = index
    s.metadata["prompt_index"] = prompt.index
    return s


def _version(state: Any) -> int:
    if not isinstance(state, dict):
        raise DriverStateError(f"driver state must be a dict, got {type(state).__name__}")
    if "version" not in state:
        raise DriverStateError(f"driver state has no 'version' (keys: {sorted(state)})")
    if state["version"] not in _READABLE_VERSIONS:
        raise DriverStateError(
            f"driver state version {state['version']!r} is not supported "
            f"(this driver reads versions {', '.join(map(str, _READABLE_VERSIONS))})"
        )
    return int(state["version"])


def _sample_json(sample: Sample, where: str) -> dict[str, Any]:
    data = sample.to_dict()
    try:
        json.dumps(data)
    except (TypeError, ValueError) as e:  # e.g. a PIL image left in a custom source's prompt
        raise TypeError(f"driver_checkpoint_state: {where} ({sample.name}) is not JSON-serializable: {e}") from e
    return data


def _carried_from(data: Any, where: str) -> CarriedGroup:
    """Rebuild a carried group under the resume policy: finished episodes as saved, the others restarted."""
    if not isinstance(data, dict):
        raise DriverStateError(f"{where} must be a dict, got {type(data).__name__}")
    _check_keys(data, {"group_index", "prompt", "finished", "restart"}, where)
    group_index = _index(data["group_index"], f"{where}.group_index")
    where = f"{where} (group {group_index})"
    prompt = _sample_from(data["prompt"], f"{where}.prompt")
    finished = [_sample_from(d, f"{where}.finished[{i}]") for i, d in enumerate(_list(data, "finished", where))]
    restart = [_index(i, f"{where}.restart[{j}]") for j, i in enumerate(_list(data, "restart", where))]
    for s in finished:
        if s.group_index != group_index:
            raise DriverStateError(f"{where}: finished {s.name} belongs to group {s.group_index}")
        if s.status in RUNNABLE:
            raise DriverStateError(f"{where}: finished {s.name} has status {s.status.value}, which is not finished")
    indices = Counter([s.index for s in finished] + restart)
    repeated = sorted(i for i, count in indices.items() if count > 1)
    if repeated:
        raise DriverStateError(f"{where}: sample indices {repeated} appear more than once in finished/restart")
    if not indices:
        raise DriverStateError(f"{where}: the group has no samples (finished and restart are both empty)")
    samples = finished + [_restarted(prompt, group_index, i) for i in restart]
    return CarriedGroup(group_index, prompt, sorted(samples, key=lambda s: s.index))


def _dropped_group_from(data: Any, where: str) -> tuple[int, str]:
    if not isinstance(data, dict):
        raise DriverStateError(f"{where} must be a dict, got {type(data).__name__}")
    _check_keys(data, {"group_index", "reason"}, where)
    reason = data["reason"]
    if not isinstance(reason, str) or not reason:
        raise DriverStateError(f"{where}.reason must be a non-empty string, got {reason!r}")
    return _index(data["group_index"], f"{where}.group_index"), reason


def _restarted(prompt: Sample, group_index: int, index: int) -> Sample:
    sample = episode_copy(prompt, group_index, index)
    sample.metadata["restarted_on_resume"] = True  # its pre-checkpoint tokens were lost (module docstring)
    return sample


def _sample_from(data: Any, where: str) -> Sample:
    if not isinstance(data, dict):
        raise DriverStateError(f"{where} must be a Sample dict, got {type(data).__name__}")
    try:
        sample = Sample.from_dict(data)
        sample.validate()
        return sample
    except (TypeError, ValueError, KeyError) as e:  # SampleError is a ValueError
        raise DriverStateError(f"{where} is not a valid Sample dict: {type(e).__name__}: {e}") from e


def _list(data: dict[str, Any], key: str, where: str) -> list[Any]:
    value = data[key]
    if not isinstance(value, list):
        raise DriverStateError(f"{where}.{key} must be a list, got {type(value).__name__}")
    return value


def _index(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DriverStateError(f"{where} must be a non-negative int, got {value!r}")
    return value


def _check_keys(data: dict[str, Any], expected: set[str], where: str) -> None:
    missing, unknown = expected - set(data), set(data) - expected
    if missing or unknown:
        raise DriverStateError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")


def restore_into(current: DriverState, suspended: int, state: dict[str, Any] | None, next_group_index: int | None,
                 holder: str) -> DriverState:
    """The driver state a checkpoint saved (`restored_state`), for a fresh `holder` (a run, or slime's args) whose
    state is `current` with `suspended` suspended episodes. Raises DriverStateError naming the entry, or when the
    holder already holds driver state or suspended episodes (restoring over them would drop or duplicate prompts);
    nothing is half-restored."""
    if current.held() or suspended:
        raise DriverStateError(
            f"restore_driver_state: the {holder} already {'hold' if holder == 'args' else 'holds'} driver state "
            f"{current.held()} and {suspended} suspended episodes; restore into a fresh {holder}, before the first "
            "rollout step"
        )
    return restored_state(state, next_group_index)


def restored_state(state: dict[str, Any] | None, next_group_index: int | None) -> DriverState:
    """The driver state a checkpoint saved (`DriverState.to_dict`); with `state=None` (an older checkpoint without
    one) only the group counter `next_group_index`, with a warning. Raises DriverStateError naming the entry."""
    if state is not None:
        return DriverState.from_dict(state, next_group_index=next_group_index)
    if next_group_index is None:
        raise DriverStateError("restore_driver_state: neither a driver state nor a next_group_index to restore")
    logger.warning("the checkpoint has no rollout driver state (an older checkpoint): buffered prompts and "
                   "carried partial groups of the interrupted run are not restored")
    return DriverState(next_group_index=_index(next_group_index, "next_group_index"))


# ----------------------------------------------------------------------------- the run
@dataclass
class RolloutRun:
    """What one rollout run reads: typed options (`options`, `multiturn`, `rewards`), the runtime services
    (`context`: client, encoder, env module, generate slots, router mode) and the driver's cross-step `state`.

    `args` is slime's flat namespace saying the same under slime's names: it is handed only to user code.
    """

    options: RolloutOptions
    multiturn: MultiTurnOptions
    rewards: RewardSettings
    context: RolloutContext
    state: DriverState
    args: Any

    @classmethod
    def from_args(cls, args: Any) -> "RolloutRun":
        """The run a slime namespace describes (slime's entry points): its options read once, its context (encoder
        set up, see `get_context`) and its driver state (created on first use)."""
        multiturn = MultiTurnOptions.from_args(args)
        # A namespace without the chat-template kwargs leaves the encoder's own (as `get_context` does).
        context = _prepared_context(args, multiturn if hasattr(args, "apply_chat_template_kwargs") else None)
        return cls(options=RolloutOptions.from_args(args), multiturn=multiturn, rewards=RewardSettings.from_args(args),
                   context=context, state=driver_state(args), args=args)

    @classmethod
    def typed(cls, options: RolloutOptions, multiturn: MultiTurnOptions, rewards: RewardSettings,
              args: Any) -> "RolloutRun":
        """The run of a job, from its typed options (the one source of each value); `args` is the job's slime
        namespace for user code, which must carry the rollout context (the engine session sets it)."""
        context = _prepared_context(args, multiturn)
        return cls(options=options, multiturn=multiturn, rewards=rewards, context=context, state=driver_state(args),
                   args=args)

    def restore_state(self, state: dict[str, Any] | None, *, next_group_index: int | None = None) -> None:
        """Load a checkpointed `DriverState.to_dict()` into this fresh run, before its first rollout step (see
        `restore_into`); the namespace user code sees gets the same state."""
        self.state = restore_into(self.state, len(self.context.suspended), state, next_group_index, "run")
        self.args.driver_state = self.state

    def derive(self, **changes: Any) -> "RolloutRun":
        """This run with some fields replaced (`dataclasses.replace`), and a copy of its namespace that says the
        same to user code: every typed option under its slime name, its context and its driver state."""
        run = dataclasses.replace(self, **changes)
        args = copy.copy(self.args)
        for options in (run.rewards, run.multiturn, run.options):
            for f in dataclasses.fields(options):
                setattr(args, f.name, getattr(options, f.name))
        args.rollout_context = run.context
        args.driver_state = run.state
        run.args = args
        return run
