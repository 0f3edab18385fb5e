"""DESIGN.md §3's layering, enforced on the source: rollout/ and envs/ without jax, rl/ without engine or job,
models/ without config, rollout or sharding, no cycles between packages (any two direct children of jaxrl_vlm/,
no module exempt) or modules (function-local imports included).
Each rule is also shown to fire when one forbidden import is added to a copy of the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _import_graph import ROOTS, violations

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_follows_the_layering_rules():
    problems = violations(ROOT)
    assert not problems, "\n".join(problems)


def test_importing_every_rollout_and_env_module_loads_no_jax():
    code = (
        "import importlib, pathlib, sys\n"
        "for top in ('rollout', 'envs'):\n"
        "    for p in sorted(pathlib.Path(top).rglob('*.py')):\n"
        "        parts = list(p.with_suffix('').parts)\n"
        "        parts = parts[:-1] if parts[-1] == '__init__' else parts\n"
        "        importlib.import_module('.'.join(parts))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'jaxrl_vlm'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture()
def tree_copy(tmp_path: Path) -> Path:
    for top in ROOTS:
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    assert not violations(tmp_path)
    return tmp_path


def _append(root: Path, rel: str, line: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + "\n" + line + "\n")


@pytest.mark.parametrize(
    ("rel", "line", "needle"),
    [
        ("rollout/sample.py", "import jax", "rollout/ and envs/ never import jax"),
        ("envs/base.py", "from jaxrl_vlm.models import rope", "rollout/ and envs/ never import jax"),
        ("jaxrl_vlm/rl/losses.py", "from jaxrl_vlm.engine import sampling", "rl/ is RL math"),
        ("jaxrl_vlm/rl/advantages.py", "from rollout.client import SGLangClient", "rl/ is RL math"),
        ("jaxrl_vlm/models/rope.py", "from jaxrl_vlm.config import Config", "models/ never import"),
        ("jaxrl_vlm/models/rope.py", "from jaxrl_vlm.sharding import layout", "models/ never import sharding/"),
        # The cycle the sharding rules once closed: sharding/ places models, so models/ importing even the rules
        # module of sharding/ makes the two packages import each other.
        ("jaxrl_vlm/models/activation_sharding.py", "from jaxrl_vlm.sharding.rules import spec_with_notes",
         "package cycle jaxrl_vlm.models <-> jaxrl_vlm.sharding"),
        ("jaxrl_vlm/batching.py", "from jaxrl_vlm.job import run", "only the CLI and benches use the job"),
        # A function-local import closing a cycle is still a cycle.
        ("jaxrl_vlm/models/rope.py", "def _late():\n    from jaxrl_vlm import batching", "package cycle"),
        ("jaxrl_vlm/rl/aggregation.py", "def _late():\n    from jaxrl_vlm.rl import losses", "module cycle"),
    ],
)
@pytest.mark.slow
def test_each_rule_fires_on_one_forbidden_import(tree_copy: Path, rel: str, line: str, needle: str):
    _append(tree_copy, rel, line)
    problems = violations(tree_copy)
    assert any(needle in p for p in problems), problems
