"""Name -> function registries (losses, loss types, KL estimators, aggregation modes, advantage estimators): one
helper, one error style.

A registry may name the module that fills it (`populated_by`): asking for its names imports that module first,
so the config can offer and validate the names without importing jax until then.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind under unique names; `register(name)` is a decorator."""

    def __init__(self, kind: str, *, populated_by: str | None = None):
        self.kind = kind
        self._populated_by = populated_by
        self._entries: dict[str, F] = {}

    def _populate(self) -> None:
        if self._populated_by is not None:
            importlib.import_module(self._populated_by)

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's temporary entry, a plug-in unloaded); an unknown name is a KeyError."""
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        del self._entries[name]

    def get(self, name: str) -> F:
        """The function registered as `name`; an unknown name lists the registered ones."""
        self._populate()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}") from None

    def names(self) -> list[str]:
        self._populate()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {self.names()}>"
