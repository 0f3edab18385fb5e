"""`ConfigError`, the one error type for config problems a user can fix.

Its own dependency-free module so that low layers (e.g. `jaxrl_vlm.sharding.rules`) can raise a subclass
that `jaxrl-vlm`'s CLI reports as a config error, without importing `jaxrl_vlm.config` (which pulls in
`rollout/` loading). `jaxrl_vlm.config` re-exports it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem a user can fix: unknown key, wrong type, bad value, unreadable file."""
