"""`--xla-cpu-cores`: the core lists it takes (tests/test_engine.py's `jaxrl-vlm serve` test checks where a served
engine's threads then run, tests/test_cli_errors.py its refusal once jax's backends have started), and its refusal
on a GPU or TPU host."""

import jax
import pytest
from jax._src import xla_bridge

from jaxrl_vlm.xla_cpu_cores import allowed_cores, confine_xla_threads, parse_cpu_list


@pytest.mark.parametrize("text, allowed, cores", [
    ("1", {0, 1}, {1}),
    ("0-2,5", {0, 1, 2, 3, 4, 5}, {0, 1, 2, 5}),
    (" 3 - 4 ", {3, 4}, {3, 4}),
    ("auto", {0, 1, 2, 3}, {1, 2, 3}),  # every core but the lowest, which the interpreter keeps
    ("auto", {2, 5}, {5}),
    ("auto", {7}, {7}),  # one core: XLA shares it
])
def test_core_lists_as_taskset_takes_them(text, allowed, cores):
    assert parse_cpu_list(text, frozenset(allowed)) == cores


@pytest.mark.parametrize("text, allowed, cause", [
    ("one", {0, 1}, "'one' is not a core or a range"),
    ("1,", {0, 1}, "'' is not a core or a range"),
    ("3-1", {0, 1, 2, 3}, "'3-1' is not an ascending range"),
    ("-1", {0, 1}, "is not a core or a range"),
    ("1-2", {0, 1}, "cores [2] are not among this process's [0, 1]"),
])
def test_a_bad_core_list_is_refused_naming_the_cause(text, allowed, cause):
    with pytest.raises(ValueError, match="--xla-cpu-cores") as e:
        parse_cpu_list(text, frozenset(allowed))
    assert cause in str(e.value)


def test_an_accelerator_named_in_jax_platforms_is_refused_before_any_backend_starts():
    """On a GPU or TPU host jax starts every backend at once, so the flag would confine the accelerator client's
    host threads as well: refused before anything is started (and before the check that nothing has started yet,
    so it holds in this process too)."""
    previous = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cuda,cpu")
    try:
        with pytest.raises(RuntimeError, match="for an engine on a CPU host") as e:
            confine_xla_threads(str(max(allowed_cores())))
    finally:
        jax.config.update("jax_platforms", previous)
    assert "'cuda,cpu' (JAX_PLATFORMS)" in str(e.value)


def test_an_accelerator_jax_found_by_itself_is_refused_once_started(monkeypatch):
    """With JAX_PLATFORMS unset jax picks its platforms as it starts: an accelerator is only known then, so the
    flag is refused after the start (the process must end), and this thread has its cores back."""
    before = allowed_cores()
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(jax, "devices", lambda *a: [])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(RuntimeError, match="jax found gpu devices"):
        confine_xla_threads(str(max(before)))
    assert allowed_cores() == before
