"""On-policy self-distillation (--opd-type self): the teacher's view of a batch and where it lines up, host-side.

The teacher (the frozen initial policy) reads each episode with privileged text in its first user turn
(`Sample.privileged_prompt_tokens`, rendered by rollout/privileged.py) followed by the student's own tokens after
the prompt. Those views are packed by the same batcher as the student's (`teacher_views`), so rows, micro-batches
and the vision inputs are the batcher's usual ones; only the offsets differ. `alignment` maps every target slot of
the student's batch to the teacher batch's slot that predicts the same response token: response token j of a
sample is predicted at slot `offset + prompt_length + j - 1` in both layouts, with each layout's own offset and
prompt length. The train step gathers the teacher's hidden states through that map (rl/opsd.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxrl_vlm.batching import BatchingError, TrainBatch
from rollout.sample import Sample


class Alignment(NamedTuple):
    """index int32 [K, R, T]: for each student target slot, its slot in the teacher batch flattened over
    (K', R', T') (0 where none); valid float32 [K, R, T]: 1 where the slot is a loss-mask target that the teacher
    batch also holds (a response token cut by truncation in either layout has no teacher prediction)."""

    index: np.ndarray
    valid: np.ndarray


def teacher_view(sample: Sample) -> Sample:
    """The sample as the privileged teacher reads it: its privileged prompt, then its own tokens after the prompt
    (same response, loss mask, pictures). No teacher or routing data: the teacher routes itself."""
    if sample.privileged_prompt_tokens is None:
        raise BatchingError(f"{sample.name} has no privileged_prompt_tokens: with --opd-type self every episode is "
                            "rendered again with --opsd-privileged-field in its prompt when it finishes (saved "
                            "rollouts from a run without it cannot be replayed with --opd-type self)")
    tokens = list(sample.privileged_prompt_tokens) + list(sample.tokens[sample.prompt_length:])
    return dataclasses.replace(sample, tokens=tokens, teacher_log_probs=None, rollout_routed_experts=None)


def teacher_views(samples: Sequence[Sample]) -> list[Sample]:
    return [teacher_view(s) for s in samples]


def alignment(student: TrainBatch, teacher: TrainBatch, samples: Sequence[Sample]) -> Alignment:
    """The student batch's target slots mapped onto the teacher batch (both built from `samples` and their
    `teacher_views` in the same order). O(response tokens), vectorized per sample."""
    k, r, t = student.arrays.loss_mask.shape
    _, r_t, t_t = teacher.arrays.loss_mask.shape
    index = np.zeros((k, r, t), np.int32)
    valid = np.zeros((k, r, t), np.float32)
    placed = {q.sample_position: q for q in teacher.layout.placements}
    for p in student.layout.placements:
        q = placed.get(p.sample_position)
        if q is None:
            continue
        sample = samples[p.sample_position]
        resp = sample.response_length
        prompt_s = len(sample.tokens) - resp
        prompt_t = len(sample.privileged_prompt_tokens or ())
        j = np.arange(resp)
        # Response token j is placed in both layouts (truncation keeps a prefix of each sequence).
        kept = (prompt_s + j < p.length) & (prompt_t + j < q.length)
        j = j[kept]
        s_slot = p.offset + prompt_s + j - 1
        t_slot = q.offset + prompt_t + j - 1
        index[p.micro_batch, p.row, s_slot] = (q.micro_batch * r_t + q.row) * t_t + t_slot
        valid[p.micro_batch, p.row, s_slot] = student.arrays.loss_mask[p.micro_batch, p.row, s_slot] > 0
    return Alignment(index, valid)
