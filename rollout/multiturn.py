"""The default per-sample multi-turn episode: `async def generate(args, sample, sampling_params) -> Sample`.

Phases of one episode (slime's loop, with its defects fixed; reference/slime.md):

1. **init**: render the prompt with the chat template; training view (expanded pads) into `sample.tokens`,
   wire view (compact pads) kept for the engine; prompt images go to `image_data`, clips to `video_data`, and
   their tensors to the buffer. Then
   `env.reset()`: an observation it returns joins the prompt's first user turn (re-encoded, still prompt).
2. **generate**: POST `/generate` with the wire ids so far and every image and clip so far; append the sampled ids
   and log-probs with loss mask 1. The engine's ids are never re-tokenized.
3. **env.step** on the model's text of this turn, with a timeout (`--env-step-timeout`) and bounded retries.
4. **observe**: encode the observation as delta tokens (template separator + observation + generation
   prompt) with loss mask 0 and log-prob 0.
5. **multimodal state**: observation images and clips are appended to `image_data` / `video_data` and their
   tensors buffered; the buffer is concatenated once per key at finalize.

Termination: env done -> COMPLETED; `max_turns` reached -> COMPLETED (no unanswered observation is
appended); the response budget (generated + observation tokens) or the context runs out -> TRUNCATED with
the cause recorded; engine `length` -> TRUNCATED; engine `abort` -> ABORTED; an engine that stays
unreachable, an env whose reset raises or whose step keeps failing (`env_error`), the episode's wall-clock
limit, or a reward that cannot be trained on (a mapping without its `--reward-key`, a non-finite value) ->
FAILED with the error recorded.
None of these raise: one bad episode never kills a rollout. `env.close()` always runs. Every ending goes through
`_end_episode`, which sets the status and the typed `Sample.termination` together.

Env hooks are user code and run bounded (`call_env_hook`): `step` under `--env-step-timeout` (then retried), and
`reset`, `verdict`, `close` and the env module's `reward_fn` under `--env-hook-timeout` each; an overrun FAILs the
episode with cause `env_timeout` naming the hook. A sync hook runs in a worker thread of its own (a daemon thread,
not the loop's default executor), so a blocking one never stalls the event loop or the other episodes. A thread
running a truly stuck function cannot be killed: it is abandoned (it holds no executor slot, and as a daemon it
does not keep the process alive) and its result, if it ever comes, is ignored. An async hook runs on the loop; on
overrun it is cancelled and never awaited again. `--episode-timeout` bounds the whole episode, `reset` and
finalize (reward) included; `close()` then still runs, under its own `--env-hook-timeout`.

The episode reads the typed options of its `RolloutRun` (rollout/run.py: `play_episode(run, ...)`, which the default
driver calls); slime's `generate(args, ...)` builds that run from `args` first. `args` reaches user code only:
the env module's `build_env(sample, args)`.
The reward is the env's verdict by default; `--rm-type` grades the model's own turns instead (rollout/rewards.py);
with `--custom-rm-path` the episode leaves it unset and the driver scores it (rollout/driver.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import inspect
import logging
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rollout.client import EngineError
from rollout.encoding import check_prefix_stability, prompt_with_opening
from rollout.engine_link import EngineLost
from rollout.options import MultiTurnOptions, RolloutOptions
from rollout.rewards import RewardError, RewardSettings, reward_components, rm_function, scalar_reward
from rollout.run import RolloutContext, RolloutRun, get_context  # noqa: F401  (re-exported: get_context lived here)
from rollout.sample import (
    FINISH_REASON_STATUS,
    Sample,
    Status,
    Termination,
    TerminationKind,
    TruncationCause,
    TurnRecord,
)
from rollout.sglang_wire import decode_routed_experts

logger = logging.getLogger(__name__)

# Big enough that no realistic logit survives it; finite because JSON has no -inf.
BANNED_TOKEN_BIAS = -1.0e9


class EpisodeError(RuntimeError):
    """An episode could not be run at all (missing context, bad env module); names the sample."""


class EnvResetError(Exception):
    """`env.reset()` raised (a remote env's server refused or dropped it, a simulator that cannot start): the env
    failed, so the episode FAILs as `env_error` like a step that keeps failing, not as an unexplained `exception`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        super().__init__(f"env.reset failed: {type(error).__name__}: {error}")


class EnvHookTimeout(Exception):
    """An env hook (`env.reset`, `env.step`, `env.verdict`, `env.close`, the module's `reward_fn`) overran its limit.

    Deliberately not a TimeoutError: the episode's own wall-clock limit raises that, and the two end an episode
    with different causes (`env_timeout` and `episode_timeout`).
    """

    def __init__(self, hook: str, timeout_s: float, option: str) -> None:
        self.hook, self.timeout_s, self.option = hook, timeout_s, option
        super().__init__(f"{hook} did not return within {timeout_s:g} s ({option}); it was abandoned")


@dataclass
class EpisodeState:
    """Live state of one episode beyond what the Sample holds (survives a partial-rollout suspension)."""

    wire_ids: list[int]
    env: Any
    mm_chunks: list[dict[str, np.ndarray]] = field(default_factory=list)
    model_turns: list[list[int]] = field(default_factory=list)
    observations: list[list[dict[str, Any]] | None] = field(default_factory=list)
    routing_key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # wire_ids index where the current (possibly resumed) model turn started: a resumed turn keeps growing it.
    open_turn: bool = False
    # --env-hook-timeout of the episode, kept for `close_env` (the driver closes suspended episodes' envs too).
    hook_timeout_s: float = field(default_factory=lambda: MultiTurnOptions().env_hook_timeout)
    # The episode's prompt when the env's reset observation joined it (None: `Sample.prompt` as it is).
    prompt: list[dict[str, Any]] | None = None


def default_sampling_params(args: Any, banned_ids: tuple[int, ...], eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The `sampling_params` a generate function receives (slime builds the same dict once from its rollout
    flags); each turn then sets its own `max_new_tokens` and `sampling_seed`.

    `args` is a `RolloutOptions` (the default path) or a flat namespace, whose missing options take their
    defaults. Beyond slime's keys it carries what the default episode needs: the model's EOS ids among the stop
    ids, and the ban of the vision special tokens.
    """
    opts = args if isinstance(args, RolloutOptions) else RolloutOptions.from_args(args)
    stop_ids = list(dict.fromkeys([*eos_ids, *opts.rollout_stop_token_ids]))
    params: dict[str, Any] = {
        "temperature": opts.rollout_temperature,
        "top_p": opts.rollout_top_p,
        "top_k": opts.rollout_top_k,
        "max_new_tokens": opts.rollout_max_response_len,
        "stop_token_ids": stop_ids,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        # A sampled image pad or vision marker would corrupt M-RoPE positions of every later token.
        "logit_bias": {str(t): BANNED_TOKEN_BIAS for t in banned_ids},
    }
    if opts.rollout_stop:
        params["stop"] = list(opts.rollout_stop)
    return params


def episode_sampling_params(sampling_params: dict[str, Any], banned_ids: tuple[int, ...],
                            eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The params an episode sends: the received dict, plus what must hold whoever built it (the EOS ids
    stop a turn, and the vision special tokens stay banned: a caller's bias cannot lift the ban)."""
    params = dict(sampling_params)
    params["stop_token_ids"] = list(dict.fromkeys([*eos_ids, *(params.get("stop_token_ids") or [])]))
    params["logit_bias"] = {**dict(params.get("logit_bias") or {}), **{str(t): BANNED_TOKEN_BIAS for t in banned_ids}}
    return params


# The training tensors of each modality travel together: a turn shows pictures, clips, both or neither.
_IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})
_VIDEO_KEYS = frozenset({"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"})


def _modality_of(key: str) -> str:
    return "image" if key in _IMAGE_KEYS else "video" if key in _VIDEO_KEYS else "other"


def merge_multimodal_chunks(chunks: list[dict[str, np.ndarray]], name: str) -> dict[str, np.ndarray] | None:
    """Concatenate per-turn training tensors once per key (O(total), not O(turns^2)).

    A turn may show pictures, clips or both, so a chunk holds the keys of the modalities it has; every chunk that
    has a modality must have the same keys of it (e.g. `second_per_grid_ts` with every clip or none), and every
    value must be an array: a key missing from some turns, or a value that is not an array, is an error rather
    than being silently dropped (slime's defect).
    """
    chunks = [c for c in chunks if c]
    if not chunks:
        return None
    first: dict[str, tuple[int, set[str]]] = {}  # modality -> (first chunk with it, its keys)
    for k, chunk in enumerate(chunks):
        for key, value in chunk.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"{name}: multimodal chunk {k} key {key!r} is {type(value).__name__}, not ndarray")
        for modality in {_modality_of(key) for key in chunk}:
            keys = {key for key in chunk if _modality_of(key) == modality}
            j, expected = first.setdefault(modality, (k, keys))
            if keys != expected:
                raise ValueError(f"{name}: multimodal chunk {k} has {modality} keys {sorted(keys)}, chunk {j} has "
                                 f"{sorted(expected)}")
    keys = sorted({key for chunk in chunks for key in chunk})
    return {key: np.concatenate([c[key] for c in chunks if key in c], axis=0) for key in keys}


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():  # the caller gave up (timeout or cancel): the late result is dropped
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def run_in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "hook") -> asyncio.Future:
    """Start `fn(*args)` in a new daemon thread; a future of the running loop gets its result or exception.

    Not the loop's default executor: a stuck call would hold one of its few workers for good (starving every
    later `to_thread`), and its non-daemon threads are joined at loop and interpreter shutdown. A daemon thread
    whose caller stopped waiting is simply abandoned; whatever it returns later is dropped.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome: tuple[bool, Any] = (True, context.run(fn, *args))
        except Exception as e:
            outcome = (False, e)
        except BaseException as e:  # SystemExit & co. in a hook must not escape as such into the loop
            outcome = (False, RuntimeError(f"{name} raised {type(e).__name__}: {e}"))
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name=f"env-hook:{name}", daemon=True).start()
    return future


def _drop_outcome(task: asyncio.Future) -> None:
    """Done callback of an abandoned hook: read its outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _within(awaitable: Any, deadline: float, hook: str, timeout_s: float, option: str) -> Any:
    """Await `awaitable` until the loop time `deadline`; past it, cancel it without waiting and raise EnvHookTimeout.

    The awaitable is never awaited after the cancel, so a coroutine that swallows cancellation cannot hang the
    episode either (it is left to finish on its own).
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
    finally:  # also when the episode's own deadline cancels us
        if not task.done():
            task.cancel()
            task.add_done_callback(_drop_outcome)
    if not done:
        raise EnvHookTimeout(hook, timeout_s, option)
    return task.result()


async def call_env_hook(fn: Callable[..., Any], *args: Any, timeout_s: float, hook: str,
                        option: str = "--env-hook-timeout") -> Any:
    """`fn(*args)` (an env hook: user code) with a time limit; raises EnvHookTimeout (naming `hook`) past it.

    An `async def` runs on the loop; a sync function runs in its own daemon thread (`run_in_daemon_thread`), so
    a blocking one cannot stall the loop, and an awaitable it returns is awaited within the same limit.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    if inspect.iscoroutinefunction(fn):
        result = await _within(fn(*args), deadline, hook, timeout_s, option)
    else:
        result = await _within(run_in_daemon_thread(fn, *args, name=hook), deadline, hook, timeout_s, option)
    if inspect.isawaitable(result):
        result = await _within(result, deadline, hook, timeout_s, option)
    return result


async def close_env(state: EpisodeState) -> None:
    """`env.close()` of an episode under its `--env-hook-timeout`; raises EnvHookTimeout or what close raised."""
    await call_env_hook(state.env.close, timeout_s=state.hook_timeout_s, hook="env.close")


async def _call_env_step(env: Any, text: str, timeout_s: float) -> tuple[dict, bool, dict]:
    """Run `env.step` with a time limit; a sync step runs in a worker thread so it cannot block the loop."""
    result = await call_env_hook(env.step, text, timeout_s=timeout_s, hook="env.step", option="--env-step-timeout")
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"{type(env).__name__}.step must return (observation, done, info), got {type(result).__name__}")
    observation, done, info = result
    return observation, bool(done), info or {}


@dataclass(frozen=True)
class _Deadline:
    """The episode's wall-clock limit (`--episode-timeout`) as a loop time, shared by the turns and finalize."""

    at: float
    limit_s: float

    @classmethod
    def after(cls, limit_s: float) -> "_Deadline":
        return cls(asyncio.get_running_loop().time() + limit_s, limit_s)

    def remaining(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def error(self, where: str) -> str:
        return f"episode exceeded its {self.limit_s:g} s wall-clock limit (--episode-timeout) {where}"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any] | None = None) -> Sample:
    """Run (or resume) one episode. Never raises for episode-level failures; see the module docstring.

    `sampling_params` is the dict the driver builds from the rollout options (`default_sampling_params`); it is
    used as given (None, from a direct call, builds the same dict here).
    """
    return await play_episode(RolloutRun.from_args(args), sample, sampling_params)


async def play_episode(run: RolloutRun, sample: Sample, sampling_params: dict[str, Any] | None = None) -> Sample:
    """`generate` on a typed run (what the default driver calls): the same episode, read from `run`."""
    ctx, opts, multiturn, rewards = run.context, run.options, run.multiturn, run.rewards
    deadline = _Deadline.after(opts.episode_timeout)
    key = (sample.group_index, sample.index)
    state: EpisodeState | None = None
    try:
        state = ctx.suspended.pop(key, None)
        fresh = state is None
        if state is None:
            state = await _init_episode(ctx, run.args, sample, multiturn)
        state.hook_timeout_s = multiturn.env_hook_timeout
        episode = _EpisodeRun.start(ctx, opts, multiturn, sample, state, sampling_params)
        await asyncio.wait_for(episode.run(reset=fresh), deadline.remaining())
    except asyncio.TimeoutError:
        _end_episode(sample, Termination(TerminationKind.EPISODE_TIMEOUT), error=deadline.error("in its turns"))
    except EnvHookTimeout as e:
        logger.warning("%s: %s", sample.name, e)
        _end_episode(sample, Termination(TerminationKind.ENV_TIMEOUT), error=f"env: {e}")
    except EnvResetError as e:
        logger.warning("%s: %s", sample.name, e)
        sample.metadata["env_errors"] = [str(e)]  # counted as env/errors/reset_failed
        _end_episode(sample, Termination(TerminationKind.ENV_ERROR), error=f"env: {e}")
    except Exception as e:  # an episode must never take the rollout down; the error is recorded on the sample
        logger.warning("%s failed: %s", sample.name, e)
        _end_episode(sample, Termination(TerminationKind.EXCEPTION), error=f"{type(e).__name__}: {e}",
                     detail=traceback.format_exc(limit=5))
    if state is not None:  # once the env is built, it is closed (or suspended for a partial rollout)
        if sample.status is Status.ABORTED and opts.partial_rollout:
            ctx.suspended[key] = state
        else:
            await _finalize(ctx, opts, multiturn, rewards, sample, state, deadline)
    return sample


def turn_seed(rollout_seed: int, sample: Sample, turn: int, request_index: int) -> int:
    """Per-request sampling seed from (run seed, group, sample, turn): a resumed run samples exactly what an
    uninterrupted one would, independent of request order or concurrency (group indices are global)."""
    key = f"{rollout_seed}:{sample.group_index}:{sample.index}:{turn}:{request_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & 0x7FFFFFFF


def model_turn_text(tokenizer: Any, model_ids: list[int]) -> str:
    """The model's own text of one turn, as the env and the reward see it (special tokens dropped)."""
    return tokenizer.decode(model_ids, skip_special_tokens=True)


def _end_episode(sample: Sample, termination: Termination, *, error: str | None = None,
                 detail: str | None = None) -> None:
    """The one place an episode ends: its status follows from `termination`, and both are set together.

    A failure (`error` says what went wrong) marks the episode FAILED whatever it had reached (a failure in
    finalize overrides COMPLETED too); the first error is kept in `error`/`termination`, later ones are
    appended to `errors`.
    """
    if termination.status is Status.FAILED:
        # Set directly: the transition table has no edge into FAILED from a finished status.
        sample.status = Status.FAILED
        if "error" in sample.metadata:
            sample.metadata.setdefault("errors", []).append(error)
            return
        sample.metadata["error"] = error
        sample.termination = termination
        if detail:
            sample.metadata["error_detail"] = detail
        return
    sample.set_status(termination.status)
    sample.termination = termination


async def _init_episode(ctx: RolloutContext, args: Any, sample: Sample, multiturn: MultiTurnOptions) -> EpisodeState:
    """Encode the prompt and build the env (not yet reset: `_EpisodeRun.run` resets it, within the deadline).
    `build_env` is user code too: bounded by `--env-hook-timeout` like the other env hooks.

    From here on the env is always closed, also when its `reset()` fails or hangs.
    """
    if ctx.env_module is None:
        raise EpisodeError(f"{sample.name}: no environment module (--rollout-interaction-env-path)")
    tools = sample.metadata.get("tools")
    seg = ctx.encoder.encode_prompt(sample.prompt, tools=tools)
    sample.set_prompt_tokens(seg.train_ids)
    sample.image_data = list(seg.image_data)
    sample.video_data = list(seg.video_data)
    env = await call_env_hook(ctx.env_module.build_env, sample, args, timeout_s=multiturn.env_hook_timeout,
                              hook="build_env")
    state = EpisodeState(wire_ids=list(seg.wire_ids), env=env, hook_timeout_s=multiturn.env_hook_timeout)
    if seg.mm_inputs is not None:
        state.mm_chunks.append(seg.mm_inputs)
    return state


def _turn_budget(opts: RolloutOptions, sample: Sample) -> tuple[int, TruncationCause]:
    """Tokens the next model turn may generate, and which limit binds."""
    limits = {TruncationCause.RESPONSE_BUDGET: opts.rollout_max_response_len - sample.response_length}
    if opts.rollout_max_context_len:
        limits[TruncationCause.CONTEXT] = opts.rollout_max_context_len - len(sample.tokens)
    cause = min(limits, key=limits.get)
    return limits[cause], cause


class _TurnContinues:
    """A weight update aborted the turn's request; the turn goes on (see `_EpisodeRun._generate`)."""


_TURN_CONTINUES = _TurnContinues()


@dataclass(frozen=True)
class _Ending:
    """How a turn ends its episode: the termination and, for a failure, the error message."""

    termination: Termination
    error: str | None = None


@dataclass
class _EpisodeRun:
    """The turns of one episode: each turn generates, steps the env and appends the observation, in that order,
    and the first phase that ends the episode returns an `_Ending` that `_end_episode` applies."""

    ctx: RolloutContext
    opts: RolloutOptions
    multiturn: MultiTurnOptions
    sample: Sample
    state: EpisodeState
    base_params: dict[str, Any]
    configured_max_new: int

    @classmethod
    def start(cls, ctx: RolloutContext, opts: RolloutOptions, multiturn: MultiTurnOptions, sample: Sample,
              state: EpisodeState, sampling_params: dict[str, Any] | None) -> "_EpisodeRun":
        vision = ctx.encoder.vision
        if sampling_params is None:
            sampling_params = default_sampling_params(opts, vision.banned_ids, vision.eos_ids)
        base_params = episode_sampling_params(sampling_params, vision.banned_ids, vision.eos_ids)
        configured_max_new = int(base_params.get("max_new_tokens", opts.rollout_max_response_len))
        return cls(ctx, opts, multiturn, sample, state, base_params, configured_max_new)

    async def run(self, *, reset: bool) -> None:
        """`env.reset()` first for a fresh episode (not for a resumed one), then the turns. A reset observation
        joins the prompt before the first generation (`_open_with`)."""
        if reset:
            try:
                opening = await call_env_hook(self.state.env.reset, timeout_s=self.multiturn.env_hook_timeout,
                                              hook="env.reset")
            except EnvHookTimeout:
                raise  # its own cause, env_timeout
            except Exception as e:
                raise EnvResetError(e) from e
            if opening is not None:
                self._open_with(opening)
        await self.run_turns()

    def _open_with(self, observation: dict[str, Any]) -> None:
        """Re-encode the prompt with the env's reset observation appended to its first user turn (its text after
        the prompt's, its pictures after the prompt's in placeholder order): prompt tokens, loss mask 0.

        The prompt was encoded before `build_env` (envs read the prompt's pictures there), so an env with a reset
        observation pays a second encoding; the episode's prompt (`EpisodeState.prompt`) is what the finalize
        re-render checks, and `Sample.prompt` stays the dataset's (a rerun starts from it again).
        """
        ctx, sample, state = self.ctx, self.sample, self.state
        message = state.env.format_observation(observation)
        if message["role"] != "user":
            raise ValueError(f"{sample.name}: a reset observation opens the user turn; its role is {message['role']!r}")
        prompt = prompt_with_opening(sample.prompt, message)
        seg = ctx.encoder.encode_prompt(prompt, tools=sample.metadata.get("tools"))
        sample.set_prompt_tokens(seg.train_ids)
        sample.image_data = list(seg.image_data)
        sample.video_data = list(seg.video_data)
        state.wire_ids = list(seg.wire_ids)
        state.mm_chunks = [seg.mm_inputs] if seg.mm_inputs is not None else []
        state.prompt = prompt
        kinds = [item.get("type") for item in message["content"]]
        sample.metadata["reset_observation"] = {"text": observation.get("obs_str", ""),
                                                "images": kinds.count("image"), "clips": kinds.count("video")}

    async def run_turns(self) -> None:
        sample, state = self.sample, self.state
        if sample.status is not Status.PENDING:
            sample.set_status(Status.PENDING)  # resuming a partial rollout
        while True:
            record = TurnRecord(turn=len(state.model_turns) - (1 if state.open_turn else 0))
            ending = await self._turn(record)
            sample.turns.append(record)
            if ending is not None:
                if ending.termination.kind is TerminationKind.TRUNCATED:
                    state.open_turn = False
                _end_episode(sample, ending.termination, error=ending.error)
                return

    async def _turn(self, record: TurnRecord) -> _Ending | None:
        """One turn; its record is filled in place. Returns how the episode ends, or None to go on."""
        ending = await self._generate(record)
        if ending is _TURN_CONTINUES:  # a weight update cut the request: the same turn goes on (next record)
            return None
        if ending is not None:
            return ending
        stepped = await self._step_env(record)
        if isinstance(stepped, _Ending):
            return stepped
        return self._append_observation(record, stepped)

    async def _generate(self, record: TurnRecord) -> _Ending | _TurnContinues | None:
        """POST /generate within the budget and append the sampled ids (mask 1).

        Asynchronous training (`--max-staleness` >= 1) meets weight updates mid-episode (`--inflight-update-policy`):
        `continue` appends what the aborted request produced and returns `_TURN_CONTINUES` (the turn is re-sent
        with the new weights, each request's tokens keeping their own version); `rerun` ends the episode
        WEIGHT_UPDATE_RERUN, before appending, as soon as an answer's version differs from the episode's, so the
        driver restarts it from the prompt.
        """
        ctx, sample, state = self.ctx, self.sample, self.state
        budget, binding = _turn_budget(self.opts, sample)
        turn_cap = self.multiturn.max_tokens_per_turn
        max_new = min(self.configured_max_new, budget)
        capped = turn_cap is not None and turn_cap < max_new  # the per-turn cap binds, not a budget
        if capped:
            max_new = turn_cap
        if max_new <= 0:
            record.truncation_cause = binding
            return _Ending(Termination.truncated(binding))

        params = {**self.base_params, "max_new_tokens": max_new}
        if "sampling_seed" not in self.base_params and self.opts.rollout_seed is not None:
            params["sampling_seed"] = turn_seed(self.opts.rollout_seed, sample, record.turn, len(sample.turns))
        t0 = time.perf_counter()
        async with ctx.generate_slots:
            if ctx.aborting:  # checked after the wait for a slot: the driver may have aborted meanwhile
                record.truncation_cause = TruncationCause.ROLLOUT_ABORT
                return _Ending(Termination(TerminationKind.ABORT))
            try:
                result = await ctx.client.generate(
                    state.wire_ids,
                    image_data=sample.image_data,
                    video_data=sample.video_data,
                    sampling_params=params,
                    rid=f"g{sample.group_index}-s{sample.index}-t{record.turn}-{uuid.uuid4().hex[:8]}",
                    routing_key=state.routing_key if ctx.router_mode else None,
                    return_routed_experts=self.opts.use_rollout_routing_replay,
                )
            except EngineLost as e:  # the engine did not come back (--engine-reconnect-timeout): the run stops
                record.error = f"engine lost: {e}"
                return _Ending(Termination(TerminationKind.ENGINE_LOST), record.error)
            except EngineError as e:
                record.error = f"engine: {e}"
                return _Ending(Termination(TerminationKind.ENGINE_ERROR), record.error)
        record.engine_latency_s = time.perf_counter() - t0
        record.generated_tokens = len(result.output_ids)
        record.finish_reason = result.finish_reason
        record.weight_version = result.weight_version
        record.env_retries = 0
        # Per-token versions: several when weights changed while this request was alive (SGLang's spans).
        made_by = result.token_weight_versions
        if self.opts.max_staleness > 0 and self.opts.inflight_update_policy == "rerun":
            # Would this episode's tokens span two versions? (A cut request that made nothing yet is just re-sent.)
            made = bool(sample.weight_versions)
            crossed = (result.aborted_by_weight_update and (made or bool(result.output_ids))) or len(made_by) > 1 or (
                made and bool(made_by) and sample.weight_versions[-1] != made_by[0])
            if crossed:
                record.truncation_cause = TruncationCause.WEIGHT_UPDATE
                return _Ending(Termination(TerminationKind.WEIGHT_UPDATE_RERUN))
        # A version is recorded for the tokens it made (an aborted request may have made none).
        for version in made_by:
            if not sample.weight_versions or sample.weight_versions[-1] != version:
                sample.weight_versions.append(version)

        banned = set(ctx.encoder.vision.banned_ids).intersection(result.output_ids)
        if banned:
            record.error = f"engine sampled banned vision token ids {sorted(banned)}"
            return _Ending(Termination(TerminationKind.BANNED_TOKEN), record.error)
        sample.append_model_tokens(result.output_ids, result.output_log_probs or [])
        # The latest answer's routing covers the whole conversation so far (SGLang keeps it by KV slot, so a
        # reused prefix comes back too): it replaces the previous turn's.
        routed = decode_routed_experts(result.meta_info)
        if routed is not None:
            if routed.shape[0] != len(sample.tokens) - 1:
                record.error = (f"engine routed_experts cover {routed.shape[0]} positions, the sample has "
                                f"{len(sample.tokens)} tokens (expected one fewer)")
                return _Ending(Termination(TerminationKind.ENGINE_ERROR), record.error)
            sample.rollout_routed_experts = routed
        state.wire_ids.extend(result.output_ids)
        if state.open_turn:  # a resumed turn continues the suspended one
            state.model_turns[-1].extend(result.output_ids)
            state.open_turn = False
        else:
            state.model_turns.append(list(result.output_ids))
            state.observations.append(None)

        status = FINISH_REASON_STATUS.get(result.finish_reason)
        if status is Status.ABORTED and result.aborted_by_weight_update and self.opts.max_staleness > 0:
            state.open_turn = True  # continue policy (rerun returned above): the turn goes on with the new weights
            record.truncation_cause = TruncationCause.WEIGHT_UPDATE
            return _TURN_CONTINUES
        if status is Status.ABORTED:
            state.open_turn = True
            record.truncation_cause = TruncationCause.ENGINE_ABORT
            record.error = f"engine abort: {result.finish_message}" if result.finish_message else "engine abort"
            sample.metadata["abort_message"] = result.finish_message
            return _Ending(Termination(TerminationKind.ABORT))
        if status is Status.TRUNCATED and capped:
            return None  # cut at --max-tokens-per-turn: the env judges the turn, the episode goes on
        if status is Status.TRUNCATED:
            cause = binding if max_new < self.configured_max_new else TruncationCause.LENGTH
            record.truncation_cause = cause
            return _Ending(Termination.truncated(cause))
        return None

    async def _step_env(self, record: TurnRecord) -> _Ending | dict[str, Any]:
        """env.step on the model's text of this turn; the observation, or how the episode ends."""
        sample = self.sample
        text = model_turn_text(self.ctx.encoder.tokenizer, self.state.model_turns[-1])
        t_env = time.perf_counter()
        outcome = await _step_with_retries(self.multiturn, self.state.env, text, record, sample)
        record.env_latency_s = time.perf_counter() - t_env
        if isinstance(outcome, _Ending):
            return outcome
        observation, done, info = outcome
        if info:
            sample.metadata.setdefault("env_info", []).append(_json_friendly(info))
        if done:
            return _Ending(Termination(TerminationKind.ENV_DONE))
        if record.turn + 1 >= self.multiturn.max_turns:
            return _Ending(Termination(TerminationKind.MAX_TURNS))
        return observation

    def _append_observation(self, record: TurnRecord, observation: dict[str, Any]) -> _Ending | None:
        """Delta-encode the observation (mask 0) and buffer its images; it must leave room for an answer."""
        ctx, sample, state = self.ctx, self.sample, self.state
        model_ids = state.model_turns[-1]
        message = state.env.format_observation(observation)
        ended_turn = bool(model_ids) and model_ids[-1] == ctx.encoder.vision.im_end
        seg = ctx.encoder.encode_observation([message], model_ended_turn=ended_turn)
        budget, binding = _turn_budget(self.opts, sample)
        record.observation_tokens = len(seg.train_ids)
        if len(seg.train_ids) >= budget:
            # The observation plus at least one generated token must fit; otherwise nothing could answer it.
            record.truncation_cause = binding.by_observation()
            return _Ending(Termination.truncated(record.truncation_cause))
        sample.append_observation_tokens(seg.train_ids)
        state.wire_ids.extend(seg.wire_ids)
        sample.image_data.extend(seg.image_data)
        sample.video_data.extend(seg.video_data)
        if seg.mm_inputs is not None:
            state.mm_chunks.append(seg.mm_inputs)
        state.observations[-1] = [message]
        record.observation_images = len(seg.image_data)
        record.observation_clips = len(seg.video_data)
        return None


async def _step_with_retries(
    multiturn: MultiTurnOptions, env: Any, text: str, record: TurnRecord, sample: Sample
) -> tuple[dict, bool, dict] | _Ending:
    """env.step with timeout and at most `max_env_retries_per_turn` retries; an ENV_ERROR ending when exhausted.

    A recoverable env (`env.recoverable`) is reset before a retry; a non-recoverable one is retried as is,
    which is right for transient failures (a judge server hiccup) and is the documented contract.
    """
    retries, timeout_s = multiturn.max_env_retries_per_turn, multiturn.env_step_timeout
    errors: list[str] = []
    for attempt in range(retries + 1):
        try:
            return await _call_env_step(env, text, timeout_s)
        except EnvHookTimeout:  # the stuck call is abandoned (a sync step's thread runs on, unawaited)
            errors.append(f"attempt {attempt + 1}: env.step timed out after {timeout_s:g} s")
        except Exception as e:  # env code is user code: record and retry within the bound
            errors.append(f"attempt {attempt + 1}: {type(e).__name__}: {e}")
        record.env_retries = attempt + 1 if attempt < retries else attempt
        if attempt < retries and getattr(env, "recoverable", False):
            try:
                await call_env_hook(env.reset, timeout_s=multiturn.env_hook_timeout, hook="env.reset")
            except Exception as e:  # a reset that fails (or overruns) ends the retries
                errors.append(f"env.reset failed: {type(e).__name__}: {e}")
                break
    record.error = "env: " + "; ".join(errors)
    sample.metadata["env_errors"] = errors
    return _Ending(Termination(TerminationKind.ENV_ERROR), f"env step failed {len(errors)} time(s): {errors[-1]}")


def _json_friendly(info: dict) -> dict:
    return {str(k): (v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)) for k, v in info.items()}


async def _finalize(ctx: RolloutContext, opts: RolloutOptions, multiturn: MultiTurnOptions, rewards: RewardSettings,
                    sample: Sample, state: EpisodeState, deadline: _Deadline | None = None) -> None:
    """Merge multimodal tensors once, check the template, compute the reward, close the env.

    The reward runs within what is left of the episode's `deadline` (and each env hook within its own limit);
    `env.close()` runs last, always, under `--env-hook-timeout`, and a close that overruns FAILs the episode.
    """
    try:
        sample.multimodal_train_inputs = merge_multimodal_chunks(state.mm_chunks, sample.name)
        response_ids = sample.tokens[sample.prompt_length :]
        sample.response = ctx.encoder.tokenizer.decode(response_ids, skip_special_tokens=False)
        model_texts = [model_turn_text(ctx.encoder.tokenizer, ids) for ids in state.model_turns]
        sample.metadata["model_text"] = model_texts
        if sample.status is not Status.FAILED:
            prompt = state.prompt if state.prompt is not None else sample.prompt
            rendered = ctx.encoder.reference_render(
                prompt, list(zip(state.model_turns, state.observations)), tools=sample.metadata.get("tools")
            )
            sample.metadata["prefix_stable"] = check_prefix_stability(
                ctx.encoder, state.wire_ids, rendered, multiturn.delta_check, sample.name
            )
            if ctx.privileged is not None:  # --opd-type self: the teacher's prompt (a missing field fails this one)
                sample.privileged_prompt_tokens = ctx.privileged.prompt_tokens(ctx.encoder, prompt, sample)
            assign = _assign_reward(ctx, opts, multiturn, rewards, sample, state, model_texts)
            if deadline is None:
                await assign
            else:
                await asyncio.wait_for(assign, deadline.remaining())
    except asyncio.TimeoutError:  # the episode's deadline (an env hook's own limit raises EnvHookTimeout)
        sample.reward = None
        _end_episode(sample, Termination(TerminationKind.EPISODE_TIMEOUT),
                     error=deadline.error("in finalize (reward)") if deadline else "finalize timed out")
    except EnvHookTimeout as e:
        logger.warning("%s: %s", sample.name, e)
        sample.reward = None
        _end_episode(sample, Termination(TerminationKind.ENV_TIMEOUT), error=f"env: {e}")
    except RewardError as e:  # the reward exists but cannot be trained on: its own cause, named
        _end_episode(sample, Termination(TerminationKind.REWARD_ERROR), error=f"reward: {e}")
    except Exception as e:  # a finalize failure marks the sample, it does not kill the rollout
        _end_episode(sample, Termination(TerminationKind.FINALIZE_ERROR), error=f"finalize: {type(e).__name__}: {e}")
    finally:
        try:
            await close_env(state)
        except EnvHookTimeout as e:  # a stuck close leaks whatever the env holds: the episode FAILs, named
            logger.warning("%s: %s", sample.name, e)
            sample.reward = None
            _end_episode(sample, Termination(TerminationKind.ENV_TIMEOUT), error=f"env: {e}")
        except Exception as e:  # closing is best effort but never silent
            logger.warning("%s: env.close() raised %s: %s", sample.name, type(e).__name__, e)
            sample.metadata.setdefault("errors", []).append(f"env.close: {type(e).__name__}: {e}")


async def _assign_reward(ctx: RolloutContext, opts: RolloutOptions, multiturn: MultiTurnOptions,
                         rewards: RewardSettings, sample: Sample, state: EpisodeState, model_texts: list[str]) -> None:
    """The reward: `--rm-type`'s function when set, else the env's verdict, else the module's reward_fn.

    Reward functions see the model's own text only (all its turns, never an observation); a mapping reward is
    reduced by `--reward-key` (rollout/rewards.py). The env's `verdict` and the module's `reward_fn` are env hooks
    (`--env-hook-timeout`); the `--rm-type` function runs in a daemon thread within the episode's deadline.
    With `--custom-rm-path` the reward stays unset: the driver scores the finished episode (or its group) with it,
    as slime's `generate_and_rm` does.
    """
    if opts.custom_rm_path is not None:
        return
    model_text = "\n".join(model_texts)
    hook_timeout = multiturn.env_hook_timeout
    if rewards.rm_type is not None:
        fn = rm_function(rewards.rm_type)
        raw = await run_in_daemon_thread(fn, model_text, sample.label, name=f"rm_type:{rewards.rm_type}")
        source = f"rm_type:{rewards.rm_type}"
    else:
        verdict = None
        if hasattr(state.env, "verdict"):
            verdict = await call_env_hook(state.env.verdict, timeout_s=hook_timeout, hook="env.verdict")
        if verdict is not None:
            raw, source = verdict, "env_verdict"
        elif ctx.reward_fn is None:
            raise EpisodeError(f"{sample.name}: the env gave no verdict and its module has no reward_fn")
        else:
            raw = await call_env_hook(ctx.reward_fn, model_text, sample.label, timeout_s=hook_timeout,
                                      hook=f"{getattr(ctx.env_module, '__name__', 'env module')}.reward_fn")
            source = "reward_fn"
    sample.metadata["reward_source"] = source
    components = reward_components(raw)
    if components is not None:
        sample.metadata["reward_components"] = components
    sample.reward = scalar_reward(raw, rewards.reward_key, f"{sample.name}: {source}")
