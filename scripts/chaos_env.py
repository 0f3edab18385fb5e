"""The color-reveal env with faults that `scripts/chaos_run.py` switches on at run time: a step that hangs, a step
that raises.

Loaded by the chaos run's trainer as `--rollout-interaction-env-path chaos_env` (scripts/ on its PYTHONPATH); it is
`envs.color_reveal` unchanged until the chaos run writes a fault order into `$JAXRL_CHAOS_DIR/env_fault.json`
(`{"id": N, "kind": "hang" | "raise"}`). The next episode that steps then claims the order (once per id, across
trainer restarts: the claim is a file `env_fault_<id>.claimed` naming the episode's group and index) and from then
on every step of that episode hangs (an `await` that never ends: the rollout's `--env-step-timeout` cuts it) or
raises, so the rollout's retries run out and the episode FAILs with a typed cause (env_error: its retries timed out or raised) that
the chaos run finds in the step's dump. Every other episode is untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from envs.color_reveal import CONFIG_KEYS, ColorRevealEnv
from envs.color_reveal import build_env as build_color_reveal_env

__all__ = ["CONFIG_KEYS", "ChaosColorRevealEnv", "build_env"]

CONTROL_ENV_VAR = "JAXRL_CHAOS_DIR"
HANG_S = 3600.0


class InjectedEnvFault(RuntimeError):
    """The chaos run's injected env failure (an env that raises)."""


def _control_dir() -> Path | None:
    value = os.environ.get(CONTROL_ENV_VAR)
    return Path(value) if value else None


def _claim(where: tuple[int, int]) -> str | None:
    """The kind of a pending fault order this episode now owns, or None. O_EXCL makes the claim atomic across the
    episodes of one process and across restarts."""
    control = _control_dir()
    if control is None:
        return None
    try:
        order = json.loads((control / "env_fault.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # no order yet, or one being written (the run renames it in)
        return None
    try:
        fd = os.open(control / f"env_fault_{int(order['id'])}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        json.dump({"group_index": where[0], "index": where[1], "time": time.time(), "kind": order["kind"]}, f)
    return str(order["kind"])


class ChaosColorRevealEnv(ColorRevealEnv):
    """ColorRevealEnv whose episode may claim a fault order; `step` is async so a hang blocks no thread."""

    chaos_where: tuple[int, int] = (-1, -1)
    chaos_fault: str | None = None

    async def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:  # type: ignore[override]
        if self.chaos_fault is None:
            self.chaos_fault = _claim(self.chaos_where)
        if self.chaos_fault == "hang":
            await asyncio.sleep(HANG_S)
        if self.chaos_fault == "raise":
            raise InjectedEnvFault(f"chaos: injected env failure (group {self.chaos_where[0]}, "
                                   f"sample {self.chaos_where[1]})")
        return super().step(response_text)


# jaxrl_vlm.job.eval.EVAL_PASS: the metadata key every eval sample carries (not imported: envs never import jax).
EVAL_PASS = "eval_pass"


def build_env(sample: Any, args: Any) -> ColorRevealEnv:
    """A training episode's env may claim a fault order; an eval episode's never does (eval samples are in no
    training dump, so the chaos run could not see the fault's outcome)."""
    env = build_color_reveal_env(sample, args)
    if EVAL_PASS in (getattr(sample, "metadata", None) or {}):
        return env
    env.__class__ = ChaosColorRevealEnv  # same state, the chaos step
    env.chaos_where = (int(getattr(sample, "group_index", -1)), int(getattr(sample, "index", -1)))
    return env
