"""The proof that the README's main command learns a multi-turn visual task (issue 13): the shipped config
(configs/color_reveal_tiny.yaml) and its blind ablation, run end to end on CPU by `scripts/color_reveal_ablations.py`.
- learn (100 steps, as shipped): the held-out eval reward rises from chance by >= 0.25 (or reaches 2x chance), and
  episodes really run more than one turn in the early steps;
- blind (every picture blank, same rows; 50 steps): eval stays within chance + a small margin (the best blind
  policy earns 0.475: it can learn not to repeat a wrong color, nothing more), and lies clearly below the learning
  run's eval after the same 50 steps, so the pictures carry the signal.
Both run in CI's step for long tests (`-m ci_step`), sharing one learning arm (the module's fixture), not in the
README's test command: the learning run is the suite's longest test (4-5 minutes on 2 cores), and the README's
command keeps the closed-loop learning proofs (tests/test_closed_loop.py: for both families, reward rises only when
the weights reach the engine; tests/test_agent_envs_learning.py: one-push Sokoban above chance).
`python scripts/color_reveal_ablations.py` runs all three arms, sync_off included (the engine never receives new
weights: no rise), for 100 steps (the README's table).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "color_reveal_ablations.py"
RISE = 0.25  # the margin over the initial (chance-level) eval
BLIND_MARGIN = 0.12  # blind eval may exceed chance by the best-blind gap (0.056) plus sampling noise (256 episodes)
INITIAL_SLACK = 0.1  # the untrained policy is a chance-level guesser
BLIND_STEPS = 50  # the ablations stop early (multiples of the config's eval_interval, 25)


@pytest.fixture(scope="module")
def ablations():
    spec = importlib.util.spec_from_file_location("color_reveal_ablations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("color_reveal")


@pytest.fixture(scope="module")
def learn(ablations, root):
    return ablations.run_arm("learn", root)


@pytest.mark.slow
@pytest.mark.ci_step  # CI's own step for long tests (.ci/run), not the README's test command: see pyproject.toml
def test_the_main_command_learns_from_chance(learn):
    assert abs(learn.initial - learn.chance) <= INITIAL_SLACK, learn
    assert learn.rise >= RISE or learn.final >= 2 * learn.chance, learn
    assert learn.early_turns > 1.2, learn  # a first guess is often wrong: most episodes take the second turn
    assert len(learn.evals) >= 3, learn  # step 0, every eval_interval steps, and the end


@pytest.mark.slow
@pytest.mark.ci_step  # CI's own step for long tests (.ci/run), not the README's test command: see pyproject.toml
def test_blind_ablation_stays_at_chance(ablations, root, learn):
    blind = ablations.run_arm("blind", root, ["--num-rollout", str(BLIND_STEPS)])
    assert max(blind.evals) == BLIND_STEPS, blind
    assert blind.best_blind < blind.chance + BLIND_MARGIN
    assert max(blind.evals.values()) <= blind.chance + BLIND_MARGIN, blind
    assert learn.evals[BLIND_STEPS] - blind.final >= 0.15, (learn, blind)
