"""`jaxrl-vlm train|rollout|eval --help` lists every run option: argparse alone would show only `-h`, since the
options are parsed from the config layers, not declared to argparse."""

from __future__ import annotations

import pytest

from jaxrl_vlm.cli import main
from jaxrl_vlm.config import FIELDS


@pytest.mark.parametrize("command", ["train", "rollout", "eval"])
def test_help_lists_every_option_with_its_choices_and_bounds(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: jaxrl-vlm {command}")
    for info in FIELDS.values():
        line = next((ln for ln in out.splitlines() if ln.startswith(f"  {info.flag} ")), None)
        assert line is not None, f"{info.flag} missing from `jaxrl-vlm {command} --help`"
        if info.choices:
            assert all(repr(c) in line for c in info.choices), (info.flag, line)
        for op, bound in ((">", info.gt), (">=", info.ge), ("<", info.lt), ("<=", info.le)):
            if bound is not None:
                assert f"{op}{bound:g}" in line, (info.flag, line)
