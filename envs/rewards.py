"""Reward functions selected by `--rm-type` (slime's `rm_hub`), graded on the model's own text only.

The rollout loads these by dotted path (`rollout.rewards.RM_TYPES`), so `rollout/` never imports `envs/`. Each
function is `fn(model_text, label) -> float`, blocking (it may wait on a grading worker): callers run it in a
thread. `model_text` is every model turn of the episode, joined; environment feedback is never part of it, so a
`\\boxed{}` the environment echoes back can never count as the model's answer (slime grades its whole decoded
response, observations included: a defect not copied here).

This module never imports jax.
"""

from __future__ import annotations

from typing import Any

from envs.grading import grade_answer, last_boxed_span

_BOXED = ("\\boxed",)


def last_boxed_answer(model_text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `model_text` (brace matched), or None.

    As slime's `extract_answer`: only `\\boxed` counts (its `\\fbox` fallback can never produce an answer, since
    `remove_boxed` requires `\\boxed{`), and an unbalanced last box means no answer rather than an earlier box.
    """
    if not isinstance(model_text, str) or "\\boxed" not in model_text:
        return None
    span = last_boxed_span(model_text, _BOXED)
    return None if span is None else span[2]


def label_text(label: Any) -> str | None:
    """The reference answer as text, or None when there is none (missing or blank: the reward is 0).

    slime's `if not ground_truth` also rejects a numeric label 0; here a number is graded as its text, so a
    reference answer of 0 can be matched.
    """
    if label is None or isinstance(label, bool):
        return None
    text = str(label).strip()
    return text or None


def math_reward(model_text: str, label: Any, *, timeout_s: float = 2.0) -> float:
    """slime's `--rm-type math`: 1.0 if the last `\\boxed{}` of the model's text equals `label`, else 0.0.

    Equality is `envs.grading.grade_answer` (normalisation, then math-verify and a numeric check, time-bounded
    in a worker process) instead of slime's Hendrycks-string-or-sympy check; a label holding a `\\boxed{}` is
    compared by its box content, as slime does. No box, an empty or unbalanced box, or no label gives 0.0.
    """
    gold = label_text(label)
    if gold is None:
        return 0.0
    answer = last_boxed_answer(model_text)
    if answer is None or not answer.strip():
        return 0.0
    return 1.0 if grade_answer(answer, gold, timeout_s=timeout_s) else 0.0
