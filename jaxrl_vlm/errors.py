"""The errors of bad input: what a user gave (a config key or flag, a file it names) and can fix.

`jaxrl-vlm` reports each of them in one line, `jaxrl-vlm <command>: error: <cause>` on stderr, and exits 2; any
other exception is a failure of the run, not of its input. So the message is the whole report: it names the
file, key, column or endpoint at fault and what to do.

Its own dependency-free module so that low layers (`models/`, `data/`, `sharding.rules`, `checkpoint`) raise them
without importing `jaxrl_vlm.config` (which pulls in `rollout/` loading). `rollout/` cannot import this module:
its one bad-input error, an engine that cannot serve the run as it was started, is `rollout.client.EngineRefused`,
which the command line reports the same way.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input a user can fix: an unknown key, a wrong type, a value out of bounds, a file that is missing,
    unreadable or not what its option says (a checkpoint, a dataset)."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used: an HF model directory (`config.json`, safetensors) or a run's checkpoint
    (`--load`) that is missing, damaged, or does not fit the model or optimizer of this run."""
