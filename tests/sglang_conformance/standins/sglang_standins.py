"""Import-only stand-ins for the GPU packages SGLang's HTTP layer imports but never calls when no model runs.

PyPI's `torchvision` pulls CUDA torch and `triton` is a 1 GB compiler: neither can run here, and the conformance
server (`_sglang_stub_server.py`) starts no scheduler, so nothing calls into them. A finder on `sys.meta_path`
(installed by a `.pth` file in the SGLang venv, see scripts/setup_sglang_conformance_venv.sh) answers
`import torchvision...` / `import triton...` with modules whose every attribute is an inert placeholder:
decorators hand back the function they wrap, calls and indexing give another placeholder. Anything that would
really compute with one fails loudly (`StandInUsed`), so a stand-in can never fake a result.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STANDIN_PACKAGES = ("torchvision", "triton")


def _accept_anything(self: Any, *args: Any, **kwargs: Any) -> None:
    """The constructor of a stand-in class (`triton.Config(...)` at import time builds one)."""


def _standin_attribute(owner: str, item: str, cache: dict[str, Any]) -> Any:
    """A capitalised name stands for a class (code subclasses it or passes it to isinstance), anything else
    for a placeholder; the same name always gives the same object."""
    if item not in cache:
        full = f"{owner}.{item}"
        cache[item] = type(item, (), {"__module__": owner, "__qualname__": item, "__init__": _accept_anything}) if item[:1].isupper() \
            else _Placeholder(full)
    return cache[item]


class StandInUsed(RuntimeError):
    """Code tried to compute with a stand-in (it only exists to be imported)."""


class _Placeholder:
    """An attribute of a stand-in module: attribute access, calls and indexing give placeholders again; used as
    a decorator (called with one function or class) it returns what it decorates unchanged."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._attributes: dict[str, Any] = {}

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__") or item in ("_name", "_attributes"):
            raise AttributeError(item)
        return _standin_attribute(self._name, item, self._attributes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
            return args[0]  # used as a decorator
        if not args and not kwargs:  # a query of the device or runtime: there is none
            raise StandInUsed(f"{self._name}() was called, but {self._name.split('.')[0]} is an import-only stand-in")
        return _Placeholder(f"{self._name}(...)")  # a decorator factory: @triton.jit(...), @triton.autotune(...)

    def __getitem__(self, item: Any) -> _Placeholder:
        return _Placeholder(f"{self._name}[...]")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        raise StandInUsed(f"{self._name} is an import-only stand-in; it cannot be iterated")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        cache = self.__dict__.setdefault("_standin_attributes", {})
        return _standin_attribute(self.__name__, item, cache)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in STANDIN_PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+standin"
        module.__sglang_standin__ = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _settle_availability_probes() -> None:
    """torch and transformers ask "is triton / torchvision installed?" once and cache the answer; asked before
    the stand-ins exist, they answer no, so neither library starts using a stand-in as the real thing."""
    import torch.utils._triton as torch_triton
    import transformers.utils.import_utils as hf_imports

    if torch_triton.has_triton_package() or hf_imports.is_torchvision_available():
        raise RuntimeError("a real triton or torchvision is installed in this venv; the stand-ins must not shadow "
                           "it (rebuild the venv with scripts/setup_sglang_conformance_venv.sh)")


def install() -> None:
    """Answer the availability probes first, then put the finder last on sys.meta_path."""
    _settle_availability_probes()
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())
