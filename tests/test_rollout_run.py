"""The typed rollout run: read once from slime's namespace; a derived run tells user code the same under slime's names."""

import asyncio
import dataclasses
import types

from rollout.options import MultiTurnOptions, RolloutOptions
from rollout.run import DriverState, RolloutContext, RolloutRun


def _args(**values):
    ctx = RolloutContext(client=None, encoder=None, env_module=None, generate_slots=asyncio.Semaphore(2))
    return types.SimpleNamespace(rollout_context=ctx, **values)


def test_a_run_reads_the_namespace_once_into_typed_options():
    args = _args(rollout_temperature="0.5", max_turns=4, reward_key="acc")
    run = RolloutRun.from_args(args)
    assert run.options == RolloutOptions(rollout_temperature=0.5)
    assert run.multiturn == MultiTurnOptions(max_turns=4)
    assert run.rewards.reward_key == "acc"
    assert run.context is args.rollout_context and run.args is args
    assert run.state is args.driver_state and isinstance(run.state, DriverState)  # created on first use


def test_a_derived_run_has_its_own_namespace_with_the_typed_options_under_slime_names():
    args = _args(rollout_temperature=1.0, n_samples_per_prompt=4)
    args.driver_state = DriverState(next_group_index=9)
    run = RolloutRun.from_args(args)
    context = dataclasses.replace(run.context, suspended={})
    derived = run.derive(options=dataclasses.replace(run.options, rollout_temperature=0.25, n_samples_per_prompt=1),
                         context=context, state=DriverState())
    user = derived.args
    assert (user.rollout_temperature, user.n_samples_per_prompt, user.max_turns) == (0.25, 1, MultiTurnOptions().max_turns)
    assert user.rollout_context is context and user.driver_state is derived.state
    assert RolloutRun.from_args(user).options == derived.options  # user code calling slime's entry points reads the same
    # The run it came from is untouched.
    assert (args.rollout_temperature, args.n_samples_per_prompt, args.driver_state.next_group_index) == (1.0, 4, 9)
    assert run.options.rollout_temperature == 1.0 and run.args is args
