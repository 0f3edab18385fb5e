"""How far a tiny model's 3-step training trajectory under a mesh layout drifts from one device: the settings and
samples of tests/test_train_layouts.py, for any family (e.g. the fp32-sensitive Qwen3.5 ones), printing relative
differences of the test's metrics per step and the largest parameter difference, against the test's tolerances.

    python scripts/layout_drift.py --arch qwen3_5_moe fsdp_ep fsdp_tp [--adam-eps 1e-4] [--delta-chunk 32]

`self` as a layout runs one device against itself with only the delta rule's chunk size changed (`--delta-chunk`,
Qwen3.5 families): the model's own sensitivity to a change of float rounding, the yardstick for a layout's drift.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test's samples and picture generator, so the numbers are the test's

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _train_samples import train_samples  # noqa: E402
from conftest import _test_image  # noqa: E402
from jaxrl_vlm.config import load_config  # noqa: E402
from jaxrl_vlm.job.trainer import Trainer  # noqa: E402
from jaxrl_vlm.tiny import make_tiny  # noqa: E402

KEYS = ("train/loss_total", "train/kl_loss", "train/entropy_loss", "train/grad_norm")
STEPS = 3


def trajectory(model_dir: Path, samples: list, overrides: list[str], devices: list, adam_eps: str | None):
    cfg = load_config(None, [
        "--hf-checkpoint", str(model_dir), "--lr", "1e-3", "--weight-decay", "0.01",
        "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--entropy-coef", "0.01",
        "--seq-buckets", "256,512", "--row-buckets", "8,16", "--patch-buckets", "0,64,128",
        "--logprob-chunk-size", "64", *(["--adam-eps", adam_eps] if adam_eps else []), *overrides,
    ])
    trainer = Trainer(cfg, devices=devices)
    trainer.build_policy(model_dir)
    metrics = [trainer.train_on(samples) for _ in range(STEPS)]
    return metrics, jax.tree.map(np.asarray, trainer.state.params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="+", help="configs/mesh/<name>.yaml stems, or 'self'")
    parser.add_argument("--arch", default="qwen3_5_moe")
    parser.add_argument("--adam-eps", default=None)
    parser.add_argument("--delta-chunk", type=int, default=32)
    args = parser.parse_args()
    model_dir = make_tiny(Path(tempfile.mkdtemp()) / "model", seed=3, arch=args.arch)
    samples = train_samples(model_dir, _test_image)
    ref_metrics, ref_params = trajectory(model_dir, samples, ["--mesh-data", "1"], jax.devices()[:1], args.adam_eps)
    for layout in args.layouts:
        if layout == "self":
            import jaxrl_vlm.models.qwen3_5 as qwen3_5

            default, qwen3_5.DEFAULT_CHUNK = qwen3_5.DEFAULT_CHUNK, args.delta_chunk
            metrics, params = trajectory(model_dir, samples, ["--mesh-data", "1"], jax.devices()[:1], args.adam_eps)
            qwen3_5.DEFAULT_CHUNK = default
        else:
            mesh = ROOT / "configs" / "mesh" / f"{layout}.yaml"
            metrics, params = trajectory(model_dir, samples, ["--mesh-config", str(mesh)], jax.devices(), args.adam_eps)
        for step in range(STEPS):
            cells = []
            for key in KEYS:
                want, got = ref_metrics[step][key], metrics[step][key]
                within = abs(got - want) <= 1e-4 * abs(want) + 1e-5  # the test's tolerance
                cells.append(f"{key.split('/')[1]} {abs(got - want) / max(abs(want), 1e-30):.1e}{'' if within else ' (over)'}")
            print(f"{layout} step {step}: relative difference " + ", ".join(cells), flush=True)
        worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params)))
        print(f"{layout}: largest parameter difference after {STEPS} steps {worst:.1e} (the test allows 1e-3)", flush=True)


if __name__ == "__main__":
    main()
