"""On-policy self-distillation's privileged view (--opd-type self, slime's OPSD), rollout-side, no jax.

The teacher is the frozen initial policy reading the student's own episode with privileged information it would
not have at test time (a field of the dataset row, e.g. the answer). Here that text is appended to the episode's
first user turn, after its pictures and the env's reset observation, and the prompt is rendered again through the
chat template: `Sample.privileged_prompt_tokens`. Everything after the prompt (the model's turns, observations and
their pictures) is the student's own, so the trainer lines up each response token with the teacher's prediction of
it by a per-sample shift (jaxrl_vlm/privileged.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.encoding import ChatEncoder, prompt_with_opening
from rollout.options import LABEL_FIELD, privileged_problem
from rollout.sample import Sample


class PrivilegedFieldError(KeyError):
    """The sample has no value at --opsd-privileged-field."""

    def __str__(self) -> str:  # KeyError quotes its message
        return str(self.args[0])


@dataclass(frozen=True)
class PrivilegedView:
    """`field`: `label` (the row's label) or `label.NAME` (one key of a dict label); `template`: a str.format
    string with a `{privileged}` slot."""

    field: str
    template: str

    def __post_init__(self) -> None:
        problem = privileged_problem(self.field, self.template)
        if problem is not None:
            raise ValueError(problem)

    def text(self, sample: Sample) -> str:
        """The privileged text of one sample: the template filled with its field's value."""
        value: Any = sample.label
        for key in self.field.split(".")[1:]:
            if not isinstance(value, dict) or key not in value:
                raise PrivilegedFieldError(f"{sample.name}: --opsd-privileged-field {self.field}: the label "
                                           f"{_short(sample.label)} has no key {key!r}")
            value = value[key]
        if value is None:
            raise PrivilegedFieldError(f"{sample.name}: --opsd-privileged-field {self.field} is empty (None)")
        return self.template.format(privileged=value)

    def prompt_tokens(self, encoder: ChatEncoder, prompt: list[dict[str, Any]], sample: Sample) -> list[int]:
        """The episode's `prompt` (the messages the student's prompt tokens were rendered from) with the privileged
        text at the end of its first user turn, rendered and tokenized as the student's (image pads expanded)."""
        message = {"role": "user", "content": [{"type": "text", "text": self.text(sample)}]}
        seg = encoder.encode_prompt(prompt_with_opening(prompt, message), tools=sample.metadata.get("tools"))
        return list(seg.train_ids)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
