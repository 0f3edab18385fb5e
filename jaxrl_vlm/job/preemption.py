"""Preemption: SIGTERM (and SIGINT) stop the main job at a safe point, with a checkpoint, inside a grace period.

Spot VMs and cluster schedulers send SIGTERM, then SIGKILL once their grace period (`--preemption-grace-seconds`)
is over. Without this, a run loses everything since its last periodic checkpoint.

**Policy** (`--preemption-policy`):
- `finish` (default): the training step in progress completes when the estimate says it fits in the grace period
  with time left for the checkpoint (`abort_verdict`; with no completed step in this run to measure, it is
  aborted), and the checkpoint after it is written. Its weight sync is skipped: the resumed run pushes the
  trainer's weights to the engine before its first rollout anyway.
- `abort`: the step in progress is given up at once, and the checkpoint holds the state as of the last completed
  step (the data cursor and rollout driver state snapshotted when the step began).
In both, a second signal forces the fastest path (abort now), the engine's generation is aborted through the
client's `abort_all`, the run exits 0 and its log says where the checkpoint is. `--load` of it resumes exactly.
A third signal stops at once without a checkpoint (KeyboardInterrupt), as Ctrl-C did before: a start-up that
takes long (compilation, an engine launch) has no safe point to wait for.

**What can be aborted**: waiting for samples (the synchronous rollout, the asynchronous stream's `take`) and
evaluation, which produces no training state and runs again on resume. A train step that has started always
completes: it is compiled programs whose state cannot be half kept, and in synchronous mode it holds the main
thread, so the signal is only seen when it returns. A grace period shorter than one train step cannot be met.

**Signals**: the handler only records the signal and sets a `threading.Event`. The job reads it at step boundaries
and, while it waits for samples, every `POLL_S` (`run_abortable`); nothing is checkpointed from the handler.
Handlers are installed for the run (`installed`) and the previous ones restored after it. Python runs signal
handlers in the main thread only; a job run from another thread installs none and says so.

**Several processes**: each process receives its own signal (schedulers signal every task of a job). Process 0's
flag decides for all of them at step boundaries (`broadcast_stop`), so every process stops after the same step and
writes its shards of the same checkpoint; a step in progress is never aborted there (its rollout ends in
collectives that every process must join), so the policy is `finish` without the grace-period abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.2  # how often a wait for samples looks at the flag
# Measured durations are scaled by this before they are compared with the time left: steps vary.
ESTIMATE_MARGIN = 1.5
# Share of the grace period kept for the checkpoint before one has been timed in this run.
UNTIMED_CHECKPOINT_SHARE = 0.25


class PreemptionPolicy(enum.Enum):
    FINISH = "finish"
    ABORT = "abort"


@dataclass(frozen=True)
class StepTimes:
    """Seconds the last completed step spent in each phase, and the last checkpoint write (None: not measured yet).

    `wait_s`: waiting for samples (the rollout, or the stream's batch); `train_s`: training and weight sync."""

    wait_s: float | None = None
    train_s: float | None = None
    checkpoint_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    """Whether the step in progress is given up now, and why (for the log)."""

    abort: bool
    reason: str


def abort_verdict(*, policy: PreemptionPolicy, signals: int, since_signal_s: float, waited_s: float,
                  times: StepTimes, grace_s: float) -> Verdict:
    """The decision, while a step waits for its samples after `signals` signals (the first `since_signal_s` ago),
    to finish the step or abort it now.

    Finishing needs the rest of the wait (the last step's wait minus `waited_s`, at least 0), a train step and the
    checkpoint, each as last measured and scaled by ESTIMATE_MARGIN; the checkpoint is given
    UNTIMED_CHECKPOINT_SHARE of the grace period until one was timed. The step is aborted when that would end past
    `grace_s` after the signal. Called again as time passes, a wait longer than estimated is therefore aborted by
    the deadline. Without a completed step there is nothing to estimate from (the first one also compiles): abort.
    """
    if signals >= 2:
        return Verdict(True, f"{signals} signals: the fastest path")
    if policy is PreemptionPolicy.ABORT:
        return Verdict(True, "--preemption-policy abort")
    if times.wait_s is None or times.train_s is None:
        return Verdict(True, "no step has completed yet to estimate how long finishing this one takes")
    checkpoint_s = times.checkpoint_s if times.checkpoint_s is not None else UNTIMED_CHECKPOINT_SHARE * grace_s / ESTIMATE_MARGIN
    needed_s = ESTIMATE_MARGIN * (max(0.0, times.wait_s - waited_s) + times.train_s + checkpoint_s)
    if since_signal_s + needed_s > grace_s:
        return Verdict(True, f"finishing the step and checkpointing needs about {needed_s:.1f} s more, "
                             f"{since_signal_s:.1f} s into the {grace_s:g} s grace period")
    return Verdict(False, f"finishing the step: about {needed_s:.1f} s with the checkpoint, inside the "
                          f"{grace_s:g} s grace period")


class StepAborted(Exception):
    """The step in progress was given up for a preemption (`Verdict.reason`); the job checkpoints and stops."""


class Preemption:
    """The signals received by this run, and the waits that they may cut short (module docstring)."""

    def __init__(self, policy: PreemptionPolicy, grace_s: float):
        self.policy = policy
        self.grace_s = grace_s
        self.received: list[tuple[str, float]] = []  # (signal name, time.monotonic() when the handler ran)
        self._event = threading.Event()

    @classmethod
    def from_config(cls, checkpoint_cfg: Any) -> "Preemption":
        return cls(PreemptionPolicy(checkpoint_cfg.preemption_policy), checkpoint_cfg.preemption_grace_seconds)

    # -------------------------------------------------------------------------- the handler
    @contextlib.contextmanager
    def installed(self) -> Iterator["Preemption"]:
        """Handle SIGTERM and SIGINT for the duration of the block, then restore the handlers found before it."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("the job runs outside the main thread: SIGTERM/SIGINT are not handled (no checkpoint on "
                           "preemption)")
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Only records: the job acts at its next safe point (never checkpoint from a signal handler). The third
        signal interrupts whatever runs (module docstring)."""
        self.received.append((signal.Signals(signum).name, time.monotonic()))
        self._event.set()
        if len(self.received) >= 3:
            raise KeyboardInterrupt(f"{self.describe()}: stopping at once, without a checkpoint")

    # -------------------------------------------------------------------------- the job's side
    @property
    def requested(self) -> bool:
        return self._event.is_set()

    @property
    def signals(self) -> int:
        return len(self.received)

    def describe(self) -> str:
        """The signals received, for the log: e.g. `SIGTERM`, `SIGTERM, SIGTERM`."""
        return ", ".join(name for name, _ in self.received) or "no signal"

    def since_signal_s(self) -> float:
        return time.monotonic() - self.received[0][1] if self.received else 0.0

    def verdict(self, waited_s: float, times: StepTimes) -> Verdict:
        return abort_verdict(policy=self.policy, signals=self.signals, since_signal_s=self.since_signal_s(),
                             waited_s=waited_s, times=times, grace_s=self.grace_s)

    async def run_abortable(self, awaitable: Awaitable[T], times: StepTimes, *, always_abort: bool = False) -> T:
        """Await `awaitable` as a task; once a signal came, cancel it and raise StepAborted as soon as the verdict
        (or `always_abort`: evaluation, which holds no training state) says so."""
        task = asyncio.ensure_future(awaitable)
        t0 = time.monotonic()
        logged = False
        while True:
            done, _ = await asyncio.wait([task], timeout=POLL_S)
            if done:
                return task.result()
            if not self.requested:
                continue
            verdict = Verdict(True, "an evaluation is never waited for") if always_abort else \
                self.verdict(time.monotonic() - t0, times)
            if not verdict.abort and not logged:
                logger.warning("%s received: %s", self.describe(), verdict.reason)
                logged = True
            if verdict.abort:
                task.cancel()
                (outcome,) = await asyncio.gather(task, return_exceptions=True)
                if isinstance(outcome, Exception):  # it failed while it was being cancelled: said, then given up
                    logger.warning("the aborted wait raised %s: %s", type(outcome).__name__, outcome)
                raise StepAborted(verdict.reason)
