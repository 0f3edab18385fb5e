"""`--xla-cpu-cores`: the core lists it takes (tests/test_engine.py's `jaxrl-vlm serve` test checks where a served
engine's threads then run, tests/test_cli_errors.py its refusal once jax's backends have started)."""

import pytest

from jaxrl_vlm.xla_cpu_cores import parse_cpu_list


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

