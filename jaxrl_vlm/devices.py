"""Device placement of one host: which local devices the embedded engine and the trainer use.

`--rollout-devices 0-3 --train-devices 4-7` gives the embedded engine and the trainer disjoint devices, so
rollout and training run at the same time (`--max-staleness K`) without sharing memory or compute. Without
them the trainer takes every device and the engine its first `tp_size x dp_size` ones (they share: the
synchronous loop never runs both at once; `--colocate` also frees the engine's memory while training).

A device list is written as ids and inclusive ranges: "0-3", "0,1,2,3", "0-1,6-7". Ids are positions in
`jax.local_devices()` (what `CUDA_VISIBLE_DEVICES` leaves visible), not global ids, so a config means the same
on every host.

Parsing and checking lists needs no jax (the run config validates them before any backend starts); only
`pick_devices` asks jax for the local devices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jaxrl_vlm.errors import ConfigError

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_device_ids(spec: str, what: str = "device list") -> tuple[int, ...]:
    """"0-3" / "0,2,4" / "0-1,6-7" -> sorted unique ids; ConfigError naming `what` for anything else."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{what}: expected device ids like '0-3' or '0,1,2,3', got {spec!r}")
    ids: list[int] = []
    for item in spec.split(","):
        m = _ITEM.match(item)
        if m is None:
            raise ConfigError(f"{what}: {item.strip()!r} in {spec!r} is not a device id or an inclusive range like '4-7'")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ConfigError(f"{what}: range {item.strip()!r} in {spec!r} runs backwards")
        ids.extend(range(lo, hi + 1))
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{what}: {spec!r} names a device twice")
    return tuple(sorted(ids))


def pick_devices(ids: Sequence[int], what: str = "device list", devices: Sequence[Any] | None = None) -> list[Any]:
    """The local devices with these positions (ConfigError if one does not exist)."""
    import jax  # here, not at the top: `jaxrl_vlm.config` imports this module and must not load jax

    local = list(jax.local_devices() if devices is None else devices)
    missing = [i for i in ids if not 0 <= i < len(local)]
    if missing:
        raise ConfigError(f"{what}: device id(s) {missing} do not exist; this host has {len(local)} local devices "
                          f"(ids 0-{len(local) - 1})")
    return [local[i] for i in ids]


def check_disjoint(rollout: Sequence[int], train: Sequence[int]) -> None:
    """Engine and trainer on disjoint devices: sharing one would run two programs' memory on it unplanned."""
    both = sorted(set(rollout) & set(train))
    if both:
        raise ConfigError(f"--rollout-devices and --train-devices share device(s) {both}; give them disjoint devices, "
                          "or leave both unset and use --colocate to share all of them")
