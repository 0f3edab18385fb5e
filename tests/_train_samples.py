"""Deterministic finished episodes for train-step tests: two groups of four, with and without an image."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout.encoding import ChatEncoder
from rollout.processing import image_to_data_url, load_image_processor, load_tokenizer
from rollout.sample import Sample, Status


def train_samples(model_dir: Path, make_image) -> list[Sample]:
    """Two groups of 4: with and without an image, different lengths, a fixed reward pattern."""
    enc = ChatEncoder(load_tokenizer(model_dir), load_image_processor(model_dir))
    rng = np.random.default_rng(0)
    samples = []
    for g in range(2):
        content = [{"type": "text", "text": f"Find x in figure {g}."}]
        if g == 0:
            content.insert(0, {"type": "image", "image": image_to_data_url(make_image(g, (64, 96)))})
        prompt = [{"role": "user", "content": content}]
        for i in range(4):
            seg = enc.encode_prompt(prompt)
            s = Sample(group_index=g, index=i, prompt=prompt, label="1")
            s.set_prompt_tokens(seg.train_ids)
            s.image_data = seg.image_data
            s.multimodal_train_inputs = seg.mm_inputs
            n = 5 + 3 * i + g
            s.append_model_tokens(rng.integers(10, 900, size=n).tolist(), (-rng.uniform(0.1, 3.0, size=n)).tolist())
            s.append_observation_tokens(enc.encode_observation([{"role": "user", "content": "more"}]).train_ids)
            s.append_model_tokens([enc.vision.im_end], [-0.2])
            s.reward = float((i + g) % 3)
            s.set_status(Status.COMPLETED)
            samples.append(s)
    return samples
