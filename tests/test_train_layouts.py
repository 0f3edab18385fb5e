"""The compiled train step on 8 simulated devices gives the same trajectory under every shipped mesh layout
as on one device (losses, gradient norms, and the resulting parameters over 3 steps), for a tiny Qwen3-VL-MoE
(layer 0 routed: 4 experts, top-2; layer 1 a dense Qwen3-VL layer; Qwen3-VL's deepstack tower), so every layout
runs both a dense and a routed layer, the expert-parallel one (fsdp_ep) its all-to-all dispatch; a tiny Qwen2.5-VL
(windowed vision tower, q/k/v biases) runs fsdp_tp, the layout that splits its heads (what differs between the
families is the layers the axes split, not the batch axes; its context-parallel split is
tests/test_context_parallel.py's)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_vlm.config import load_config
from jaxrl_vlm.job.trainer import Trainer
from _train_samples import train_samples

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = sorted((ROOT / "configs" / "mesh").glob("*.yaml"))
STEPS = 3
CASES = [("qwen3_vl_moe", p) for p in LAYOUTS] + [("qwen2_5_vl", p) for p in LAYOUTS if p.stem == "fsdp_tp"]


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    from jaxrl_vlm.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}") / "model", seed=3, arch=request.param)


def _trajectory(model_dir: Path, samples: list, overrides: list[str], devices) -> tuple[list[dict], dict]:
    cfg = load_config(None, [
        "--hf-checkpoint", str(model_dir), "--lr", "1e-3", "--weight-decay", "0.01",
        "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--entropy-coef", "0.01",
        "--seq-buckets", "256,512", "--row-buckets", "8,16", "--patch-buckets", "0,64,128",
        "--logprob-chunk-size", "64", *overrides,
    ])
    trainer = Trainer(cfg, devices=devices)
    trainer.build_policy(model_dir)
    metrics = [trainer.train_on(samples) for _ in range(STEPS)]
    params = jax.tree.map(np.asarray, trainer.state.params)
    return metrics, params


@pytest.fixture(scope="module")
def baseline(tiny_dir, make_test_image):
    samples = train_samples(tiny_dir, make_test_image)
    one = jax.devices()[:1]
    return samples, _trajectory(tiny_dir, samples, ["--mesh-data", "1"], one)


@pytest.mark.slow
@pytest.mark.parametrize(("tiny_dir", "layout"), CASES, ids=[f"{a}-{p.stem}" for a, p in CASES], indirect=["tiny_dir"])
def test_layout_matches_one_device(tiny_dir, baseline, layout):
    assert len(jax.devices()) == 8
    samples, (ref_metrics, ref_params) = baseline
    metrics, params = _trajectory(tiny_dir, samples, ["--mesh-config", str(layout)], jax.devices())
    for step, (got, want) in enumerate(zip(metrics, ref_metrics)):
        for key in ("train/loss_total", "train/kl_loss", "train/entropy_loss", "train/grad_norm", "train/pg_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (layout.stem, step, key)
    # The KL term is live after the first update (the policy moved away from the reference).
    assert ref_metrics[-1]["train/kl_loss"] > 0
    # Parameters after 3 AdamW steps of lr 1e-3: Adam divides by sqrt(v), so on near-zero gradients float
    # reduction-order noise between layouts is amplified up to ~1e-4 of the 3e-3 total movement; 1e-3 still
    # catches any real layout bug (a wrong gradient moves parameters by the full lr per step).
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params))
    assert max(diffs) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("tiny_dir", ["qwen3_vl_moe", "qwen2_5_vl"], indirect=True)  # their one-device baselines are shared
def test_fused_attention_under_fsdp_tp_matches_xla_on_one_device(tiny_dir, baseline):
    """`attention_impl: pallas_gpu` (the flash kernel, run by Pallas' interpreter on CPU, inside shard_map over
    the mesh) follows the same trajectory as the XLA attention on one device: text rows (packed, causal) and
    vision patches (per image, bidirectional), forward and backward."""
    samples, (ref_metrics, ref_params) = baseline
    layout = ROOT / "configs" / "mesh" / "fsdp_tp.yaml"
    metrics, params = _trajectory(
        tiny_dir, samples, ["--mesh-config", str(layout), "--attention-impl", "pallas_gpu"], jax.devices()
    )
    for step, (got, want) in enumerate(zip(metrics, ref_metrics)):
        for key in ("train/loss_total", "train/kl_loss", "train/entropy_loss", "train/grad_norm", "train/pg_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params))
    assert max(diffs) < 1e-3
