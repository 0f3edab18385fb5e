"""Issue 17 row 5: an env hook that hangs or blocks fails its own episode, never the rollout.

`build_env`, `reset`, `verdict`, `close`, the module's `reward_fn` and `step` run under time limits; sync ones in daemon
worker threads, so a blocking one neither stalls the event loop nor holds up the loop's shutdown. The faults are
injected into real episodes run by the driver against the scripted SGLang server, as tests/test_driver.py does.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import pytest

from envs.base import BaseInteractionEnv
from rollout.client import RetryPolicy, SGLangClient
from rollout.driver import RolloutResult, close_suspended, generate_rollout
from rollout.encoding import ChatEncoder
from rollout.fake_engine import FakeSGLangServer, Tokens
from rollout.multiturn import EnvHookTimeout, EpisodeState, RolloutContext, call_env_hook, generate
from rollout.options import MultiTurnOptions
from rollout.sample import Sample, Status, Termination, TerminationKind

HOOK_TIMEOUT_S = 0.5
BLOCK_S = 60.0  # how long a stuck sync hook would block: far beyond any bound the test allows


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer, tiny_image_processor) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, tiny_image_processor)


class Blocker:
    """A sync call stuck in `time.sleep` for up to BLOCK_S; `release()` lets the abandoned threads end."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = threading.Event()

    def block(self) -> None:
        self.entered.set()
        end = time.monotonic() + BLOCK_S
        while not self.released.is_set() and time.monotonic() < end:
            time.sleep(0.05)

    def release(self) -> None:
        self.released.set()


class FaultyEnv(BaseInteractionEnv):
    """One done-after-one-turn episode; `fault` picks the hook that misbehaves."""

    def __init__(self, fault: str | None, blocker: Blocker) -> None:
        self.fault, self.blocker = fault, blocker
        self.closes = 0
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        if self.fault == "reset_blocks":
            self.blocker.block()

    def step(self, response_text: str):  # sync: runs in a worker thread
        if self.fault == "step_blocks":
            self.blocker.block()
        return {"obs_str": ""}, True, {}

    def verdict(self) -> float | None:
        if self.fault == "verdict_hangs":
            self.blocker.block()
        return None if self.fault == "reward_fn_hangs" else 1.0

    async def close(self) -> None:
        self.closes += 1
        if self.fault == "close_never_returns":
            await asyncio.Event().wait()


# Sample index -> the fault of its env (None: a healthy episode), and the cause and hook each fault must be named by.
FAULTS: dict[int, str | None] = {
    0: None, 1: "reset_blocks", 2: "verdict_hangs", 3: "close_never_returns", 4: None, 5: "step_blocks",
    6: "reward_fn_hangs", 7: "build_env_blocks",
}
EXPECTED: dict[str, tuple[str, str]] = {
    "reset_blocks": ("env_timeout", "env.reset did not return within 0.5 s (--env-hook-timeout)"),
    "verdict_hangs": ("env_timeout", "env.verdict did not return within 0.5 s (--env-hook-timeout)"),
    "close_never_returns": ("env_timeout", "env.close did not return within 0.5 s (--env-hook-timeout)"),
    "step_blocks": ("env_error", "env.step timed out after 0.5 s"),
    "reward_fn_hangs": ("env_timeout", "faulty_env.reward_fn did not return within 0.5 s (--env-hook-timeout)"),
    "build_env_blocks": ("env_timeout", "build_env did not return within 0.5 s (--env-hook-timeout)"),
}


def faulty_module(blocker: Blocker, envs: dict[int, FaultyEnv]) -> types.ModuleType:
    def build_env(sample: Sample, args: Any) -> FaultyEnv:  # sync: runs in a worker thread
        if FAULTS[sample.index] == "build_env_blocks":
            blocker.block()
        env = envs[sample.index] = FaultyEnv(FAULTS[sample.index], blocker)
        return env

    def reward_fn(model_text: str, label: Any) -> float:
        if "hang" in model_text:  # only sample 6's engine reply says so
            blocker.block()
        return 0.5

    module = types.ModuleType("faulty_env")
    module.build_env = build_env
    module.reward_fn = reward_fn
    return module


class OnePrompt:
    def next_batch(self) -> list[Sample]:
        return [Sample(prompt=[{"role": "user", "content": "Question?"}], label="1", index=0)]


def _args(ctx: RolloutContext, **overrides: Any) -> types.SimpleNamespace:
    base = dict(
        rollout_batch_size=1, n_samples_per_prompt=len(FAULTS), over_sampling_batch_size=None, dynamic_filter=None,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
        custom_generate_function_path="rollout.multiturn.generate",
        rollout_max_response_len=200, rollout_max_context_len=None, max_turns=2, max_env_retries_per_turn=0,
        env_step_timeout=HOOK_TIMEOUT_S, env_hook_timeout=HOOK_TIMEOUT_S, episode_timeout=30.0,
        delta_check="strict", rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_stop_token_ids=[], failed_share_warning=1.0, rollout_context=ctx,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


async def _heartbeat(gaps: list[float], stop: asyncio.Event) -> None:
    """Ticks every 10 ms and records how late each tick was: a blocked event loop shows up as a long gap."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = loop.time()
        gaps.append(now - last)
        last = now


def test_stuck_hooks_fail_their_own_samples_and_the_group_finishes_in_bounded_time(encoder):
    """One group: a sync reset blocked in time.sleep, a hanging verdict, an async close that never returns, a
    blocked sync step and a hanging reward_fn. The step finishes in a few hook timeouts (not BLOCK_S), the loop
    never stalls, those samples are FAILED with the hook named and the healthy ones are COMPLETED; and the
    loop's own shutdown (asyncio.run) is not held up by the abandoned threads."""
    blocker = Blocker()
    envs: dict[int, FaultyEnv] = {}
    gaps: list[float] = []

    def reply(body: dict[str, Any]) -> Tokens:
        text = "please hang" if "-s6-" in str(body.get("rid")) else "the answer"
        return Tokens(output_ids=tuple(encoder.tokenize(text) + [encoder.vision.im_end]))

    async def main() -> RolloutResult:
        stop = asyncio.Event()
        beat = asyncio.create_task(_heartbeat(gaps, stop))
        server = FakeSGLangServer(generate_fn=reply, eos_token_id=encoder.vision.im_end,
                                  image_token_id=encoder.vision.image_pad)
        async with server:
            async with SGLangClient(server.url, timeout_s=10.0, retry=RetryPolicy(max_retries=0)) as client:
                ctx = RolloutContext(client=client, encoder=encoder, env_module=faulty_module(blocker, envs),
                                     generate_slots=asyncio.Semaphore(16))
                result = await asyncio.wait_for(generate_rollout(_args(ctx), 0, OnePrompt()), 20.0)
        stop.set()
        await beat
        return result

    t0 = time.monotonic()
    try:
        result = asyncio.run(main())  # includes the loop's shutdown of its default executor
        elapsed = time.monotonic() - t0
        stuck = [t for t in threading.enumerate() if t.name.startswith("env-hook:") and t.is_alive()]
    finally:
        blocker.release()
    assert elapsed < 10.0, f"the rollout took {elapsed:.1f} s: a stuck hook held it up"
    assert max(gaps) < 2.0, f"the event loop stalled for {max(gaps):.2f} s"
    # The stuck sync calls were abandoned in daemon threads (they cannot be killed), not in executor workers.
    assert stuck and all(t.daemon for t in stuck)
    assert {t.name for t in stuck} >= {"env-hook:env.reset", "env-hook:env.verdict", "env-hook:env.step",
                                       "env-hook:faulty_env.reward_fn", "env-hook:build_env"}

    failed = {s.index: s for s in result.failed}
    assert sorted(failed) == sorted(i for i, f in FAULTS.items() if f is not None)
    for index, sample in failed.items():
        cause, message = EXPECTED[FAULTS[index]]
        assert sample.status is Status.FAILED and str(sample.termination) == cause, (index, sample.termination)
        assert message in sample.metadata["error"], (index, sample.metadata["error"])
        sample.validate()
    assert len(result.groups) == 1
    kept = result.groups[0]
    assert sorted(s.index for s in kept) == [0, 4]
    assert all(s.status is Status.COMPLETED and s.reward == 1.0 for s in kept)
    assert result.episodes == len(FAULTS)
    # close() ran exactly once for every env that was built, the one whose reset is stuck included.
    assert {i: e.closes for i, e in envs.items()} == {i: 1 for i, f in FAULTS.items() if f != "build_env_blocks"}
    for t in stuck:
        t.join(timeout=5.0)


async def test_episode_timeout_covers_finalize(encoder):
    """A verdict slower than what is left of --episode-timeout (but within its hook limit) ends the episode at the
    episode's deadline, FAILED episode_timeout, and close() still runs."""

    class SlowVerdict(FaultyEnv):
        async def verdict(self) -> float:
            await asyncio.sleep(30.0)
            return 1.0

    env = SlowVerdict(None, Blocker())
    s = await _one_episode(encoder, env, episode_timeout=0.5, env_hook_timeout=30.0)
    assert s.status is Status.FAILED and s.termination == Termination(TerminationKind.EPISODE_TIMEOUT)
    assert "in finalize" in s.metadata["error"] and "--episode-timeout" in s.metadata["error"]
    assert s.reward is None and env.closes == 1


async def test_a_reset_that_raises_still_closes_the_env(encoder):
    class BadReset(FaultyEnv):
        def reset(self) -> None:
            raise OSError("no such device")

    env = BadReset(None, Blocker())
    s = await _one_episode(encoder, env)
    assert s.status is Status.FAILED and str(s.termination) == "env_error"  # the env failed, typed
    assert "env.reset failed: OSError: no such device" in s.metadata["error"] and env.closes == 1


async def test_close_of_suspended_episodes_is_bounded():
    """The driver's close of suspended (partial-rollout) episodes uses the same bounded close."""

    blocker = Blocker()
    env = FaultyEnv(None, blocker)
    env.close = blocker.block  # a sync close stuck in time.sleep
    ctx = RolloutContext(client=None, encoder=None, env_module=None, generate_slots=asyncio.Semaphore(1))
    ctx.suspended[(0, 0)] = EpisodeState(wire_ids=[], env=env, hook_timeout_s=0.2)
    t0 = time.monotonic()
    try:
        await close_suspended(types.SimpleNamespace(rollout_context=ctx))
        assert time.monotonic() - t0 < 5.0 and not ctx.suspended and blocker.entered.is_set()
    finally:
        blocker.release()


async def test_call_env_hook_contract():
    async def coro(x):
        return x + 1

    assert await call_env_hook(coro, 1, timeout_s=1.0, hook="h") == 2
    assert await call_env_hook(lambda x: x * 2, 3, timeout_s=1.0, hook="h") == 6
    assert await call_env_hook(lambda: coro(4), timeout_s=1.0, hook="h") == 5  # a sync fn returning an awaitable

    def raises():
        raise KeyError("k")

    with pytest.raises(KeyError):
        await call_env_hook(raises, timeout_s=1.0, hook="h")
    with pytest.raises(EnvHookTimeout, match=r"env\.verdict did not return within 0\.05 s \(--env-hook-timeout\)") as e:
        await call_env_hook(asyncio.sleep, 10, timeout_s=0.05, hook="env.verdict")
    assert not isinstance(e.value, TimeoutError)  # the episode's own deadline is the TimeoutError

    class Stubborn:
        """An async hook that swallows its cancellation: it is abandoned, never awaited again."""

        def __init__(self) -> None:
            self.done = asyncio.Event()

        async def __call__(self) -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.3)
            self.done.set()

    stubborn = Stubborn()
    t0 = time.monotonic()
    with pytest.raises(EnvHookTimeout):
        await call_env_hook(stubborn.__call__, timeout_s=0.05, hook="env.close")
    assert time.monotonic() - t0 < 0.25
    await asyncio.wait_for(stubborn.done.wait(), 5.0)  # let it finish inside this test's loop


def test_env_hook_timeout_is_a_documented_option():
    f = MultiTurnOptions.__dataclass_fields__["env_hook_timeout"]
    assert f.default > 0 and "reset" in f.metadata["help"] and "env_timeout" in f.metadata["help"]


async def _one_episode(encoder: ChatEncoder, env: FaultyEnv, **overrides: Any) -> Sample:
    module = types.ModuleType("one_env")
    module.build_env = lambda sample, args: env
    reply = Tokens(output_ids=tuple(encoder.tokenize("the answer") + [encoder.vision.im_end]))
    server = FakeSGLangServer(generate_fn=lambda body: reply, eos_token_id=encoder.vision.im_end,
                              image_token_id=encoder.vision.image_pad)
    async with server:
        async with SGLangClient(server.url, timeout_s=5.0, retry=RetryPolicy(max_retries=0)) as client:
            ctx = RolloutContext(client=client, encoder=encoder, env_module=module, generate_slots=asyncio.Semaphore(4))
            sample = Sample(prompt=[{"role": "user", "content": "Question?"}], label="1")
            return await asyncio.wait_for(generate(_args(ctx, **overrides), sample), 20.0)
