"""Preemption (issue 35, item 2): the grace-period verdict as a pure function, the signal handler (records only,
restores the handlers it replaced), the wait that a signal cuts short, and the options' bounds.

The end-to-end checks (SIGTERM to a running `jaxrl-vlm train`, checkpoint, exit 0, exact resume) are in
tests/test_main_job.py (synchronous) and tests/test_async_training.py (`--max-staleness 1`)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from jaxrl_vlm.config import load_config
from jaxrl_vlm.errors import ConfigError
from jaxrl_vlm.job.preemption import (
    ESTIMATE_MARGIN,
    UNTIMED_CHECKPOINT_SHARE,
    Preemption,
    PreemptionPolicy,
    StepAborted,
    StepTimes,
    abort_verdict,
)

FINISH, ABORT = PreemptionPolicy.FINISH, PreemptionPolicy.ABORT
# A step that waited 4 s for samples and trained 2 s; a checkpoint that took 1 s.
MEASURED = StepTimes(wait_s=4.0, train_s=2.0, checkpoint_s=1.0)


def verdict(**kw):
    args = dict(policy=FINISH, signals=1, since_signal_s=0.0, waited_s=0.0, times=MEASURED, grace_s=30.0)
    return abort_verdict(**{**args, **kw})


# ----------------------------------------------------------------------------- the verdict
def test_finish_policy_finishes_a_step_that_fits_in_the_grace_period():
    # Just signalled, at the start of the wait: 1.5 * (4 + 2 + 1) = 10.5 s of 30.
    v = verdict()
    assert not v.abort and "10.5 s" in v.reason


def test_finish_policy_aborts_when_finishing_would_overrun_the_grace_period():
    # The same step with a 10 s grace period: 10.5 s does not fit.
    assert verdict(grace_s=10.0).abort
    # Signalled 20 s into a 30 s grace period (e.g. the signal came during a long wait): 20 + 10.5 > 30.
    v = verdict(since_signal_s=20.0)
    assert v.abort and "20.0 s into the 30 s grace period" in v.reason


def test_the_deadline_aborts_a_wait_that_runs_longer_than_measured():
    # The wait is already past its estimate (remaining wait counted as 0): train + checkpoint = 1.5 * 3 = 4.5 s.
    # Asked again as time passes, the verdict flips exactly when the signal's age plus that passes the grace period.
    assert not verdict(waited_s=9.0, since_signal_s=25.4).abort
    assert verdict(waited_s=9.0, since_signal_s=25.6).abort


def test_part_of_the_wait_already_done_is_not_counted_again():
    # 3 of the 4 s waited: 1.5 * (1 + 2 + 1) = 6 s needed; 23 s after the signal that fits, 25 s does not.
    assert not verdict(waited_s=3.0, since_signal_s=23.0).abort
    assert verdict(waited_s=3.0, since_signal_s=25.0).abort


def test_an_untimed_checkpoint_reserves_a_share_of_the_grace_period():
    untimed = StepTimes(wait_s=0.0, train_s=0.0, checkpoint_s=None)
    reserve = UNTIMED_CHECKPOINT_SHARE * 40.0  # ESTIMATE_MARGIN cancels: 10 s of a 40 s grace period
    assert not verdict(times=untimed, grace_s=40.0, since_signal_s=40.0 - reserve - 0.1).abort
    assert verdict(times=untimed, grace_s=40.0, since_signal_s=40.0 - reserve + 0.1).abort
    assert ESTIMATE_MARGIN > 1


def test_abort_policy_a_second_signal_and_no_completed_step_abort_at_once():
    assert verdict(policy=ABORT).abort
    v = verdict(signals=2)
    assert v.abort and "2 signals" in v.reason
    v = verdict(times=StepTimes())
    assert v.abort and "no step has completed" in v.reason


# ----------------------------------------------------------------------------- the handler and the wait
def test_handler_records_the_signal_and_restores_the_previous_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    preemption = Preemption(FINISH, 30.0)
    with preemption.installed():
        assert signal.getsignal(signal.SIGTERM) == preemption._on_signal
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGTERM)  # would end this process without the handler
        signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt without it
        assert preemption.requested and preemption.signals == 2
        assert preemption.describe() == "SIGTERM, SIGINT"
        with pytest.raises(KeyboardInterrupt, match="without a checkpoint"):  # the third: at once
            os.kill(os.getpid(), signal.SIGTERM)
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_a_signal_cuts_the_wait_short_and_cancels_it_when_the_policy_aborts():
    preemption = Preemption(ABORT, 30.0)
    cancelled = asyncio.Event()

    async def rollout_that_never_ends():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with preemption.installed():
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        with pytest.raises(StepAborted, match="--preemption-policy abort"):
            await asyncio.wait_for(preemption.run_abortable(rollout_that_never_ends(), MEASURED), timeout=10)
    assert cancelled.is_set()


async def test_finish_policy_lets_a_wait_that_fits_complete():
    preemption = Preemption(FINISH, 30.0)

    async def rollout():
        await asyncio.sleep(0.6)  # the signal arrives 0.1 s in; finishing needs ~10.5 s of 30
        return "samples"

    with preemption.installed():
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        assert await preemption.run_abortable(rollout(), MEASURED) == "samples"
    assert preemption.requested


async def test_an_evaluation_is_never_waited_for():
    preemption = Preemption(FINISH, 30.0)
    with preemption.installed():
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        with pytest.raises(StepAborted, match="evaluation"):
            await preemption.run_abortable(asyncio.sleep(3600), MEASURED, always_abort=True)


# ----------------------------------------------------------------------------- options
def test_preemption_options_are_typed_and_bounded():
    cfg = load_config(None, ["--preemption-policy", "abort", "--preemption-grace-seconds", "12.5"])
    assert cfg.checkpoint.preemption_policy == "abort" and cfg.checkpoint.preemption_grace_seconds == 12.5
    assert Preemption.from_config(cfg.checkpoint).policy is ABORT
    assert load_config(None, []).checkpoint.preemption_grace_seconds == 30.0
    with pytest.raises(ConfigError, match=r"--preemption-grace-seconds\) must be > 0, got -1"):
        load_config(None, ["--preemption-grace-seconds", "-1"])
    with pytest.raises(ConfigError, match="preemption_policy='later' is not one of"):
        load_config(None, ["--preemption-policy", "later"])
