"""The link to an external engine that may die and come back (`--engine-reconnect-timeout`).

An SGLang server that crashes (OOM) and is restarted comes back empty: its KV cache is gone and it serves the
weights it was started with. Without this, every `/generate` sent meanwhile fails its episode, and a step trains on
what the outage left of its batch. With it:

* the first connection-level failure (refused, reset, disconnected) of a request to the engine marks the link DOWN
  (`lost`); from then on `/generate` requests wait at the link (`wait_up`) instead of being sent, and control calls
  to the engine fail at once;
* one task probes the engine's health with bounded exponential backoff until it answers, or until the reconnect
  timeout has passed since the loss;
* once it answers, the owner's `on_return` runs before anything else is sent: the main job checks the engine's weight
  version and, if the engine restarted, pushes the trainer's weights and confirms their version. An engine that
  fails again during that goes back to probing, within the same deadline;
* then the link is UP and the waiting requests are re-sent (an episode cut mid-turn re-sends its turn: the engine
  holds the same weights as before the loss, so the episode stays on-policy);
* past the deadline the link is FAILED: every waiter raises `EngineLost` (the episode FAILs with cause
  `engine_lost`), and the owner stops the run with the same error, naming the URL and how long it waited.

Every outage is recorded (`Outage`) and counted. This module never imports jax.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Health probes after a loss: the delay before probe k is min(PROBE_MAX_S, PROBE_BASE_S * 2**k).
PROBE_BASE_S = 0.25
PROBE_MAX_S = 5.0
# A request re-sent after this many outages fails (cause engine_lost) instead of waiting again: an engine that keeps
# dying under one request must not hold it forever.
MAX_OUTAGES_PER_REQUEST = 3


class LinkState(enum.Enum):
    UP = "up"
    DOWN = "down"  # unreachable: probing
    RESTORING = "restoring"  # answering again: the owner's `on_return` runs
    FAILED = "failed"  # not back within the reconnect timeout


class EngineLost(RuntimeError):
    """The engine at `url` was lost for good: not back within `--engine-reconnect-timeout`, or lost too often under
    one request. The episodes it ends FAIL with cause `engine_lost`; the run stops with it."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        super().__init__(message)


def _gave_up(url: str, waited_s: float, timeout_s: float, probes: int, last_error: str) -> EngineLost:
    return EngineLost(url, f"engine at {url} lost: not back after waiting {waited_s:.1f} s "
                           f"(--engine-reconnect-timeout {timeout_s:g}), {probes} health probe(s); last error: "
                           f"{last_error}")


@dataclass
class Outage:
    """One loss of the engine: when, why, how long until it served again, and whether its weights were re-pushed."""

    url: str
    cause: str
    started: float  # time.time()
    waited_s: float = 0.0
    probes: int = 0
    weights_restored: bool = False
    recovered: bool = False


Probe = Callable[[float], Awaitable[tuple[bool, str]]]  # (timeout_s) -> (healthy, error text)


class EngineLink:
    """State of the link to the engine at `url`; see the module docstring.

    `probe(timeout_s)` is one health check; `on_return()` (set by `arm`) makes the returned engine hold the trainer's
    weights, or raises (the engine failed again: probing goes on). Until armed, `lost` is ignored: a loss before
    the run attached is the session's start-up wait's business.
    """

    def __init__(self, url: str, probe: Probe, timeout_s: float, *, probe_timeout_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reconnect timeout must be > 0 seconds, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._probe = probe
        self.on_return: Callable[[], Awaitable[bool]] | None = None
        self.state = LinkState.UP
        self.outages: list[Outage] = []
        self.failure: EngineLost | None = None
        self.requests_resent = 0  # requests sent again after the engine came back
        self._up = asyncio.Event()
        self._up.set()
        self._task: asyncio.Task | None = None

    @property
    def armed(self) -> bool:
        return self.on_return is not None

    def arm(self, on_return: Callable[[], Awaitable[bool]]) -> None:
        """From now on, losses are handled; `on_return()` returns whether it re-pushed the weights."""
        self.on_return = on_return

    @property
    def is_down(self) -> bool:
        """Unreachable and probing: control calls to the engine are pointless."""
        return self.state is LinkState.DOWN

    def lost(self, cause: str) -> None:
        """A request met a connection-level failure. Starts the reconnection unless one is running already."""
        if not self.armed or self.state is not LinkState.UP:
            return
        logger.warning("engine at %s unreachable (%s): holding /generate requests, probing for up to %g s "
                       "(--engine-reconnect-timeout)", self.url, cause, self.timeout_s)
        self.state = LinkState.DOWN
        self._up.clear()
        outage = Outage(self.url, cause, time.time())
        self.outages.append(outage)
        self._task = asyncio.ensure_future(self._reconnect(outage))

    async def wait_up(self) -> bool:
        """Wait until the link is UP; True when the caller waited for an outage. Raises `EngineLost` once FAILED."""
        waited = not self._up.is_set()
        await self._up.wait()
        if self.failure is not None:
            raise self.failure
        return waited

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def _reconnect(self, outage: Outage) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.timeout_s
        last = outage.cause
        k = 0
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                outage.probes += 1
                ok, error = await self._probe(min(self.probe_timeout_s, remaining))
                if ok:
                    self.state = LinkState.RESTORING
                    try:
                        outage.weights_restored = bool(await asyncio.wait_for(self.on_return(),
                                                                              max(1e-3, deadline - loop.time())))
                    except asyncio.TimeoutError:
                        last = "restoring the weights did not finish before the deadline"
                        break
                    except Exception as e:  # any failure of the restore: the engine is probed again, within the deadline
                        last = f"restoring the weights failed: {type(e).__name__}: {e}"
                        logger.warning("engine at %s answered again but %s; probing again", self.url, last)
                        self.state = LinkState.DOWN
                    else:
                        outage.recovered = True
                        outage.waited_s = loop.time() - start
                        logger.warning("engine at %s back after %.1f s (%d probe(s)); weights %s", self.url,
                                       outage.waited_s, outage.probes,
                                       "re-pushed and confirmed" if outage.weights_restored else "still in place")
                        self.state = LinkState.UP
                        self._up.set()
                        return
                else:
                    last = error or last
                await asyncio.sleep(max(0.0, min(PROBE_MAX_S, PROBE_BASE_S * 2.0 ** k, deadline - loop.time())))
                k += 1
            outage.waited_s = loop.time() - start
            self.failure = _gave_up(self.url, outage.waited_s, self.timeout_s, outage.probes, last)
            logger.error("%s", self.failure)
            self.state = LinkState.FAILED
            self._up.set()  # waiters wake and raise
        except asyncio.CancelledError:
            self.state = LinkState.FAILED
            self.failure = _gave_up(self.url, loop.time() - start, self.timeout_s, outage.probes,
                                    "the reconnection was cancelled (shutdown)")
            self._up.set()
            raise

    async def close(self) -> None:
        """Stop a reconnection in progress (end of the session)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def metrics(self) -> dict[str, float]:
        """Run totals: outages, seconds waited, weight re-pushes, re-sent requests."""
        return {
            "engine/outages": float(len(self.outages)),
            "engine/outage_seconds": float(sum(o.waited_s for o in self.outages)),
            "engine/weight_restores": float(sum(o.weights_restored for o in self.outages)),
            "engine/requests_resent": float(self.requests_resent),
        }
