"""A test environment whose every step raises: every episode of every step ends FAILED."""

from __future__ import annotations

from typing import Any

from envs.base import BaseInteractionEnv


class BrokenEnv(BaseInteractionEnv):
    def reset(self) -> None:
        pass

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        raise RuntimeError("simulator crashed")


def build_env(sample: Any, args: Any) -> BrokenEnv:
    return BrokenEnv()
