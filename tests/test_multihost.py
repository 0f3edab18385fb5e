"""Multi-host training on CPU: 2 processes x 4 simulated devices on loopback give the same GRPO step as one
process with 8 devices, and the multi-process plumbing (settings, broadcast, global batches, gathered
export, orbax checkpoints) behaves as `jaxrl_vlm.distributed` documents.

The 2-process test launches `tests/_multihost_worker.py` twice (gloo collectives over 127.0.0.1) and
computes the reference step in this process (8 devices from conftest) with the same code path.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from _launch import Launched, killed_on_exit, launch_job, wait_all
from jaxrl_vlm import distributed
from jaxrl_vlm.distributed import DistributedConfigError, resolve_settings

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_multihost_worker.py"
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 420  # both workers together; ~50 s on an idle 2-core machine


# ----------------------------------------------------------------------------- settings (pure)


def test_settings_from_environment():
    env = {"JAXRL_COORDINATOR": "10.0.0.1:1234", "JAXRL_NUM_PROCESSES": "4", "JAXRL_PROCESS_ID": "3",
           "JAXRL_LOCAL_DEVICE_IDS": "0,1"}
    s = resolve_settings(None, env)
    assert (s.mode, s.coordinator_address, s.num_processes, s.process_id, s.local_device_ids) == (
        "explicit", "10.0.0.1:1234", 4, 3, (0, 1))


def test_config_overrides_environment():
    env = {"JAXRL_COORDINATOR": "10.0.0.1:1234", "JAXRL_NUM_PROCESSES": "4", "JAXRL_PROCESS_ID": "3"}
    cfg = SimpleNamespace(coordinator_address="host-a:999", num_processes=2, process_id=0, local_device_ids=None)
    s = resolve_settings(cfg, env)
    assert (s.coordinator_address, s.num_processes, s.process_id, s.source) == ("host-a:999", 2, 0, "distributed config")


def test_nothing_configured_is_one_process_and_auto_is_opt_in():
    assert resolve_settings(None, {}).mode == "single"
    assert resolve_settings(None, {"JAXRL_DISTRIBUTED": "off"}).mode == "single"
    assert resolve_settings(None, {"JAXRL_DISTRIBUTED": "auto"}).mode == "auto"
    assert resolve_settings({"auto": True}, {}).mode == "auto"
    assert resolve_settings(SimpleNamespace(distributed_auto=True), {}).mode == "auto"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2"}, "JAXRL_PROCESS_ID missing"),
        ({"JAXRL_PROCESS_ID": "0"}, "JAXRL_COORDINATOR, JAXRL_NUM_PROCESSES missing"),
        ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "2"}, "outside 0..1"),
        ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "two", "JAXRL_PROCESS_ID": "0"}, "must be an integer"),
        ({"JAXRL_COORDINATOR": "nohostport", "JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "0"}, "host:port"),
        ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "0",
          "JAXRL_LOCAL_DEVICE_IDS": "0,0"}, "distinct"),
        ({"JAXRL_DISTRIBUTED": "yes"}, "use 'auto' or 'off'"),
    ],
)
def test_misconfiguration_names_the_setting(env, message):
    with pytest.raises(DistributedConfigError, match=message):
        resolve_settings(None, env)


def test_initialize_single_process_is_a_no_op_and_late_multiprocess_init_is_refused():
    assert distributed.initialize_from_env_or_config(environ={}).num_processes == 1
    assert distributed.initialize_from_env_or_config({"coordinator_address": "h:1", "num_processes": 1, "process_id": 0},
                                                     environ={}).process_id == 0
    jax.devices()  # this process's backend is running: joining a cluster now cannot work
    with pytest.raises(DistributedConfigError, match="backend has already started"):
        distributed.initialize_from_env_or_config(environ={"JAXRL_COORDINATOR": "127.0.0.1:1", "JAXRL_NUM_PROCESSES": "2",
                                                           "JAXRL_PROCESS_ID": "1"})
    assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- one-process behaviour


def test_single_process_helpers_are_local(tmp_path):
    from rollout.sample import Sample

    assert distributed.is_main_process()
    distributed.barrier("single")  # returns at once
    samples = [Sample(group_index=0, index=i, reward=float(i)) for i in range(3)]
    assert distributed.broadcast_samples(samples) == samples
    with pytest.raises(ValueError, match="must pass its samples"):
        distributed.broadcast_samples(None)
    with pytest.raises(TypeError, match="not rollout.sample.Sample"):
        distributed.broadcast_samples([object()])
    x = jax.device_put(np.arange(16.0).reshape(8, 2), jax.sharding.NamedSharding(
        jax.make_mesh((8,), ("fsdp",)), jax.sharding.PartitionSpec("fsdp")))
    np.testing.assert_array_equal(distributed.gather_for_export(x), np.arange(16.0).reshape(8, 2))


def test_global_batch_single_process_equals_device_put():
    from jaxrl_vlm.sharding.layout import put_batch
    from jaxrl_vlm.sharding.rules import DEFAULT_RULES

    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"))
    rng = np.random.default_rng(0)
    tree = {"tokens": rng.integers(0, 9, (2, 8, 5)).astype(np.int32), "positions": rng.integers(0, 9, (2, 3, 8, 5)),
            "vision": {"pixel_values": rng.standard_normal((2, 4, 6)).astype(np.float32)}}
    got, want = distributed.global_batch(tree, mesh, rules=DEFAULT_RULES), put_batch(tree, mesh, DEFAULT_RULES)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


class _TwoBlockSharding:
    """A process that holds row blocks [0:2] and [4:6] of 8 (its devices are not neighbours), columns whole."""

    def addressable_devices_indices_map(self, shape):
        return {"dev_a": (slice(4, 6), slice(None)), "dev_b": (slice(0, 2), slice(None))}


def test_process_local_rows_follow_block_order():
    x = np.arange(8 * 3).reshape(8, 3)
    idx = distributed.process_local_index(_TwoBlockSharding(), x.shape)
    np.testing.assert_array_equal(idx[0], [0, 1, 4, 5])
    assert idx[1] == slice(None)
    np.testing.assert_array_equal(distributed.process_local_data(x, _TwoBlockSharding()), x[[0, 1, 4, 5]])


# ----------------------------------------------------------------------------- 2 processes x 4 devices


def _launch(model_dir: Path, work_dir: Path) -> list[Launched]:
    argv = [sys.executable, str(WORKER), "--model-dir", str(model_dir), "--work-dir", str(work_dir)]
    return launch_job(argv, work_dir, num_processes=NUM_PROCESSES, local_devices=LOCAL_DEVICES)


@pytest.mark.slow
def test_two_processes_train_step_equals_single_process(tmp_path):
    """One GRPO step (FSDP over 8 devices): 2 processes x 4 devices == 1 process x 8 devices."""
    import _multihost_worker as worker
    from flax import nnx
    from safetensors.numpy import load_file

    from jaxrl_vlm.models.hf_io import from_hf, to_hf
    from jaxrl_vlm.tiny import make_tiny

    model_dir = make_tiny(tmp_path / "model", seed=3)
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    deadline = time.monotonic() + TIMEOUT_S
    with killed_on_exit(_launch(model_dir, work_dir)) as procs:
        # The single-process reference runs while the workers start up.
        assert len(jax.devices()) == NUM_PROCESSES * LOCAL_DEVICES
        samples = worker.make_samples(model_dir)
        ref, ref_metrics = worker.train_one_step(model_dir, tmp_path / "ref", samples, jax.devices())
        ref_params = worker.flat_params(ref.state.params, np.asarray)
        to_hf(ref.policy_model(), tmp_path / "ref_export", dtype=np.float32)
        init_params = worker.flat_params(nnx.state(from_hf(str(model_dir)), nnx.Param), np.asarray)
        wait_all(procs, deadline)

    results = [json.loads((work_dir / f"result_{pid}.json").read_text()) for pid in range(NUM_PROCESSES)]
    params = [dict(np.load(work_dir / f"params_{pid}.npz")) for pid in range(NUM_PROCESSES)]
    for pid, r in enumerate(results):
        assert (r["process_id"], r["process_count"], r["local_devices"], r["global_devices"]) == (pid, 2, 4, 8)
        assert r["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
        # Process 1 built nothing itself: it trained on what process 0 broadcast, byte for byte.
        assert r["samples_digest"] == worker.samples_digest(samples)
        blob = np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8).tobytes()
        assert r["chunked_broadcast_sha256"] == hashlib.sha256(blob).hexdigest()

    # Each process uploaded only the rows of its own 4 devices; together, every row exactly once.
    rows = [r["uploaded_token_rows"] for r in results]
    assert sorted(rows[0] + rows[1]) == list(range(len(rows[0]) + len(rows[1])))
    assert len(rows[0]) == len(rows[1]) and not set(rows[0]) & set(rows[1])

    # Metrics are replicated results of one computation: identical on both processes, and equal to one process's.
    assert results[0]["metrics"] == results[1]["metrics"]
    for key in ("train/loss_total", "train/grad_norm", "train/entropy_loss", "train/pg_loss", "train/tis"):
        assert results[0]["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
    assert ref_metrics["train/skipped_nonfinite"] == 0.0 and results[0]["metrics"]["train/skipped_nonfinite"] == 0.0

    # Gathered parameters: the same full tensors on both processes, equal to the single-process update.
    assert results[0]["checksums"] == results[1]["checksums"]
    assert sorted(params[0]) == sorted(ref_params)
    moved = 0.0
    for key, want in ref_params.items():
        np.testing.assert_array_equal(params[0][key], params[1][key], err_msg=key)
        np.testing.assert_allclose(params[0][key], want, rtol=0, atol=1e-5, err_msg=key)
        moved = max(moved, float(np.max(np.abs(want - init_params[key]))))
    assert moved > 5e-4  # the step really moved the weights (lr 1e-3), so atol 1e-5 is a real check

    # Export: process 0 wrote the full (gathered) tensors; they match the single-process export.
    exported, ref_exported = load_file(work_dir / "export" / "model.safetensors"), load_file(tmp_path / "ref_export" / "model.safetensors")
    assert sorted(exported) == sorted(ref_exported)
    for key in ref_exported:
        np.testing.assert_allclose(exported[key], ref_exported[key], rtol=0, atol=1e-5, err_msg=key)
    assert (work_dir / "export" / "config.json").exists()

    # Checkpoint: every process saved its shards with orbax; restoring gives back the same parameters.
    for r in results:
        assert r["checkpoint"]["step"] == 1 and r["checkpoint"]["restore_exact"]
        assert r["checkpoint"]["meta"] == {"note": "multihost test", "process_count": 2}
