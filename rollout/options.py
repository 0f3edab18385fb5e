"""Typed rollout and multi-turn options: the one home of their names, defaults and help text.

`jaxrl_vlm.config` composes `RolloutOptions` and `MultiTurnOptions` as its `rollout` and `multiturn` sections
(YAML sections, `--flag` names and `Config.to_namespace()` come from these fields). Rollout code receives the
flat `args` namespace (slime's convention) and reads these options once through `from_args`, which fills any
attribute the namespace lacks from the dataclass default, so a default is written only here.

This module never imports jax or jaxrl_vlm: a rollout host runs without them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import string
import types
import typing
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

_T = TypeVar("_T", bound="ArgsOptions")


def opt(default: Any, help: str, *, choices: Collection[Any] | None = None, gt: float | None = None,
        ge: float | None = None, lt: float | None = None, le: float | None = None, key: str | None = None,
        flags: tuple[str, ...] = ()) -> Any:
    """Declare an option once: its default, help text, allowed values (`choices`: a tuple, or a registry whose names
    are read when a value is checked) and bounds of a number (`gt` >, `ge` >=, `lt` <, `le` <=; `bound_error`).

    A component's options that the run config also holds (engine, loss) name their run-config key (`key`) when it
    is not the field's name; `flags` are extra command-line spellings (SGLang's, for `serve`; for a switch, they
    flip its default, as `--disable-radix-cache` does). Lists and dicts get a fresh copy each time.
    """
    meta = {"help": help, "choices": choices, "gt": gt, "ge": ge, "lt": lt, "le": le, "key": key, "flags": flags}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=meta)
    return field(default=default, metadata=meta)


class NamesOf(Collection[str]):
    """The names `module.attr` holds, as choices: read (importing `module`) when a value is checked, so a module
    that imports jax is imported only then, not with the config."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr = module, attr

    def _names(self) -> Collection[str]:
        return getattr(importlib.import_module(self.module), self.attr)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


LABEL_FIELD = "label"  # --opsd-privileged-field: the dataset row's label (or label.NAME: one key of it)


def privileged_problem(field: str, template: str) -> str | None:
    """What is wrong with --opsd-privileged-field / --opsd-privileged-template, in words (None: nothing)."""
    if field != LABEL_FIELD and not (field.startswith(LABEL_FIELD + ".") and len(field) > len(LABEL_FIELD) + 1):
        return (f"--opsd-privileged-field {field!r}: use 'label' (the dataset row's label) or 'label.NAME' (a key "
                "of a dict label)")
    try:
        template.format(privileged="x")
    except (KeyError, IndexError, ValueError) as e:
        return f"--opsd-privileged-template {template!r} is not a format string with only a {{privileged}} slot ({e})"
    if "{privileged}" not in template:
        return f"--opsd-privileged-template {template!r} has no {{privileged}} slot"
    return None


def option_of(owner: type, name: str, help: str) -> Any:
    """The option `name` declared by the dataclass `owner`, offered by another component under its own help text:
    its default, choices and bounds are read from `owner`'s field, so they are written once, and the run config
    holds it once, under the field's `key` (else `name`). E.g. the engine's seed is the rollout seed."""
    f = next(f for f in dataclasses.fields(owner) if f.name == name)
    meta = f.metadata
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return opt(default, help, choices=meta["choices"], gt=meta["gt"], ge=meta["ge"], lt=meta["lt"], le=meta["le"],
               key=meta["key"] or name)


BOUNDS = (("gt", ">", float.__gt__), ("ge", ">=", float.__ge__), ("lt", "<", float.__lt__), ("le", "<=", float.__le__))


def bound_error(name: str, value: Any, metadata: Any) -> str | None:
    """Why `value` of the option `name` breaks a bound declared on its field (`opt(gt=, ge=, lt=, le=)`): e.g.
    "max_batch must be >= 1, got 0"; None when it keeps them all (or is not a number: None means unset)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for bound, sign, holds in BOUNDS:
        limit = metadata.get(bound)
        if limit is not None and not holds(float(value), float(limit)):
            return f"{name} must be {sign} {limit:g}, got {value}"
    return None


_SCALARS: tuple[type, ...] = (bool, int, float, str)


def _caster(hint: Any) -> Callable[[Any], Any] | None:
    """How `from_args` normalises a value of type `hint` (`X | None` as X): the cast, or None to keep it."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = members[0] if len(members) == 1 else Any
    if hint in _SCALARS:
        return hint
    if typing.get_origin(hint) is list:
        return list
    return None


@functools.cache
def _casts(cls: type) -> tuple[tuple[str, Callable[[Any], Any] | None], ...]:
    """Per field of `cls`: its name and its cast (resolved once per class)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _caster(hints[f.name])) for f in dataclasses.fields(cls))


class ArgsOptions:
    """Mixin of the option dataclasses: build one from slime's flat `args` namespace."""

    @classmethod
    def from_args(cls: type[_T], args: Any) -> _T:
        """The options on `args` (a flat namespace, or another options object); a missing attribute takes the
        field's default. Scalars are cast to the declared type, as the rollout code always did at each read."""
        values: dict[str, Any] = {}
        for name, cast in _casts(cls):
            if not hasattr(args, name):
                continue
            value = getattr(args, name)
            # None is kept as None even where the type says otherwise: the reads it replaces treated it as unset.
            values[name] = cast(value) if cast is not None and value is not None else value
        return cls(**values)


@dataclass
class RolloutOptions(ArgsOptions):
    """One rollout step: which functions run it, how many groups of how many episodes, sampling, filtering."""

    rollout_function_path: str = opt("rollout.driver.generate_rollout", "Dotted path of the whole-step rollout function.")
    custom_generate_function_path: str = opt("rollout.multiturn.generate", "Dotted path of the per-sample episode function.")
    rollout_interaction_env_path: str | None = opt("envs.geo3k", "Module (dotted or .py path) exposing build_env(sample, args).")
    custom_config_path: str | None = opt(None, "YAML whose keys become attributes of args (max_turns, ...).")
    num_rollout: int = opt(10, "Number of rollout -> train iterations.", ge=1)
    rollout_batch_size: int = opt(4, "Prompts per rollout step.", ge=1)
    n_samples_per_prompt: int = opt(
        1, "Samples per prompt (a group). slime's default 1; GRPO-style advantages need >= 2 (a group of 1 has "
        "advantage 0).", ge=1)
    over_sampling_batch_size: int | None = opt(None, "Prompts submitted at a time when dynamic filtering drops groups.")
    rollout_max_response_len: int = opt(512, "Token budget of the whole response, observation tokens included.", ge=1)
    rollout_max_context_len: int | None = opt(None, "Maximum prompt+response length (None: no extra limit).", gt=0)
    rollout_max_prompt_len: int | None = opt(
        None,
        "Skip prompts longer than this many tokens, counted as trained (chat template applied, image pads "
        "expanded), before their group is generated; the step is filled with other prompts and the skips are "
        "counted in rollout/filtered_long_prompts (None: no limit). slime filters them at dataset load.",
        gt=0,
    )
    rollout_temperature: float = opt(1.0, "Sampling temperature.", ge=0)
    rollout_top_p: float = opt(1.0, "Nucleus sampling threshold in (0, 1].", gt=0, le=1)
    rollout_top_k: int = opt(-1, "Top-k sampling (-1: whole vocabulary).")
    rollout_seed: int = opt(42, "Seed of the rollout sampler.")
    rollout_stop: list[str] = opt([], "Stop strings (slime's --rollout-stop); the matched text stays in the turn.")
    rollout_stop_token_ids: list[int] = opt([], "Extra stop token ids (the model's EOS ids always stop).")
    use_rollout_routing_replay: bool = opt(
        False, "MoE (slime's R3): every request asks the engine for its routed experts (SGLang's "
        "return_routed_experts; meta_info.routed_experts), the sample keeps them, and the trainer's forwards (old, "
        "reference and current policy) route each token to the experts the engine chose; the expert weights stay "
        "the trainer router's probabilities at those ids, so the router still learns.")
    sglang_server_concurrency: int = opt(
        512,
        "Maximum in-flight /generate requests per engine, as slime's: the rollout allows this times the number of "
        "engines in total (the --engine-worker-urls behind a router, else 1).",
        ge=1,
    )
    dynamic_filter: str | None = opt(None, "Group filter: drop groups whose rewards are all equal.", choices=(None, "zero_std"))
    partial_rollout: bool = opt(False, "Resume unfinished episodes in the next step instead of discarding them.")
    max_staleness: int = opt(
        0,
        "Asynchronous training with bounded staleness K: with K >= 1 the rollout keeps generating groups into a "
        "bounded buffer while the trainer trains, new weights reach the engine at step boundaries, and no sample "
        "trains whose oldest token's weight version lags the trainer's version by more than K (such groups are "
        "handled by --stale-group-policy and counted). 0: the synchronous loop (every sample on-policy).")
    inflight_update_policy: str = opt(
        "continue",
        "With --max-staleness >= 1, what a weight update does to episodes in flight: `continue` (partial rollout: "
        "the request the update aborted is re-sent with the tokens so far, each token keeps the weight version that "
        "made it, and the off-policy tokens are counted) or `rerun` (an episode whose tokens would span two weight "
        "versions is restarted from its prompt, so every sample comes from one version).",
        choices=("continue", "rerun"))
    stale_group_policy: str = opt(
        "regenerate",
        "With --max-staleness >= 1, a finished group too stale to train (its oldest token lags the trainer by more "
        "than K): `regenerate` its prompt as a new group, or `drop` it. Either is counted (async/stale_groups_*).",
        choices=("regenerate", "drop"))
    mask_offpolicy_in_partial_rollout: bool = opt(False, "Mask tokens of resumed episodes sampled by older weights.")
    episode_timeout: float = opt(
        600.0, "Wall-clock limit of one episode in seconds: env reset, turns and finalize (reward) included; an "
        "episode past it FAILs with cause episode_timeout. env.close() then still runs, under --env-hook-timeout.",
        gt=0)
    failed_share_warning: float = opt(
        0.5, "Warn with the top causes when more than this share of a step's finished episodes FAILED.", ge=0)
    max_all_failed_steps: int = opt(
        3, "Stop the run, naming the top causes, after this many consecutive steps in which every finished "
        "episode FAILED (0: never stop).", ge=0)
    # slime's rollout hooks (rollout/hooks.py loads them; docs/guides/hooks.md has each signature). The default
    # --rollout-function-path (rollout.driver) calls them; a custom rollout function calls what it wants.
    custom_rm_path: str | None = opt(
        None,
        "slime's custom reward: `async def rm(args, sample) -> float` (or a mapping, reduced by --reward-key), "
        "called by the driver for each finished episode whose reward is unset (the default episode then leaves it "
        "unset: this replaces the env's verdict), within --episode-timeout. With --group-rm: "
        "`async def rm(args, samples) -> list[float]`, once per finished group.")
    group_rm: bool = opt(False, "Score each finished group with one --custom-rm-path call (slime's --group-rm).")
    dynamic_sampling_filter_path: str | None = opt(
        None,
        "slime's dynamic sampling filter: `fn(args, samples) -> bool | DynamicFilterOutput(keep, reason)` on each "
        "finished group (its trainable samples), after --dynamic-filter; a dropped group is counted as "
        "rollout/dynamic_filter/drop_<reason> and over-sampling refills the step.")
    buffer_filter_path: str | None = opt(
        None,
        "slime's buffer filter: `fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]` picks which "
        "groups carried by --partial-rollout resume in this step (default: all); groups it leaves in `buffer` stay "
        "carried, groups it removes without returning are discarded. Only consulted when groups are carried.")
    rollout_sample_filter_path: str | None = opt(
        None,
        "slime's rollout sample filter: `fn(args, groups) -> None` on the kept groups at the end of the step; it "
        "sets `sample.remove_sample = True` on samples to leave out of the loss (they still count in their "
        "group's advantage statistics, as in slime).")
    rollout_all_samples_process_path: str | None = opt(
        None,
        "slime's all-samples hook: `fn(args, all_groups, data_source) -> None` at the end of the step with every "
        "group that finished in it, dropped ones (filters, FAILED episodes) included; for logging and analysis.")
    custom_rollout_log_function_path: str | None = opt(
        None,
        "slime's rollout log function: `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> "
        "bool` at the end of each training step's rollout; True skips the default rollout/* metrics. Entries it "
        "adds to the `rollout_extra_metrics` dict are logged with the step.")
    # On-policy distillation: the teacher scores each finished episode, rollout-side, so dumps and replays carry
    # its log-probs (`Sample.teacher_log_probs`); the loss options (--opd-kl-coef, --opd-only) are rl/options.py's.
    use_opd: bool = opt(
        False, "On-policy distillation (slime's --use-opd): a teacher scores every finished episode's tokens, "
        "prompt, turns, observations and pictures included, and --opd-kl-coef folds the per-token reverse KL "
        "(student - teacher log-prob) into the advantages (docs/guides/distillation.md).")
    opd_type: str = opt(
        "engine", "Where the teacher runs (slime's --opd-type; its sglang -> engine, megatron -> trainer): engine, "
        "a teacher engine's prompt log-probs (--opd-teacher-url, or an embedded engine from "
        "--opd-teacher-checkpoint), stored on the sample; trainer, a frozen second model in the trainer "
        "(--opd-teacher-checkpoint, sharded like the policy) scoring the packed batch inside the train step; self "
        "(slime's OPSD): the frozen initial policy reads each episode with --opsd-privileged-field in its prompt, "
        "and the clipped full-vocabulary JSD (--opsd-beta, --opsd-jsd-clip) weighted by --opd-kl-coef joins the "
        "loss.", choices=("engine", "trainer", "self"))
    opd_teacher_url: str | None = opt(
        None, "--opd-type engine: URL of a running teacher that scores prompts: SGLang or `jaxrl-vlm serve` "
        "(/generate, logprob_start_len 0), or vLLM (its token route with prompt_logprobs 0; started with "
        "--enable-scale-out). --opd-teacher-api says which.")
    opd_teacher_api: str = opt(
        "auto", "The protocol of --opd-teacher-url: sglang (SGLang's /generate, also `jaxrl-vlm serve`) or vllm "
        "(/inference/v1/generate with sampling_params.prompt_logprobs). auto: asked of the server, as --engine-api "
        "auto does. An embedded teacher (--opd-teacher-checkpoint) speaks SGLang's.",
        choices=("auto", "sglang", "vllm"))
    opd_teacher_checkpoint: str | None = opt(
        None, "HF checkpoint directory of the teacher. --opd-type engine: the run serves it with the embedded engine "
        "(the engine settings of --engine-* apply); --opd-type trainer: the trainer loads it beside the policy, "
        "any family with the student's tokenizer, vocabulary and image-input format. Same tokenizer and image "
        "processor as the student either way.")
    opd_teacher_concurrency: int = opt(
        8, "Teacher scoring requests in flight at once (one per finished episode).", ge=1)
    opsd_privileged_field: str = opt(
        "label", "--opd-type self: the privileged information the teacher reads and the student does not: label "
        "(the dataset row's label) or label.NAME (one key of a dict label). A sample without it fails with "
        "finalize_error, naming the field.")
    opsd_privileged_template: str = opt(
        "Privileged information (it will not be shown at test time): {privileged}",
        "--opd-type self: the text appended to the episode's first user turn for the teacher, a str.format "
        "string whose {privileged} slot receives --opsd-privileged-field's value.")


@dataclass
class MultiTurnOptions(ArgsOptions):
    """One episode of the default multi-turn loop: turn limit, env retries and timeout, the delta check."""

    max_turns: int = opt(3, "Maximum model turns per episode.", ge=1)
    max_tokens_per_turn: int | None = opt(
        None,
        "Tokens one model turn may generate (None: the rest of the response budget). A turn cut at this cap is "
        "closed (the observation delta ends the assistant turn) and judged by the env like a finished one; a turn "
        "cut by the response budget or the context still ends the episode TRUNCATED.", ge=1)
    max_env_retries_per_turn: int = opt(2, "Retries of an env step that raises or times out before the episode FAILs.",
                                        ge=0)
    env_step_timeout: float = opt(30.0, "Seconds an env step may take (an overrun is retried like an error).", gt=0)
    env_hook_timeout: float = opt(
        30.0,
        "Seconds each other env hook may take: env.reset(), env.verdict(), env.close() and the env module's "
        "reward_fn. An overrun FAILs the episode with cause env_timeout naming the hook; a sync hook runs in its own "
        "daemon thread, which is abandoned (it cannot be killed) while the rollout goes on.", gt=0)
    env_url: str | None = opt(
        None, "Run each episode's environment out of process, on the env server at this WebSocket URL "
        "(ws://HOST:PORT/ws: `jaxrl-vlm env-serve ENV_MODULE`, or any OpenEnv server). --rollout-interaction-env-path "
        "still names the task (its prompts, reward_fn and config keys); each episode's reset sends its sample, so "
        "`env-serve` of the same module plays the in-process episode (envs/remote.py: api key, adapter, retries).")
    delta_check: str = opt("strict", "Prefix-stability check of observation deltas at finalize.", choices=("strict", "warn", "off"))
    apply_chat_template_kwargs: dict[str, Any] = opt(
        {},
        "Extra chat-template variables, as slime's --apply-chat-template-kwargs (JSON on the command line, e.g. "
        "'{\"enable_thinking\": false}'); used alike for the prompt, observation deltas and the finalize re-render.")


@dataclass
class DebugOptions(ArgsOptions):
    """slime's debug group: save every step's rollout, or train on saved ones without an engine."""

    save_debug_rollout_data: str | None = opt(
        None,
        "Save every training step's rollout losslessly (samples, masks, log-probs, image patches, rewards, weight "
        "versions, the step's drop accounting) to PATH.format(rollout_id=k), one file per step; PATH must contain "
        "{rollout_id} (slime's flag; our own format, rollout/rollout_data.py; a .gz suffix compresses).")
    load_debug_rollout_data: str | None = opt(
        None,
        "Train on the rollouts saved by --save-debug-rollout-data instead of rolling out: step k reads "
        "PATH.format(rollout_id=k); no engine is started or contacted, there is no weight sync and no evaluation "
        "(slime's flag). The same config replays a run's per-step losses bit for bit (one device, fp32).")
    dump_rollout_interval: int = opt(
        0,
        "Every N training steps (steps 0, N, 2N, ...), write that step's first --dump-rollout-max-samples samples "
        "(FAILED ones first, so the cap never hides them) for `jaxrl-vlm view`: <output_dir>/rollout/step_<k>.jsonl "
        "in rollout/dump.py's format, with the pictures as sent to the engine (thumbnails) and per-token log-probs; "
        "0 writes none.", ge=0)
    dump_rollout_max_samples: int = opt(
        16, "At most this many samples per dumped training step (--dump-rollout-interval): keeps dumps bounded.", ge=1)


# The field a saved-rollout path template fills in (slime's `PATH.format(rollout_id=k)`).
PLACEHOLDER = "rollout_id"


def check_template(template: str, flag: str) -> None:
    """`template` must name `{rollout_id}` and nothing else to fill in; raises ValueError naming `flag`."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{flag} {template!r}: not a valid path template ({e})") from None
    if PLACEHOLDER not in fields:
        raise ValueError(f"{flag} {template!r} must contain {{{PLACEHOLDER}}}: each step has its own file "
                         f"(e.g. runs/x/rollouts/step_{{{PLACEHOLDER}}}.jsonl)")
    other = sorted(set(fields) - {PLACEHOLDER})
    if other:
        raise ValueError(f"{flag} {template!r}: only {{{PLACEHOLDER}}} is filled in, not {other}")


def total_generate_concurrency(per_engine: int, worker_urls: Sequence[str] = ()) -> int:
    """In-flight /generate requests the rollout allows: slime's `--sglang-server-concurrency` is per engine, and
    its rollout semaphore is that times the number of engines (here the workers behind a router, else 1)."""
    if per_engine < 1:
        raise ValueError(f"sglang_server_concurrency must be >= 1, got {per_engine}")
    return per_engine * max(1, len(worker_urls))
