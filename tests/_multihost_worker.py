"""One process of the 2-process CPU training test (`tests/test_multihost.py`); also its single-process reference.

Run as a script by the test, once per process, with the job in the environment:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
    JAXRL_COORDINATOR=127.0.0.1:<port> JAXRL_NUM_PROCESSES=2 JAXRL_PROCESS_ID=<0|1>
    python tests/_multihost_worker.py --model-dir D --work-dir W

What one process does, in the order a multi-host trainer would:
  1. joins the job (`jaxrl_vlm.distributed.initialize_from_env_or_config`);
  2. process 0 builds the samples (standing in for the rollout), `broadcast_samples` gives them to all;
  3. `Trainer.build_policy` loads the tiny model straight into its shards on the global 8-device FSDP mesh;
  4. the host batch becomes global arrays (`global_batch`: each process uploads its own rows) and ONE
     GRPO step runs through the real `compile_train_step`;
  5. the updated parameters are gathered (`gather_tree`), the policy is exported (`export_hf`: process 0
     writes) and checkpointed with orbax (every process writes its shards) and restored;
  6. writes `result_<pid>.json` (metrics, per-parameter checksums, checks) and `params_<pid>.npz`.

The test imports `make_samples` and `train_one_step` to compute the same step in its own process.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MESH_CONFIG = ROOT / "configs" / "mesh" / "fsdp.yaml"


def make_samples(model_dir: Path) -> list[Any]:
    """Two groups of 4 multi-turn samples (one group with an image), fixed tokens, log-probs and rewards."""
    from conftest import _test_image

    from _train_samples import train_samples

    return train_samples(model_dir, _test_image)


def train_config(model_dir: Path, output_dir: Path) -> Any:
    from jaxrl_vlm.config import load_config

    return load_config(None, [
        "--hf-checkpoint", str(model_dir), "--output-dir", str(output_dir), "--mesh-config", str(MESH_CONFIG),
        # Adam's first update is lr*g/(|g|+eps): +-lr except where |g| is within a few eps of zero, where the
        # float reduction order of the all-reduce (gloo across processes vs in-process) picks the value. An eps
        # of 1e-4 keeps the update a smooth function of g there, so the two runs agree to ~1e-8 (not ~1e-5).
        "--lr", "1e-3", "--adam-eps", "1e-4", "--weight-decay", "0.01", "--entropy-coef", "0.01",
        "--seq-buckets", "256,512", "--row-buckets", "8,16", "--patch-buckets", "0,64,128", "--logprob-chunk-size", "64",
    ])


def train_one_step(model_dir: Path, output_dir: Path, samples: list[Any], devices: list[Any]) -> tuple[Any, dict[str, float]]:
    """(trainer after one GRPO update, its metrics): `Trainer.build_policy` on `devices`, then `Trainer.train_on`
    (whose batch becomes global arrays from each process's own rows)."""
    from jaxrl_vlm.job.trainer import Trainer

    cfg = train_config(model_dir, output_dir)
    trainer = Trainer(cfg, devices=devices)
    trainer.build_policy(model_dir)
    return trainer, trainer.train_on(samples)


def uploaded_token_rows(trainer: Any, num_rows: int) -> list[int]:
    """Rows of a [K, R, T] batch array that this process's devices hold (what `global_batch` uploads)."""
    from jaxrl_vlm import distributed
    from jaxrl_vlm.sharding.layout import batch_sharding

    rows = distributed.process_local_index(batch_sharding(trainer.mesh, trainer.rules), (1, num_rows, 1))[1]
    return list(range(num_rows)) if isinstance(rows, slice) else rows.tolist()


def flat_params(params: Any, to_numpy: Callable[[Any], np.ndarray]) -> dict[str, np.ndarray]:
    """{"path.to.param": array} of an nnx param state, each value through `to_numpy` (in tree order)."""
    from flax import nnx

    return {".".join(map(str, path)): to_numpy(var.get_value()) for path, var in nnx.to_flat_state(params)}


def samples_digest(samples: list[Any]) -> str:
    """sha256 over what training reads from the samples (ids, tokens, masks, log-probs, reward, image inputs)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(np.asarray([s.group_index, s.index, s.response_length], np.int64).tobytes())
        h.update(np.asarray(s.tokens, np.int64).tobytes() + np.asarray(s.loss_mask, np.int64).tobytes())
        h.update(np.asarray(s.rollout_log_probs, np.float64).tobytes() + np.float64(s.reward).tobytes())
        for key, value in sorted((s.multimodal_train_inputs or {}).items()):
            h.update(key.encode() + np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def checksums(params: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """Per parameter [sum, sum of squares, sum weighted by position] in float64 (order-sensitive)."""
    out = {}
    for k, v in params.items():
        x = v.astype(np.float64).ravel()
        out[k] = [float(x.sum()), float((x * x).sum()), float((x * np.linspace(-1, 1, x.size)).sum())]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True, help="shared by all processes: exports, checkpoints")
    args = parser.parse_args(argv)
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - clock[0], 3)
        clock[0] = now

    from jaxrl_vlm import distributed

    info = distributed.initialize_from_env_or_config()  # before anything touches a device
    # Idempotent: a second call with the same environment is a no-op returning the same facts.
    if distributed.initialize_from_env_or_config() != info:
        raise RuntimeError("initialize_from_env_or_config is not idempotent")
    import jax

    pid = info.process_id
    lap("initialize")
    samples = distributed.broadcast_samples(make_samples(args.model_dir) if distributed.is_main_process() else None)
    # A payload of several chunks whose size is not a multiple of the chunk (exercises the chunked path).
    blob = np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    chunked = distributed.broadcast_bytes(blob if distributed.is_main_process() else None, max_chunk_bytes=1024)
    lap("samples_and_broadcast")

    trainer, metrics = train_one_step(args.model_dir, args.work_dir / f"run_{pid}", samples, jax.devices())
    uploaded = {"token_rows": uploaded_token_rows(trainer, int(metrics["batch/rows_per_micro_batch"]))}
    lap("build_and_train_step")
    params = flat_params(trainer.state.params, distributed.gather_for_export)
    lap("gather")
    export_dir = distributed.export_hf(trainer.policy_model(), args.work_dir / "export", dtype=np.float32)
    lap("export")

    from jaxrl_vlm.checkpoint import CheckpointStore, abstract_like

    store = CheckpointStore(args.work_dir / "checkpoints", keep=1)
    store.save(1, trainer.state, {"note": "multihost test", "process_count": info.num_processes})
    step, restored, meta = store.restore(abstract_like(trainer.state))
    store.close()
    restored_params = flat_params(restored.params, distributed.gather_for_export)
    distributed.barrier("multihost-test-done")
    lap("checkpoint")

    result = {
        "process_id": pid,
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "samples_digest": samples_digest(samples),
        "chunked_broadcast_sha256": hashlib.sha256(chunked).hexdigest(),
        "uploaded_token_rows": uploaded["token_rows"],
        "metrics": metrics,
        "checksums": checksums(params),
        "export_dir": str(export_dir),
        "checkpoint": {
            "step": step, "meta": meta,
            "restore_exact": sorted(restored_params) == sorted(params)
            and all(np.array_equal(restored_params[k], params[k]) for k in params),
        },
        "timings_s": timings,
    }
    buf = io.BytesIO()
    np.savez(buf, **params)
    (args.work_dir / f"params_{pid}.npz").write_bytes(buf.getvalue())
    (args.work_dir / f"result_{pid}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
