"""Load user code by dotted path or file path (slime's `--*-function-path` / `--*-env-path` convention)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


class LoadError(ImportError):
    """User code named by a path could not be loaded; the message says which option and path."""


def load_module(path: str, what: str) -> ModuleType:
    """Import `path`: a dotted module name (`envs.geo3k`) or a `.py` file. `what` names the option for errors."""
    try:
        if path.endswith(".py"):
            file = Path(path).resolve()
            if not file.is_file():
                raise LoadError(f"{what}: file {path} does not exist")
            digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
            name = f"_jaxrl_user_{file.stem}_{digest}"
            if name in sys.modules:
                return sys.modules[name]
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise LoadError(f"{what}: {path} is not a loadable Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
        return importlib.import_module(path)
    except LoadError:
        raise
    except Exception as e:  # user code failed to import: re-raise naming the option and the path
        raise LoadError(f"{what}: cannot import {path!r}: {type(e).__name__}: {e}") from e


def load_function(path: str, what: str) -> Callable[..., Any]:
    """`pkg.module.fn` or `file.py:fn` -> the callable, with an error naming what is missing."""
    if ":" in path:
        module_path, _, attr = path.rpartition(":")
    else:
        module_path, _, attr = path.rpartition(".")
    if not module_path or not attr:
        raise LoadError(f"{what}: {path!r} is not of the form 'package.module.function' or 'file.py:function'")
    module = load_module(module_path, what)
    fn = getattr(module, attr, None)
    if fn is None:
        raise LoadError(f"{what}: module {module_path!r} has no attribute {attr!r}")
    if not callable(fn):
        raise LoadError(f"{what}: {path!r} is a {type(fn).__name__}, not a function")
    return fn
