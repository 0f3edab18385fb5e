"""`--kl-coef`: KL reward shaping before the advantages, checked against numpy on per-sample log-probs that are
computed one sample at a time (no packing), independently of the learner's packed batches."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _train_samples import train_samples

from jaxrl_vlm.batching import build_train_batch
from jaxrl_vlm.config import load_config
from jaxrl_vlm.distributed import global_batch
from jaxrl_vlm.job.trainer import Trainer
from jaxrl_vlm.tiny import make_tiny

COEF = 0.5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=9)


def _trainer(tiny_dir, tmp_path, *extra: str) -> Trainer:
    cfg = load_config(None, [
        "--hf-checkpoint", str(tiny_dir), "--lr", "3e-3", "--weight-decay", "0", "--seq-buckets", "256,512",
        "--row-buckets", "1,8,16", "--patch-buckets", "0,64,128", "--logprob-chunk-size", "64", "--mesh-data", "1",
        "--output-dir", str(tmp_path), *extra,
    ])
    t = Trainer(cfg, devices=jax.devices()[:1])
    t.build_policy(tiny_dir)
    return t


def _one_sample_logprobs(trainer: Trainer, params, sample) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs and mask of one sample's targets in a batch of its own (one row, no packing)."""
    cfg = trainer.cfg
    batch = build_train_batch(
        [sample], np.zeros(1, np.float32), trainer.model_cfg, seq_buckets=cfg.batching.seq_buckets, row_buckets=[1],
        patch_buckets=cfg.batching.patch_buckets, packing=False, micro_batch_rows=None,
        aggregation="token_mean", aggregation_constant=None, overlong_policy="error",
    )
    lp = np.asarray(trainer._logprobs(params, global_batch(batch.arrays, trainer.mesh, rules=trainer.rules)))
    return lp[0, 0].astype(np.float64), batch.arrays.loss_mask[0, 0].astype(np.float64)


@pytest.mark.slow
def test_kl_coef_shapes_rewards_with_k1_before_grpo(tiny_dir, tmp_path, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)
    trainer = _trainer(tiny_dir, tmp_path, "--kl-coef", str(COEF), "--global-batch-size", "4")
    assert trainer.ref_params is not None
    # At the start the policy is the reference: no penalty.
    adv0, m0 = trainer.advantages(samples)
    assert abs(m0["rollout/kl_penalty_mean"]) < 1e-6
    trainer.train_on(samples)  # move the policy away from the reference
    advantages, metrics = trainer.advantages(samples)

    kl = []
    for s in samples:
        cur, mask = _one_sample_logprobs(trainer, trainer.state.params, s)
        ref, _ = _one_sample_logprobs(trainer, trainer.ref_params, s)
        kl.append(float(((cur - ref) * mask).sum()))
    kl = np.array(kl)
    assert np.abs(kl).max() > 1e-3, "the update did not move the policy: the test would not see the penalty"
    shaped = np.array([s.reward for s in samples]) - COEF * kl
    want = np.zeros(len(samples))
    groups = np.array([s.group_index for s in samples])
    for g in np.unique(groups):
        r = shaped[groups == g]
        want[groups == g] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(advantages, want, rtol=0, atol=2e-4)
    assert metrics["rollout/kl_penalty_mean"] == pytest.approx(COEF * kl.mean(), abs=1e-4)
    # The train step consumes exactly these advantages.
    assert trainer.train_on(samples)["rollout/advantages"] == pytest.approx(float(np.mean(advantages)), abs=1e-9)


def test_without_kl_coef_there_is_no_reference_and_no_shaping(tiny_dir, tmp_path, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)
    trainer = _trainer(tiny_dir, tmp_path)
    assert trainer.ref_params is None
    advantages, metrics = trainer.advantages(samples)
    assert metrics == {}
    rewards = np.array([s.reward for s in samples])
    groups = np.array([s.group_index for s in samples])
    for g in np.unique(groups):
        r = rewards[groups == g]
        np.testing.assert_allclose(advantages[groups == g], (r - r.mean()) / (r.std(ddof=1) + 1e-6), atol=1e-9)
