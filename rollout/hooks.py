"""slime's customization hooks: user functions named by an option, loaded like the env and generate functions, and
their outputs checked.

Every hook is an option whose flag is slime's (`--custom-rm-path`, `--custom-loss-function-path`, ...; `HOOK_OPTIONS`
lists them all). `load_hook(path, option)` loads the function with `rollout.loading.load_function` (a dotted path
`pkg.module.fn` or `file.py:fn`) and wraps it in a `Hook` that knows its flag and path. Whoever calls a hook checks
its output with the `Hook.expect*` helpers, so a wrong return type raises `HookError` naming the flag, the path, what
was expected and what came back. docs/guides/hooks.md lists every hook: its signature, when it runs, what it returns.

This module never imports jax: the trainer-side hooks (loss, TIS, advantages, reward post-processing) use it too,
and check jax arrays through their `shape` and `dtype` only (which a tracer has at trace time).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rollout.loading import load_function

# Every hook option, in the order of docs/guides/hooks.md. The first seven run in the rollout (rollout/options.py declares
# them), the other four in the trainer (the config's algo section).
HOOK_OPTIONS: tuple[str, ...] = (
    "custom_rm_path",
    "dynamic_sampling_filter_path",
    "buffer_filter_path",
    "rollout_sample_filter_path",
    "rollout_all_samples_process_path",
    "custom_rollout_log_function_path",
    "custom_reward_post_process_path",
    "custom_advantage_function_path",
    "custom_loss_function_path",
    "custom_tis_function_path",
)


class HookError(TypeError):
    """A hook returned something it must not; the message names the flag, the path, the expected and the got."""


def option_flag(option: str) -> str:
    """`custom_rm_path` -> `--custom-rm-path`."""
    return "--" + option.replace("_", "-")


def describe(value: Any) -> str:
    """A short description of a value for an error message: its type, and its length, shape or value."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(shape)}"
    if isinstance(value, (list, tuple)):
        items = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of length {len(value)}" + (f" (items: {', '.join(items)})" if items else "")
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {sorted(map(str, value))[:8]}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def is_number(value: Any) -> bool:
    """A real number (python or numpy scalar); not a string, array or None."""
    return isinstance(value, numbers.Real)


def is_reward(value: Any) -> bool:
    """What a reward may be before `--reward-key` reduces it: a number, or a mapping of named rewards."""
    return is_number(value) or isinstance(value, Mapping)


def _float_dtype(dtype: Any) -> bool:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype.kind == "f" or "float" in dtype.name  # bfloat16 is not kind "f" in numpy


@dataclass(frozen=True)
class Hook:
    """A loaded hook: the option that named it, the path, and the function (call the Hook to call it)."""

    option: str
    path: str
    fn: Callable[..., Any]

    @property
    def flag(self) -> str:
        return option_flag(self.option)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        """Call an `async def` hook (awaited) or a plain one (run on the event loop: keep it cheap)."""
        out = self.fn(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out

    # ------------------------------------------------------------------ the one validation helper
    def invalid(self, expected: str, got: Any, where: str = "") -> HookError:
        """The error for a wrong output: `--flag path: [where: ]expected ..., got ...`."""
        at = f"{where}: " if where else ""
        return HookError(f"{self.flag} {self.path}: {at}expected {expected}, got {describe(got)}")

    def expect(self, ok: bool, expected: str, got: Any, where: str = "") -> Any:
        """`got` when `ok`, else raise `invalid(expected, got, where)`."""
        if not ok:
            raise self.invalid(expected, got, where)
        return got

    def expect_list(self, value: Any, length: int | None, item_ok: Callable[[Any], bool], item: str,
                    where: str = "") -> list[Any]:
        """A list (or tuple) of `length` items (any length if None), each passing `item_ok`; as a list."""
        n = "" if length is None else f"{length} "
        expected = f"a list of {n}{item}"
        self.expect(isinstance(value, (list, tuple)) and (length is None or len(value) == length), expected, value,
                    where)
        for i, v in enumerate(value):
            self.expect(item_ok(v), item, v, f"{where}[{i}]" if where else f"item {i}")
        return list(value)

    def expect_array(self, value: Any, shape: tuple[int, ...], where: str = "", *, finite: bool = False,
                     sequence: bool = False) -> Any:
        """A float array of exactly `shape` (numpy or jax, a tracer included). With `sequence`, a list or tuple of
        numbers is accepted too and returned as a float64 numpy array; `finite` checks the values (host only)."""
        expected = f"a float array of shape {shape}"
        if sequence and isinstance(value, (list, tuple)):
            self.expect_list(value, shape[0] if len(shape) == 1 else None, is_number, "numbers", where)
            value = np.asarray(value, np.float64)
        ok = hasattr(value, "shape") and hasattr(value, "dtype") and tuple(value.shape) == tuple(shape)
        self.expect(ok and (_float_dtype(value.dtype) or (sequence and np.dtype(value.dtype).kind in "iub")),
                    expected, value, where)
        if finite:
            array = np.asarray(value, np.float64)
            bad = np.flatnonzero(~np.isfinite(array.reshape(-1)))
            if bad.size:
                raise self.invalid(f"finite values ({expected})", value, f"{where + ' ' if where else ''}"
                                   f"item {int(bad[0])} is {float(array.reshape(-1)[bad[0]])!r}")
        return value

    def expect_finite_numbers(self, value: Any, length: int, where: str = "") -> list[float]:
        """A list of `length` finite numbers (or a 1-D array of them), as floats."""
        array = self.expect_array(value, (length,), where, finite=True, sequence=True)
        return [float(x) for x in np.asarray(array, np.float64)]


def load_hook(path: str | None, option: str) -> Hook | None:
    """The hook `option` names (None when unset), loaded by the env/generate loader; a LoadError names the flag."""
    if path is None:
        return None
    return Hook(option, path, load_function(path, option_flag(option)))


# ----------------------------------------------------------------------------- outputs with their own types
@dataclass
class DynamicFilterOutput:
    """slime's dynamic sampling filter verdict: keep the group or not, and why not (counted as
    `rollout/dynamic_filter/drop_<reason>`). A filter may also return a bare bool, or any object with `keep` and
    `reason` attributes (slime's own class, for one)."""

    keep: bool
    reason: str | None = None


def dynamic_filter_verdict(hook: Hook, value: Any) -> DynamicFilterOutput:
    """A `--dynamic-sampling-filter-path` return value as a DynamicFilterOutput, checked."""
    expected = "a bool or a DynamicFilterOutput(keep: bool, reason: str | None)"
    if isinstance(value, (bool, np.bool_)):
        return DynamicFilterOutput(bool(value))
    hook.expect(hasattr(value, "keep") and isinstance(value.keep, (bool, np.bool_)), expected, value)
    reason = getattr(value, "reason", None)
    hook.expect(reason is None or isinstance(reason, str), "reason: a str or None", reason)
    return DynamicFilterOutput(bool(value.keep), reason)


def finite_metric(hook: Hook, key: Any, value: Any) -> float:
    """One metric a hook logs: a str key and a finite number."""
    hook.expect(isinstance(key, str), "metric names that are str", key)
    hook.expect(is_number(value) and math.isfinite(float(value)), "a finite number", value, f"metric {key!r}")
    return float(value)
