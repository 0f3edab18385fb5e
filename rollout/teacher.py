"""On-policy distillation's teacher scoring (`--use-opd --opd-type engine`): a rollout-side step.

Once an episode has finished, the teacher scores the student's whole trajectory (the prompt, every turn, the
observations and every picture of the episode) in one request for the engine's prompt log-probs (SGLang's
`/generate` with `logprob_start_len: 0`, `max_new_tokens: 0`; `SGLangClient.prompt_logprobs`). The log-prob of each
response token goes on the sample (`Sample.teacher_log_probs`, 0.0 on observation tokens as `rollout_log_probs`), so
the rollout dump, saved rollouts and their replay carry it; the trainer folds it into the advantages
(`jaxrl_vlm/rl/opd.py`). The teacher scores at temperature 1 (its own distribution), as slime's teacher request
(temperature 0, which SGLang reports untempered) does.

No jax here: a rollout host runs it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rollout.client import EngineError, SGLangClient
from rollout.encoding import ChatEncoder
from rollout.sample import Sample


class TeacherError(RuntimeError):
    """The teacher could not score an episode (its answer does not fit the trajectory); names the sample."""


TEACHER_TEMPERATURE = 1.0


def response_teacher_logprobs(sample: Sample, position_logprobs: list[float]) -> list[float]:
    """The teacher's log-prob of each response token of `sample` from its prompt log-probs (`position_logprobs[i-1]`
    = log p(tokens[i] | tokens[:i]), len(tokens) - 1 of them), 0.0 where the loss mask is 0."""
    expected = len(sample.tokens) - 1
    if len(position_logprobs) != expected:
        raise TeacherError(f"{sample.name}: the teacher scored {len(position_logprobs) + 1} positions, the trajectory "
                           f"has {len(sample.tokens)} (tokens with image pads expanded): is it the student's model "
                           "family with the same tokenizer and image processor?")
    start = sample.prompt_length - 1  # the first response token is predicted at position prompt_length
    return [float(position_logprobs[start + j]) if m else 0.0 for j, m in enumerate(sample.loss_mask)]


@dataclass
class TeacherScorer:
    """A teacher engine behind an SGLang client, with at most `concurrency` scoring requests in flight.

    `encoder` compacts the trajectory's expanded image pads back to one per image, as the wire wants them.
    """

    client: SGLangClient
    encoder: ChatEncoder
    concurrency: int = 8
    timeout_s: float | None = None
    _slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency)

    async def score(self, sample: Sample) -> None:
        """Set `sample.teacher_log_probs`; TeacherError (or the client's EngineError) when it cannot."""
        wire_ids = self.encoder.compact_image_pads(sample.tokens)
        async with self._slots:
            position_lps = await self.client.prompt_logprobs(wire_ids, image_data=sample.image_data or None,
                                                             temperature=TEACHER_TEMPERATURE, timeout_s=self.timeout_s)
        sample.teacher_log_probs = response_teacher_logprobs(sample, position_lps)

    async def close(self) -> None:
        await self.client.close()


TEACHER_ERRORS = (TeacherError, EngineError, asyncio.TimeoutError)
